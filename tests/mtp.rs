//! Multi-token prediction heads: the tiny Qwen3.5, Qwen3-Next, GLM-4.5 and GLM-5 models given
//! MTP layers (in their checkpoints' layouts: `mtp.*`, or GLM's NextN layer after its last)
//! draft for themselves on the CPU backend, and whatever the head guesses, the served tokens
//! are the target's own: greedy and sampled, with drafts accepted and refused, across
//! preemption and prefix-cache hits. The head's graph (its hidden-state input, its joined
//! projection) runs on the CPU backend as the IR's reference interpreter runs it.

mod common;

use codegen::gpu;
use codegen::Target;
use common::drafting::{
    adds_to_the_residual, assert_refused_drafts_kept_the_tokens, bigram, config, f32_tensor, in_memory, noise,
    requests, requests_of_lengths, segment, serve_on, Served,
};
use ir::reference::Interpreter;
use models::{LogitsFor, LowerOptions, MemoryTensor, Model, ModelSpec, WeightSource};
use runtime::emulator_device::EmulatorBackend;
use runtime::plan_exec::PlanExecutor;
use runtime::serving::{Drafter, MtpDrafter, PagedBackend, SchedulerConfig, ServingEngine};
use runtime::{CpuBackend, SamplingParams};

/// How the test's MTP layers are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Head {
    /// For a target whose layers add nothing ([`bigram`]: its next token a function of its
    /// last), a head that computes that function of its input token: `fc` keeps the embedding
    /// half, the layer adds nothing, and the final norm is the target's. Every greedy draft
    /// is the target's own choice.
    Exact,
    /// The target's full-attention layer copied as the MTP layer, a random `fc` and norms:
    /// guesses the target mostly refuses.
    Copied,
}

/// Where a family keeps its MTP layer's tensors: the layer's prefix; its embedding norm,
/// hidden-state norm, joining projection and final norm; and the weight of a norm that
/// leaves its input as it is (Qwen's norms multiply by `1 + w`).
struct MtpNames {
    layer: String,
    enorm: String,
    hnorm: String,
    fc: String,
    norm: String,
    unit: f32,
}

fn mtp_names(config: &models::ModelConfig) -> MtpNames {
    match config.family {
        models::Family::Glm4Moe | models::Family::GlmMoeDsa => {
            let layer = format!("model.layers.{}.", config.layers);
            let name = |rest: &str| format!("{layer}{rest}.weight");
            MtpNames {
                enorm: name("enorm"),
                hnorm: name("hnorm"),
                fc: name("eh_proj"),
                norm: name("shared_head.norm"),
                layer,
                unit: 1.0,
            }
        }
        _ => MtpNames {
            layer: "mtp.layers.0.".into(),
            enorm: "mtp.pre_fc_norm_embedding.weight".into(),
            hnorm: "mtp.pre_fc_norm_hidden.weight".into(),
            fc: "mtp.fc.weight".into(),
            norm: "mtp.norm.weight".into(),
            unit: 0.0,
        },
    }
}

/// The tiny `family` model with one MTP layer drawn as `head` in its checkpoints' layout, its
/// weights in memory.
fn with_mtp(family: &str, head: Head) -> Model {
    let mut model =
        in_memory(Model::open(ModelSpec::for_weights(&common::fixture(&format!("hf-tiny/{family}")))).unwrap());
    let c = &model.config;
    let h = c.hidden;
    let names = mtp_names(c);
    let WeightSource::Memory(tensors) = &mut model.weights else {
        unreachable!("in memory")
    };
    // The MTP layer has the shapes of the target's last full-attention layer.
    let full = (0..c.layers)
        .rfind(|&i| c.layer_attention[i] == models::LayerAttention::Full)
        .unwrap();
    let prefix = format!("model.layers.{full}.");
    let layer: Vec<(String, MemoryTensor)> = tensors
        .iter()
        .filter_map(|(name, t)| Some((format!("{}{}", names.layer, name.strip_prefix(&prefix)?), t.clone())))
        .collect();
    for (i, (name, mut t)) in layer.into_iter().enumerate() {
        if head == Head::Exact && adds_to_the_residual(&name) {
            t.bytes.fill(0);
        }
        if head == Head::Copied && name.contains("norm") {
            let n: usize = t.shape.iter().product();
            let values: Vec<f32> = noise(i as u64, n, 0.3).iter().map(|v| v + names.unit).collect();
            t = f32_tensor(&t.shape, &values);
        }
        tensors.insert(name, t);
    }
    let fc = match head {
        // [I | 0]: the normed embedding alone.
        Head::Exact => (0..h * 2 * h)
            .map(|k| ((k % (2 * h)) == k / (2 * h)) as u8 as f32)
            .collect(),
        Head::Copied => noise(99, h * 2 * h, 0.2),
    };
    tensors.insert(names.fc.clone(), f32_tensor(&[h, 2 * h], &fc));
    for (k, norm) in [&names.enorm, &names.hnorm, &names.norm].into_iter().enumerate() {
        let t = match head {
            Head::Exact if *norm == names.norm => tensors["model.norm.weight"].clone(),
            Head::Exact => f32_tensor(&[h], &vec![names.unit; h]),
            Head::Copied => {
                let values: Vec<f32> = noise(7 + k as u64, h, 0.3).iter().map(|v| v + names.unit).collect();
                f32_tensor(&[h], &values)
            }
        };
        tensors.insert(norm.clone(), t);
    }
    model.config.mtp_layers = 1;
    model
}

