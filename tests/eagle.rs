//! EAGLE draft heads drafting for the tiny Llama: an EAGLE-1 head and EAGLE-3 heads in the
//! EAGLE authors' layout and the speculators library's (`tests/fixtures/eagle`, made by
//! `make_eagle_heads.py` with speculators' and transformers' layers as the reference). The
//! target outputs the states each head reads, the head's rows (the prompt's and chained ones)
//! give the reference's logits and states, its drafter proposes the reference's drafts, and
//! whatever the head guesses, the served tokens are the target's own: greedy and sampled,
//! with drafts accepted and refused, across preemption and prefix-cache hits.

mod common;

use common::drafting::{
    adds_to_the_residual, assert_refused_drafts_kept_the_tokens, bigram, config, f32_tensor, in_memory, requests,
    requests_of_lengths, segment, serve_on, Served,
};
use ir::multi_token::{DRAFT_HIDDEN_STATE, TARGET_HIDDEN_STATES};
use ir::reference::Interpreter;
use models::eagle::{EagleHead, EagleMethod};
use models::weights::DequantizedWeights;
use models::{LogitsFor, Model, ModelSpec, WeightSource};
use runtime::emulator_device::EmulatorBackend;
use runtime::serving::{DraftRequest, Drafter, MtpDrafter, PagedBackend, SchedulerConfig, SeqId};
use runtime::{CpuBackend, SamplingParams};
use std::path::Path;

/// The fixture heads: name and method.
const HEADS: [(&str, EagleMethod); 3] = [
    ("eagle3", EagleMethod::Eagle3),
    ("eagle3_speculators", EagleMethod::Eagle3),
    ("eagle", EagleMethod::Eagle),
];

fn llama() -> Model {
    Model::open(ModelSpec::for_weights(&common::fixture("hf-tiny/llama"))).unwrap()
}

fn open_head(model: &Model, dir: &Path, method: EagleMethod) -> EagleHead {
    EagleHead::open(dir, method, &model.config).unwrap()
}

fn fixture_head(model: &Model, name: &str, method: EagleMethod) -> EagleHead {
    open_head(model, &common::fixture(&format!("eagle/{name}")), method)
}

/// What `make_eagle_heads.py` wrote for a head.
struct Reference {
    prompt: Vec<u32>,
    /// The target's states, a row a prompt position.
    states: Vec<f32>,
    /// The head's logits at the prompt's rows but the last, then at two chained rows.
    logits: Vec<f32>,
    /// The state each of those rows passes on.
    draft_states: Vec<f32>,
    /// The greedy drafts, as the target's ids.
    drafts: Vec<u32>,
}

fn reference(name: &str) -> Reference {
    let bytes = std::fs::read(common::fixture(&format!("eagle/{name}-reference.safetensors"))).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let floats = |key: &str| -> Vec<f32> {
        let t = file.tensor(key).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::F32, "{key}");
        t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let ids = |key: &str| -> Vec<u32> {
        let t = file.tensor(key).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::I64, "{key}");
        t.data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    };
    Reference {
        prompt: ids("input_ids"),
        states: floats("states"),
        logits: floats("logits"),
        draft_states: floats("draft_states"),
        drafts: ids("drafts"),
    }
}

/// `got` is `want` within 1e-4 of `want`'s largest magnitude.
fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0f32, |m, d| if d > m || d.is_nan() { d } else { m });
    assert!(worst <= 1e-4 * scale, "{what}: off by {worst} (largest {scale})");
}

/// The target's graph outputting the states `head` reads, optimized for the CPU.
fn target_graph(model: &Model, head: &EagleHead, logits: LogitsFor) -> ir::Graph {
    let graph = model.lower(logits).unwrap();
    let graph = head
        .target_graph(&graph, &model.weights, model.lower_options(logits))
        .unwrap();
    passes::optimized(&graph, passes::CostModel::CPU).unwrap()
}

fn target_backend(model: &Model, head: &EagleHead) -> CpuBackend {
    let weights = head.weights_beside(&model.weights);
    let graph = target_graph(model, head, LogitsFor::LastToken);
    CpuBackend::new(graph, &weights, model.config.context_length).unwrap()
}

/// The drafter over `head`'s greedy graph on the CPU backend, its 4-bit shortlist or not.
fn drafter(model: &Model, head: &EagleHead, shortlisted: bool) -> MtpDrafter<CpuBackend> {
    let graph = head
        .lower(
            &model.config,
            &model.weights,
            model.lower_options(LogitsFor::GreedyToken),
        )
        .unwrap();
    let graph = match shortlisted {
        true => passes::shortlisted_draft_head(&graph).unwrap(),
        false => graph,
    };
    let graph = passes::optimized(&graph, passes::CostModel::CPU).unwrap();
    let weights = head.weights_beside(&model.weights);
    let backend = CpuBackend::new(graph, &weights, model.config.context_length).unwrap();
    let drafter = MtpDrafter::new(backend, head.config.hidden, 256, 8, 64, model.config.context_length).unwrap();
    match &head.token_map {
        Some(map) => drafter.with_token_map(map.clone()),
        None => drafter,
    }
}

