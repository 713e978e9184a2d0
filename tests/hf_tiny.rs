//! Tiny random HF models (float32) against HF transformers: logits at every prompt position
//! and at every cached decode step within 1e-4 of the reference relative to its largest
//! magnitude, greedy ids identical. Both the IR reference interpreter and the CPU backend.

mod common;

use common::fixture;
use common::hf_reference::Reference;
use models::{ComputeDtype, LogitsFor, Model, ModelSpec};
use runtime::CpuBackend;

fn open(family: &str) -> Model {
    let mut spec = ModelSpec::for_weights(&fixture(&format!("hf-tiny/{family}")));
    spec.dtype = ComputeDtype::F32;
    Model::open(spec).unwrap()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_close_within(got, want, 1e-4, what);
}

fn assert_close_within(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    // A NaN difference is the worst, and fails (`f32::max` would pass it by).
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0f32, |m, d| if d > m || d.is_nan() { d } else { m });
    assert!(
        worst <= tolerance * scale,
        "{what}: max error {worst} exceeds {tolerance} × {scale}"
    );
}

fn argmax(row: &[f32]) -> u32 {
    runtime::sampling::argmax(row)
}

/// The CPU backend against HF, on the graph as lowered and on the graph the CPU's passes fuse.
fn check_cpu_backend(family: &str) {
    check_cpu_backend_of(&open(family), family, family);
}

/// As [`check_cpu_backend`], for `model` holding `family`'s weights in another form.
fn check_cpu_backend_of(model: &Model, family: &str, label: &str) {
    check_cpu_backend_against(model, &Reference::of(family), label);
}

/// The CPU backend running `model`, lowered and fused, against `reference`.
fn check_cpu_backend_against(model: &Model, reference: &Reference, label: &str) {
    check_cpu_backend_within(model, reference, 1e-4, label);
}

/// [`check_cpu_backend_against`] within `tolerance` (relative to the largest logit).
fn check_cpu_backend_within(model: &Model, reference: &Reference, tolerance: f32, label: &str) {
    let lowered = model.lower(LogitsFor::AllTokens).unwrap();
    let fused = passes::optimized(&lowered, passes::CostModel::CPU).unwrap();
    assert!(fused.op_count() < lowered.op_count(), "{label}: nothing fused");
    check_cpu_graph_within(model, lowered, reference, tolerance, label);
    check_cpu_graph_within(model, fused, reference, tolerance, &format!("{label} fused"));
}

/// The CPU backend's logits within `tolerance` (relative to the largest) of `reference` at
/// every prompt position and cached step, and its greedy ids.
fn check_cpu_graph_within(model: &Model, graph: ir::Graph, reference: &Reference, tolerance: f32, label: &str) {
    let backend = CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap();
    let mut seq = backend.new_sequence();
    let out = backend.step(&mut seq, &reference.input_ids).unwrap();
    assert_close_within(
        &out["logits"].data,
        &reference.logits,
        tolerance,
        &format!("{label} prompt logits"),
    );
    let v = reference.vocab;
    let mut last = out["logits"].row(reference.input_ids.len() - 1).to_vec();
    for (step, &want_id) in reference.greedy_ids.iter().enumerate() {
        assert_close_within(
            &last,
            &reference.step_logits[step * v..(step + 1) * v],
            tolerance,
            &format!("{label} step {step}"),
        );
        let id = argmax(&last);
        assert_eq!(id, want_id, "{label}: greedy id at step {step}");
        last = backend.step(&mut seq, &[id]).unwrap()["logits"].data.clone();
    }
}

fn check_reference_interpreter(family: &str) {
    check_reference_interpreter_of(&open(family), family, family);
}

fn check_reference_interpreter_of(model: &Model, family: &str, label: &str) {
    check_interpreter_against(model, &Reference::of(family), label);
}

/// The IR reference interpreter running `model` against `reference`: every prompt row, and
/// every cached step after HF's greedy ids.
fn check_interpreter_against(model: &Model, reference: &Reference, label: &str) {
    let graph = model.lower(LogitsFor::AllTokens).unwrap();
    let weights = models::weights::DequantizedWeights::new(&model.weights);
    let mut interp = ir::reference::Interpreter::new(&weights);
    let n = reference.input_ids.len();
    let positions: Vec<usize> = (0..n).collect();
    let out = interp.step(&graph, &reference.input_ids, &positions).unwrap();
    assert_close(
        &out["logits"].data,
        &reference.logits,
        &format!("{label} interpreter prompt logits"),
    );
    let v = reference.vocab;
    let mut last = out["logits"].row(n - 1).to_vec();
    for (step, &want_id) in reference.greedy_ids.iter().enumerate() {
        assert_close(
            &last,
            &reference.step_logits[step * v..(step + 1) * v],
            &format!("{label} interpreter step {step}"),
        );
        assert_eq!(argmax(&last), want_id, "{label} interpreter: greedy id at step {step}");
        last = interp.step(&graph, &[want_id], &[n + step]).unwrap()["logits"]
            .data
            .clone();
    }
}

#[test]
fn llama_cpu_backend_matches_hf() {
    check_cpu_backend("llama");
}

#[test]
fn gemma3_cpu_backend_matches_hf() {
    check_cpu_backend("gemma3");
}

#[test]
fn glm4_moe_cpu_backend_matches_hf() {
    check_cpu_backend("glm4_moe");
}

#[test]
fn glm4_moe_reference_interpreter_matches_hf() {
    check_reference_interpreter("glm4_moe");
}

#[test]
fn qwen3_5_cpu_backend_matches_hf() {
    check_cpu_backend("qwen3_5");
}

#[test]
fn qwen3_5_reference_interpreter_matches_hf() {
    check_reference_interpreter("qwen3_5");
}

/// The same model as llama.cpp's converter writes it to GGUF (`tests/fixtures/gguf-tiny`:
/// norms stored `+ 1`, `A` instead of `A_log`, value heads tiled over the key heads; llama.cpp
/// itself gives HF's greedy ids on that file): HF's logits, through the interpreter and the
/// CPU backend.
#[test]
fn qwen3_5_from_llama_cpp_gguf_matches_hf() {
    check_gguf_against_hf("qwen3_5", models::Family::Qwen35);
}

/// `gguf-tiny/{family}.gguf` opens as `want` and gives HF's logits for `hf-tiny/{family}`,
/// through the interpreter and the CPU backend.
fn check_gguf_against_hf(family: &str, want: models::Family) {
    let model = Model::open(ModelSpec::for_weights(&fixture(&format!("gguf-tiny/{family}.gguf")))).unwrap();
    assert_eq!(model.config.family, want);
    let label = format!("{family} gguf");
    check_reference_interpreter_of(&model, family, &label);
    check_cpu_backend_of(&model, family, &label);
}

/// The same GGUF with its matrices in Q8_0 (as the converter's `--outtype q8_0` writes it),
/// computed natively (int8 activations) and dequantized to f32: HF's greedy ids up to step 9,
/// where HF's top two are 0.118 apart (within Q8_0's noise: on this file llama.cpp's prompt
/// logits differ from HF's by up to 0.13 of the largest, bbc's by 0.18 natively and 0.11
/// dequantized); prompt logits within 0.2.
#[test]
fn qwen3_5_from_a_q8_0_gguf_follows_hf_to_its_first_near_tie() {
    check_quantized_gguf_follows_hf("qwen3_5", 0.2, 9);
}

/// `gguf-tiny/{family}.q8_0.gguf` computed natively (int8 activations) and dequantized to f32
/// through the CPU backend on `family`'s reference prompt: prompt logits within `tolerance` of
/// HF's, relative to the largest, and HF's greedy ids for the first `steps` steps.
fn check_quantized_gguf_follows_hf(family: &str, tolerance: f32, steps: usize) {
    let reference = Reference::of(family);
    for dtype in [ComputeDtype::Native, ComputeDtype::F32] {
        let mut spec = ModelSpec::for_weights(&fixture(&format!("gguf-tiny/{family}.q8_0.gguf")));
        spec.dtype = dtype;
        let model = Model::open(spec).unwrap();
        let graph = passes::optimized(&model.lower(LogitsFor::AllTokens).unwrap(), passes::CostModel::CPU).unwrap();
        let backend = CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap();
        let mut seq = backend.new_sequence();
        let out = backend.step(&mut seq, &reference.input_ids).unwrap();
        let scale = reference.logits.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = out["logits"]
            .data
            .iter()
            .zip(&reference.logits)
            .fold(0f32, |m, (a, b)| {
                let d = (a - b).abs();
                if d > m || d.is_nan() {
                    d
                } else {
                    m
                }
            });
        assert!(
            worst <= tolerance * scale,
            "{family} {dtype:?}: prompt logits off by {worst} of {scale}"
        );
        let mut last = out["logits"].row(reference.input_ids.len() - 1).to_vec();
        for (step, &want) in reference.greedy_ids.iter().take(steps).enumerate() {
            let id = argmax(&last);
            assert_eq!(id, want, "{family} {dtype:?}: greedy id at step {step}");
            last = backend.step(&mut seq, &[id]).unwrap()["logits"].data.clone();
        }
    }
}

/// Qwen3-Next as llama.cpp's converter writes it (`in_proj_qkvz` split into `attn_qkv` and
/// `attn_gate`, `ssm_ba` as it was, each projection's experts stacked into one tensor, the
/// shared expert's `*_shexp`; value heads left grouped): HF's logits, through the interpreter
/// and the CPU backend (llama.cpp itself gives HF's greedy ids on this file).
#[test]
fn qwen3_next_from_llama_cpp_gguf_matches_hf() {
    check_gguf_against_hf("qwen3_next", models::Family::Qwen3Next);
}

/// Qwen3.5-MoE (llama.cpp's `qwen35moe`: Qwen3.5's layers with Qwen3-Next's MoE MLPs), from a
/// GGUF written as llama.cpp's converter writes it (the tiny Qwen3.5's layers with the tiny
/// Qwen3-Next's MLPs; no HF reference exists for it): llama.cpp's own logits on that file
/// within 5e-4 (llama.cpp differs from HF by up to 2.1e-4 on the other two tiny models), its
/// 12 greedy ids (two of whose margins are 0.039 and 0.007), on the graph as lowered and fused.
#[test]
fn qwen3_5_moe_from_llama_cpp_gguf_matches_llama_cpp() {
    let model = Model::open(ModelSpec::for_weights(&fixture("gguf-tiny/qwen3_5_moe.gguf"))).unwrap();
    assert!(model.config.family == models::Family::Qwen35 && model.config.moe.is_some());
    let reference = Reference::from_fixture("gguf-tiny/qwen3_5_moe-llamacpp.safetensors");
    let lowered = model.lower(LogitsFor::AllTokens).unwrap();
    let fused = passes::optimized(&lowered, passes::CostModel::CPU).unwrap();
    check_cpu_graph_within(&model, lowered, &reference, 5e-4, "qwen3_5_moe gguf");
    check_cpu_graph_within(&model, fused, &reference, 5e-4, "qwen3_5_moe gguf fused");
}