fn options(model: &Model) -> LowerOptions {
    LowerOptions {
        logits: LogitsFor::LastToken,
        compute: model.spec.dtype,
        kv_cache: model.spec.kv_cache_dtype,
    }
}

/// The target on the CPU backend, its hidden states output at every row where `mtp` reads them.
fn target(model: &Model, mtp: bool) -> CpuBackend {
    let mut graph = model.lower(LogitsFor::LastToken).unwrap();
    if mtp {
        graph = models::with_hidden_states(&graph).unwrap();
    }
    let graph = passes::optimized(&graph, passes::CostModel::CPU).unwrap();
    CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap()
}

fn head_graph(model: &Model) -> ir::Graph {
    models::lower_mtp(&model.config, &model.weights, options(model)).unwrap()
}

/// The head's graph giving its greedy token from a 4-bit shortlist of its head.
fn shortlisted_head_graph(model: &Model) -> ir::Graph {
    let greedy = LowerOptions {
        logits: LogitsFor::GreedyToken,
        ..options(model)
    };
    passes::shortlisted_draft_head(&models::lower_mtp(&model.config, &model.weights, greedy).unwrap()).unwrap()
}

/// How the head's vocabulary projection is computed.
#[derive(Debug, Clone, Copy, PartialEq)]
enum DraftHead {
    /// Logits, their argmax taken by the drafter.
    Logits,
    /// The greedy token by the exact INT8-bound head.
    Exact,
    /// The greedy token of a 4-bit shortlist rescored in full precision.
    Shortlisted,
}

const DRAFT_HEADS: [DraftHead; 3] = [DraftHead::Logits, DraftHead::Exact, DraftHead::Shortlisted];

fn drafter(model: &Model, head: DraftHead) -> MtpDrafter<CpuBackend> {
    let greedy = LowerOptions {
        logits: LogitsFor::GreedyToken,
        ..options(model)
    };
    let graph = match head {
        DraftHead::Logits => head_graph(model),
        DraftHead::Exact => models::lower_mtp(&model.config, &model.weights, greedy).unwrap(),
        DraftHead::Shortlisted => {
            let graph = models::lower_mtp(&model.config, &model.weights, greedy).unwrap();
            passes::shortlisted_draft_head(&graph).unwrap()
        }
    };
    let graph = passes::optimized(&graph, passes::CostModel::CPU).unwrap();
    let fused = match head {
        DraftHead::Logits => None,
        DraftHead::Exact => Some("int8_bound_top_k"),
        DraftHead::Shortlisted => Some("shortlist_top_k"),
    };
    if let Some(op) = fused {
        assert!(graph.nodes().iter().any(|n| n.op.name() == op), "{head:?}: no {op}");
    }
    let backend = CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap();
    MtpDrafter::new(backend, model.config.hidden, 256, 8, 64, model.config.context_length).unwrap()
}

fn serve(
    model: &Model,
    head: Option<DraftHead>,
    config: SchedulerConfig,
    requests: &[(Vec<u32>, SamplingParams)],
    max_tokens: usize,
) -> Served {
    let head = head.map(|head| Box::new(drafter(model, head)) as Box<dyn Drafter>);
    serve_on(target(model, head.is_some()), head, config, requests, max_tokens)
}