/// The target's states at every prompt position: through the IR's reference interpreter
/// (unoptimized) and on the CPU backend (optimized, as served), each as the reference's.
#[test]
fn the_target_outputs_the_states_its_head_reads() {
    let model = llama();
    for (name, method) in HEADS {
        let head = fixture_head(&model, name, method);
        let want = reference(name);
        let weights = head.weights_beside(&model.weights);
        let unoptimized = head
            .target_graph(
                &model.lower(LogitsFor::LastToken).unwrap(),
                &model.weights,
                model.lower_options(LogitsFor::LastToken),
            )
            .unwrap();
        let positions: Vec<usize> = (0..want.prompt.len()).collect();
        let dequantized = DequantizedWeights::new(&weights);
        let out = Interpreter::new(&dequantized)
            .step(&unoptimized, &want.prompt, &positions)
            .unwrap();
        assert_close(
            &out[TARGET_HIDDEN_STATES].data,
            &want.states,
            &format!("{name}: interpreter"),
        );
        let backend = target_backend(&model, &head);
        let mut pages = backend.new_pages(8);
        let table: Vec<runtime::kv::BlockId> = (0..2).map(runtime::kv::BlockId).collect();
        let step = segment(&table, 0, &want.prompt, &[]);
        let out = &backend.step_batch(&mut pages, &[step]).unwrap()[0];
        assert_close(
            &out[TARGET_HIDDEN_STATES].data,
            &want.states,
            &format!("{name}: CPU backend"),
        );
    }
}

/// The head's rows as the reference computes them: the prompt's (each reading the token
/// after its position and the target's state there) in one step, then two chained rows, each
/// reading the draft before it and the state the row before passed on; every row's logits and
/// state through the interpreter and on the CPU backend (optimized), and each step's last
/// row's on the head's batched plan for the H200 (the emulator).
#[test]
fn the_heads_rows_are_the_references() {
    let model = llama();
    for (name, method) in HEADS {
        let head = fixture_head(&model, name, method);
        let want = reference(name);
        let graph = head
            .lower(&model.config, &model.weights, model.lower_options(LogitsFor::AllTokens))
            .unwrap();
        let weights = head.weights_beside(&model.weights);
        let dequantized = DequantizedWeights::new(&weights);
        let mut interpreter = Interpreter::new(&dequantized);
        let optimized = passes::optimized(&graph, passes::CostModel::CPU).unwrap();
        let backend = CpuBackend::new(optimized, &weights, model.config.context_length).unwrap();
        let mut pages = backend.new_pages(8);
        let plan_graph = head
            .lower(&model.config, &model.weights, model.lower_options(LogitsFor::LastToken))
            .unwrap();
        let plan_graph = models::with_greedy_token(&fused_for_h200(&plan_graph)).unwrap();
        let (plan, kernels) =
            codegen::gpu::build_batched(&plan_graph, codegen::Target::H200, PLAN_ROWS, plan_cache(4)).unwrap();
        let plan = EmulatorBackend::emulated(plan, kernels, plan_graph, &weights, &[], PLAN_CONTEXT).unwrap();
        let mut plan_pages = PagedBackend::new_pages(&plan, 8);
        let table: Vec<runtime::kv::BlockId> = (0..2).map(runtime::kv::BlockId).collect();
        let (h, vocab) = (head.config.hidden, head.draft_vocab);
        let n = want.prompt.len();
        // The prompt's rows, then each chained row.
        let mut steps = vec![(want.prompt[1..].to_vec(), 0, want.states[..(n - 1) * h].to_vec())];
        for k in 0..2 {
            let state = want.draft_states[(n - 2 + k) * h..(n - 1 + k) * h].to_vec();
            steps.push((vec![want.drafts[k]], n - 1 + k, state));
        }
        for (ids, start, states) in &steps {
            let rows = *start..start + ids.len();
            let what = format!("{name}, rows {rows:?}");
            let positions: Vec<usize> = rows.clone().collect();
            let interpreted = interpreter
                .step_with_hidden_states(&graph, ids, &positions, states)
                .unwrap();
            let served = &backend
                .step_batch(&mut pages, &[segment(&table, *start, ids, states)])
                .unwrap()[0];
            for (out, by) in [(&interpreted, "interpreter"), (served, "CPU backend")] {
                let what = format!("{what}, {by}");
                assert_close(
                    &out["logits"].data,
                    &want.logits[rows.start * vocab..rows.end * vocab],
                    &format!("{what}: logits"),
                );
                assert_close(
                    &out[DRAFT_HIDDEN_STATE].data,
                    &want.draft_states[rows.start * h..rows.end * h],
                    &format!("{what}: states"),
                );
            }
            let step = [segment(&table, *start, ids, states)];
            let planned = &PagedBackend::step_batch(&plan, &mut plan_pages, &step).unwrap()[0];
            let last = rows.end - 1;
            let what = format!("{what}, H200 plan");
            assert_close(
                &planned["logits"].data,
                &want.logits[last * vocab..(last + 1) * vocab],
                &format!("{what}: logits"),
            );
            assert_close(
                &planned[DRAFT_HIDDEN_STATE].data,
                &want.draft_states[last * h..(last + 1) * h],
                &format!("{what}: state"),
            );
        }
    }
}

