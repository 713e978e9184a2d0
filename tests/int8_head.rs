//! The INT8-bound LM head returns exactly the full-precision head's argmax and top-5 (ties to
//! the lowest id): on 100 000 random hidden states with constructed exact ties and near-ties,
//! and on the real hidden states of SmolLM2 and Gemma 3 at every step of every fixture prompt.
//! A single mismatch fails. The average number of rescored rows is printed (`--nocapture`).

mod common;

use common::{ids, read_json, real_model};
use ir::reference::ops::top_k;
use models::{ComputeDtype, LogitsFor, Model, ModelSpec};
use runtime::cpu::{simd, Int8Head, Matrix, Storage};
use runtime::CpuBackend;

/// The plain head: every row's f32 dot, then the top-k.
fn full_top_k(w: &Matrix, h: &[f32], k: usize) -> Vec<usize> {
    let mut buf = vec![0f32; w.cols];
    let scores: Vec<f32> = (0..w.rows).map(|v| simd::dot(w.row_f32(v, &mut buf), h)).collect();
    top_k(&scores, k)
}

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

#[test]
fn random_hidden_states_with_ties_and_near_ties() {
    let (vocab, d) = (512, 64);
    let mut rng = Lcg(2024);
    let mut data: Vec<f32> = (0..vocab * d).map(|_| rng.next()).collect();
    // Exact ties: rows 100..110 copy row 7; near-ties: rows 200..210 are row 9 nudged by 1 ulp-ish.
    for r in 100..110 {
        data.copy_within(7 * d..8 * d, r * d);
    }
    for r in 200..210 {
        for i in 0..d {
            let v = data[9 * d + i];
            data[r * d + i] = v + v * 1e-7 * (r - 199) as f32;
        }
    }
    let w = Matrix {
        rows: vocab,
        cols: d,
        storage: Storage::F32(data.clone()),
    };
    let head = Int8Head::prepare(&w);
    let (mut rescored, queries) = (0usize, 100_000);
    for q in 0..queries {
        // Every third query points at a tied or near-tied row, so ties decide the answer.
        let h: Vec<f32> = match q % 3 {
            0 => data[7 * d..8 * d].iter().map(|v| v * 2.0).collect(),
            1 => data[9 * d..10 * d].iter().map(|v| v + 1e-3 * rng.next()).collect(),
            _ => (0..d).map(|_| rng.next()).collect(),
        };
        let got = head.top_k(&h, 5, None, &w);
        let want = full_top_k(&w, &h, 5);
        assert_eq!(got.ids, want, "query {q}");
        rescored += got.rescored;
    }
    println!(
        "random heads: {:.1} rows rescored per query of {vocab}",
        rescored as f64 / queries as f64
    );
}