/// A head drafting three tokens a step whose guesses the target mostly refuses changes no
/// token: greedy and sampled requests, with the cache too small for every sequence at once
/// (preemption) or not, the later requests finding their prompts' beginnings in the prefix
/// cache, and the hybrid targets' refused drafts taken back out of their recurrent states;
/// whether the head gives logits, the exact greedy token, or a 4-bit shortlist's.
#[test]
fn refused_mtp_drafts_change_no_token() {
    for family in ["qwen3_5", "qwen3_next", "glm4_moe", "glm_moe_dsa"] {
        let model = with_mtp(family, Head::Copied);
        let requests = requests(model.config.vocab_size as u32, true);
        for kv_blocks in [64, 9] {
            let plain = serve(&model, None, config(kv_blocks, 0), &requests, 24);
            assert_eq!(plain.drafted, 0);
            for head in DRAFT_HEADS {
                let what = format!("{family}, {kv_blocks} blocks, {head:?}");
                let drafting = serve(&model, Some(head), config(kv_blocks, 3), &requests, 24);
                assert_refused_drafts_kept_the_tokens(&drafting, &plain, kv_blocks == 9, &what);
            }
        }
    }
}

/// Quantized to FP8 as they load (`--quantization fp8`: the MTP layer's projections and `fc`
/// too), the targets still serve their own tokens with the head drafting for them: its drafts
/// mostly refused, the cache too small for every sequence (preemption), prompts found in the
/// prefix cache.
#[test]
fn mtp_drafts_over_weights_quantized_as_they_load_change_no_token() {
    for family in ["qwen3_5", "qwen3_next", "glm4_moe", "glm_moe_dsa"] {
        let mut model = with_mtp(family, Head::Copied);
        model.weights.quantize_as("fp8").unwrap();
        let names = mtp_names(&model.config);
        let (fc, _) = model.weights.describe(&names.fc).unwrap();
        assert_eq!(fc, models::quant::GgmlType::F8E4M3B32, "{family}");
        let requests = requests(model.config.vocab_size as u32, true);
        let plain = serve(&model, None, config(9, 0), &requests, 24);
        let drafting = serve(&model, Some(DraftHead::Exact), config(9, 3), &requests, 24);
        assert_eq!(drafting.tokens, plain.tokens, "{family}");
        assert!(drafting.drafted > drafting.accepted, "{family}: every draft accepted");
        assert!(drafting.prefix_hits > 0 && drafting.cache_full, "{family}");
    }
}

/// A head that guesses exactly what the target chooses (see [`Head::Exact`]) has every
/// greedy draft accepted, three a step, and changes no token beside sampled requests, with
/// preemption and prefix-cache hits as above; its 4-bit shortlist (64 of 320 rows) keeps
/// every guess.
#[test]
fn accepted_mtp_drafts_change_no_token() {
    for family in ["qwen3_5", "qwen3_next", "glm4_moe", "glm_moe_dsa"] {
        let model = bigram(with_mtp(family, Head::Exact));
        let vocab = model.config.vocab_size as u32;
        for kv_blocks in [64, 9] {
            let mixed = requests(vocab, true);
            let plain = serve(&model, None, config(kv_blocks, 0), &mixed, 24);
            for head in DRAFT_HEADS {
                let what = format!("{family}, {kv_blocks} blocks, {head:?}");
                let drafting = serve(&model, Some(head), config(kv_blocks, 3), &mixed, 24);
                assert_eq!(drafting.tokens, plain.tokens, "{what}");
                assert!(drafting.prefix_hits > 0, "{what}: the prefix cache served nothing");
                assert_eq!(drafting.cache_full, kv_blocks == 9, "{what}");
                let greedy = serve(&model, Some(head), config(kv_blocks, 3), &requests(vocab, false), 24);
                assert!(greedy.drafted > 0, "{what}: no drafts");
                assert_eq!(greedy.accepted, greedy.drafted, "{what}: a draft refused");
            }
        }
    }
}