/// GLM-4.5 as llama.cpp's converter writes it (`glm4moe`: experts stacked, the router's score
/// bias as `exp_probs_b.bias`, shared experts `*_shexp`, the first layer dense, the
/// checkpoint's prediction layer counted in `block_count`): HF's logits through the
/// interpreter and the CPU backend (llama.cpp itself gives HF's greedy ids on this file).
#[test]
fn glm4_moe_from_llama_cpp_gguf_matches_hf() {
    check_gguf_against_hf("glm4_moe", models::Family::Glm4Moe);
}

/// GLM-4.5 as `llama-quantize … MXFP4_MOE` writes it (`glm4moe`: the stacked experts in
/// GGUF's MXFP4, every other matrix in Q8_0, the router and vectors in f32), against HF over
/// the weights the file holds (each block dequantized, exact in f32): the interpreter, and the
/// CPU backend computing in f32 (every weight dequantized), within 1e-4 with HF's 12 greedy
/// ids, lowered and fused; natively (the MXFP4 and Q8_0 rows against int8 activations, which
/// move these logits by up to 1.4% of the largest) the logits within 3e-2 of HF's, relative to
/// the largest, and HF's greedy ids (whose smallest lead is 0.008).
#[test]
fn glm4_moe_from_an_mxfp4_moe_gguf_matches_hf_over_its_weights() {
    let path = fixture("gguf-tiny/glm4_moe.mxfp4_moe.gguf");
    let reference = Reference::from_fixture("gguf-tiny/glm4_moe.mxfp4_moe-reference.safetensors");
    let mut spec = ModelSpec::for_weights(&path);
    spec.dtype = ComputeDtype::F32;
    let model = Model::open(spec).unwrap();
    assert_eq!(model.config.family, models::Family::Glm4Moe);
    let experts = model
        .weights
        .describe("blk.1.ffn_gate_exps.weight")
        .map(|(dtype, _)| dtype);
    assert_eq!(experts, Some(quant::GgmlType::MXFP4));
    check_interpreter_against(&model, &reference, "glm4_moe mxfp4_moe");
    check_cpu_backend_against(&model, &reference, "glm4_moe mxfp4_moe");
    let native = Model::open(ModelSpec::for_weights(&path)).unwrap();
    let graph = passes::optimized(&native.lower(LogitsFor::AllTokens).unwrap(), passes::CostModel::CPU).unwrap();
    check_cpu_graph_within(&native, graph, &reference, 3e-2, "glm4_moe mxfp4_moe native");
}

/// Gemma 4 as llama.cpp's converter writes it (`gemma4`: the full layers' heads in
/// `key_length` and the sliding ones' in `key_length_swa`, sliding layers flagged, the
/// full layers' proportional RoPE as `rope_freqs` factors, per-layer inputs as
/// `per_layer_token_embd`/`per_layer_model_proj`/`inp_gate`/`proj`): HF's logits through the
/// interpreter and the CPU backend, on the shared tiny model and on the two in the released
/// checkpoints' shapes: KV-shared layers with double-wide MLPs (a width per layer) and a
/// soft cap; keys as values (no `attn_v` in full layers, KV heads per layer) and the MoE
/// block (`ffn_gate_inp` with its `.scale`, experts' scales as `ffn_down_exps.scale`, the
/// experts fused as `ffn_gate_up_exps`).
#[test]
fn gemma4_from_llama_cpp_gguf_matches_hf() {
    for family in ["gemma4", "gemma4_kv_shared", "gemma4_moe"] {
        check_gguf_against_hf(family, models::Family::Gemma4);
    }
}

/// The two Gemma 4 models in the released checkpoints' shapes with their matrices in Q8_0 (the
/// converter's `--outtype q8_0`: the per-layer embedding and the fused experts in blocks, the
/// experts' down projections, rows of 24, in F16, the router in f32), computed natively (int8
/// activations) and dequantized to f32: HF's 12 greedy ids, and prompt logits within 5e-2 of
/// HF's relative to the largest (llama.cpp on these files: 2.2e-2 and 2.8e-2).
#[test]
fn gemma4_from_q8_0_ggufs_follows_hf() {
    for family in ["gemma4_kv_shared", "gemma4_moe"] {
        check_quantized_gguf_follows_hf(family, 5e-2, 12);
    }
}

/// Qwen3.5-MoE from an HF directory (`qwen3_5_moe_text`: the tiny Qwen3.5's layers with the
/// tiny Qwen3-Next's MLPs, as `gguf-tiny/make_qwen3_5_moe.py` makes it), its experts stored one
/// by one or fused as transformers 5 keeps them (`mlp.experts.gate_up_proj`, `down_proj`):
/// llama.cpp's logits on the same model converted to GGUF, within 5e-4, and its 12 greedy ids.
#[test]
fn qwen3_5_moe_from_hf_matches_llama_cpp() {
    let reference = Reference::from_fixture("gguf-tiny/qwen3_5_moe-llamacpp.safetensors");
    for fused in [false, true] {
        let scratch = common::scratch_dir("bbc-qwen3_5_moe-");
        write_qwen3_5_moe(scratch.path(), fused);
        let mut spec = ModelSpec::for_weights(scratch.path());
        spec.dtype = ComputeDtype::F32;
        let model = Model::open(spec).unwrap();
        assert!(model.config.family == models::Family::Qwen35 && model.config.moe.is_some());
        let graph = passes::optimized(&model.lower(LogitsFor::AllTokens).unwrap(), passes::CostModel::CPU).unwrap();
        let label = format!("qwen3_5_moe hf, experts fused: {fused}");
        check_cpu_graph_within(&model, graph, &reference, 5e-4, &label);
    }
}

/// The tiny Qwen3.5-MoE's HF directory in `dir`: the tiny Qwen3.5's tensors but its MLPs, the
/// tiny Qwen3-Next's MLPs (experts one by one, or each layer's fused into `[experts, 2·I,
/// hidden]` gate/up and `[experts, hidden, I]` down tensors), Qwen3.5's config with the MoE keys.
fn write_qwen3_5_moe(dir: &std::path::Path, fused: bool) {
    let read = |family: &str| std::fs::read(fixture(&format!("hf-tiny/{family}/model.safetensors"))).unwrap();
    let (dense_bytes, moe_bytes) = (read("qwen3_5"), read("qwen3_next"));
    let dense = safetensors::SafeTensors::deserialize(&dense_bytes).unwrap();
    let moe = safetensors::SafeTensors::deserialize(&moe_bytes).unwrap();
    let config = |family: &str| -> serde_json::Value {
        let text = std::fs::read_to_string(fixture(&format!("hf-tiny/{family}/config.json"))).unwrap();
        serde_json::from_str(&text).unwrap()
    };
    let (mut merged, moe_config) = (config("qwen3_5"), config("qwen3_next"));
    for key in [
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
    ] {
        merged[key] = moe_config[key].clone();
    }
    merged["model_type"] = "qwen3_5_moe_text".into();
    std::fs::write(dir.join("config.json"), merged.to_string()).unwrap();
    let (experts, layers) = (
        merged["num_experts"].as_u64().unwrap() as usize,
        merged["num_hidden_layers"].as_u64().unwrap() as usize,
    );
    // (name, shape, bytes) of each layer's fused experts.
    let mut fused_tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    if fused {
        for i in 0..layers {
            let expert = |e: usize, proj: &str| {
                moe.tensor(&format!("model.layers.{i}.mlp.experts.{e}.{proj}.weight"))
                    .unwrap()
            };
            let (gate, down) = (expert(0, "gate_proj"), expert(0, "down_proj"));
            let gate_up: Vec<u8> = (0..experts)
                .flat_map(|e| [expert(e, "gate_proj").data(), expert(e, "up_proj").data()].concat())
                .collect();
            let downs: Vec<u8> = (0..experts)
                .flat_map(|e| expert(e, "down_proj").data().to_vec())
                .collect();
            let prefix = format!("model.layers.{i}.mlp.experts");
            fused_tensors.push((
                format!("{prefix}.gate_up_proj"),
                vec![experts, 2 * gate.shape()[0], gate.shape()[1]],
                gate_up,
            ));
            fused_tensors.push((
                format!("{prefix}.down_proj"),
                [vec![experts], down.shape().to_vec()].concat(),
                downs,
            ));
        }
    }
    let mut views: Vec<(String, safetensors::tensor::TensorView)> = Vec::new();
    for name in dense.names().into_iter().filter(|n| !n.contains(".mlp.")) {
        views.push((name.to_string(), dense.tensor(name).unwrap()));
    }
    for name in moe.names().into_iter().filter(|n| n.contains(".mlp.")) {
        if !(fused && name.contains(".mlp.experts.")) {
            views.push((name.to_string(), moe.tensor(name).unwrap()));
        }
    }
    for (name, shape, bytes) in &fused_tensors {
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes).unwrap();
        views.push((name.clone(), view));
    }
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

#[test]
fn qwen3_next_cpu_backend_matches_hf() {
    check_cpu_backend("qwen3_next");
}

#[test]
fn qwen3_next_reference_interpreter_matches_hf() {
    check_reference_interpreter("qwen3_next");
}

#[test]
fn gemma4_cpu_backend_matches_hf() {
    check_cpu_backend("gemma4");
}

#[test]
fn gemma4_reference_interpreter_matches_hf() {
    check_reference_interpreter("gemma4");
}

/// Gemma 4 E2B/E4B's shape: KV-shared layers (reading the last earlier layer of their kind),
/// their double-wide MLPs, soft-capped logits, per-layer inputs; the config as released
/// (`global_head_dim`, no `per_layer_config`).
#[test]
fn gemma4_kv_shared_cpu_backend_matches_hf() {
    check_cpu_backend("gemma4_kv_shared");
}

#[test]
fn gemma4_kv_shared_reference_interpreter_matches_hf() {
    check_reference_interpreter("gemma4_kv_shared");
}

