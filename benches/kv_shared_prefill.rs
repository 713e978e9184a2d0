//! Gemma 4's KV-shared layers on the sampled rows only, against every prompt row through them
//! (how bbc ran them before), side by side in one run on the CPU backend: a prompt's prefill,
//! to its last logits. The model is Gemma-4-E2B-shaped, narrower (35 layers, the last 20
//! KV-shared with double-wide MLPs, every fifth full attention; hidden 768, 4 heads of 256 with
//! one KV head, 512 in full-attention layers; MLP 3072; per-layer inputs of 256; vocabulary
//! 8192, so the head is a small part of either), random bf16 weights written to a scratch
//! directory. The other graph is the same model lowered with every row's logits, its head then
//! cut back to the last row: what differs is only the rows the shared layers run on.
//!
//! Prints medians of alternated runs and their ratio. `cargo bench --bench kv_shared_prefill`.

use models::{ComputeDtype, LogitsFor, LowerOptions, ModelConfig, WeightSource};
use runtime::CpuBackend;
use std::time::Instant;

/// Large buffers on cache lines: the CPU kernels' 64-byte writes then never straddle two
/// (`runtime::cpu::line_alloc`).
#[global_allocator]
static ALLOCATOR: runtime::cpu::line_alloc::LineAlignedAlloc = runtime::cpu::line_alloc::LineAlignedAlloc;

const PROMPTS: [usize; 2] = [128, 512];
const RUNS: usize = 3;

fn config_json() -> serde_json::Value {
    let layer_types: Vec<&str> = (0..35)
        .map(|i| match (i + 1) % 5 {
            0 => "full_attention",
            _ => "sliding_attention",
        })
        .collect();
    serde_json::json!({
        "model_type": "gemma4_text",
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 35,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "global_head_dim": 512,
        "layer_types": layer_types,
        "num_kv_shared_layers": 20,
        "use_double_wide_mlp": true,
        "hidden_size_per_layer_input": 256,
        "vocab_size": 8192,
        "vocab_size_per_layer_input": 8192,
        "sliding_window": 512,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": true,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}
        }
    })
}

/// `graph` lowered with every row's logits, its head cut back to the last row (the shared
/// layers still run on every row).
fn head_on_the_last_row_only(mut graph: ir::Graph) -> ir::Graph {
    let hidden = graph.output("hidden").expect("a hidden output");
    let capped = graph.output("logits").expect("a logits output");
    let ir::Op::SoftCap { cap } = graph.node(capped).op else {
        panic!("the bench's model soft-caps its logits")
    };
    let head = graph.node(graph.node(capped).inputs[0]).inputs[1];
    let last = graph.add(ir::Op::LastToken, &[hidden]).unwrap();
    let logits = graph.add(ir::Op::MatMul, &[last, head]).unwrap();
    let logits = graph.add(ir::Op::SoftCap { cap }, &[logits]).unwrap();
    graph.set_output("hidden", last);
    graph.set_output("logits", logits);
    graph.prune_dead();
    graph.validate().unwrap();
    graph
}

/// The prompt's prefill on a fresh sequence: milliseconds, and its last logits.
fn prefill(backend: &CpuBackend, prompt: &[u32]) -> (f64, Vec<f32>) {
    let mut seq = backend.new_sequence();
    let start = Instant::now();
    let out = backend.step(&mut seq, prompt).unwrap();
    (start.elapsed().as_secs_f64() * 1e3, out["logits"].data.clone())
}

fn median(t: &mut [f64]) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config_json().to_string()).unwrap();
    let config = ModelConfig::from_hf_config(&dir.path().join("config.json")).unwrap();
    let lower = |logits| {
        let options = LowerOptions {
            logits,
            compute: ComputeDtype::Bf16,
            kv_cache: models::KvCacheDtype::Auto,
        };
        models::lower_without_weights(&config, options).unwrap()
    };
    let sampled_rows = lower(LogitsFor::LastToken);
    runtime::random_weights::write_checkpoint(&sampled_rows, 7, &dir.path().join("model.safetensors")).unwrap();
    let weights = WeightSource::open_safetensors(dir.path()).unwrap();
    let backend = |graph: ir::Graph| {
        let graph = passes::optimized(&graph, passes::CostModel::CPU).unwrap();
        CpuBackend::new(graph, &weights, config.context_length).unwrap()
    };
    let shortcut = backend(sampled_rows);
    let every_row = backend(head_on_the_last_row_only(lower(LogitsFor::AllTokens)));
    println!("Gemma-4-E2B-shaped, 35 layers (20 KV-shared), hidden 768, bf16; prefill to the last logits");
    println!(
        "{:>14} {:>16} {:>16} {:>8}",
        "prompt", "every row, ms", "last rows, ms", "ratio"
    );
    for tokens in PROMPTS {
        let prompt: Vec<u32> = (0..tokens as u32).map(|i| 3 + (i * 37) % 8000).collect();
        let (want, got) = (prefill(&every_row, &prompt).1, prefill(&shortcut, &prompt).1);
        let worst =
            want.iter()
                .zip(&got)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, |m, d| if d > m || d.is_nan() { d } else { m });
        assert!(worst < 1e-3, "the two graphs' logits differ by {worst}");
        let (mut all, mut last) = (Vec::new(), Vec::new());
        for _ in 0..RUNS {
            all.push(prefill(&every_row, &prompt).0);
            last.push(prefill(&shortcut, &prompt).0);
        }
        let (a, b) = (median(&mut all), median(&mut last));
        println!("{tokens:>14} {a:>16.1} {b:>16.1} {:>7.2}×", a / b);
    }
}