/// A sequence whose prompt began in the target's prefix cache drafts from the head's own
/// cached rows of those positions, every greedy draft accepted with the exact head, where the
/// token after them is the one the rows were computed with (the target's hit ends inside the
/// prompt both share); where it is not (the hit ends where the prompts part), the sequence
/// drafts nothing. The tokens are the target's either way.
#[test]
fn a_sequence_whose_prompt_began_in_the_prefix_cache_drafts_from_the_heads_cache() {
    for family in ["qwen3_5", "qwen3_next", "glm4_moe", "glm_moe_dsa"] {
        let model = bigram(with_mtp(family, Head::Exact));
        let vocab = model.config.vocab_size as u32;
        let base: Vec<u32> = (0..19).map(|j| (11 + 29 * j) % vocab).collect();
        let greedy = SamplingParams::default();
        // The second prompt: the first's and one more token (the hit, 16 positions, ends inside
        // what both share), or the first's 16 tokens and another than the one the first went on
        // with (it ends where they part).
        for shared in [true, false] {
            let what = format!("{family}, {}", if shared { "within" } else { "at the end of" });
            let mut engine = ServingEngine::new(target(&model, true), config(64, 3));
            assert!(engine.use_drafter(Box::new(drafter(&model, DraftHead::Logits))));
            let run = |engine: &mut ServingEngine<CpuBackend>, prompt: &[u32]| {
                let id = engine.add(prompt.to_vec(), 8, vec![], greedy).unwrap();
                let (mut drafted, mut accepted, mut tokens) = (0, 0, Vec::new());
                while !engine.scheduler().is_idle() {
                    let out = engine.step().unwrap();
                    drafted += out.drafted;
                    accepted += out.accepted;
                    tokens.extend(out.finished.into_iter().filter(|d| d.seq == id).map(|d| d.generated));
                }
                (tokens.concat(), drafted, accepted)
            };
            let first = match shared {
                true => &base[..],
                false => &base[..16],
            };
            let (generated, _, _) = run(&mut engine, first);
            let mut second = first.to_vec();
            second.push(match shared {
                true => 5,
                false => (generated[0] + 1) % vocab,
            });
            let hits_before = engine.scheduler().prefix_cache_stats().hit;
            let (tokens, drafted, accepted) = run(&mut engine, &second);
            let hit = engine.scheduler().prefix_cache_stats().hit - hits_before;
            assert_eq!(hit, 16, "{what}: positions from the prefix cache");
            let plain = serve(&model, None, config(64, 0), &[(second.clone(), greedy)], 8);
            assert_eq!(tokens, plain.tokens[0], "{what}");
            match shared {
                true => {
                    assert!(drafted > 0, "{what}: no drafts");
                    assert_eq!(accepted, drafted, "{what}: a draft refused");
                }
                false => assert_eq!(drafted, 0, "{what}: drafted from rows of another next token"),
            }
        }
    }
}

/// The head's graph (hidden states in, embedding and hidden state joined side by side),
/// optimized, gives on the CPU backend what the IR's reference interpreter gives unoptimized:
/// the last row's logits, or its token from a 4-bit shortlist (of 64 rows of 320: the exact
/// best is among them), and its hidden state.
#[test]
fn the_mtp_graph_runs_on_the_cpu_backend_as_the_reference_runs_it() {
    for family in ["qwen3_5", "qwen3_next", "glm4_moe", "glm_moe_dsa"] {
        let model = with_mtp(family, Head::Copied);
        let greedy = LowerOptions {
            logits: LogitsFor::GreedyToken,
            ..options(&model)
        };
        let shortlisted =
            passes::shortlisted_draft_head(&models::lower_mtp(&model.config, &model.weights, greedy).unwrap()).unwrap();
        for (graph, outputs) in [
            (head_graph(&model), ["logits", ir::multi_token::DRAFT_HIDDEN_STATE]),
            (shortlisted, ["next_token", ir::multi_token::DRAFT_HIDDEN_STATE]),
        ] {
            runs_as_the_reference_runs_it(&model, &graph, &outputs, family);
        }
    }
}

/// Two steps of `graph` (the second attending over the first's cache) give `outputs` on the
/// CPU backend, the graph optimized as served, as the reference gives them; a step whose hidden
/// states do not cover its tokens is refused.
fn runs_as_the_reference_runs_it(model: &Model, graph: &ir::Graph, outputs: &[&str], family: &str) {
    // Optimized, as served (the joined input through the e-graph and back).
    let optimized = passes::optimized(graph, passes::CostModel::CPU).unwrap();
    let backend = CpuBackend::new(optimized, &model.weights, 256).unwrap();
    backend_runs_as_the_reference_runs_it(model, graph, &backend, outputs, family);
}