fn check_real(name: &str, fixture: &str) {
    let mut spec = ModelSpec::for_weights(&real_model(name));
    spec.dtype = ComputeDtype::F32;
    let model = Model::open(spec).unwrap();
    let backend = CpuBackend::new(
        model.lower(LogitsFor::LastToken).unwrap(),
        &model.weights,
        model.config.context_length,
    )
    .unwrap();
    let head_name = if model.weights.contains("output.weight") {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    let view = model.weights.require(head_name).unwrap();
    let w = Matrix {
        rows: view.shape[0],
        cols: view.shape[1],
        storage: Storage::F32(view.to_f32().data),
    };
    let head = Int8Head::prepare(&w);
    let reference = read_json(fixture);
    let cases = reference["raw"]
        .as_array()
        .unwrap()
        .iter()
        .chain(reference["chat"].as_array().into_iter().flatten());
    let (mut rescored, mut queries) = (0usize, 0usize);
    for case in cases {
        let mut seq = backend.new_sequence();
        let mut out = backend.step(&mut seq, &ids(&case["prompt_ids"])).unwrap();
        for &next in &ids(&case["greedy_ids"]) {
            let h = &out["hidden"].data;
            let got = head.top_k(h, 5, None, &w);
            assert_eq!(got.ids, full_top_k(&w, h, 5), "{name}: hidden state {queries}");
            rescored += got.rescored;
            queries += 1;
            out = backend.step(&mut seq, &[next]).unwrap();
        }
    }
    println!(
        "{name}: {:.1} rows rescored per step of {} ({queries} steps)",
        rescored as f64 / queries as f64,
        w.rows
    );
}

#[test]
fn smollm2_hidden_states() {
    check_real("smollm2", "real/smollm2.json");
}

#[test]
fn gemma3_hidden_states() {
    check_real("gemma3-270m", "real/gemma3.json");
}

/// In the product: with a full-precision (f32) head, the greedy graph's LM head is the
/// INT8-bound top-k, and greedy generation through it equals generation from full logits.
#[test]
fn greedy_graph_with_int8_head_generates_like_the_logits_graph() {
    let mut spec = ModelSpec::for_weights(&real_model("smollm2"));
    spec.dtype = ComputeDtype::F32;
    let model = Model::open(spec).unwrap();
    let fuse = |g: ir::Graph| passes::optimized(&g, passes::CostModel::CPU).unwrap();
    let logits = fuse(model.lower(LogitsFor::LastToken).unwrap());
    let greedy = fuse(model.lower(LogitsFor::GreedyToken).unwrap());
    assert!(
        greedy
            .nodes()
            .iter()
            .any(|n| matches!(n.op, ir::Op::Int8BoundTopK { k: 1, .. })),
        "{}",
        greedy.to_text()
    );
    let engine = runtime::Engine::new(logits, Some(greedy), &model.weights, model.config.context_length).unwrap();
    let reference = read_json("real/smollm2.json");
    for case in reference["raw"]
        .as_array()
        .unwrap()
        .iter()
        .chain(reference["chat"].as_array().unwrap())
    {
        let prompt = ids(&case["prompt_ids"]);
        let run = |need_logits| {
            let options = runtime::GenerateOptions {
                max_tokens: 32,
                need_logits,
                ..Default::default()
            };
            runtime::generate(&engine, &prompt, &options, |e| {
                assert_eq!(e.logits.is_some(), need_logits);
                Ok(true)
            })
            .unwrap()
        };
        assert_eq!(run(false), run(true), "{prompt:?}");
    }
    // Greedy decoding needs only the greedy graph (what `bbc run` loads on a GPU for it);
    // sampling without the logits graph is refused, not attempted.
    let prompt = ids(&reference["raw"][0]["prompt_ids"]);
    let options = runtime::GenerateOptions {
        max_tokens: 8,
        ..Default::default()
    };
    let want = runtime::generate(&engine, &prompt, &options, |_| Ok(true)).unwrap();
    let greedy_only = runtime::Engine {
        logits: None,
        greedy: engine.greedy,
    };
    assert_eq!(
        runtime::generate(&greedy_only, &prompt, &options, |_| Ok(true)).unwrap(),
        want
    );
    let sampling = runtime::GenerateOptions {
        sampling: runtime::SamplingParams {
            temperature: 0.8,
            ..Default::default()
        },
        ..options
    };
    let refused = runtime::generate(&greedy_only, &prompt, &sampling, |_| Ok(true)).unwrap_err();
    assert!(refused.to_string().contains("logits graph"), "{refused}");
}

/// A plan's INT8 head rows are quantized from the values its head holds: for a bf16 or half
/// head of an f32 file, the file's values rounded to that type (a bound over the unrounded
/// values would not bound the logits the plan rescores).
#[test]
fn plan_int8_rows_quantize_the_values_the_head_holds() {
    let dir = common::fixture("hf-tiny/llama");
    let f32_model = Model::open(ModelSpec::for_weights(&dir)).unwrap();
    for (dtype, round) in [
        (ComputeDtype::F32, (|v| v) as fn(f32) -> f32),
        (ComputeDtype::Bf16, |v| half::bf16::from_f32(v).to_f32()),
        (ComputeDtype::F16, |v| half::f16::from_f32(v).to_f32()),
    ] {
        let mut spec = ModelSpec::for_weights(&dir);
        spec.dtype = dtype;
        let model = Model::open(spec).unwrap();
        let greedy = passes::optimized(&model.lower(LogitsFor::GreedyToken).unwrap(), passes::CostModel::H200).unwrap();
        let heads = codegen::int8_heads(&greedy, &model.weights).unwrap();
        let [(name, rows)] = &heads[..] else {
            panic!(
                "{dtype:?}: heads {:?}",
                heads.iter().map(|(n, _)| n).collect::<Vec<_>>()
            )
        };
        let head = f32_model.weights.get(name).unwrap();
        let values = head.to_f32().data;
        let cols = head.row_len();
        let want = quant::int8_rows::Int8Rows::quantize(head.rows(), cols, |r, buf| {
            for (b, &v) in buf.iter_mut().zip(&values[r * cols..(r + 1) * cols]) {
                *b = round(v);
            }
        });
        assert!(*rows == want, "{dtype:?}: rows of other values");
    }
}
