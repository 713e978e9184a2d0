//! Snapshots of the IR each family lowers to (the tiny HF models: small enough to read).
//! Review a diff here like code: it is the compiler's input changing.

mod common;

use models::{ComputeDtype, LogitsFor, Model, ModelSpec};

fn graph_text(family: &str, logits: LogitsFor) -> String {
    let mut spec = ModelSpec::for_weights(&common::fixture(&format!("hf-tiny/{family}")));
    spec.dtype = ComputeDtype::F32;
    Model::open(spec).unwrap().lower(logits).unwrap().to_text()
}

#[test]
fn llama_graph() {
    insta::assert_snapshot!(graph_text("llama", LogitsFor::LastToken));
}

#[test]
fn gemma3_graph() {
    insta::assert_snapshot!(graph_text("gemma3", LogitsFor::LastToken));
}

#[test]
fn lowering_is_deterministic() {
    assert_eq!(
        graph_text("gemma3", LogitsFor::AllTokens),
        graph_text("gemma3", LogitsFor::AllTokens)
    );
}