/// [`runs_as_the_reference_runs_it`] on `backend`, which runs `graph` as it was made for it.
fn backend_runs_as_the_reference_runs_it<B: PagedBackend>(
    model: &Model,
    graph: &ir::Graph,
    backend: &B,
    outputs: &[&str],
    family: &str,
) {
    let h = model.config.hidden;
    let steps: [(Vec<u32>, usize); 2] = [(vec![3, 77, 150, 9, 41], 0), (vec![200, 12], 5)];
    let states = |rows: usize, seed: u64| noise(seed, rows * h, 1.5);
    let weights = models::weights::DequantizedWeights::new(&model.weights);
    let mut reference = Interpreter::new(&weights);
    let mut pages = backend.new_pages(8);
    let table: Vec<runtime::kv::BlockId> = (0..2).map(runtime::kv::BlockId).collect();
    for (k, (ids, start)) in steps.iter().enumerate() {
        let hidden = states(ids.len(), k as u64);
        let positions: Vec<usize> = (*start..start + ids.len()).collect();
        let want = reference
            .step_with_hidden_states(graph, ids, &positions, &hidden)
            .unwrap();
        let step = segment(&table, *start, ids, &hidden);
        let got = &backend.step_batch(&mut pages, &[step]).unwrap()[0];
        for output in outputs {
            let (w, g) = (&want[*output], &got[*output]);
            assert_eq!(w.shape, g.shape, "{family} step {k} {output}");
            let worst = w
                .data
                .iter()
                .zip(&g.data)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, |m, d| if d > m || d.is_nan() { d } else { m });
            assert!(worst < 1e-4, "{family} step {k} {output}: off by {worst}");
        }
    }
    let short_states = states(1, 9);
    let short = segment(&table, 0, &[1, 2], &short_states);
    let refused = backend.step_batch(&mut pages, &[short]).unwrap_err().to_string();
    assert!(refused.contains("hidden-state values"), "{refused}");
}

/// Lowering a head that is not there says so: a model without MTP layers, a family whose
/// layers bbc does not read.
#[test]
fn lowering_a_missing_mtp_head_is_refused() {
    let model = Model::open(ModelSpec::for_weights(&common::fixture("hf-tiny/qwen3_5"))).unwrap();
    let err = models::lower_mtp(&model.config, &model.weights, options(&model))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no multi-token prediction layers"), "{err}");
    let llama = with_mtp_config("llama");
    let err = models::lower_mtp(&llama.config, &llama.weights, options(&llama))
        .unwrap_err()
        .to_string();
    assert!(err.contains("qwen3_5, qwen3_next, glm4_moe and glm_moe_dsa"), "{err}");
    // The tiny GLM-4.5's config names a layer its weights do not hold.
    let glm = Model::open(ModelSpec::for_weights(&common::fixture("hf-tiny/glm4_moe"))).unwrap();
    assert_eq!(glm.config.mtp_layers, 1);
    let err = models::lower_mtp(&glm.config, &glm.weights, options(&glm))
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.layers.3.enorm.weight"), "{err}");
}

/// The tiny Llama claiming an MTP layer it does not have.
fn with_mtp_config(family: &str) -> Model {
    let mut model = Model::open(ModelSpec::for_weights(&common::fixture(&format!("hf-tiny/{family}")))).unwrap();
    model.config.mtp_layers = 1;
    model
}

/// Rows a step of the emulated plans takes, and the positions a sequence may hold there.
const PLAN_ROWS: usize = 64;
const PLAN_CONTEXT: usize = 128;

/// `graph` through the pipeline for the H200, as `bbc compile --target h200` fuses it.
fn fused_for_h200(graph: &ir::Graph) -> ir::Graph {
    passes::optimized(graph, bbc::model_ref::cost_model(Target::H200)).unwrap()
}

/// `graph`'s batched plan for the H200 on the emulator over `model`'s weights (and the INT8
/// rows of its head where it takes the INT8-bound one): `blocks` blocks of 8, 4 sequences.
fn emulated(model: &Model, graph: ir::Graph, blocks: usize) -> EmulatorBackend {
    let int8 = codegen::int8_heads(&graph, &model.weights).unwrap();
    let cache = gpu::BatchedCache {
        blocks,
        block_size: 8,
        sequences: 4,
    };
    let (plan, kernels) = gpu::build_batched(&graph, Target::H200, PLAN_ROWS, cache).unwrap();
    EmulatorBackend::emulated(plan, kernels, graph, &model.weights, &int8, PLAN_CONTEXT).unwrap()
}

/// The serving plan `bbc compile` writes for `model` on the emulator (each sequence's argmax
/// beside its logits), outputting its hidden state at every row where `mtp`, with snapshots of
/// its recurrent states for the prefix cache and checkpoints for three drafts.
fn target_plan(model: &Model, mtp: bool, kv_blocks: usize) -> EmulatorBackend {
    let mut graph = model.lower(LogitsFor::LastToken).unwrap();
    if mtp {
        graph = models::with_hidden_states(&graph).unwrap();
    }
    let graph = models::with_greedy_token(&fused_for_h200(&graph)).unwrap();
    emulated(model, graph, kv_blocks)
        .capture_graphs_up_to(16)
        .keep_state_snapshots(32)
        .unwrap()
        .verify_drafts_up_to(3)
        .unwrap()
}

