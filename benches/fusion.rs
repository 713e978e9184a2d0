//! Compile time of the pass pipeline on a 64-layer graph with a 27B-class Qwen3.5's shapes
//! (no weights): lowering → e-graph fusion → extraction, for the CPU and H200 cost models. The
//! target is well under 5 s; see `docs/passes.md` for the figure measured.

use criterion::{criterion_group, criterion_main, Criterion};
use models::{ComputeDtype, LogitsFor, LowerOptions, ModelConfig};
use passes::CostModel;

fn fuse_qwen35_27b(c: &mut Criterion) {
    let options = LowerOptions {
        logits: LogitsFor::LastToken,
        compute: ComputeDtype::Bf16,
        kv_cache: models::KvCacheDtype::Auto,
    };
    let graph = models::lower_without_weights(&ModelConfig::qwen3_5_27b(), options).expect("the shapes lower");
    let mut group = c.benchmark_group("fuse_qwen3_5_27b_64_layers");
    group.sample_size(10);
    for (name, model) in [("cpu", CostModel::CPU), ("h200", CostModel::H200)] {
        group.bench_function(name, |b| {
            b.iter(|| passes::optimize(&graph, model, None).expect("fusion succeeds"))
        });
    }
    group.finish();
}

criterion_group!(benches, fuse_qwen35_27b);
criterion_main!(benches);