/// Where only the last rows' logits are wanted, the KV-shared layers run on those rows alone
/// (they write no cache): the prompt's last logits and every cached step still match HF, with
/// the prompt in one step or in two chunks (the shared layers of the first chunk's last row
/// computing what nothing reads), on the CPU backend (lowered and fused) and the reference.
#[test]
fn gemma4_kv_shared_layers_run_on_the_last_rows_only_and_match_hf() {
    let family = "gemma4_kv_shared";
    let model = open(family);
    let reference = Reference::of(family);
    let n = reference.input_ids.len();
    let graph = model.lower(LogitsFor::LastToken).unwrap();
    let shared: Vec<_> = graph
        .nodes()
        .iter()
        .filter(|node| matches!(node.op, ir::Op::SharedKvAttention(_)))
        .collect();
    assert_eq!(shared.len(), 3);
    assert!(shared.iter().all(|node| node.shape.0[0] == ir::Dim::Const(1)));
    let fused = passes::optimized(&graph, passes::CostModel::CPU).unwrap();
    for (graph, label) in [(graph.clone(), "lowered"), (fused, "fused")] {
        for split in [n, 10] {
            let backend = CpuBackend::new(graph.clone(), &model.weights, model.config.context_length).unwrap();
            let mut seq = backend.new_sequence();
            let ids = &reference.input_ids;
            let mut out = backend.step(&mut seq, &ids[..split]).unwrap();
            if split < n {
                out = backend.step(&mut seq, &ids[split..]).unwrap();
            }
            let first = out["logits"].data.clone();
            let next = |id: u32, _| backend.step(&mut seq, &[id]).unwrap()["logits"].data.clone();
            follow_greedy_steps(&reference, first, next, &format!("{label}, prompt split at {split}"));
        }
    }
    let weights = models::weights::DequantizedWeights::new(&model.weights);
    let mut interp = ir::reference::Interpreter::new(&weights);
    let positions: Vec<usize> = (0..n).collect();
    let first = interp.step(&graph, &reference.input_ids, &positions).unwrap()["logits"]
        .data
        .clone();
    let next = |id: u32, at: usize| interp.step(&graph, &[id], &[at]).unwrap()["logits"].data.clone();
    follow_greedy_steps(&reference, first, next, "interpreter");
}

/// `first` (the prompt's last logits) and the logits `next(id, position)` gives for each
/// greedy id after it against `reference`'s, and its greedy ids.
fn follow_greedy_steps(
    reference: &Reference,
    first: Vec<f32>,
    mut next: impl FnMut(u32, usize) -> Vec<f32>,
    label: &str,
) {
    let (v, n) = (reference.vocab, reference.input_ids.len());
    assert_close(&first, &reference.logits[(n - 1) * v..], &format!("{label} prompt"));
    let mut last = first;
    for (step, &want_id) in reference.greedy_ids.iter().enumerate() {
        let want = &reference.step_logits[step * v..(step + 1) * v];
        assert_close(&last, want, &format!("{label} step {step}"));
        assert_eq!(argmax(&last), want_id, "{label} step {step}");
        last = next(want_id, n + step);
    }
}

/// Gemma 4 26B-A4B's shape: a mixture of experts beside every MLP (its router's scales,
/// GELU experts), full-attention layers taking their values from the key projection with
/// their own count of KV heads, soft-capped logits, no per-layer inputs.
#[test]
fn gemma4_moe_cpu_backend_matches_hf() {
    check_cpu_backend("gemma4_moe");
}

#[test]
fn gemma4_moe_reference_interpreter_matches_hf() {
    check_reference_interpreter("gemma4_moe");
}

/// GLM-5 (latent attention, sparse indexer) on the tiny model with two index heads: every
/// prompt row and cached step, through the interpreter and the CPU backend (lowered and
/// fused), against transformers with `topk` keeping the earliest of tied positions
/// (`make_held_out.py`'s `earliest_tie_reference`). Its indexer scores keys by ReLU'd dot
/// products, so wherever both heads' products are negative a score is exactly 0, and on 7 of
/// the 24 prompt rows (9–13, 15, 22, in some layer) the cut of 8 falls among such zeros: there
/// `torch.topk` keeps whichever tied positions its selection algorithm leaves in front
/// (`float64` keeps the same ones, by the same algorithm), and bbc the earliest, as every
/// top-k of bbc does. Everywhere else the two references agree; the held-out GLM-5 models
/// below, with no tie at any cut, are compared with transformers' own `topk`.
#[test]
fn glm_moe_dsa_matches_hf_with_tied_index_scores_kept_earliest() {
    let model = open("glm_moe_dsa");
    let reference = earliest_tie_reference();
    check_interpreter_against(&model, &reference, "glm_moe_dsa");
    check_cpu_backend_against(&model, &reference, "glm_moe_dsa");
}

/// `glm_moe_dsa`'s reference with tied index scores kept earliest.
fn earliest_tie_reference() -> Reference {
    Reference::from_fixture("hf-tiny/glm_moe_dsa-earliest-ties-reference.safetensors")
}

/// GLM-5 as llama.cpp's converter writes it (`glm-dsa`: one KV head of the latent's width in
/// `key_length`, the per-head sizes in `key_length_mla`/`value_length_mla`, `kv_b_proj` split
/// into `attn_k_b`, each head's `W_UK` transposed, and `attn_v_b`, the indexer's sizes and
/// types, experts stacked as for GLM-4.5): the checks of the HF directory, and the CPU
/// backend's logits bit for bit those of the HF directory (the same weights, transposed by
/// the converter instead of at load).
#[test]
fn glm_moe_dsa_from_llama_cpp_gguf_matches_hf() {
    let gguf = Model::open(ModelSpec::for_weights(&fixture("gguf-tiny/glm_moe_dsa.gguf"))).unwrap();
    assert_eq!(gguf.config.family, models::Family::GlmMoeDsa);
    let reference = earliest_tie_reference();
    check_interpreter_against(&gguf, &reference, "glm_moe_dsa gguf");
    check_cpu_backend_against(&gguf, &reference, "glm_moe_dsa gguf");
    check_gguf_computes_as_hf("glm_moe_dsa", &gguf);
}

/// The same for GLM-5.2's shared indexers (`indexer.types` false where a layer has none).
#[test]
fn glm_moe_dsa_with_shared_indexers_from_gguf_matches_hf() {
    let gguf = Model::open(ModelSpec::for_weights(&fixture("gguf-tiny/glm_moe_dsa_shared.gguf"))).unwrap();
    let shared = gguf.config.mla.as_ref().map(|m| m.shared_indexer.clone());
    assert_eq!(shared, Some(vec![false, true, false, true]));
    check_reference_interpreter_of(&gguf, "glm_moe_dsa_shared", "glm_moe_dsa_shared gguf");
    check_cpu_backend_of(&gguf, "glm_moe_dsa_shared", "glm_moe_dsa_shared gguf");
    check_gguf_computes_as_hf("glm_moe_dsa_shared", &gguf);
}

/// `gguf`'s logits through the CPU backend, over the prompt and the greedy steps of
/// `family`'s reference, bit for bit those of the HF directory.
fn check_gguf_computes_as_hf(family: &str, gguf: &Model) {
    let hf = open(family);
    let reference = Reference::of(family);
    let logits = |model: &Model| -> Vec<Vec<f32>> {
        let graph = passes::optimized(&model.lower(LogitsFor::LastToken).unwrap(), passes::CostModel::CPU).unwrap();
        let backend = CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap();
        let mut seq = backend.new_sequence();
        let mut steps = vec![backend.step(&mut seq, &reference.input_ids).unwrap()["logits"]
            .data
            .clone()];
        for _ in 0..reference.greedy_ids.len() {
            let id = argmax(steps.last().unwrap());
            steps.push(backend.step(&mut seq, &[id]).unwrap()["logits"].data.clone());
        }
        steps
    };
    assert_eq!(
        logits(gguf),
        logits(&hf),
        "the GGUF file computes what the HF directory does"
    );
}