/// `graph`'s batched plan as [`emulated`] loads it, on `target`'s emulated memory, reading the
/// weights `target` holds already from its buffers (as `bbc serve` loads an MTP head).
fn emulated_beside(model: &Model, graph: ir::Graph, blocks: usize, target: &EmulatorBackend) -> EmulatorBackend {
    let cache = gpu::BatchedCache {
        blocks,
        block_size: 8,
        sequences: 4,
    };
    let (plan, kernels) = gpu::build_batched(&graph, Target::H200, PLAN_ROWS, cache).unwrap();
    let device = target.with_device(|d| d.beside(kernels)).unwrap();
    let shared = target.shared_weights().unwrap();
    let weights = runtime::plan_exec::PlanWeights::Host(&model.weights);
    PlanExecutor::with_weights_beside(device, plan, graph, weights, &[], PLAN_CONTEXT, &shared).unwrap()
}

/// The head's graph as `bbc compile` fuses it: its argmax beside its logits, or
/// (`--draft-head shortlist`) its greedy token from a 4-bit shortlist of its head.
fn compiled_head_graph(model: &Model, shortlisted: bool) -> ir::Graph {
    match shortlisted {
        true => fused_for_h200(&shortlisted_head_graph(model)),
        false => models::with_greedy_token(&fused_for_h200(&head_graph(model))).unwrap(),
    }
}

/// The head's plan drafting on the emulator beside `target`'s, as `bbc serve` loads it.
fn head_plan(model: &Model, shortlisted: bool, target: &EmulatorBackend) -> MtpDrafter<EmulatorBackend> {
    let graph = compiled_head_graph(model, shortlisted);
    let backend = emulated_beside(model, graph, 256, target).capture_graphs_up_to(4);
    MtpDrafter::new(backend, model.config.hidden, 256, 8, PLAN_ROWS, PLAN_CONTEXT).unwrap()
}

/// The head's batched plans for the H200 (its logits and their argmax; its greedy token from a
/// 4-bit shortlist of its head, 64 of 320 rows, the copy made where the plan loads) give on
/// the emulator, step after step over their paged cache, what the IR's reference interpreter
/// gives unoptimized: the last row's logits and token, and its hidden state; a step whose
/// hidden states do not cover its tokens is refused.
#[test]
fn the_mtp_plans_run_on_the_emulator_as_the_reference_runs_them() {
    for family in ["qwen3_5", "qwen3_next", "glm4_moe", "glm_moe_dsa"] {
        let model = with_mtp(family, Head::Copied);
        let graph = models::with_greedy_token(&head_graph(&model)).unwrap();
        let outputs = ["logits", "next_token", ir::multi_token::DRAFT_HIDDEN_STATE];
        let plan = emulated(
            &model,
            models::with_greedy_token(&fused_for_h200(&head_graph(&model))).unwrap(),
            4,
        );
        backend_runs_as_the_reference_runs_it(&model, &graph, &plan, &outputs, family);
        let shortlisted = shortlisted_head_graph(&model);
        let plan = emulated(&model, fused_for_h200(&shortlisted), 4);
        let outputs = ["next_token", ir::multi_token::DRAFT_HIDDEN_STATE];
        backend_runs_as_the_reference_runs_it(&model, &shortlisted, &plan, &outputs, family);
    }
    // The INT8-bound head scores one row: a batched plan of it is refused, not run wrong.
    let model = with_mtp("qwen3_5", Head::Copied);
    let greedy = LowerOptions {
        logits: LogitsFor::GreedyToken,
        ..options(&model)
    };
    let greedy = fused_for_h200(&models::lower_mtp(&model.config, &model.weights, greedy).unwrap());
    assert!(greedy.nodes().iter().any(|n| n.op.name() == "int8_bound_top_k"));
    let cache = gpu::BatchedCache {
        blocks: 4,
        block_size: 8,
        sequences: 4,
    };
    let refused = gpu::build_batched(&greedy, Target::H200, PLAN_ROWS, cache)
        .expect_err("refused")
        .to_string();
    assert!(refused.contains("scores one row a step"), "{refused}");
}

/// `bbc gpu-check`'s lockstep of the MTP head's plans (argmax and 4-bit shortlist, a tiny
/// Qwen3.5 with random MTP weights, hidden states read every row) runs its steps end to end;
/// with the emulator standing in for the GPU every kernel agrees exactly.
#[test]
fn the_gpu_checks_mtp_lockstep_runs_on_the_emulator() {
    let fixtures = common::fixture("hf-tiny");
    let worst = bbc::gpu_check::kernels::mtp_kernel_errors(Target::H200, &fixtures, |kernels| {
        Ok(runtime::emulator_device::EmulatorDevice::new(kernels.to_vec()))
    })
    .unwrap();
    assert_eq!(worst, 0.0);
}

