//! `bbc compile MODEL --target T -o DIR [--emit ir]`.

use crate::model_ref::{self, ModelRef};
use anyhow::{bail, Result};
use codegen::Target;
use models::LogitsFor;
use std::path::Path;

pub fn compile(model: &str, target: &str, out: &Path, emit: Option<&str>) -> Result<()> {
    let Some(target) = Target::parse(target) else {
        let names: Vec<&str> = Target::ALL.iter().map(|t| t.name()).collect();
        bail!(
            "unknown target `{target}`; choose one of {}",
            names.join(", ")
        );
    };
    if matches!(ModelRef::parse(model)?, ModelRef::Artifact(_)) {
        bail!(
            "{model} is already an artifact; compile a model.toml, a weights path or a model name"
        );
    }
    let loaded = model_ref::load(model, None, LogitsFor::LastToken, false)?;
    match emit {
        None => {}
        Some("ir") => print!("{}", loaded.graph.to_text()),
        Some(other) => bail!("--emit {other}: this build can emit `ir` (the unfused graph)"),
    }
    let manifest = codegen::compile(&loaded.model, &loaded.graph, target, out)?;
    eprintln!(
        "compiled {} ({} ops per step, dtype {}) for {} into {}",
        manifest.family.name(),
        loaded.graph.op_count(),
        manifest.dtype.name(),
        target.name(),
        out.display()
    );
    Ok(())
}