/// The drafter, given the target's states of the prompt's positions but the last, proposes
/// the reference's three greedy drafts (EAGLE-3's through its draft vocabulary's ids), from
/// the exact head and from its 4-bit shortlist (the exact best among its 64 rows here).
#[test]
fn the_drafter_proposes_the_references_drafts() {
    let model = llama();
    for (name, method) in HEADS {
        let head = fixture_head(&model, name, method);
        let want = reference(name);
        let n = want.prompt.len();
        let h = head.config.hidden;
        let states = ir::Tensor::new(vec![n - 1, h], want.states[..(n - 1) * h].to_vec());
        for shortlisted in [false, true] {
            let mut drafter = drafter(&model, &head, shortlisted);
            drafter.observe(SeqId(0), 0, &states);
            let request = DraftRequest {
                seq: SeqId(0),
                tokens: &want.prompt,
                limit: 3,
            };
            let drafts = drafter.propose(&[request]).unwrap();
            assert_eq!(drafts[&SeqId(0)], want.drafts, "{name}, shortlisted {shortlisted}");
        }
    }
}

/// The tiny Llama whose next token is a function of its last ([`bigram`]), its final norm the
/// identity, so that its greedy choice after token `t` is the row of its (tied) head that best
/// matches `t`'s embedding.
fn bigram_llama() -> Model {
    let mut model = bigram(in_memory(llama()));
    let WeightSource::Memory(tensors) = &mut model.weights else {
        unreachable!("in memory")
    };
    let h = model.config.hidden;
    tensors.insert("model.norm.weight".into(), f32_tensor(&[h], &vec![1.0; h]));
    model
}