/// On the serving and head plans `bbc compile` writes (run by the emulator, the head loaded
/// beside the target as `bbc serve` loads it), drafting with the head generates the tokens the CPU backend generates without it (as the plans do without
/// it: `gpu_plan_emulated`), for every family with MTP layers, with preemption and
/// prefix-cache hits: drafts refused (a copied layer; greedy and sampled requests, the hybrid
/// targets' refused drafts rewound out of their recurrent states) and all accepted (the exact
/// head; greedy requests). Shorter prompts than the CPU tests': the emulator computes a few
/// thousand positions a second.
#[test]
fn mtp_drafts_on_gpu_plans_change_no_token() {
    for family in ["qwen3_5", "qwen3_next", "glm4_moe", "glm_moe_dsa"] {
        for head in [Head::Copied, Head::Exact] {
            let model = match head {
                Head::Exact => bigram(with_mtp(family, head)),
                Head::Copied => with_mtp(family, head),
            };
            let what = format!("{family}, {head:?}");
            let vocab = model.config.vocab_size as u32;
            let requests = requests_of_lengths(vocab, head == Head::Copied, [9, 4, 13, 6]);
            let kv_blocks = 6;
            let on_plans = |drafts: usize| SchedulerConfig {
                context_length: PLAN_CONTEXT,
                ..config(kv_blocks, drafts)
            };
            let plain = serve(&model, None, on_plans(0), &requests, 8);
            // The exact head's guesses through the 4-bit shortlist: each still the argmax.
            let target = target_plan(&model, true, kv_blocks);
            let head_drafting = Box::new(head_plan(&model, head == Head::Exact, &target)) as Box<dyn Drafter>;
            let drafting = serve_on(target, Some(head_drafting), on_plans(3), &requests, 8);
            assert_eq!(drafting.tokens, plain.tokens, "{what}");
            assert!(drafting.drafted > 0, "{what}: no drafts");
            assert!(drafting.cache_full, "{what}: never preempted");
            assert!(drafting.prefix_hits > 0, "{what}: the prefix cache served nothing");
            match head {
                Head::Exact => assert_eq!(drafting.accepted, drafting.drafted, "{what}: a draft refused"),
                Head::Copied => assert!(drafting.accepted < drafting.drafted, "{what}: every draft accepted"),
            }
        }
    }
}

/// Loaded beside its target on the same device memory (as `bbc serve` loads it), the head reads
/// the weights the target holds in the same form (its embedding and LM head) from the
/// target's buffers: its load adds only its own, and it computes what it computes loaded
/// apart, bit for bit.
#[test]
fn an_mtp_head_beside_its_target_uploads_no_second_embedding_or_head() {
    use runtime::kv::{BlockId, Segment, StateSnapshots};
    let model = with_mtp("qwen3_5", Head::Copied);
    let target = target_plan(&model, true, 4);
    let graph = compiled_head_graph(&model, false);
    let apart = emulated(&model, graph.clone(), 4);
    let held = |backend: &EmulatorBackend| backend.with_device(|d| d.bytes_held()).unwrap();
    let before = held(&target);
    let beside = emulated_beside(&model, graph.clone(), 4, &target);
    let added = held(&target) - before;
    // What the two plans hold alike: the same tensors in the same form.
    let cache = gpu::BatchedCache {
        blocks: 4,
        block_size: 8,
        sequences: 4,
    };
    let target_graph = models::with_hidden_states(&model.lower(LogitsFor::LastToken).unwrap()).unwrap();
    let target_graph = models::with_greedy_token(&fused_for_h200(&target_graph)).unwrap();
    let (target_plan, _) = gpu::build_batched(&target_graph, Target::H200, PLAN_ROWS, cache).unwrap();
    let (head_plan, _) = gpu::build_batched(&graph, Target::H200, PLAN_ROWS, cache).unwrap();
    let alike: Vec<&gpu::WeightUse> = head_plan
        .weights
        .iter()
        .filter(|w| {
            target_plan
                .weights
                .iter()
                .any(|t| t.parts == w.parts && t.dtype == w.dtype)
        })
        .collect();
    let names: Vec<&str> = alike.iter().flat_map(|w| w.parts.iter().map(|p| p.name())).collect();
    assert!(names.iter().any(|n| n.contains("embed_tokens")), "{names:?}");
    let width = |d: ir::DType| if d == ir::DType::BF16 { 2 } else { 4 };
    let shared: usize = alike
        .iter()
        .map(|w| w.shape.iter().product::<usize>() * width(w.dtype))
        .sum();
    assert_eq!(added, held(&apart) - shared, "the head added {added} bytes");
    let hidden: Vec<f32> = (0..2 * model.config.hidden)
        .map(|i| (i % 7) as f32 / 7.0 - 0.4)
        .collect();
    let step = |head: &EmulatorBackend| {
        head.step_batch(&[Segment {
            hidden_states: &hidden,
            table: &[BlockId(1)],
            start: 0,
            ids: &[7, 11],
            state_slot: 0,
            sampled_rows: 1,
            drafts: 0,
            snapshots: StateSnapshots::NONE,
        }])
        .unwrap()
    };
    let (got, want) = (step(&beside), step(&apart));
    for name in ["logits", "next_token", ir::multi_token::DRAFT_HIDDEN_STATE] {
        assert_eq!(got[0][name].data, want[0][name].data, "{name}");
    }
}