/// Older GLM-5 GGUF files keep `kv_b_proj` whole (`attn_kv_b`, which llama.cpp still loads):
/// the same file with each layer's `attn_k_b` and `attn_v_b` joined back that way computes the
/// same logits, the split made at compile time.
#[test]
fn glm_moe_dsa_gguf_with_an_unsplit_kv_b_computes_the_same() {
    use models::gguf::writer::GgufWriter;
    use models::gguf::GgufFile;
    let path = fixture("gguf-tiny/glm_moe_dsa.gguf");
    let file = GgufFile::open(&path).unwrap();
    let floats = |name: &str| -> Vec<f32> {
        let info = file.tensor(name).unwrap();
        file.tensor_data(info)
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let mut writer = GgufWriter::new();
    for (key, value) in &file.metadata {
        writer = writer.meta(key, value.clone());
    }
    for t in file
        .tensors
        .iter()
        .filter(|t| !t.name.contains("attn_k_b") && !t.name.contains("attn_v_b"))
    {
        writer = writer.tensor(&t.name, &t.dims, t.dtype as u32, file.tensor_data(t).to_vec());
    }
    for i in 0..3 {
        // attn_k_b is [heads, latent, nope] (innermost last here), attn_v_b [heads, value, latent].
        let k_dims = &file.tensor(&format!("blk.{i}.attn_k_b.weight")).unwrap().dims;
        let (n, l, h) = (k_dims[0] as usize, k_dims[1] as usize, k_dims[2] as usize);
        let v = file.tensor(&format!("blk.{i}.attn_v_b.weight")).unwrap().dims[1] as usize;
        let (k_b, v_b) = (
            floats(&format!("blk.{i}.attn_k_b.weight")),
            floats(&format!("blk.{i}.attn_v_b.weight")),
        );
        let mut kv_b = Vec::with_capacity(h * (n + v) * l);
        for head in 0..h {
            for r in 0..n {
                kv_b.extend((0..l).map(|j| k_b[(head * l + j) * n + r]));
            }
            kv_b.extend_from_slice(&v_b[head * v * l..(head + 1) * v * l]);
        }
        let bytes = kv_b.iter().flat_map(|x| x.to_le_bytes()).collect();
        writer = writer.tensor(
            &format!("blk.{i}.attn_kv_b.weight"),
            &[l as u64, (h * (n + v)) as u64],
            0,
            bytes,
        );
    }
    let joined = common::scratch_dir("bbc-glm5-kv-b-");
    let joined_path = joined.path().join("glm_moe_dsa.gguf");
    std::fs::write(&joined_path, writer.to_bytes()).unwrap();
    assert_eq!(
        prompt_logits("glm_moe_dsa", &joined_path),
        prompt_logits("glm_moe_dsa", &path)
    );
}

/// GLM-5.2's shared indexers (`indexer_types` [full, shared, full, shared]: layers 1 and 3 have
/// no indexer and keep the positions layers 0 and 2 keep), on a tiny model whose 8 index heads
/// leave no tie at the cut of 12: HF's logits at every prompt row and cached step, through the
/// interpreter and the CPU backend.
#[test]
fn glm_moe_dsa_with_shared_indexers_matches_hf() {
    check_reference_interpreter("glm_moe_dsa_shared");
    check_cpu_backend("glm_moe_dsa_shared");
}

/// Held-out tiny models (`make_held_out.py`): each family's config with every weight drawn
/// anew from another seed, and a longer prompt (72 ids, past the gated delta rule's 64-token
/// chunks), 16 cached greedy steps: transformers' own logits at every prompt row and step,
/// its greedy ids, through the interpreter and the CPU backend (lowered and fused). Each
/// reference was checked in float64 to leave no choice to rounding: greedy steps, routers'
/// experts and the GLM-5 indexer's kept positions all lead what they leave out.
fn check_held_out(name: &str) {
    check_reference_interpreter(name);
    check_cpu_backend(name);
}

#[test]
fn held_out_llama_matches_hf() {
    check_held_out("llama_held_out");
}

#[test]
fn held_out_gemma3_matches_hf() {
    check_held_out("gemma3_held_out");
}

#[test]
fn held_out_gemma4_matches_hf() {
    check_held_out("gemma4_held_out");
}

#[test]
fn held_out_qwen3_next_matches_hf() {
    check_held_out("qwen3_next_held_out");
}

#[test]
fn held_out_qwen3_5_matches_hf() {
    check_held_out("qwen3_5_held_out");
}

#[test]
fn held_out_glm4_moe_matches_hf() {
    check_held_out("glm4_moe_held_out");
}

/// GLM-5 held out with prompts of 48 and 96 ids, so the indexer keeping 8 chooses on all but
/// the first rows of every layer and at every cached step; 8 and 16 index heads of 32 and 24
/// dims, of which the first 16 rotate (the rest pass through unrotated); from the HF
/// directories and from the GGUF files llama.cpp's converter writes of them.
#[test]
fn held_out_glm_moe_dsa_matches_hf() {
    for name in ["glm_moe_dsa_held_out_48", "glm_moe_dsa_held_out_96"] {
        check_held_out(name);
        let gguf = Model::open(ModelSpec::for_weights(&fixture(&format!("gguf-tiny/{name}.gguf")))).unwrap();
        assert_eq!(gguf.config.family, models::Family::GlmMoeDsa);
        let label = format!("{name} gguf");
        check_reference_interpreter_of(&gguf, name, &label);
        check_cpu_backend_of(&gguf, name, &label);
    }
}

/// Llama 3.1's RoPE scaling (`rope_type` "llama3") on the tiny Llama, over an original
/// context of 64 so its four rotary pairs fall in every regime (kept, blended, divided): HF's
/// logits at every prompt row and cached step, through the interpreter and the CPU backend.
/// (Unscaled, the same weights' logits are 3.9% of the largest away.)
#[test]
fn llama_with_llama3_rope_scaling_matches_hf() {
    check_reference_interpreter("llama_rope_llama3");
    check_cpu_backend("llama_rope_llama3");
}

/// Gemma 3's larger checkpoints' linear RoPE scaling (factor 8) on the full-attention layers
/// only. (Unscaled, 7.8% of the largest away.)
#[test]
fn gemma3_with_linear_rope_scaling_matches_hf() {
    check_reference_interpreter("gemma3_rope_linear");
    check_cpu_backend("gemma3_rope_linear");
}

/// YaRN (`rope_type` "yarn", factor 4 over an original context of 64) on the tiny Llama (of
/// its eight rotary pairs one extrapolated, one blended, six interpolated; cos and sin times
/// the attention factor), the tiny Qwen3.5 (a quarter of each head rotates: the factor scales
/// those dims alone) and the tiny GLM-5 (DeepSeek's `mscale`s: cos and sin unscaled, the
/// softmax scale times `mscale(4, 1)²`, the indexer's keys and queries rotated the same way):
/// HF's logits at every prompt row and cached step, through the interpreter and the CPU
/// backend. (Unscaled, the prompt logits are 6.1%, 4.5% and 39% of the largest away; with
/// cos and sin left unscaled, 5.6% and 3.9%; GLM-5 with its softmax scale left alone, 5.5%;
/// the ramp one pair late, 12%, 15% and 42%.)
#[test]
fn yarn_rope_scaling_matches_hf() {
    for name in ["llama_rope_yarn", "qwen3_5_rope_yarn", "glm_moe_dsa_rope_yarn"] {
        check_reference_interpreter(name);
        check_cpu_backend(name);
    }
}

/// YaRN from a GGUF file (llama.cpp's `rope.scaling.*` keys: type "yarn", the factor, the
/// original context; betas and attention factor llama.cpp's defaults): the tiny Qwen3.5's
/// file with them gives HF's logits for the same model with YaRN, through the interpreter and
/// the CPU backend; a file that changes what llama.cpp computes by default (an attention
/// factor, latent attention's log multiplier, an extrapolation factor) is refused naming the
/// key.
#[test]
fn yarn_from_gguf_matches_hf() {
    use models::gguf::MetaValue;
    let scratch = common::scratch_dir("bbc-gguf-yarn-");
    let with_yarn = |extra: Option<(&str, f32)>| {
        rewrite_gguf("qwen3_5", scratch.path(), |metadata, _| {
            metadata.retain(|(key, _)| !key.starts_with("qwen35.rope.scaling."));
            metadata.extend([
                ("qwen35.rope.scaling.type".into(), MetaValue::String("yarn".into())),
                ("qwen35.rope.scaling.factor".into(), MetaValue::F32(4.0)),
                ("qwen35.rope.scaling.original_context_length".into(), MetaValue::U32(64)),
            ]);
            metadata.extend(extra.map(|(key, v)| (format!("qwen35.rope.scaling.{key}"), MetaValue::F32(v))));
        })
    };
    let model = Model::open(ModelSpec::for_weights(&with_yarn(None))).unwrap();
    check_reference_interpreter_of(&model, "qwen3_5_rope_yarn", "qwen3_5 gguf with YaRN");
    check_cpu_backend_of(&model, "qwen3_5_rope_yarn", "qwen3_5 gguf with YaRN");
    for key in ["yarn_attn_factor", "yarn_log_multiplier", "yarn_ext_factor"] {
        let err = match Model::open(ModelSpec::for_weights(&with_yarn(Some((key, 0.5))))) {
            Ok(_) => panic!("{key} = 0.5 should be refused"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(&format!("qwen35.rope.scaling.{key}")), "{key}: {err}");
    }
}

/// YaRN's parameters read as transformers 5 reads them: the factor, where absent, from
/// `max_position_embeddings` over the original context; the config's own
/// `original_max_position_embeddings` before the parameters'; betas 32 and 1 and truncation
/// unless given; the attention factor `0.1·ln(factor) + 1`, or DeepSeek's ratio of `mscale`s,
/// or as given.
#[test]
fn yarn_parameters_are_read_as_transformers_reads_them() {
    let src = fixture("hf-tiny/llama");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let read = |top: serde_json::Value, rope: serde_json::Value| -> ir::RopeScaling {
        let scratch = common::scratch_dir("bbc-yarn-");
        let mut edited = config.clone();
        for (key, value) in top.as_object().unwrap() {
            edited[key] = value.clone();
        }
        edited["rope_parameters"] = rope;
        std::fs::write(scratch.path().join("config.json"), edited.to_string()).unwrap();
        models::ModelConfig::from_hf_config(&scratch.path().join("config.json"))
            .unwrap()
            .rope_scaling
    };
    let yarn = |factor: f64, original_context: f64, attention_factor: f64| ir::RopeScaling::Yarn {
        factor,
        original_context,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor,
    };
    let mscale = |factor: f64, m: f64| 0.1 * m * f64::ln(factor) + 1.0;
    let base = serde_json::json!({"rope_theta": 100000.0, "rope_type": "yarn", "original_max_position_embeddings": 64});
    // max_position_embeddings is 256: the factor is 4.
    assert_eq!(
        read(serde_json::json!({}), base.clone()),
        yarn(4.0, 64.0, mscale(4.0, 1.0))
    );
    assert_eq!(
        read(
            serde_json::json!({"original_max_position_embeddings": 32}),
            base.clone()
        ),
        yarn(8.0, 32.0, mscale(8.0, 1.0))
    );
    let mut deepseek = base.clone();
    deepseek["mscale"] = 0.707.into();
    deepseek["mscale_all_dim"] = 1.0.into();
    assert_eq!(
        read(serde_json::json!({}), deepseek),
        yarn(4.0, 64.0, mscale(4.0, 0.707) / mscale(4.0, 1.0))
    );
    let mut given = base.clone();
    given["attention_factor"] = 1.5.into();
    given["beta_fast"] = 16.into();
    given["truncate"] = false.into();
    assert_eq!(
        read(serde_json::json!({}), given),
        ir::RopeScaling::Yarn {
            factor: 4.0,
            original_context: 64.0,
            beta_fast: 16.0,
            beta_slow: 1.0,
            truncate: false,
            attention_factor: 1.5,
        }
    );
}

#[test]
fn llama_reference_interpreter_matches_hf() {
    check_reference_interpreter("llama");
}

#[test]
fn gemma3_reference_interpreter_matches_hf() {
    check_reference_interpreter("gemma3");
}

/// A model split into shards through `model.safetensors.index.json` loads to the same weights.
#[test]
fn sharded_safetensors_load_like_one_file() {
    let src = fixture("hf-tiny/llama");
    let scratch = common::scratch_dir("bbc-sharded-");
    let dir = scratch.path();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let (first, second) = names.split_at(names.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (shard, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        let views: Vec<(String, safetensors::tensor::TensorView)> =
            part.iter().map(|n| (n.clone(), st.tensor(n).unwrap())).collect();
        safetensors::serialize_to_file(views, None, &dir.join(shard)).unwrap();
        for n in part {
            weight_map.insert(n.clone(), serde_json::Value::String(shard.into()));
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();

    let sharded = models::WeightSource::open_safetensors(dir).unwrap();
    let whole = models::WeightSource::open_safetensors(&src).unwrap();
    assert_eq!(sharded.names().len(), whole.names().len());
    for name in whole.names() {
        assert_eq!(
            sharded.require(name).unwrap().bytes,
            whole.require(name).unwrap().bytes,
            "{name}"
        );
    }
}

/// A model lowered from its config alone (no weights; what the GPU check's 8B-shaped decode
/// and the compile-time benchmark use) is the graph its weights give, for every family; so is
/// one quantized to FP8 as it loads, and the tiny Llama in 4-bit, FP4 and Q8_0 blocks as its
/// GPTQ, NVFP4 and 8-bit checkpoints'.
#[test]
fn lowering_without_weights_gives_the_graph_the_weights_give() {
    for family in [
        "llama",
        "gemma3",
        "gemma4",
        "gemma4_kv_shared",
        "gemma4_moe",
        "glm4_moe",
        "glm_moe_dsa",
        "qwen3_5",
        "qwen3_next",
    ] {
        let mut spec = ModelSpec::for_weights(&fixture(&format!("hf-tiny/{family}")));
        spec.dtype = ComputeDtype::Bf16;
        let model = Model::open(spec).unwrap();
        for logits in [LogitsFor::LastToken, LogitsFor::GreedyToken] {
            let options = models::LowerOptions {
                logits,
                compute: ComputeDtype::Bf16,
                kv_cache: models::KvCacheDtype::Auto,
            };
            let implied = models::lower_without_weights(&model.config, options).unwrap();
            assert_eq!(implied.to_text(), model.lower(logits).unwrap().to_text(), "{family}");
            let quantized = open_quantized(family, ComputeDtype::Bf16);
            let implied = models::lower_without_weights_quantized(&model.config, options, Some("fp8")).unwrap();
            let lowered = quantized.lower(logits).unwrap().to_text();
            assert!(lowered.contains("f8_e4m3_b32"), "{family}");
            assert_eq!(implied.to_text(), lowered, "{family} quantized");
        }
    }
    let options = models::LowerOptions {
        logits: LogitsFor::LastToken,
        compute: ComputeDtype::Bf16,
        kv_cache: models::KvCacheDtype::Auto,
    };
    let err = models::lower_without_weights_quantized(&models::ModelConfig::llama3_8b(), options, Some("awq"));
    assert!(err.unwrap_err().to_string().contains("`fp8` only"));
    // In 4-bit blocks, the graph a GPTQ checkpoint of the same projections gives (the 128-wide
    // Llama's in blocks of 128 but its down projection's), and in FP4 blocks an NVFP4 one's.
    for (name, method, blocks, held) in [
        ("llama_gptq", "gptq", quant::GgmlType::U4B32, &["u4_b32"][..]),
        (
            "llama_gptq_g128",
            "gptq",
            quant::GgmlType::U4B32,
            &["u4_b32", "u4_b128"],
        ),
        (
            "llama_nvfp4",
            "compressed-tensors",
            quant::GgmlType::F4E2M1B32,
            &["f4_e2m1_b32"],
        ),
    ] {
        let mut spec = ModelSpec::for_weights(&fixture(&format!("hf-tiny/{name}")));
        spec.dtype = ComputeDtype::Bf16;
        spec.quantization = Some(method.into());
        let checkpoint = Model::open(spec).unwrap();
        let implied = models::lower_without_weights_in_blocks(&checkpoint.config, options, Some(blocks)).unwrap();
        let lowered = checkpoint.lower(LogitsFor::LastToken).unwrap().to_text();
        assert!(held.iter().all(|dtype| lowered.contains(dtype)), "{name}");
        assert_eq!(implied.to_text(), lowered, "{name}");
    }
    // In Q8_0 blocks, the graph of an 8-bit checkpoint with bf16 scales.
    let w8 = common::checkpoint_copies::with_bf16_scales(&fixture("hf-tiny/llama_w8a16"));
    let mut spec = ModelSpec::for_weights(w8.path());
    (spec.dtype, spec.quantization) = (ComputeDtype::Bf16, Some("compressed-tensors".into()));
    let checkpoint = Model::open(spec).unwrap();
    let implied =
        models::lower_without_weights_in_blocks(&checkpoint.config, options, Some(quant::GgmlType::Q8_0)).unwrap();
    let lowered = checkpoint.lower(LogitsFor::LastToken).unwrap().to_text();
    assert!(lowered.contains("q8_0"));
    assert_eq!(implied.to_text(), lowered, "8-bit checkpoint");
    let config = open("llama").config;
    let err = models::lower_without_weights_in_blocks(&config, options, Some(quant::GgmlType::Q4K));
    assert!(err
        .unwrap_err()
        .to_string()
        .contains("FP8, 4-bit, FP4, MXFP4 or Q8_0 blocks only"));
    let eight_b = models::ModelConfig::llama3_8b();
    let options = models::LowerOptions {
        logits: LogitsFor::LastToken,
        compute: ComputeDtype::Bf16,
        kv_cache: models::KvCacheDtype::Auto,
    };
    let graph = models::lower_without_weights(&eight_b, options).unwrap();
    let weights: usize = graph
        .nodes()
        .iter()
        .filter(|n| matches!(n.op, ir::Op::Weight { .. }))
        .map(|n| n.shape.resolve(0, 0).iter().product::<usize>())
        .sum();
    assert_eq!(weights, 8_030_261_248, "Llama-3-8B's parameter count");
}

/// The language model of a multimodal checkpoint (`…ForConditionalGeneration`: settings in
/// `text_config`, tensors under `model.language_model.` or, before transformers 4.52,
/// `language_model.model.` with `language_model.lm_head`, beside a vision tower bbc does not
/// read) runs exactly as the same weights saved as a text model.
#[test]
fn multimodal_checkpoints_run_their_language_model() {
    for family in ["gemma3", "gemma4", "qwen3_5"] {
        let want = prompt_logits(family, &fixture(&format!("hf-tiny/{family}")));
        for (model, head) in [
            ("model.language_model.", "lm_head.weight"),
            ("language_model.model.", "language_model.lm_head.weight"),
        ] {
            let dir = multimodal_copy(family, model, head);
            assert_eq!(prompt_logits(family, dir.path()), want, "{family} under {model}");
        }
    }
}

/// The CPU backend's logits at every position of the family's reference prompt.
fn prompt_logits(family: &str, dir: &std::path::Path) -> Vec<f32> {
    let mut spec = ModelSpec::for_weights(dir);
    spec.dtype = ComputeDtype::F32;
    let model = Model::open(spec).unwrap();
    let reference = Reference::of(family);
    let graph = model.lower(LogitsFor::AllTokens).unwrap();
    let backend = CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap();
    let mut seq = backend.new_sequence();
    backend.step(&mut seq, &reference.input_ids).unwrap()["logits"]
        .data
        .clone()
}

/// The tiny `family` model rewritten as a multimodal checkpoint: config nested in
/// `text_config`, every `model.` tensor moved under `model_prefix`, the head named `head`, and
/// a vision tensor beside them.
fn multimodal_copy(family: &str, model_prefix: &str, head: &str) -> tempfile::TempDir {
    let src = fixture(&format!("hf-tiny/{family}"));
    let tag = model_prefix.replace('.', "_");
    let scratch = common::scratch_dir(&format!("bbc-multimodal-{family}-{tag}-"));
    let dir = scratch.path();
    let text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let config = serde_json::json!({
        "architectures": ["ForConditionalGeneration"],
        "model_type": family,
        "text_config": text,
        "vision_config": {"hidden_size": 8},
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let vision = [0u8; 16];
    let mut views: Vec<(String, safetensors::tensor::TensorView)> = st
        .names()
        .into_iter()
        .map(|name| {
            let renamed = match name.strip_prefix("model.") {
                Some(rest) => format!("{model_prefix}{rest}"),
                None if name == "lm_head.weight" => head.to_string(),
                None => name.to_string(),
            };
            (renamed, st.tensor(name).unwrap())
        })
        .collect();
    let dtype = safetensors::Dtype::F32;
    views.push((
        "model.vision_tower.patch_embedding.weight".into(),
        safetensors::tensor::TensorView::new(dtype, vec![2, 2], &vision).unwrap(),
    ));
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    scratch
}

/// The CPU backend holds each weight's bytes once: an MoE layer's experts, stacked for the
/// step (or picked from a GGUF's stacks and stacked again), and the projections the fusion
/// passes join are not kept beside their parts (the tiny models are f32 files computed in f32,
/// so the bytes held equal the file's tensors').
#[test]
fn the_cpu_backend_holds_each_weight_once() {
    let gguf = |name: &str| Model::open(ModelSpec::for_weights(&fixture(&format!("gguf-tiny/{name}.gguf")))).unwrap();
    for (family, model) in [
        ("glm4_moe", open("glm4_moe")),
        ("qwen3_next", open("qwen3_next")),
        ("llama", open("llama")),
        ("qwen3_next gguf (experts picked from stacks)", gguf("qwen3_next")),
    ] {
        let graph = passes::optimized(&model.lower(LogitsFor::LastToken).unwrap(), passes::CostModel::CPU).unwrap();
        let backend = CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap();
        let file: usize = model
            .weights
            .names()
            .iter()
            .map(|name| model.weights.require(name).unwrap().bytes.len())
            .sum();
        assert_eq!(backend.weight_bytes(), file, "{family}");
    }
}

/// A tensor as a GGUF writer takes it: name, dims innermost-first, GGML type id, bytes.
type GgufTensor = (String, Vec<u64>, u32, Vec<u8>);

/// `gguf-tiny/{name}.gguf` written again into `dir` after `edit` has changed its metadata and
/// tensors.
fn rewrite_gguf(
    name: &str,
    dir: &std::path::Path,
    edit: impl FnOnce(&mut Vec<(String, models::gguf::MetaValue)>, &mut Vec<GgufTensor>),
) -> std::path::PathBuf {
    let file = models::gguf::GgufFile::open(&fixture(&format!("gguf-tiny/{name}.gguf"))).unwrap();
    let mut metadata: Vec<_> = file.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut tensors: Vec<GgufTensor> = file
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dims.clone(),
                t.dtype as u32,
                file.tensor_data(t).to_vec(),
            )
        })
        .collect();
    edit(&mut metadata, &mut tensors);
    let mut writer = models::gguf::writer::GgufWriter::new();
    for (key, value) in metadata {
        writer = writer.meta(&key, value);
    }
    for (name, dims, dtype, data) in tensors {
        writer = writer.tensor(&name, &dims, dtype, data);
    }
    let path = dir.join(format!("{name}.gguf"));
    std::fs::write(&path, writer.to_bytes()).unwrap();
    path
}

/// A GGUF whose checkpoint kept its multi-token-prediction layer (`nextn_predict_layers = 1`,
/// one more block and recurrent-layer flag, as llama.cpp's converter writes Qwen3.5 with its
/// `mtp.*` weights) runs the model's own layers: the same logits as without it.
#[test]
fn gguf_prediction_layers_past_the_model_are_left_alone() {
    use models::gguf::MetaValue;
    let scratch = common::scratch_dir("bbc-mtp-");
    let with_mtp = rewrite_gguf("qwen3_5", scratch.path(), |metadata, _| {
        for (key, value) in metadata.iter_mut() {
            match key.as_str() {
                "qwen35.block_count" => *value = MetaValue::U32(5),
                "qwen35.attention.recurrent_layers" => {
                    let mut flags = value.as_array().unwrap().to_vec();
                    flags.push(MetaValue::Bool(false));
                    *value = MetaValue::Array(flags);
                }
                _ => {}
            }
        }
        metadata.push(("qwen35.nextn_predict_layers".into(), MetaValue::U32(1)));
    });
    let plain = fixture("gguf-tiny/qwen3_5.gguf");
    assert_eq!(prompt_logits("qwen3_5", &with_mtp), prompt_logits("qwen3_5", &plain));
}

/// A shared-expert gate stored as a vector (`[hidden]`, as llama.cpp declares it) reads like
/// the `[1, hidden]` row the converter writes.
#[test]
fn gguf_shared_expert_gates_stored_as_vectors_read_like_rows() {
    let scratch = common::scratch_dir("bbc-shexp-");
    let vectors = rewrite_gguf("qwen3_next", scratch.path(), |_, tensors| {
        let gates = tensors
            .iter_mut()
            .filter(|t| t.0.ends_with("ffn_gate_inp_shexp.weight"));
        for (name, dims, ..) in gates {
            assert_eq!(dims.len(), 2, "{name}: the fixture stores a row");
            dims.truncate(1);
        }
    });
    let plain = fixture("gguf-tiny/qwen3_next.gguf");
    assert_eq!(
        prompt_logits("qwen3_next", &vectors),
        prompt_logits("qwen3_next", &plain)
    );
}

/// Experts whose gate and up projections a file holds fused (`ffn_gate_up_exps`, llama.cpp's
/// `--fuse-gate-up-exps`: per expert its gate rows, then its up rows) give what the two
/// stacked tensors give.
#[test]
fn gguf_fused_gate_up_experts_read_like_separate_ones() {
    let scratch = common::scratch_dir("bbc-fused-");
    let fused = rewrite_gguf("qwen3_next", scratch.path(), |_, tensors| {
        let take = |tensors: &mut Vec<GgufTensor>, name: &str| {
            let at = tensors.iter().position(|t| t.0 == name).unwrap();
            tensors.remove(at)
        };
        for i in 0..4 {
            let gate = take(tensors, &format!("blk.{i}.ffn_gate_exps.weight"));
            let up = take(tensors, &format!("blk.{i}.ffn_up_exps.weight"));
            let experts = gate.1[2] as usize;
            let per_expert = gate.3.len() / experts;
            let data = (0..experts)
                .flat_map(|e| [&gate.3, &up.3].map(|t| &t[e * per_expert..(e + 1) * per_expert]))
                .flatten()
                .copied()
                .collect();
            let dims = vec![gate.1[0], 2 * gate.1[1], gate.1[2]];
            tensors.push((format!("blk.{i}.ffn_gate_up_exps.weight"), dims, gate.2, data));
        }
    });
    let plain = fixture("gguf-tiny/qwen3_next.gguf");
    assert_eq!(prompt_logits("qwen3_next", &fused), prompt_logits("qwen3_next", &plain));
}

/// `--dtype half` computes in f32 over the weights rounded to half: the tiny Llama in f16
/// gives, bit for bit, the logits that its HF directory rewritten with every matrix stored as
/// halves gives as stored (both with half KV caches), over the prompt and cached steps.
#[test]
fn half_compute_is_f32_over_weights_rounded_to_half() {
    let src = fixture("hf-tiny/llama");
    let scratch = common::scratch_dir("bbc-half-llama-");
    std::fs::copy(src.join("config.json"), scratch.path().join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut halved: Vec<(String, Vec<usize>, safetensors::Dtype, Vec<u8>)> = Vec::new();
    for (name, view) in tensors.tensors() {
        assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
        let (dtype, data) = match view.shape().len() {
            2 => (
                safetensors::Dtype::F16,
                view.data()
                    .chunks_exact(4)
                    .flat_map(|b| half::f16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_le_bytes())
                    .collect(),
            ),
            _ => (safetensors::Dtype::F32, view.data().to_vec()),
        };
        halved.push((name, view.shape().to_vec(), dtype, data));
    }
    let views = halved.iter().map(|(name, shape, dtype, data)| {
        (
            name.clone(),
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
        )
    });
    safetensors::serialize_to_file(views, None, &scratch.path().join("model.safetensors")).unwrap();
    let run = |weights: &std::path::Path, dtype: ComputeDtype| -> Vec<Vec<f32>> {
        let mut spec = ModelSpec::for_weights(weights);
        spec.dtype = dtype;
        let model = Model::open(spec).unwrap();
        let graph = model.lower(LogitsFor::AllTokens).unwrap();
        let caches: Vec<ir::DType> = graph
            .nodes()
            .iter()
            .filter_map(|n| n.op.appended_attention())
            .map(|a| a.cache_dtype)
            .collect();
        assert!(caches.iter().all(|&c| c == ir::DType::F16), "{dtype:?}: {caches:?}");
        let graph = passes::optimized(&graph, passes::CostModel::CPU).unwrap();
        let backend = CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap();
        let mut seq = backend.new_sequence();
        let mut ids = Reference::of("llama").input_ids;
        (0..4)
            .map(|_| {
                let logits = backend.step(&mut seq, &ids).unwrap()["logits"].clone();
                ids = vec![argmax(logits.row(logits.rows() - 1))];
                logits.data
            })
            .collect()
    };
    let (half, stored) = (run(&src, ComputeDtype::F16), run(scratch.path(), ComputeDtype::Native));
    assert_eq!(half, stored);
    // And not what f32 gives: the rounding is there to see.
    assert_ne!(half[0], run_f32_logits(&src));
}

/// The tiny Llama's prompt logits computed in f32.
fn run_f32_logits(dir: &std::path::Path) -> Vec<f32> {
    let model = Model::open(ModelSpec::for_weights(dir)).unwrap();
    let graph = model.lower(LogitsFor::AllTokens).unwrap();
    let backend = CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap();
    let mut seq = backend.new_sequence();
    backend.step(&mut seq, &Reference::of("llama").input_ids).unwrap()["logits"]
        .data
        .clone()
}

/// FP8 checkpoints (`make_fp8_variants.py`): the weights of `llama`, `qwen3_next`, GLM-5.2's
/// `glm_moe_dsa_shared` and `glm4_moe` stored as FP8 codes with scales, blocks of 16 × 32 and
/// 16 × 16 (`weight_scale_inv`, every expert's own; GLM-5.2's latent projections too) and one
/// scale a row (compressed-tensors' `weight_scale`). Each weight is its code times its scale
/// in f32, as transformers reads it, whether read in f32 or held as FP8 blocks of 32 (all but
/// Qwen3-Next's, whose 16-column blocks do not fit them, so it keeps its checkpoint's f32):
/// logits at every prompt row and cached step, and greedy ids, through the interpreter and the
/// CPU backend.
#[test]
fn fp8_checkpoints_match_hf() {
    for (name, held) in [
        ("llama_fp8", quant::GgmlType::F8E4M3B32),
        ("qwen3_next_fp8", quant::GgmlType::F32),
        ("glm_moe_dsa_fp8", quant::GgmlType::F8E4M3B32),
        ("glm4_moe_fp8", quant::GgmlType::F8E4M3B32),
    ] {
        check_reference_interpreter(name);
        check_cpu_backend(name);
        let mut spec = ModelSpec::for_weights(&fixture(&format!("hf-tiny/{name}")));
        spec.dtype = ComputeDtype::Native;
        let native = Model::open(spec).unwrap();
        let weight = native
            .weights
            .require("model.layers.1.mlp.down_proj.weight")
            .or_else(|_| native.weights.require("model.layers.1.mlp.experts.0.down_proj.weight"));
        assert_eq!(weight.unwrap().dtype, held, "{name}");
        check_interpreter_against(&native, &Reference::of(name), &format!("{name} as stored"));
        check_cpu_backend_against(&native, &Reference::of(name), &format!("{name} as stored"));
    }
}

/// Integer checkpoints (`make_int_variants.py`): the weights of `llama` and `qwen3_next`
/// stored as packed integer levels with scales (and zero points) by compressed-tensors
/// (`pack-quantized`: 4 bits symmetric and asymmetric in groups of 32, 8 bits a scale a row;
/// `int-quantized`, a level a byte: 8 bits with zero points in groups of 32;
/// Qwen3-Next's experts, Gated DeltaNet and attention at 4 bits a scale a row), GPTQ (4 bits in
/// groups of 32, also with act-order, and in groups of 128 over a 128-wide Llama) and AWQ (its
/// GEMM layout). Each weight is `(q − z) · s` in
/// f32 whether read in f32 or held: as 4-bit blocks where its levels have 4 bits, its groups
/// are whole blocks (of 128 where every 128 columns lie in one group: the 128-wide Llama's
/// projections but its 160-wide down projection, whose second group is short, held in blocks
/// of 32) and its scales have at most 20 significant bits (f16's in GPTQ and AWQ,
/// f32 ones of bf16's precision; act-order's columns held by group, each layer's input taken
/// in that order), as FP8 blocks where the scales are f32's (`llama_w4a16`), else as the
/// checkpoint's f32 (8 bits, and Qwen3-Next's shared-expert down projection of 48 columns):
/// logits at every prompt row and cached step, and greedy ids,
/// through the interpreter and the CPU backend. compressed-tensors' references are
/// transformers reading the checkpoints; GPTQ's and AWQ's transformers over the products.
///
/// Held in 4-bit blocks, the CPU backend multiplies them as the Q4_0 or Q5_0 blocks of the
/// same weights on its int8 kernels (as llama.cpp runs 4-bit GGUFs, and vLLM's CPU backend
/// GPTQ and AWQ): int8 activations move the Llamas' logits by up to 1.7% of the largest
/// (checked within 3e-2), and the tiny Qwen3-Next's, whose logits Q8_0 weights alone move by
/// 37%, by up to 14.7% (checked within 0.2); every greedy id is HF's.
#[test]
fn integer_checkpoints_match_hf() {
    use quant::GgmlType::{F32, F8E4M3B32, U4B128, U4B32};
    let down = "model.layers.1.mlp.down_proj.weight";
    for (name, method, weight, held, native_cpu) in [
        ("llama_w4a16", "compressed-tensors", down, F8E4M3B32, 1e-4),
        ("llama_w4a16_asym", "compressed-tensors", down, U4B32, 3e-2),
        ("llama_w8a16", "compressed-tensors", down, F32, 1e-4),
        ("llama_w8a16_int", "compressed-tensors", down, F32, 1e-4),
        ("llama_gptq", "gptq", down, U4B32, 3e-2),
        ("llama_gptq_act_order", "gptq", down, U4B32, 3e-2),
        (
            "llama_gptq_g128",
            "gptq",
            "model.layers.1.mlp.up_proj.weight",
            U4B128,
            3e-2,
        ),
        ("llama_awq", "awq", down, U4B32, 3e-2),
        (
            "qwen3_next_w4a16",
            "compressed-tensors",
            "model.layers.1.mlp.experts.0.down_proj.weight",
            U4B32,
            0.2,
        ),
    ] {
        check_quantized_checkpoint(name, method, weight, held, native_cpu);
    }
    let shared_down = "model.layers.1.mlp.shared_expert.down_proj.weight";
    let native = Model::open(ModelSpec {
        dtype: ComputeDtype::Native,
        ..ModelSpec::for_weights(&fixture("hf-tiny/qwen3_next_w4a16"))
    })
    .unwrap();
    assert_eq!(native.weights.require(shared_down).unwrap().dtype, F32);
    let wide = Model::open(ModelSpec {
        dtype: ComputeDtype::Native,
        ..ModelSpec::for_weights(&fixture("hf-tiny/llama_gptq_g128"))
    })
    .unwrap();
    for layer in 0..2 {
        for (part, held) in [
            ("self_attn.q_proj", U4B128),
            ("self_attn.k_proj", U4B128),
            ("self_attn.v_proj", U4B128),
            ("self_attn.o_proj", U4B128),
            ("mlp.gate_proj", U4B128),
            ("mlp.up_proj", U4B128),
            ("mlp.down_proj", U4B32),
        ] {
            let name = format!("model.layers.{layer}.{part}.weight");
            assert_eq!(wide.weights.require(&name).unwrap().dtype, held, "{name}");
        }
    }
}

/// AutoRound's checkpoints (`quant_method: auto-round`, vLLM's name) packed as GPTQ and AWQ
/// pack them (`packing_format` `auto_round:auto_gptq`, `auto_round:auto_awq`): the GPTQ and
/// AWQ Llamas labelled so, their head listed in floats (`extra_config`), are held in the same
/// 4-bit blocks and match the same HF logits (interpreter within 1e-4, CPU backend on its
/// int8 kernels within 3e-2) with every greedy id.
#[test]
fn auto_round_checkpoints_read_as_their_packing() {
    for (src, packing) in [
        ("llama_gptq", "auto_round:auto_gptq"),
        ("llama_awq", "auto_round:auto_awq"),
    ] {
        let quantization = serde_json::json!({
            "quant_method": "auto-round",
            "packing_format": packing,
            "bits": 4,
            "group_size": 32,
            "sym": false,
            "data_type": "int",
            "extra_config": {"lm_head": {"bits": 16, "data_type": "float"}},
        });
        let copy =
            common::checkpoint_copies::with_quantization_config(&fixture(&format!("hf-tiny/{src}")), quantization);
        let mut spec = ModelSpec::for_weights(copy.path());
        spec.dtype = ComputeDtype::Native;
        let native = Model::open(spec).unwrap();
        assert_eq!(native.weights.quantization(), Some("auto-round"), "{src}");
        let down = native.weights.require("model.layers.1.mlp.down_proj.weight").unwrap();
        assert_eq!(down.dtype, quant::GgmlType::U4B32, "{src}");
        check_interpreter_against(&native, &Reference::of(src), &format!("{src} as {packing}"));
        check_cpu_backend_within(&native, &Reference::of(src), 3e-2, &format!("{src} as {packing}"));
    }
}

/// FP4 checkpoints: NVFP4 as compressed-tensors (`llama_nvfp4`, `code · scale / global`) and
/// ModelOpt (`qwen3_next_nvfp4`: experts, shared expert, Gated DeltaNet and attention,
/// `code · scale · scale_2`, with the activations' `input_scale` beside each weight, not used)
/// write it, and MXFP4 as compressed-tensors does (`llama_mxfp4`, `code · 2^(e − 127)`).
/// Each weight is its code's value times its group's folded f32 scale, held as FP4 blocks where
/// its rows are whole blocks of 32, else (Qwen3-Next's 48-column shared-expert down
/// projection) as the checkpoint's f32: logits at every prompt row and cached step, and greedy
/// ids, through the interpreter and the CPU backend, against transformers over those products.
/// vLLM's `modelopt_fp4` names ModelOpt's.
#[test]
fn fp4_checkpoints_match_hf() {
    use quant::GgmlType::{F32, F4E2M1B32};
    for (name, method, weight) in [
        (
            "llama_nvfp4",
            "compressed-tensors",
            "model.layers.1.mlp.down_proj.weight",
        ),
        (
            "qwen3_next_nvfp4",
            "modelopt",
            "model.layers.1.mlp.experts.0.down_proj.weight",
        ),
        (
            "llama_mxfp4",
            "compressed-tensors",
            "model.layers.1.mlp.down_proj.weight",
        ),
    ] {
        check_quantized_checkpoint(name, method, weight, F4E2M1B32, 1e-4);
    }
    let mut spec = ModelSpec::for_weights(&fixture("hf-tiny/qwen3_next_nvfp4"));
    spec.dtype = ComputeDtype::Native;
    spec.quantization = Some("modelopt_fp4".into());
    let native = Model::open(spec).unwrap();
    let shared_down = "model.layers.1.mlp.shared_expert.down_proj.weight";
    assert_eq!(native.weights.require(shared_down).unwrap().dtype, F32);
}

/// The quantized checkpoint `name` matches its reference read into f32 (interpreter, CPU
/// backend) and held as stored (its method `method`, `weight` held as `held`).
/// `name`'s checkpoint through the interpreter and the CPU backend in f32 and as stored
/// (`held`, the type of `weight`, read for `method`): every check within 1e-4 of HF's logits
/// but the CPU backend's as stored, within `native_cpu`.
fn check_quantized_checkpoint(name: &str, method: &str, weight: &str, held: quant::GgmlType, native_cpu: f32) {
    check_reference_interpreter(name);
    check_cpu_backend(name);
    let mut spec = ModelSpec::for_weights(&fixture(&format!("hf-tiny/{name}")));
    spec.dtype = ComputeDtype::Native;
    let native = Model::open(spec).unwrap();
    assert_eq!(native.weights.quantization(), Some(method), "{name}");
    assert_eq!(native.weights.require(weight).unwrap().dtype, held, "{name}");
    check_interpreter_against(&native, &Reference::of(name), &format!("{name} as stored"));
    check_cpu_backend_within(&native, &Reference::of(name), native_cpu, &format!("{name} as stored"));
}

/// compressed-tensors' 8-bit Llama (`llama_w8a16`: symmetric, a scale a row) with its scales
/// stored in bf16, as llm-compressor saves a bf16 model's: held natively as GGUF's Q8_0 blocks
/// of the same weights (every projection), its logits through the interpreter are those of
/// the checkpoint read into f32 (the same products), and through the CPU backend (int8
/// activations) within 3e-2 of them (1.6% measured) with the same 12 greedy ids; computing in
/// bf16 the blocks stay. With f32 scales (the fixture's own) the weights stay f32.
#[test]
fn eight_bit_checkpoints_under_16_bit_scales_are_held_as_q8_0() {
    let src = fixture("hf-tiny/llama_w8a16");
    let scratch = common::checkpoint_copies::with_bf16_scales(&src);
    let dir = scratch.path();
    let read = |dir: &std::path::Path, dtype| {
        let mut spec = ModelSpec::for_weights(dir);
        spec.dtype = dtype;
        Model::open(spec).unwrap()
    };
    let (native, dequantized) = (read(dir, ComputeDtype::Native), read(dir, ComputeDtype::F32));
    for layer in 0..2 {
        for part in ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"] {
            let name = format!("model.layers.{layer}.{part}.weight");
            assert_eq!(
                native.weights.require(&name).unwrap().dtype,
                quant::GgmlType::Q8_0,
                "{name}"
            );
        }
    }
    let down = "model.layers.1.mlp.down_proj.weight";
    assert_eq!(
        read(&src, ComputeDtype::Native).weights.require(down).unwrap().dtype,
        quant::GgmlType::F32
    );
    // Computing in bf16 (vLLM's `--dtype auto` over a bf16 release), the blocks stay Q8_0.
    let mut spec = ModelSpec::for_weights(dir);
    (spec.dtype, spec.quantization) = (ComputeDtype::Bf16, Some("compressed-tensors".into()));
    let in_bf16 = Model::open(spec).unwrap().lower(LogitsFor::AllTokens).unwrap();
    let projections: Vec<_> = in_bf16
        .nodes()
        .iter()
        .filter_map(|n| match &n.op {
            ir::Op::Weight { name } if name.contains("_proj.") => Some(n.dtype),
            _ => None,
        })
        .collect();
    assert!(
        projections.len() >= 14 && projections.iter().all(|&t| t == ir::DType::Q8_0),
        "{projections:?}"
    );
    // The KV caches stay the checkpoint's f32, as for its other held blocks.
    let graph = native.lower(LogitsFor::AllTokens).unwrap();
    let caches = graph.nodes().iter().filter_map(|n| match &n.op {
        ir::Op::Attention(spec) => Some(spec.cache_dtype),
        _ => None,
    });
    let caches: Vec<_> = caches.collect();
    assert!(
        !caches.is_empty() && caches.iter().all(|&c| c == ir::DType::F32),
        "{caches:?}"
    );
    let reference = interpreter_reference(&dequantized, &Reference::of("llama_w8a16").input_ids, 12);
    check_interpreter_against(&native, &reference, "w8 bf16 scales as Q8_0");
    check_cpu_backend_within(&native, &reference, 3e-2, "w8 bf16 scales as Q8_0");
}

/// vLLM's names for the kernels that run the same checkpoints (`gptq_marlin`, `awq_marlin`)
/// are taken as the methods; another method is refused naming the checkpoint's.
#[test]
fn integer_checkpoints_take_vllms_names_for_their_methods() {
    for (name, asked) in [
        ("llama_gptq", "gptq_marlin"),
        ("llama_awq", "awq_marlin"),
        ("llama_awq", "AWQ"),
        ("llama_w4a16", "compressed-tensors"),
    ] {
        let mut spec = ModelSpec::for_weights(&fixture(&format!("hf-tiny/{name}")));
        spec.quantization = Some(asked.into());
        Model::open(spec).unwrap_or_else(|e| panic!("{name} -q {asked}: {e}"));
    }
    let mut spec = ModelSpec::for_weights(&fixture("hf-tiny/llama_awq"));
    spec.quantization = Some("gptq".into());
    let err = Model::open(spec).err().expect("awq is not gptq").to_string();
    assert!(err.contains("quantized as `awq`"), "{err}");
}

/// An FP8 checkpoint read for a 16-bit model holds each weight in 16 bits, rounded once from
/// code × scale: its logits are, bit for bit, those of the weights read in f32 and rounded as
/// the model computes; and bf16's rounding is there to see against the f32 logits.
#[test]
fn fp8_weights_are_rounded_once_to_the_type_computed_in() {
    let dir = fixture("hf-tiny/llama_fp8");
    let fp8_weight = "model.layers.0.mlp.down_proj.weight";
    let prompt = Reference::of("llama_fp8").input_ids;
    let logits = |model: &Model| cpu_prompt_logits(model, &prompt);
    for (dtype, stored) in [
        (ComputeDtype::Bf16, quant::GgmlType::BF16),
        (ComputeDtype::F16, quant::GgmlType::F16),
    ] {
        let mut spec = ModelSpec::for_weights(&dir);
        spec.dtype = dtype;
        let sixteen = Model::open(spec).unwrap();
        assert_eq!(sixteen.weights.require(fp8_weight).unwrap().dtype, stored);
        let mut rounded_later = open("llama_fp8");
        assert_eq!(
            rounded_later.weights.require(fp8_weight).unwrap().dtype,
            quant::GgmlType::F32
        );
        rounded_later.spec.dtype = dtype;
        let got = logits(&sixteen);
        assert_eq!(got, logits(&rounded_later), "{dtype:?}");
        if dtype == ComputeDtype::Bf16 {
            let f32_logits = logits(&open("llama_fp8"));
            let scale = f32_logits.iter().fold(0f32, |m, v| m.max(v.abs()));
            let moved = got
                .iter()
                .zip(&f32_logits)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(moved > 1e-4 * scale, "bf16 moves the logits only {moved}");
        }
    }
}

/// What reading converts (an FP8 checkpoint's weights, or floats quantized as they load) is
/// made afresh for the CPU backend, which keeps its own copy, so the source holds none after
/// the backend is built; a weight read through the source is held until released, then made
/// again alike, and a backend built then computes the same.
#[test]
fn converted_weights_are_handed_over_or_held_until_released() {
    for (mut model, name) in [
        (open("qwen3_next_fp8"), "model.layers.0.mlp.experts.3.down_proj.weight"),
        (
            open_quantized("qwen3_next", ComputeDtype::Native),
            "model.layers.0.mlp.experts.3.down_proj.weight",
        ),
    ] {
        assert_eq!(
            model.weights.converted_bytes(),
            0,
            "nothing is converted before it is read"
        );
        let prompt = Reference::of("qwen3_next").input_ids;
        let logits = |model: &Model| cpu_prompt_logits(model, &prompt);
        let before = logits(&model);
        assert_eq!(
            model.weights.converted_bytes(),
            0,
            "the backend took what was made for it"
        );
        let made = quant::tensor::Tensors::made_afresh(&model.weights, name).unwrap();
        let bytes = model.weights.require(name).unwrap().bytes.to_vec();
        assert_eq!(made.bytes, bytes);
        assert_eq!(model.weights.converted_bytes(), bytes.len());
        assert!(
            quant::tensor::Tensors::made_afresh(&model.weights, name).is_none(),
            "a weight held is read where it is held"
        );
        model.weights.release_converted();
        assert_eq!(model.weights.converted_bytes(), 0);
        assert_eq!(model.weights.require(name).unwrap().bytes, &bytes[..]);
        assert_eq!(logits(&model), before);
    }
}

/// The hf-tiny model `name` quantized to FP8 as it loads (`--quantization fp8`), in `dtype`.
fn open_quantized(name: &str, dtype: ComputeDtype) -> Model {
    let mut spec = ModelSpec::for_weights(&fixture(&format!("hf-tiny/{name}")));
    spec.dtype = dtype;
    spec.quantization = Some("fp8".into());
    Model::open(spec).unwrap()
}

/// `--quantization fp8` over float checkpoints, against `make_fp8_variants.py`'s
/// `*_fp8_on_load`, the same weights quantized by torch where bbc quantizes them (blocks of
/// 1 × 32): bbc's quantization gives those checkpoints' scales and codes bit for bit, every
/// other tensor as stored; the model then matches transformers running the checkpoint at
/// every prompt row and cached step, greedy ids equal, through the interpreter and the CPU
/// backend. Llama; Qwen3-Next (experts, Gated DeltaNet); GLM-5.2 (latent attention, indexer).
#[test]
fn fp8_quantization_on_load_is_torchs_and_matches_hf() {
    for (base, checkpoint, least_quantized) in [
        ("llama", "llama_fp8_on_load", 21),
        ("qwen3_next", "qwen3_next_fp8_on_load", 69),
        ("glm_moe_dsa_shared", "glm_moe_dsa_fp8_on_load", 104),
    ] {
        let quantized = open_quantized(base, ComputeDtype::Native);
        assert_eq!(quantized.weights.quantization(), Some("fp8"));
        let mut spec = ModelSpec::for_weights(&fixture(&format!("hf-tiny/{checkpoint}")));
        spec.dtype = ComputeDtype::Native;
        let stored = Model::open(spec).unwrap();
        let mut names = quantized.weights.names();
        names.sort_unstable();
        let mut stored_names = stored.weights.names();
        stored_names.sort_unstable();
        assert_eq!(names, stored_names, "{base}");
        let mut fp8 = 0;
        for name in names {
            let (ours, torchs) = (
                quantized.weights.require(name).unwrap(),
                stored.weights.require(name).unwrap(),
            );
            assert_eq!((ours.dtype, ours.shape), (torchs.dtype, torchs.shape), "{base}: {name}");
            assert!(ours.bytes == torchs.bytes, "{base}: {name} is not the checkpoint's");
            fp8 += usize::from(ours.dtype == quant::GgmlType::F8E4M3B32);
        }
        assert_eq!(fp8, least_quantized, "{base}: weights quantized");
        let reference = Reference::of(checkpoint);
        check_interpreter_against(&quantized, &reference, &format!("{base} fp8 on load"));
        check_cpu_backend_against(&quantized, &reference, &format!("{base} fp8 on load"));
    }
}

/// Under `--dtype bf16` (or f16) the quantized weights stay FP8 blocks and the dtype types the
/// rest (embeddings, heads): the graph's weights say so, and the logits stay within 1e-2 of
/// the largest of transformers' over the checkpoint in f32 (bf16's rounding of the embeddings
/// and activations moves them 3.6e-3), greedy ids equal.
#[test]
fn fp8_quantization_on_load_keeps_its_blocks_under_a_16_bit_dtype() {
    let reference = Reference::of("llama_fp8_on_load");
    for (dtype, rest) in [
        (ComputeDtype::Bf16, ir::DType::BF16),
        (ComputeDtype::F16, ir::DType::F16),
    ] {
        let model = open_quantized("llama", dtype);
        let graph = model.lower(LogitsFor::AllTokens).unwrap();
        let weight_dtype = |name: &str| {
            graph
                .nodes()
                .iter()
                .find(|n| matches!(&n.op, ir::Op::Weight { name: m } if m == name))
                .map(|n| n.dtype)
                .unwrap()
        };
        assert_eq!(
            weight_dtype("model.layers.2.mlp.down_proj.weight"),
            ir::DType::F8E4M3B32
        );
        assert_eq!(weight_dtype("model.embed_tokens.weight"), rest);
        check_cpu_graph_within(&model, graph, &reference, 1e-2, &format!("fp8 on load, {dtype:?}"));
    }
}

/// Every family quantized as it loads runs on the CPU backend as the reference interpreter
/// runs the same FP8 weights (the interpreter widens each block; the backend multiplies the
/// blocks): every prompt row, and cached greedy steps.
#[test]
fn every_family_quantized_on_load_runs_on_the_cpu_as_the_interpreter_does() {
    for family in [
        "llama",
        "gemma3",
        "gemma4",
        "gemma4_moe",
        "glm4_moe",
        "glm_moe_dsa",
        "qwen3_5",
        "qwen3_next",
    ] {
        let model = open_quantized(family, ComputeDtype::Native);
        let reference = interpreter_reference(&model, &Reference::of(family).input_ids, 6);
        check_cpu_backend_against(&model, &reference, &format!("{family} fp8 on load"));
    }
}

/// The reference interpreter's run of `model` over `prompt` and `steps` greedy steps, in the
/// hf-tiny references' layout.
fn interpreter_reference(model: &Model, prompt: &[u32], steps: usize) -> Reference {
    let graph = model.lower(LogitsFor::AllTokens).unwrap();
    let weights = models::weights::DequantizedWeights::new(&model.weights);
    let mut interp = ir::reference::Interpreter::new(&weights);
    let n = prompt.len();
    let out = interp.step(&graph, prompt, &(0..n).collect::<Vec<_>>()).unwrap();
    let logits = out["logits"].data.clone();
    let vocab = logits.len() / n;
    let mut last = logits[(n - 1) * vocab..].to_vec();
    let (mut greedy_ids, mut step_logits) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let id = argmax(&last);
        step_logits.extend_from_slice(&last);
        greedy_ids.push(id);
        last = interp.step(&graph, &[id], &[n + step]).unwrap()["logits"].data.clone();
    }
    Reference {
        input_ids: prompt.to_vec(),
        logits,
        greedy_ids,
        step_logits,
        vocab,
    }
}

/// `model`'s logits at every row of `prompt` on the CPU backend, its graph as lowered.
fn cpu_prompt_logits(model: &Model, prompt: &[u32]) -> Vec<f32> {
    let backend = CpuBackend::new(model.lower(LogitsFor::AllTokens).unwrap(), &model.weights, 64).unwrap();
    backend.step(&mut backend.new_sequence(), prompt).unwrap()["logits"]
        .data
        .clone()
}
