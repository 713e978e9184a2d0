//! Real GGUF models at f32 compute against HF transformers on the same file (dequantized to
//! float32): teacher-forced on the reference's greedy tokens, our logits for the reference's
//! top-20 ids are within 2e-2 at every step, and our greedy choice equals the reference's up
//! to the first near-tie (margin < 0.05), from which another correct implementation may differ.
//! The native (int8 activation) paths: SmolLM2 against llama.cpp, Gemma 3 against transformers
//! wherever its greedy choice is clear.

mod common;

use common::{ids, read_json, real_model};
use models::{ComputeDtype, LogitsFor, Model, ModelSpec};
use runtime::sampling::argmax;
use runtime::CpuBackend;

const LOGIT_TOLERANCE: f32 = 2e-2;
const NEAR_TIE: f64 = 0.05;

fn check(name: &str, fixture: &str) {
    let mut spec = ModelSpec::for_weights(&real_model(name));
    spec.dtype = ComputeDtype::F32;
    let model = Model::open(spec).unwrap();
    let graph = model.lower(LogitsFor::LastToken).unwrap();
    let backend = CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap();
    let reference = read_json(fixture);
    let cases = reference["raw"]
        .as_array()
        .unwrap()
        .iter()
        .chain(reference["chat"].as_array().into_iter().flatten());
    let mut failures = Vec::new();
    let mut compared_steps = 0;
    for case in cases {
        let prompt = ids(&case["prompt_ids"]);
        let greedy = ids(&case["greedy_ids"]);
        let label = case.get("prompt").or(case.get("prompt_text")).unwrap().to_string();
        let mut seq = backend.new_sequence();
        let mut logits = backend.step(&mut seq, &prompt).unwrap()["logits"].data.clone();
        let mut ids_compared = true;
        for (s, step) in case["steps"].as_array().unwrap().iter().enumerate() {
            for (id, want) in ids(&step["top_ids"]).iter().zip(step["top_logits"].as_array().unwrap()) {
                let (got, want) = (logits[*id as usize], want.as_f64().unwrap() as f32);
                if (got - want).abs() > LOGIT_TOLERANCE {
                    failures.push(format!("{label} step {s}: logit of {id} is {got}, reference {want}"));
                }
            }
            if step["margin"].as_f64().unwrap() < NEAR_TIE {
                ids_compared = false;
            }
            if ids_compared && argmax(&logits) != greedy[s] {
                failures.push(format!(
                    "{label} step {s}: greedy {} but reference {}",
                    argmax(&logits),
                    greedy[s]
                ));
            }
            compared_steps += 1;
            if s + 1 < greedy.len() {
                logits = backend.step(&mut seq, &[greedy[s]]).unwrap()["logits"].data.clone();
            }
        }
    }
    assert!(compared_steps >= 100, "only {compared_steps} steps compared");
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn smollm2_f32_matches_transformers() {
    check("smollm2", "real/smollm2.json");
}

#[test]
fn gemma3_f32_matches_transformers() {
    check("gemma3-270m", "real/gemma3.json");
}

/// The native (int8 activation) path is llama.cpp's arithmetic: a second opinion from
/// llama.cpp itself on the same file. Both quantize activations, with different rounding
/// details, so near-ties may flip. The chat prompt agrees for all 32 tokens. The raw prompt
/// agrees up to generated token 5, the 0.19 near-tie where llama.cpp and transformers part
/// (see the fixtures' README); from there on we must follow one of the two references.
#[test]
fn smollm2_native_agrees_with_llama_cpp() {
    let model = Model::open_path(&real_model("smollm2")).unwrap();
    let graph = model.lower(LogitsFor::LastToken).unwrap();
    let engine = runtime::Engine::from(CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap());
    let reference = read_json("real/llamacpp-smollm2.json");
    let transformers = read_json("real/smollm2.json");
    let options = runtime::GenerateOptions {
        max_tokens: 32,
        ..Default::default()
    };
    for (case, agreeing) in [("raw_completion", 5), ("chat_template", 32)] {
        let prompt = ids(&reference[case]["prompt_token_ids"]);
        let want = ids(&reference[case]["greedy_token_ids"]);
        let got = runtime::generate(&engine, &prompt, &options, |_| Ok(true)).unwrap();
        assert_eq!(got[..agreeing], want[..agreeing], "{case}");
        if agreeing < 32 {
            let hf = ids(&transformers["raw"][0]["greedy_ids"]);
            assert_eq!(ids(&transformers["raw"][0]["prompt_ids"]), prompt);
            let follows = |r: &[u32]| got[agreeing] == r[agreeing];
            assert!(
                follows(&want) || follows(&hf),
                "{case}: token {agreeing} is neither reference's: {got:?}"
            );
        }
    }
}

/// Gemma 3's native path (its Q5_0 and Q8_0 blocks dotted over interleaved rows with
/// activations quantized per 32, its Q4_K and Q6_K blocks per 256-weight super-block) against transformers on the same file,
/// teacher-forced on the reference's greedy tokens: wherever the reference's best two logits
/// are at least 0.5 apart (more than activation rounding can move them), our greedy choice is
/// the reference's.
#[test]
fn gemma3_native_picks_transformers_greedy_tokens_where_they_are_clear() {
    let model = Model::open_path(&real_model("gemma3-270m")).unwrap();
    let graph = model.lower(LogitsFor::LastToken).unwrap();
    let backend = CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap();
    let reference = read_json("real/gemma3.json");
    let mut checked = 0;
    for case in reference["raw"].as_array().unwrap() {
        let greedy = ids(&case["greedy_ids"]);
        let mut seq = backend.new_sequence();
        let mut input = ids(&case["prompt_ids"]);
        for (step, (want, info)) in greedy.iter().zip(case["steps"].as_array().unwrap()).enumerate() {
            let outputs = backend.step(&mut seq, &input).unwrap();
            let logits = &outputs["logits"];
            if info["margin"].as_f64().unwrap() >= 0.5 {
                let got = argmax(logits.row(logits.rows() - 1));
                assert_eq!(got, *want, "{:?}, step {step}", case["prompt"]);
                checked += 1;
            }
            input = vec![*want];
        }
    }
    assert!(checked >= 80, "only {checked} clear steps checked");
}

/// The caches' element type under `kv_cache_dtype = "auto"` follows the weights: half for a
/// native model of quantized blocks (as llama.cpp keeps them: both real files), f32 for an f32
/// safetensors model read natively (exact), bf16 when computing in bf16, half in half.
#[test]
fn auto_caches_follow_the_weights() {
    let caches = |weights: std::path::PathBuf, dtype: ComputeDtype| {
        let mut spec = ModelSpec::for_weights(&weights);
        spec.dtype = dtype;
        let graph = Model::open(spec).unwrap().lower(LogitsFor::LastToken).unwrap();
        let mut kinds: Vec<ir::DType> = Vec::new();
        for kind in graph
            .nodes()
            .iter()
            .filter_map(|n| n.op.appended_attention())
            .map(|a| a.cache_dtype)
        {
            if !kinds.contains(&kind) {
                kinds.push(kind);
            }
        }
        kinds
    };
    use ir::DType::{BF16, F16, F32};
    assert_eq!(caches(real_model("smollm2"), ComputeDtype::Native), [F16]);
    assert_eq!(caches(real_model("gemma3-270m"), ComputeDtype::Native), [F16]);
    assert_eq!(caches(real_model("smollm2"), ComputeDtype::F32), [F32]);
    assert_eq!(caches(real_model("smollm2"), ComputeDtype::Bf16), [BF16]);
    assert_eq!(caches(real_model("smollm2"), ComputeDtype::F16), [F16]);
    let tiny_f32 = common::fixture("hf-tiny/llama");
    assert_eq!(caches(tiny_f32.clone(), ComputeDtype::Native), [F32]);
    assert_eq!(caches(tiny_f32, ComputeDtype::Bf16), [BF16]);
}