/// With an MTP head on the GPU, the target's KV pool sized to memory also pays, block for
/// block, for the head's pool beside it (`size_kv_pool_beside`), which is then given as many
/// blocks (`resize_kv_pool`): the two take the share the models leave. The head steps over
/// its last block and is refused past it; a resize to no blocks, past the kernels' indices or
/// once a step is captured as a graph is refused.
#[test]
fn an_mtp_heads_pool_is_sized_beside_its_targets() {
    use runtime::emulator_device::EmulatorDevice;
    use runtime::kv::{BlockId, Segment, StateSnapshots};
    use runtime::kv_sizing::GPU_HEADROOM;
    let model = with_mtp("qwen3_5", Head::Copied);
    let capacity = 1 << 30;
    let load = |graph: ir::Graph| {
        let cache = gpu::BatchedCache {
            blocks: 1,
            block_size: 8,
            sequences: 4,
        };
        let (plan, kernels) = gpu::build_batched(&graph, Target::H200, PLAN_ROWS, cache).unwrap();
        let device = EmulatorDevice::new(kernels).with_memory(capacity);
        PlanExecutor::new(device, plan, graph, &model.weights, &[], PLAN_CONTEXT).unwrap()
    };
    let target_graph = models::with_hidden_states(&model.lower(LogitsFor::LastToken).unwrap()).unwrap();
    let target = load(models::with_greedy_token(&fused_for_h200(&target_graph)).unwrap());
    let head = load(models::with_greedy_token(&fused_for_h200(&head_graph(&model))).unwrap());
    let head_block = 8 * head.kv_bytes_per_position();
    let target = target.size_kv_pool_beside(0.75, head_block).unwrap();
    let blocks = target.batched_cache().unwrap().blocks;
    let target_block = 8 * target.kv_bytes_per_position();
    let model_bytes = target.with_device(|d| d.bytes_held()).unwrap() - blocks * target_block;
    // The emulated devices are apart, so the target's counts only its own model.
    let budget = (0.75 * capacity as f64) as usize - model_bytes - GPU_HEADROOM;
    assert_eq!(blocks, budget / (target_block + head_block));
    assert!(blocks > 1000 && head_block > 0, "{blocks} blocks");

    let head = head.resize_kv_pool(blocks).unwrap().capture_graphs_up_to(1);
    assert_eq!(head.batched_cache().unwrap().blocks, blocks);
    let head_bytes = head.with_device(|d| d.bytes_held()).unwrap();
    assert!(head_bytes >= blocks * head_block, "the head holds its pool");
    let hidden = vec![0.5f32; model.config.hidden];
    let step = |table: &[BlockId]| {
        head.step_batch(&[Segment {
            hidden_states: &hidden,
            table,
            start: 0,
            ids: &[7],
            state_slot: 0,
            sampled_rows: 1,
            drafts: 0,
            snapshots: StateSnapshots::NONE,
        }])
    };
    step(&[BlockId(blocks as u32 - 1)]).expect("a step over the head's last block");
    assert!(step(&[BlockId(blocks as u32)]).is_err(), "a block past the pool");
    let refused = head
        .resize_kv_pool(blocks)
        .err()
        .expect("refused once captured")
        .to_string();
    assert!(refused.contains("captured"), "{refused}");
    let fresh = || load(models::with_greedy_token(&fused_for_h200(&head_graph(&model))).unwrap());
    for wrong in [0, usize::MAX / 2] {
        let refused = fresh().resize_kv_pool(wrong).err().expect("refused").to_string();
        assert!(refused.contains("32-bit indices"), "{wrong}: {refused}");
    }
}