/// A copy of fixture head `name` in `dir` with `change` made to its tensors (by name, in f32;
/// those it returns false for left out).
fn changed_head(name: &str, dir: &Path, change: impl Fn(&str, &mut Vec<f32>, &[usize]) -> bool) {
    let from = common::fixture(&format!("eagle/{name}"));
    std::fs::copy(from.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(from.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (key, t) in file.tensors() {
        let mut data = t.data().to_vec();
        let mut keep = true;
        if t.dtype() == safetensors::Dtype::F32 {
            let mut values: Vec<f32> = data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            keep = change(&key, &mut values, t.shape());
            data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        } else if key == "d2t" {
            let mut offsets: Vec<f32> = data
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f32)
                .collect();
            keep = change(&key, &mut offsets, t.shape());
            data = offsets.iter().flat_map(|&v| (v as i64).to_le_bytes()).collect();
        }
        if keep {
            tensors.push((key, t.dtype(), t.shape().to_vec(), data));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(k, dtype, shape, data)| {
            (
                k.clone(),
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

fn serve(
    model: &Model,
    head: Option<&EagleHead>,
    config: SchedulerConfig,
    requests: &[(Vec<u32>, SamplingParams)],
) -> Served {
    let Some(head) = head else {
        let graph = passes::optimized(&model.lower(LogitsFor::LastToken).unwrap(), passes::CostModel::CPU).unwrap();
        let target = CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap();
        return serve_on(target, None, config, requests, 24);
    };
    let drafter = Box::new(drafter(model, head, false)) as Box<dyn Drafter>;
    serve_on(target_backend(model, head), Some(drafter), config, requests, 24)
}

/// Heads of random weights (the fixtures), drafting three tokens a step, change no token:
/// greedy and sampled requests, with the cache too small for every sequence at once
/// (preemption) or not, the later requests finding their prompts' beginnings in the prefix
/// cache.
#[test]
fn refused_eagle_drafts_change_no_token() {
    let model = llama();
    let requests = requests(model.config.vocab_size as u32, true);
    for kv_blocks in [64, 9] {
        let plain = serve(&model, None, config(kv_blocks, 0), &requests);
        for (name, method) in HEADS {
            let head = fixture_head(&model, name, method);
            let what = format!("{name}, {kv_blocks} blocks");
            let drafting = serve(&model, Some(&head), config(kv_blocks, 3), &requests);
            assert_refused_drafts_kept_the_tokens(&drafting, &plain, kv_blocks == 9, &what);
        }
    }
}

/// An EAGLE-1 head that guesses exactly what a bigram target chooses (`fc` keeps the
/// embedding, its layer adds nothing, and the target's head over the embedding ranks as over
/// its normed self) has every greedy draft accepted; an EAGLE-3 head whose draft vocabulary
/// maps its only guess (every logit 0: draft id 0) to a token the target often chooses has
/// some accepted and some refused. Neither changes a token, greedy or sampled, with
/// preemption and prefix-cache hits.
#[test]
fn accepted_eagle_drafts_change_no_token() {
    let model = bigram_llama();
    let vocab = model.config.vocab_size as u32;
    let greedy = requests(vocab, false);
    let plain = serve(&model, None, config(64, 0), &greedy);
    // The token the target chooses most often.
    let mut counts = vec![0usize; vocab as usize];
    plain.tokens.iter().flatten().for_each(|&t| counts[t as usize] += 1);
    let favourite = (0..vocab).max_by_key(|&t| counts[t as usize]).unwrap();
    let dir = common::scratch_dir("bbc-eagle-");
    let h = model.config.hidden;
    let exact = dir.path().join("exact");
    std::fs::create_dir(&exact).unwrap();
    changed_head("eagle", &exact, |name, values, _| {
        match name {
            // [I | 0]: the embedding alone.
            "fc.weight" => {
                for (k, v) in values.iter_mut().enumerate() {
                    *v = ((k % (2 * h)) == k / (2 * h)) as u8 as f32;
                }
            }
            "fc.bias" => values.fill(0.0),
            _ if adds_to_the_residual(name) => values.fill(0.0),
            _ => {}
        }
        true
    });
    let constant = dir.path().join("constant");
    std::fs::create_dir(&constant).unwrap();
    changed_head("eagle3", &constant, |name, values, _| {
        match name {
            "lm_head.weight" => values.fill(0.0),
            "d2t" => values[0] = favourite as f32,
            _ => {}
        }
        true
    });
    for (dir, method, every) in [
        (&exact, EagleMethod::Eagle, true),
        (&constant, EagleMethod::Eagle3, false),
    ] {
        let head = open_head(&model, dir, method);
        for kv_blocks in [64, 9] {
            let what = format!("{}, {kv_blocks} blocks", method.name());
            let drafting = serve(&model, Some(&head), config(kv_blocks, 3), &greedy);
            assert_eq!(drafting.tokens, plain.tokens, "{what}");
            assert!(drafting.accepted > 0, "{what}: no draft accepted");
            assert_eq!(
                drafting.accepted == drafting.drafted,
                every,
                "{what}: {} of {}",
                drafting.accepted,
                drafting.drafted
            );
            assert!(drafting.prefix_hits > 0, "{what}: the prefix cache served nothing");
            assert_eq!(drafting.cache_full, kv_blocks == 9, "{what}");
            let mixed = requests(vocab, true);
            let sampled = serve(&model, Some(&head), config(kv_blocks, 3), &mixed);
            assert_eq!(
                sampled.tokens,
                serve(&model, None, config(kv_blocks, 0), &mixed).tokens,
                "{what}, sampled"
            );
        }
    }
}

/// Rows a step of the emulated plans takes, and the positions a sequence may hold there.
const PLAN_ROWS: usize = 64;
const PLAN_CONTEXT: usize = 128;

/// `graph` through the pipeline for the H200, as `bbc compile --target h200` fuses it.
fn fused_for_h200(graph: &ir::Graph) -> ir::Graph {
    passes::optimized(graph, bbc::model_ref::cost_model(codegen::Target::H200)).unwrap()
}

fn plan_cache(blocks: usize) -> codegen::gpu::BatchedCache {
    codegen::gpu::BatchedCache {
        blocks,
        block_size: 8,
        sequences: 4,
    }
}

/// The serving plan `bbc compile` writes for the target of `head` (its argmax beside its
/// logits, the states the head reads at every row), on the emulator over the target's and the
/// head's tensors, checkpoints for three drafts.
fn target_plan(model: &Model, head: &EagleHead, kv_blocks: usize) -> EmulatorBackend {
    let graph = model.lower(LogitsFor::LastToken).unwrap();
    let graph = head
        .target_graph(&graph, &model.weights, model.lower_options(LogitsFor::LastToken))
        .unwrap();
    let graph = models::with_greedy_token(&fused_for_h200(&graph)).unwrap();
    let weights = head.weights_beside(&model.weights);
    let (plan, kernels) =
        codegen::gpu::build_batched(&graph, codegen::Target::H200, PLAN_ROWS, plan_cache(kv_blocks)).unwrap();
    EmulatorBackend::emulated(plan, kernels, graph, &weights, &[], PLAN_CONTEXT)
        .unwrap()
        .capture_graphs_up_to(16)
        .verify_drafts_up_to(3)
        .unwrap()
}

/// The head's plan as `bbc compile` writes it (its argmax beside its logits, or its token from
/// a 4-bit shortlist) drafting on the emulator beside `target`'s plan, reading the weights the
/// target holds from its buffers, as `bbc serve` loads it.
fn head_plan(
    model: &Model,
    head: &EagleHead,
    shortlisted: bool,
    target: &EmulatorBackend,
) -> MtpDrafter<EmulatorBackend> {
    let logits = match shortlisted {
        true => LogitsFor::GreedyToken,
        false => LogitsFor::LastToken,
    };
    let graph = head
        .lower(&model.config, &model.weights, model.lower_options(logits))
        .unwrap();
    let graph = match shortlisted {
        true => fused_for_h200(&passes::shortlisted_draft_head(&graph).unwrap()),
        false => models::with_greedy_token(&fused_for_h200(&graph)).unwrap(),
    };
    let (plan, kernels) =
        codegen::gpu::build_batched(&graph, codegen::Target::H200, PLAN_ROWS, plan_cache(256)).unwrap();
    let device = target.with_device(|d| d.beside(kernels)).unwrap();
    let shared = target.shared_weights().unwrap();
    let weights = head.weights_beside(&model.weights);
    let weights = runtime::plan_exec::PlanWeights::Host(&weights);
    let backend =
        runtime::plan_exec::PlanExecutor::with_weights_beside(device, plan, graph, weights, &[], PLAN_CONTEXT, &shared)
            .unwrap()
            .capture_graphs_up_to(4);
    let drafter = MtpDrafter::new(backend, head.config.hidden, 256, 8, PLAN_ROWS, PLAN_CONTEXT).unwrap();
    match &head.token_map {
        Some(map) => drafter.with_token_map(map.clone()),
        None => drafter,
    }
}

/// On the serving and head plans `bbc compile` writes (run by the emulator, the head loaded
/// beside the target), drafting with every fixture head, from its full head or its 4-bit
/// shortlist, generates the tokens the CPU backend generates without it, with preemption and
/// prefix-cache hits. Shorter prompts than the CPU tests': the emulator computes a few
/// thousand positions a second.
#[test]
fn eagle_drafts_on_gpu_plans_change_no_token() {
    let model = llama();
    let vocab = model.config.vocab_size as u32;
    let requests: Vec<_> = requests_of_lengths(vocab, false, [7, 3, 11, 5]);
    for kv_blocks in [6] {
        let plain = serve(&model, None, config(kv_blocks, 0), &requests);
        for (name, method) in HEADS {
            let head = fixture_head(&model, name, method);
            for shortlisted in [false, true] {
                let what = format!("{name}, {kv_blocks} blocks, shortlisted {shortlisted}");
                let target = target_plan(&model, &head, kv_blocks);
                let drafter = Box::new(head_plan(&model, &head, shortlisted, &target)) as Box<dyn Drafter>;
                let drafting = serve_on(target, Some(drafter), config(kv_blocks, 3), &requests, 12);
                assert_eq!(
                    drafting.tokens,
                    plain.tokens.iter().map(|t| t[..12].to_vec()).collect::<Vec<_>>(),
                    "{what}"
                );
                assert!(drafting.drafted > 0, "{what}: no drafts");
                assert!(drafting.prefix_hits > 0, "{what}: the prefix cache served nothing");
                assert!(drafting.cache_full, "{what}: no preemption");
            }
        }
    }
}

/// `bbc` with `args`, its exit status and stderr.
fn bbc(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bbc"))
        .args(args)
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn speculative(method: &str, head: &str) -> String {
    let dir = common::fixture(&format!("eagle/{head}"));
    serde_json::json!({"method": method, "model": dir, "num_speculative_tokens": 3}).to_string()
}

/// `bbc compile --target h200 --speculative-config` writes the EAGLE head's draft plan beside
/// the serving plan (which outputs the states it reads: `fc` over the aux layers' streams),
/// and the manifest names the head (its method, directory and its files' sha256). `bbc serve`
/// of the artifact refuses, before touching a device, another head, method `mtp`, and an
/// EAGLE head for an artifact compiled without one; `bbc compile` refuses the CPU target and
/// a model of random weights.
#[test]
fn an_artifact_carries_its_eagle_heads_plan() {
    if codegen::nvrtc::ensure_loaded().is_err() {
        assert!(
            std::env::var_os("BBC_REQUIRE_NVRTC").is_none(),
            "BBC_REQUIRE_NVRTC is set but NVRTC is missing"
        );
        eprintln!("skipped: NVRTC not installed");
        return;
    }
    let scratch = common::scratch_dir("bbc-eagle-artifact-");
    let llama = common::fixture("hf-tiny/llama");
    let llama = llama.to_str().unwrap();
    let tokenizer = common::real_model("smollm2");
    let tokenizer = tokenizer.to_str().unwrap();
    let artifact = |name: &str, extra: &[&str]| -> String {
        let out = scratch.path().join(name);
        let out = out.to_str().unwrap().to_string();
        let args = [
            &[
                "compile",
                llama,
                "--tokenizer",
                tokenizer,
                "--target",
                "h200",
                "-o",
                &out,
            ][..],
            extra,
        ]
        .concat();
        let (ok, stderr) = bbc(&args);
        assert!(ok, "{stderr}");
        out
    };
    let eagle3 = speculative("eagle3", "eagle3");
    let with_head = artifact("eagle3", &["--speculative-config", &eagle3]);
    let manifest = codegen::read_manifest(Path::new(&with_head)).unwrap();
    let head_dir = std::fs::canonicalize(common::fixture("eagle/eagle3")).unwrap();
    assert_eq!(
        manifest.eagle_head,
        Some(codegen::EagleHeadFiles {
            method: "eagle3".into(),
            weights_sha256: codegen::hash_weights(&head_dir).unwrap(),
            dir: head_dir,
        })
    );
    let graphs = codegen::read_graphs(Path::new(&with_head), &manifest).unwrap();
    let serving = graphs.serving.expect("a serving graph");
    assert!(serving.output(TARGET_HIDDEN_STATES).is_some());
    let reads = |g: &ir::Graph, name: &str| {
        g.nodes()
            .iter()
            .any(|n| matches!(&n.op, ir::Op::Weight { name: w } if w == name))
    };
    assert!(reads(&serving, "eagle.fc.weight"));
    let head = graphs.mtp.expect("the head's graph");
    assert!(reads(&head, "eagle.midlayer.hidden_norm.weight") && reads(&head, "eagle.lm_head.weight"));
    let without_head = artifact("plain", &[]);
    let serve = |artifact: &str, config: &str| bbc(&["serve", artifact, "--port", "0", "--speculative-config", config]);
    let mtp = r#"{"method": "mtp", "num_speculative_tokens": 3}"#;
    for (artifact, config, needle) in [
        (
            &with_head,
            speculative("eagle3", "eagle3_speculators"),
            "was compiled with the eagle3 head in",
        ),
        (&without_head, eagle3.clone(), "has no EAGLE head's plan"),
        (&with_head, mtp.to_string(), "has none"),
    ] {
        let (ok, stderr) = serve(artifact, &config);
        assert!(!ok && stderr.contains(needle), "{config}: {stderr}");
    }
    let cpu = scratch.path().join("cpu");
    let (ok, stderr) = bbc(&[
        "compile",
        llama,
        "-o",
        cpu.to_str().unwrap(),
        "--speculative-config",
        &eagle3,
    ]);
    assert!(!ok && stderr.contains("compiled into GPU artifacts"), "{stderr}");
    // The tiny Llama's shape with random weights, its vocabulary SmolLM2's tokenizer's.
    let path = common::fixture("hf-tiny/llama/config.json");
    let mut shape: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    shape["vocab_size"] = 49152.into();
    let config = scratch.path().join("config.json");
    std::fs::write(&config, shape.to_string()).unwrap();
    let random = scratch.path().join("random");
    let args = [
        "compile",
        config.to_str().unwrap(),
        "--tokenizer",
        tokenizer,
        "--target",
        "h200",
        "-o",
        random.to_str().unwrap(),
        "--speculative-config",
        &eagle3,
    ];
    let (ok, stderr) = bbc(&args);
    assert!(!ok && stderr.contains("this model's are random"), "{stderr}");
}

/// A head that is not what its method reads is refused naming what is wrong: a tensor missing
/// (`d2t`, a norm) or one its graphs would not read (an attention bias), `d2t` sending an id
/// past the target's vocabulary, a tensor of another shape, two decoder layers, a layer of
/// another kind, aux layers the target has not, and the speculators options that change what
/// the head computes.
#[test]
fn a_malformed_eagle_head_is_refused_by_name() {
    let model = llama();
    let scratch = common::scratch_dir("bbc-eagle-malformed-");
    let keep_all = |_: &str, _: &mut Vec<f32>, _: &[usize]| true;
    type TensorChange = Box<dyn Fn(&str, &mut Vec<f32>, &[usize]) -> bool>;
    type ConfigChange = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, &str, TensorChange, ConfigChange, &str)> = vec![
        (
            "eagle3",
            "no d2t",
            Box::new(|n: &str, _: &mut Vec<f32>, _: &[usize]| n != "d2t"),
            Box::new(|_: &mut serde_json::Value| {}),
            "its files have no `d2t`",
        ),
        (
            "eagle3",
            "d2t past the vocabulary",
            Box::new(|n: &str, v: &mut Vec<f32>, _: &[usize]| {
                if n == "d2t" {
                    v[7] = 400.0;
                }
                true
            }),
            Box::new(|_: &mut serde_json::Value| {}),
            "maps draft id 7 past the target's 320 ids",
        ),
        (
            "eagle3",
            "no hidden norm",
            Box::new(|n: &str, _: &mut Vec<f32>, _: &[usize]| n != "midlayer.hidden_norm.weight"),
            Box::new(|_: &mut serde_json::Value| {}),
            "no `midlayer.hidden_norm.weight`",
        ),
        (
            "eagle3",
            "a wider MLP",
            Box::new(keep_all),
            Box::new(|c: &mut serde_json::Value| c["intermediate_size"] = 128.into()),
            "`midlayer.mlp.gate_proj.weight` has shape [96, 64]; its config implies [128, 64]",
        ),
        (
            "eagle3",
            "two layers",
            Box::new(keep_all),
            Box::new(|c: &mut serde_json::Value| c["num_hidden_layers"] = 2.into()),
            "it has 2 decoder layers",
        ),
        (
            "eagle3",
            "a qwen3 layer",
            Box::new(keep_all),
            Box::new(|c: &mut serde_json::Value| c["model_type"] = "qwen3".into()),
            "its layer is a `qwen3` layer",
        ),
        (
            "eagle3_speculators",
            "aux layers past the target's",
            Box::new(keep_all),
            Box::new(|c: &mut serde_json::Value| c["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([0, 1, 5])),
            "must be distinct layers of the target's 0..3",
        ),
        (
            "eagle3_speculators",
            "the same aux layer twice",
            Box::new(keep_all),
            Box::new(|c: &mut serde_json::Value| c["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([0, 1, 1])),
            "must be distinct layers",
        ),
        (
            "eagle3_speculators",
            "norm_before_fc",
            Box::new(keep_all),
            Box::new(|c: &mut serde_json::Value| c["norm_before_fc"] = true.into()),
            "`norm_before_fc` (a norm over the joined states before `fc`) is not an option bbc reads",
        ),
        (
            "eagle3_speculators",
            "a target of another width",
            Box::new(keep_all),
            Box::new(|c: &mut serde_json::Value| c["target_hidden_size"] = 128.into()),
            "trained for a target of hidden size 128",
        ),
    ];
    for (k, (fixture, what, change, edit, needle)) in cases.into_iter().enumerate() {
        let dir = scratch.path().join(k.to_string());
        std::fs::create_dir(&dir).unwrap();
        changed_head(fixture, &dir, change);
        let path = dir.join("config.json");
        let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let layer = match config.get_mut("transformer_layer_config") {
            Some(layer) if !what.contains("aux") && what != "norm_before_fc" && !what.contains("target") => layer,
            _ => &mut config,
        };
        edit(layer);
        std::fs::write(&path, config.to_string()).unwrap();
        let err = match EagleHead::open(&dir, EagleMethod::Eagle3, &model.config) {
            Ok(_) => panic!("{what}: opened"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(needle), "{what}: {err}");
    }
    // A tensor its graphs would not read (an attention bias) is refused; the input norm an
    // EAGLE-1 head's first layer skips, as its authors' files keep it, is not.
    let bias = with_extra_vector(scratch.path(), "eagle3", "midlayer.self_attn.q_proj.bias", 64);
    let err = EagleHead::open(&bias, EagleMethod::Eagle3, &model.config)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("its `midlayer.self_attn.q_proj.bias` is no tensor of the eagle3 head bbc computes"),
        "{err}"
    );
    let skipped = with_extra_vector(scratch.path(), "eagle", "layers.0.input_layernorm.weight", 64);
    let head = open_head(&model, &skipped, EagleMethod::Eagle);
    let graph = head
        .lower(&model.config, &model.weights, model.lower_options(LogitsFor::LastToken))
        .unwrap();
    assert!(!graph
        .nodes()
        .iter()
        .any(|n| matches!(&n.op, ir::Op::Weight { name } if name.contains("input_layernorm"))));
}

/// A copy of fixture head `fixture` in a new directory under `root`, with a vector `name` of
/// `len` zeros added to its tensors.
fn with_extra_vector(root: &Path, fixture: &str, name: &str, len: usize) -> std::path::PathBuf {
    let dir = root.join(name);
    std::fs::create_dir(&dir).unwrap();
    changed_head(fixture, &dir, |_, _, _| true);
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let zeros: Vec<u8> = vec![0; len * 4];
    let mut views = file.tensors();
    views.push((
        name.to_string(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![len], &zeros).unwrap(),
    ));
    safetensors::serialize_to_file(views, None, &path).unwrap();
    dir
}

/// A random EAGLE-3 head (draft vocabulary of 1 000 ids, every 49th of the target's) for
/// SmolLM2 as its GGUF file holds it (llama.cpp's names: the aux layers' streams read at its
/// `blk.N.attn_norm`, its `token_embd` shared): drafting with it changes no token, greedy or
/// sampled, with preemption and prefix-cache hits.
#[test]
fn an_eagle_head_drafts_for_a_gguf_target() {
    let model = Model::open(ModelSpec::for_weights(&common::real_model("smollm2"))).unwrap();
    let c = &model.config;
    assert!(model.weights.contains("token_embd.weight"), "a GGUF file's names");
    let (h, q, kv, ffn, draft_vocab) = (
        c.hidden,
        c.heads * c.head_dim,
        c.kv_heads * c.head_dim,
        c.intermediate,
        1000,
    );
    let scratch = common::scratch_dir("bbc-eagle-gguf-");
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |name: &str, shape: Vec<usize>, scale: f32, offset: f32| {
        let n: usize = shape.iter().product();
        let values = common::drafting::noise(tensors.len() as u64, n, scale);
        let bytes = values.iter().flat_map(|v| (v + offset).to_le_bytes()).collect();
        tensors.push((name.to_string(), shape, bytes));
    };
    for norm in ["input_layernorm", "hidden_norm", "post_attention_layernorm"] {
        add(&format!("midlayer.{norm}.weight"), vec![h], 0.1, 1.0);
    }
    add("midlayer.self_attn.q_proj.weight", vec![q, 2 * h], 0.05, 0.0);
    add("midlayer.self_attn.k_proj.weight", vec![kv, 2 * h], 0.05, 0.0);
    add("midlayer.self_attn.v_proj.weight", vec![kv, 2 * h], 0.05, 0.0);
    add("midlayer.self_attn.o_proj.weight", vec![h, q], 0.05, 0.0);
    add("midlayer.mlp.gate_proj.weight", vec![ffn, h], 0.05, 0.0);
    add("midlayer.mlp.up_proj.weight", vec![ffn, h], 0.05, 0.0);
    add("midlayer.mlp.down_proj.weight", vec![h, ffn], 0.05, 0.0);
    add("fc.weight", vec![h, 3 * h], 0.05, 0.0);
    add("norm.weight", vec![h], 0.1, 1.0);
    add("lm_head.weight", vec![draft_vocab, h], 0.05, 0.0);
    let d2t: Vec<u8> = (0..draft_vocab as i64).flat_map(|d| (48 * d).to_le_bytes()).collect();
    let mut views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes).unwrap();
            (name.clone(), view)
        })
        .collect();
    views.push((
        "d2t".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![draft_vocab], &d2t).unwrap(),
    ));
    let dir = scratch.path();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let head_config = serde_json::json!({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": ffn, "num_hidden_layers": 1, "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim, "rms_norm_eps": 1e-5,
        "rope_theta": c.rope_theta, "vocab_size": c.vocab_size, "draft_vocab_size": draft_vocab,
    });
    std::fs::write(dir.join("config.json"), head_config.to_string()).unwrap();
    let head = open_head(&model, dir, EagleMethod::Eagle3);
    assert_eq!(head.aux_layers, vec![2, c.layers / 2, c.layers - 3]);
    let requests = requests_of_lengths(c.vocab_size as u32, true, [9, 4, 14, 6]);
    let plain = serve(&model, None, config(9, 0), &requests);
    let drafting = serve(&model, Some(&head), config(9, 3), &requests);
    assert_eq!(drafting.tokens, plain.tokens);
    assert!(drafting.drafted > 0 && drafting.prefix_hits > 0 && drafting.cache_full);
}

/// `bbc gpu-check`'s lockstep of the EAGLE-3 fixture head's plans and its target's serving plan
/// (which computes the head's states) runs its steps end to end; with the emulator standing in
/// for the GPU every kernel agrees exactly.
#[test]
fn the_gpu_checks_eagle_lockstep_runs_on_the_emulator() {
    let fixtures = common::fixture("hf-tiny");
    let worst = bbc::gpu_check::kernels::eagle_kernel_errors(codegen::Target::H200, &fixtures, |kernels| {
        Ok(runtime::emulator_device::EmulatorDevice::new(kernels.to_vec()))
    })
    .unwrap();
    assert_eq!(worst, 0.0);
}
