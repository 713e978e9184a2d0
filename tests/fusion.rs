//! The fused graph generates exactly what the unfused graph generates: SmolLM2 and Gemma 3,
//! every fixture prompt (raw and chat), 32 greedy tokens, with the file's own quantization.

mod common;

use common::{ids, read_json, real_model};
use models::{LogitsFor, Model, ModelSpec};
use runtime::{generate, CpuBackend, Engine, GenerateOptions};

fn check(name: &str, fixture: &str) {
    let model = Model::open(ModelSpec::for_weights(&real_model(name))).unwrap();
    let unfused = model.lower(LogitsFor::LastToken).unwrap();
    let fused = passes::optimized(&unfused, passes::CostModel::CPU).unwrap();
    assert!(
        fused.op_count() < unfused.op_count() * 3 / 4,
        "fusion removed too little: {} → {}",
        unfused.op_count(),
        fused.op_count()
    );
    let ctx = model.config.context_length;
    let plain = Engine::from(CpuBackend::new(unfused, &model.weights, ctx).unwrap());
    let fast = Engine::from(CpuBackend::new(fused, &model.weights, ctx).unwrap());
    let options = GenerateOptions {
        max_tokens: 32,
        ..Default::default()
    };
    let reference = read_json(fixture);
    let cases = reference["raw"]
        .as_array()
        .unwrap()
        .iter()
        .chain(reference["chat"].as_array().into_iter().flatten());
    for case in cases {
        let prompt = ids(&case["prompt_ids"]);
        let want = generate(&plain, &prompt, &options, |_| Ok(true)).unwrap();
        let got = generate(&fast, &prompt, &options, |_| Ok(true)).unwrap();
        assert_eq!(got, want, "{name}: {prompt:?}");
        assert_eq!(want.len(), 32);
    }
}

#[test]
fn smollm2_fused_equals_unfused() {
    check("smollm2", "real/smollm2.json");
}

#[test]
fn gemma3_fused_equals_unfused() {
    check("gemma3-270m", "real/gemma3.json");
}

/// Every layer of a deep model fuses alike, on every target's cost model: 32 layers of
/// Llama-3-8B's shape (no weights needed) end with one joined QKV and one joined gate/up
/// matmul, Q and K rotated inside the attention, and the residual adds folded into norms (and
/// on Hopper those into the next matmul), in each layer. Under tree costs (every read of a
/// value counting its whole cost) this failed: costs doubled with each residual connection and
/// some deep layers kept two ropes where the others had one, decided by rounding.
#[test]
fn every_layer_of_a_deep_model_fuses_alike() {
    let options = models::LowerOptions {
        logits: LogitsFor::LastToken,
        compute: models::ComputeDtype::Bf16,
        kv_cache: models::KvCacheDtype::Auto,
    };
    let graph = models::lower_without_weights(&models::ModelConfig::llama3_8b(), options).unwrap();
    for model in [passes::CostModel::CPU, passes::CostModel::H200, passes::CostModel::B200] {
        let fused = passes::optimized(&graph, model).unwrap();
        let count = |name: &str| fused.nodes().iter().filter(|n| n.op.name() == name).count();
        let layers = 32;
        assert_eq!(count("rope_attention"), layers, "{model:?}\n{}", fused.to_text());
        assert_eq!(count("rope") + count("attention"), 0, "{model:?}");
        assert_eq!(count("concat_rows"), 2 * layers, "{model:?}");
        // Each layer's two residual adds feed the next norm, except the last, which reaches
        // the final norm through `last_token`: 2 × 32 − 1 fused; on Hopper into the next
        // projection's prologue (bf16 weights: its GEMM has the prologue), elsewhere not.
        let into_matmul = match model.prologue_weights.contains(&ir::DType::BF16) {
            true => 2 * layers - 1,
            false => 0,
        };
        assert_eq!(count("add_rms_norm_matmul"), into_matmul, "{model:?}");
        assert_eq!(count("add_rms_norm"), 2 * layers - 1 - into_matmul, "{model:?}");
        // There the gate/up projection also takes the SwiGLU as its epilogue.
        let swiglus = if into_matmul > 0 { 0 } else { layers };
        assert_eq!(count("swiglu"), swiglus, "{model:?}");
    }
}
