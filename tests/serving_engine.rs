//! Continuous batching on the CPU backend: many greedy requests in flight together, in batched
//! steps over a paged KV cache, with a KV budget tight enough to force preemption and
//! recomputation, or sharing prompt prefixes through the prefix cache, each produce exactly the
//! tokens they produce alone; aborts free their blocks at once.

mod common;

use common::drafting::Foreseeing;
use models::{LogitsFor, Model, ModelSpec};
use runtime::serving::{LogitsProcessor, Scheduler, SchedulerConfig, SeqId, ServingEngine, StepOutput};
use runtime::{generate, CpuBackend, Engine, GenerateOptions, SamplingParams};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

fn backend(model: &Model) -> CpuBackend {
    let graph = passes::optimized(&model.lower(LogitsFor::LastToken).unwrap(), passes::CostModel::CPU).unwrap();
    CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap()
}

#[test]
fn concurrent_requests_generate_what_they_generate_alone() {
    let model = Model::open(ModelSpec::for_weights(&common::real_model("smollm2"))).unwrap();
    concurrent_requests_match_alone(&model);
}

/// The same for a mixture-of-experts model (the tiny GLM-4.5): a step's rows share experts,
/// and each row's result must not depend on which others chose the same expert.
#[test]
fn concurrent_moe_requests_generate_what_they_generate_alone() {
    let model = Model::open(ModelSpec::for_weights(&common::fixture("hf-tiny/glm4_moe"))).unwrap();
    concurrent_requests_match_alone(&model);
}

/// The same for a hybrid model with a recurrent state per sequence (the tiny Qwen3.5): each
/// running sequence keeps its Gated DeltaNet state in a slot of its own, and a preempted one
/// recomputes it from the start.
#[test]
fn concurrent_hybrid_requests_generate_what_they_generate_alone() {
    let model = Model::open(ModelSpec::for_weights(&common::fixture("hf-tiny/qwen3_5"))).unwrap();
    concurrent_requests_match_alone(&model);
}

/// Both at once (the tiny Qwen3-Next: DeltaNet layers and MoE MLPs).
#[test]
fn concurrent_hybrid_moe_requests_generate_what_they_generate_alone() {
    let model = Model::open(ModelSpec::for_weights(&common::fixture("hf-tiny/qwen3_next"))).unwrap();
    concurrent_requests_match_alone(&model);
}

/// Gemma 4: layers of different head shapes and sliding windows in one paged cache.
#[test]
fn concurrent_gemma4_requests_generate_what_they_generate_alone() {
    let model = Model::open(ModelSpec::for_weights(&common::fixture("hf-tiny/gemma4"))).unwrap();
    concurrent_requests_match_alone(&model);
}

/// Gemma 4 with KV-shared layers, which read an earlier layer's cache slot and run on each
/// sequence's last row only.
#[test]
fn concurrent_gemma4_kv_shared_requests_generate_what_they_generate_alone() {
    let model = Model::open(ModelSpec::for_weights(&common::fixture("hf-tiny/gemma4_kv_shared"))).unwrap();
    concurrent_requests_match_alone(&model);
}

/// Verifying drafts samples several rows of a sequence: Gemma 4's KV-shared layers then run on
/// those rows (not only the last), and speculation keeps every token.
#[test]
fn speculation_through_gemma4_kv_shared_layers_keeps_every_token() {
    let model = Model::open(ModelSpec::for_weights(&common::fixture("hf-tiny/gemma4_kv_shared"))).unwrap();
    let repeating = |base: u32, period: u32| (0..40u32).map(|j| base + 17 * (j % period)).collect();
    let requests: Vec<(Vec<u32>, SamplingParams)> = [repeating(30, 6), repeating(30, 5), repeating(100, 1)]
        .into_iter()
        .map(|p| (p, SamplingParams::default()))
        .collect();
    let (plain, _, _) = serve_speculating(&model, &requests, 32, runtime::serving::NgramConfig::OFF);
    let (speculative, drafted, accepted) = serve_speculating(&model, &requests, 32, DRAFT_FOUR);
    assert_eq!(speculative, plain);
    assert!(accepted > 0, "{accepted} of {drafted} drafts accepted");
}

/// GLM-5: latent attention's latent rows (with their rotated and index keys, and no value
/// rows) in the paged cache; each query's sparse choice is its own whatever shares the step.
#[test]
fn concurrent_sparse_mla_requests_generate_what_they_generate_alone() {
    let model = Model::open(ModelSpec::for_weights(&common::fixture("hf-tiny/glm_moe_dsa"))).unwrap();
    concurrent_requests_match_alone(&model);
}

/// GLM-5.2: layers that share the previous full layer's indexer rank by that layer's cached
/// index keys, whoever else shares the step.
#[test]
fn concurrent_shared_indexer_requests_generate_what_they_generate_alone() {
    let model = Model::open(ModelSpec::for_weights(&common::fixture("hf-tiny/glm_moe_dsa_shared"))).unwrap();
    concurrent_requests_match_alone(&model);
}

/// A hybrid model's recurrent state sums up a whole prefix, which cached blocks do not hold.
/// With snapshots of states kept, requests sharing a prompt prefix, and a second turn that
/// extends a first conversation, start from the deepest snapshot along what they share and
/// generate exactly what they generate alone (drafting or not); without snapshots each
/// computes its prefix itself.
#[test]
fn hybrid_requests_sharing_a_prefix_start_from_state_snapshots() {
    use runtime::serving::{NgramConfig, StateCacheConfig};
    // Room for every snapshot the run saves (which ones go first is the cache's own test).
    let snapshots = StateCacheConfig::every(8, 16);
    let drafting = NgramConfig {
        tokens: 3,
        min: 1,
        max: 3,
    };
    for fixture in ["hf-tiny/qwen3_5", "hf-tiny/qwen3_next"] {
        let model = Model::open(ModelSpec::for_weights(&common::fixture(fixture))).unwrap();
        let mut prompts = bbc::gpu_check::kernels::prompts_sharing_a_prefix(20, 5);
        let first_turn = alone(&model, &prompts[..1], 8).remove(0);
        let second_turn = prompts[0].iter().chain(&first_turn).copied().chain([7, 8, 9]).collect();
        prompts.push(second_turn);
        let want = alone(&model, &prompts, 8);
        for (state_cache, speculation) in [
            (StateCacheConfig::OFF, NgramConfig::OFF),
            (snapshots, NgramConfig::OFF),
            (snapshots, drafting),
        ] {
            let config = SchedulerConfig {
                max_waiting: 16,
                max_running: 3,
                token_budget: 32,
                kv_blocks: 64,
                block_size: 4,
                context_length: 256,
                prefix_caching: true,
                speculation,
                recurrent_state: false,
                state_cache,
            };
            let mut engine = ServingEngine::new(backend(&model), config);
            let mut got = HashMap::new();
            let mut ids = Vec::new();
            // The first request alone fills the cache, then the others sharing its prompt,
            // then the second turn.
            for (i, p) in prompts.iter().enumerate() {
                ids.push(engine.add(p.clone(), 8, vec![], SamplingParams::default()).unwrap());
                if i == 0 || i + 2 == prompts.len() {
                    got.extend(run_to_idle(&mut engine, |_, _| {}));
                }
            }
            got.extend(run_to_idle(&mut engine, |_, _| {}));
            for (id, want) in ids.iter().zip(&want) {
                assert_eq!(&got[id], want, "{fixture} {state_cache:?} {speculation:?} {id:?}");
            }
            let hit = engine.scheduler().prefix_cache_stats().hit;
            match state_cache.capacity {
                0 => assert_eq!(hit, 0, "{fixture}"),
                // The four later prompts from the snapshot at 16, the second turn from 24.
                _ => assert!(hit >= 4 * 16 + 24, "{fixture} {speculation:?}: {hit} positions hit"),
            }
        }
    }
}

/// 12 greedy requests in flight together, in batched steps over a KV cache too small for all
/// of them (preemption and recomputation), each generate what they generate alone.
fn concurrent_requests_match_alone(model: &Model) {
    let vocab = model.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..12u32)
        .map(|i| (0..(5 + 3 * i)).map(|j| (100 + 13 * i + 7 * j) % vocab).collect())
        .collect();
    let max_tokens = 12;
    let want = alone(model, &prompts, max_tokens);

    // 12 blocks of 8 positions: far fewer than 12 sequences of up to 50 positions need.
    let config = SchedulerConfig {
        max_waiting: 64,
        max_running: 8,
        token_budget: 64,
        kv_blocks: 12,
        block_size: 8,
        context_length: 2048,
        prefix_caching: true,
        speculation: runtime::serving::NgramConfig::OFF,
        recurrent_state: false,
        state_cache: runtime::serving::StateCacheConfig::OFF,
    };
    let mut engine = ServingEngine::new(backend(model), config);
    let ids: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine
                .add(p.clone(), max_tokens, vec![], SamplingParams::default())
                .unwrap()
        })
        .collect();
    let mut preempted_any = false;
    let got = run_to_idle(&mut engine, |_, scheduler| {
        preempted_any |= scheduler.used_blocks() == 12;
    });
    assert!(preempted_any, "the KV budget was meant to be exhausted");
    for (id, want) in ids.iter().zip(&want) {
        assert_eq!(&got[id], want, "{id:?}");
    }
    assert_eq!(engine.scheduler().used_blocks(), 0);
}

/// Step `engine` until it is idle, checking the scheduler's invariants after every step and
/// showing each step's output and scheduler to `each_step`; every finished sequence's tokens.
fn run_to_idle<B: runtime::serving::PagedBackend>(
    engine: &mut ServingEngine<B>,
    mut each_step: impl FnMut(&StepOutput, &Scheduler),
) -> HashMap<SeqId, Vec<u32>> {
    let mut got = HashMap::new();
    while !engine.scheduler().is_idle() {
        let out = engine.step().unwrap();
        each_step(&out, engine.scheduler());
        assert_eq!(engine.scheduler().check(), Ok(()));
        got.extend(out.finished.into_iter().map(|d| (d.seq, d.generated)));
    }
    got
}

/// Generate each prompt alone, the reference for batched serving.
fn alone(model: &Model, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    let engine = Engine::from(backend(model));
    let options = GenerateOptions {
        max_tokens,
        ..Default::default()
    };
    prompts
        .iter()
        .map(|p| generate(&engine, p, &options, |_| Ok(true)).unwrap())
        .collect()
}

#[test]
fn requests_sharing_a_prefix_reuse_its_blocks_and_generate_what_they_generate_alone() {
    let model = Model::open(ModelSpec::for_weights(&common::real_model("smollm2"))).unwrap();
    // A 37-token "system prompt" shared by every request, then each one's own question; the
    // last pair repeats an earlier prompt exactly.
    let system: Vec<u32> = (0..37u32).map(|j| 200 + 11 * j).collect();
    let mut prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| {
            system
                .iter()
                .copied()
                .chain((0..3 + i).map(|j| 900 + 17 * i + j))
                .collect()
        })
        .collect();
    prompts.push(prompts[2].clone());
    let max_tokens = 6;
    let want = alone(&model, &prompts, max_tokens);

    let config = SchedulerConfig {
        max_waiting: 64,
        max_running: 8,
        token_budget: 48,
        kv_blocks: 64,
        block_size: 8,
        context_length: 2048,
        prefix_caching: true,
        speculation: runtime::serving::NgramConfig::OFF,
        recurrent_state: false,
        state_cache: runtime::serving::StateCacheConfig::OFF,
    };
    let mut engine = ServingEngine::new(backend(&model), config);
    let mut got: HashMap<_, Vec<u32>> = HashMap::new();
    let mut ids = Vec::new();
    // The first request alone fills the cache; the rest arrive together after it.
    for (i, p) in prompts.iter().enumerate() {
        ids.push(
            engine
                .add(p.clone(), max_tokens, vec![], SamplingParams::default())
                .unwrap(),
        );
        if i == 0 {
            got.extend(run_to_idle(&mut engine, |_, _| {}));
        }
    }
    got.extend(run_to_idle(&mut engine, |_, _| {}));
    for (id, want) in ids.iter().zip(&want) {
        assert_eq!(&got[id], want, "{id:?}");
    }
    // Every later request found at least the system prompt's 4 full blocks cached.
    let stats = engine.scheduler().prefix_cache_stats();
    assert!(stats.hit >= 6 * 32, "{stats:?}");
    assert_eq!(engine.scheduler().used_blocks(), 0);
}

#[test]
fn aborting_frees_blocks_at_once() {
    let model = Model::open(ModelSpec::for_weights(&common::real_model("smollm2"))).unwrap();
    let config = SchedulerConfig {
        max_waiting: 8,
        max_running: 4,
        token_budget: 64,
        kv_blocks: 64,
        block_size: 16,
        context_length: 2048,
        prefix_caching: true,
        speculation: runtime::serving::NgramConfig::OFF,
        recurrent_state: false,
        state_cache: runtime::serving::StateCacheConfig::OFF,
    };
    let mut engine = ServingEngine::new(backend(&model), config);
    let a = engine
        .add(vec![504, 3575, 282, 4649, 314], 100, vec![], SamplingParams::default())
        .unwrap();
    let b = engine
        .add(vec![1, 9690, 198], 100, vec![], SamplingParams::default())
        .unwrap();
    for _ in 0..3 {
        engine.step().unwrap();
    }
    assert!(engine.scheduler().used_blocks() > 0);
    // A step that finds `b` unwanted aborts it instead of computing it; `a` goes on.
    let out = engine.step_while(|id| id != b).unwrap();
    assert_eq!(out.tokens.iter().map(|s| s.seq).collect::<Vec<_>>(), vec![a]);
    assert!(!engine.abort(b), "already aborted");
    assert_eq!(engine.scheduler().running(), 1);
    assert!(engine.abort(a));
    assert!(!engine.abort(a), "a second abort finds nothing");
    assert!(!engine.abort(b));
    assert_eq!(engine.scheduler().used_blocks(), 0);
    assert!(engine.scheduler().is_idle());
}

/// Speculative decoding by prompt lookup changes no token: on a repetitive prompt (where drafts
/// are accepted), greedy requests and seeded sampled ones with penalties generate exactly what
/// they generate one token a step, alone or four at a time.
#[test]
fn speculation_keeps_every_token_and_accepts_drafts() {
    let model = Model::open(ModelSpec::for_weights(&common::real_model("smollm2"))).unwrap();
    let pattern: Vec<u32> = (0..48u32).map(|j| 300 + 17 * (j % 8)).collect();
    let sampled = SamplingParams {
        temperature: 0.8,
        seed: 11,
        top_p: 0.9,
        repetition_penalty: 1.1,
        ..SamplingParams::default()
    };
    let requests = [
        (pattern.clone(), SamplingParams::default()),
        (pattern[5..].to_vec(), SamplingParams::default()),
        (pattern.clone(), sampled),
        ((0..20u32).map(|j| 1000 + 31 * j).collect(), SamplingParams::default()),
    ];
    let run = |speculation| serve_speculating(&model, &requests, 24, speculation);
    let (plain, _, none) = run(runtime::serving::NgramConfig::OFF);
    assert_eq!(none, 0);
    let (speculative, _, accepted) = run(DRAFT_FOUR);
    assert_eq!(speculative, plain);
    assert!(
        accepted >= 24,
        "the repeated pattern should accept drafts, accepted {accepted}"
    );
}

/// Draft-model speculation changes no token either: with a second model drafting (greedily)
/// up to four tokens a step, greedy requests and seeded sampled ones generate exactly what
/// they generate without speculation: with the target itself as the draft model (every greedy
/// request's drafts accepted), the same weights under YaRN's RoPE scaling, and another
/// family's model of the same vocabulary (Gemma 3's, drafts refused).
#[test]
fn draft_model_speculation_keeps_every_token() {
    let target = Model::open(ModelSpec::for_weights(&common::fixture("hf-tiny/llama"))).unwrap();
    let sampled = SamplingParams {
        temperature: 0.8,
        seed: 5,
        top_p: 0.9,
        ..SamplingParams::default()
    };
    let greedy = greedy_requests(13);
    let mixed: Vec<(Vec<u32>, SamplingParams)> = greedy
        .iter()
        .cloned()
        .chain([(stepped(50, 12, 13), sampled), (stepped(20, 9, 13), sampled)])
        .collect();
    let plain = serve_speculating(&target, &mixed, 20, runtime::serving::NgramConfig::OFF).0;
    for draft_fixture in ["hf-tiny/llama", "hf-tiny/llama_rope_yarn", "hf-tiny/gemma3"] {
        let draft = Model::open(ModelSpec::for_weights(&common::fixture(draft_fixture))).unwrap();
        let all_accepted = draft_fixture != "hf-tiny/gemma3";
        drafting_keeps_the_tokens(&target, &draft, (&greedy, &mixed, &plain), all_accepted, draft_fixture);
    }
}

/// Requests as the serving tests send them: each prompt with its sampling settings.
type Requests = [(Vec<u32>, SamplingParams)];

/// A prompt of `len` tokens from `base` in steps of `step`.
fn stepped(base: u32, len: u32, step: u32) -> Vec<u32> {
    (0..len).map(|j| base + step * j).collect()
}

/// The draft-model tests' three greedy requests (prompts of 9, 22 and 3 tokens).
fn greedy_requests(step: u32) -> Vec<(Vec<u32>, SamplingParams)> {
    [stepped(20, 9, step), stepped(10, 22, step), stepped(7, 3, step)]
        .into_iter()
        .map(|p| (p, SamplingParams::default()))
        .collect()
}

/// With `draft` drafting for `target`, `mixed` (greedy and sampled requests) generates `plain`,
/// what it generates without speculation, and drafts are made; of `greedy`'s drafts every one
/// is accepted or, where not `all_accepted`, not every one.
fn drafting_keeps_the_tokens(
    target: &Model,
    draft: &Model,
    (greedy, mixed, plain): (&Requests, &Requests, &[Vec<u32>]),
    all_accepted: bool,
    what: &str,
) {
    let (speculative, drafted, _) = serve_drafting(target, draft, mixed, 20);
    assert_eq!(speculative, plain, "{what}");
    assert!(drafted > 0, "{what}");
    let (_, drafted, accepted) = serve_drafting(target, draft, greedy, 20);
    match all_accepted {
        true => assert_eq!(accepted, drafted, "{what}"),
        false => assert!(accepted < drafted, "{what}: all of {drafted} accepted"),
    }
}

/// The CPU backend with its greedy graph beside the logits graph (`CpuGreedyServing`: steps
/// whose requests all decode greedily take the greedy graph, whose f32 head is the INT8-bound
/// one) serves the tokens the logits graph alone serves: greedy requests with and without
/// prompt lookup's drafts (verified through the greedy ids), a sampled request beside them
/// (its steps take the logits graph), on the tiny Llama and the tiny Qwen3.5 (refused drafts
/// rewound out of its recurrent state), and SmolLM2 computing in f32.
#[test]
fn greedy_steps_on_the_greedy_graph_serve_the_logits_graphs_tokens() {
    use runtime::serving::{CpuGreedyServing, NgramConfig};
    let sampled = SamplingParams {
        temperature: 0.7,
        seed: 9,
        ..SamplingParams::default()
    };
    let repeating = |base: u32, period: u32| (0..30u32).map(|j| base + 17 * (j % period)).collect::<Vec<u32>>();
    let greedy_requests: Vec<(Vec<u32>, SamplingParams)> = [repeating(30, 6), repeating(40, 5), repeating(90, 1)]
        .into_iter()
        .map(|p| (p, SamplingParams::default()))
        .collect();
    let mut mixed = greedy_requests.clone();
    mixed.push((repeating(20, 4), sampled));
    let tiny = |name: &str| Model::open(ModelSpec::for_weights(&common::fixture(name))).unwrap();
    let mut f32_smollm2 = ModelSpec::for_weights(&common::real_model("smollm2"));
    f32_smollm2.dtype = models::ComputeDtype::F32;
    let models = [
        tiny("hf-tiny/llama"),
        tiny("hf-tiny/qwen3_5"),
        Model::open(f32_smollm2).unwrap(),
    ];
    for model in &models {
        let greedy_graph =
            passes::optimized(&model.lower(LogitsFor::GreedyToken).unwrap(), passes::CostModel::CPU).unwrap();
        assert!(
            greedy_graph
                .nodes()
                .iter()
                .any(|n| matches!(n.op, ir::Op::Int8BoundTopK { .. })),
            "the greedy graph's f32 head is the INT8-bound one"
        );
        for (requests, speculation) in [(&greedy_requests, NgramConfig::OFF), (&mixed, DRAFT_FOUR)] {
            let config = speculation_config(speculation);
            let mut plain = ServingEngine::new(backend(model), config);
            let want = serve_counting_drafts(&mut plain, requests, 16);
            let greedy = CpuBackend::new(greedy_graph.clone(), &model.weights, model.config.context_length).unwrap();
            let both = CpuGreedyServing::new(backend(model), Some(greedy)).unwrap();
            let mut engine = ServingEngine::new(both, config);
            assert_eq!(
                serve_counting_drafts(&mut engine, requests, 16),
                want,
                "{speculation:?}"
            );
        }
    }
}

/// A draft model proposes its own greedy continuation of a sequence's tokens, and after a
/// step that kept some of its drafts it computes only the tokens since the first it lacks:
/// its proposal is still the continuation a fresh start gives, and a sequence that is gone
/// gives its blocks back. The same for a draft model with recurrent state (the tiny Qwen3.5),
/// whose state its drafts have moved past the kept tokens: it goes back to the snapshot its
/// last catch-up saved.
#[test]
fn a_draft_model_proposes_its_greedy_continuation_from_what_it_kept() {
    for fixture in ["hf-tiny/llama_rope_yarn", "hf-tiny/qwen3_5_rope_yarn"] {
        let draft = Model::open(ModelSpec::for_weights(&common::fixture(fixture))).unwrap();
        draft_model_proposes_its_greedy_continuation(&draft);
    }
}

fn draft_model_proposes_its_greedy_continuation(draft: &Model) {
    use runtime::serving::{DraftModel, DraftRequest, Drafter, SeqId};
    // A token budget of 8: the 30-token prompt catches up over several steps, drafting
    // nothing until it is through, while the short sequence ahead of it drafts every step.
    let mut drafter = DraftModel::new(backend(draft), 64, 4, 8, 2048).unwrap();
    let prompt: Vec<u32> = (0..30u32).map(|j| 60 + 7 * j).collect();
    let other: Vec<u32> = vec![5, 9, 14];
    let propose = |drafter: &mut DraftModel<CpuBackend>, requests: &[(u64, &[u32], usize)]| {
        let requests: Vec<DraftRequest> = requests
            .iter()
            .map(|&(id, tokens, limit)| DraftRequest {
                seq: SeqId(id),
                tokens,
                limit,
            })
            .collect();
        drafter.propose(&requests).unwrap()
    };
    let mut steps = 0;
    let first = loop {
        steps += 1;
        let proposed = propose(&mut drafter, &[(1, &other, 2), (0, &prompt, 4)]);
        assert_eq!(proposed[&SeqId(1)], alone(draft, std::slice::from_ref(&other), 2)[0]);
        if !proposed[&SeqId(0)].is_empty() {
            break proposed;
        }
        assert!(steps < 8, "the prompt never caught up");
    };
    // The short sequence takes its 3 positions of the first pass's 8, then its last one again
    // each step (its draft is computed past it): 5 + 7 + 7 + 7 + 4 positions of the prompt.
    // A model with recurrent state goes back to the snapshot after the short sequence's
    // tokens each step instead and drafts from there with the first draft it gave, computing
    // none of them again: 5 + 8 + 8 + 8 + 1. (The engine asks again for the same tokens
    // where a step's budget left a decoding sequence out.)
    assert_eq!(steps, 5);
    assert_eq!(first[&SeqId(0)], alone(draft, std::slice::from_ref(&prompt), 4)[0]);
    // Two drafts kept and another token after them; the other sequence kept all; a third
    // differs from what the draft model computed before its last token (no step keeps drafts
    // so, but what a sequence's cache holds is checked token by token).
    let mut kept = prompt.clone();
    kept.extend(&first[&SeqId(0)][..2]);
    kept.push(3);
    let mut other_kept = other.clone();
    other_kept.extend(&first[&SeqId(1)]);
    other_kept.push(first[&SeqId(1)][1]);
    let mut diverged = other.clone();
    diverged.extend([(first[&SeqId(1)][0] + 1) % 320, 8, 9]);
    let first_again = propose(&mut drafter, &[(2, &other, 2)]);
    assert_eq!(first_again[&SeqId(2)], first[&SeqId(1)]);
    let second = propose(&mut drafter, &[(0, &kept, 3), (1, &other_kept, 3), (2, &diverged, 2)]);
    assert_eq!(second[&SeqId(0)], alone(draft, std::slice::from_ref(&kept), 3)[0]);
    assert_eq!(second[&SeqId(1)], alone(draft, std::slice::from_ref(&other_kept), 3)[0]);
    assert_eq!(second[&SeqId(2)], alone(draft, std::slice::from_ref(&diverged), 2)[0]);
    assert!(drafter.used_blocks() > 0);
    let recurrent = drafter.backend().has_recurrent_state();
    // Another sequence sharing the prompt's first 20 tokens: without state, they are in the
    // 5 blocks the prompt registered, so it computes its last 3 and drafts in the first step
    // (from nothing, its 23 tokens would take three).
    let sharing: Vec<u32> = prompt[..20].iter().copied().chain([1, 2, 3]).collect();
    let shared = propose(&mut drafter, &[(3, &sharing, 2)]);
    assert_eq!(shared[&SeqId(3)].is_empty(), recurrent);
    if !recurrent {
        assert_eq!(shared[&SeqId(3)], alone(draft, std::slice::from_ref(&sharing), 2)[0]);
    }
    drafter.retain(&mut |id| id == SeqId(1));
    let again: Vec<_> = (0..5)
        .map(|_| propose(&mut drafter, &[(0, &kept, 3)]).remove(&SeqId(0)))
        .collect();
    if recurrent {
        // From nothing again: its 33 tokens over five steps of 8.
        assert_eq!(again[3], Some(vec![]));
        assert_eq!(again[4].as_ref(), Some(&second[&SeqId(0)]), "from nothing again");
    } else {
        // From its cached prefix (a conversation's next turn, say): the blocks it let go
        // hold its first 32 tokens, so it computes the last and drafts at once.
        for proposed in &again {
            assert_eq!(proposed.as_ref(), Some(&second[&SeqId(0)]), "from the prefix cache");
        }
    }
    drafter.retain(&mut |id| id == SeqId(1));
    let held = drafter.used_blocks();
    assert_eq!(
        held,
        (other_kept.len() + 2).div_ceil(4),
        "the other sequence's blocks alone"
    );
    drafter.retain(&mut |_| false);
    assert_eq!(drafter.used_blocks(), 0);
    // No blocks to be had: no proposal, and no error.
    let mut starved = DraftModel::new(backend(draft), 2, 4, 8, 2048).unwrap();
    assert!(propose(&mut starved, &[(0, &prompt, 4)]).is_empty());
}

/// A draft model served as `bbc serve` serves it on the CPU (`CpuGreedyServing`: its passes
/// on the greedy graph, whose head is the INT8-bound one, or `--draft-head shortlist`'s 4-bit
/// shortlist, 64 of 320 rows, among which the best is here) proposes what it proposes on the
/// logits graph, round after round of partly kept drafts, with and without recurrent state
/// (whose snapshots the greedy graph saves and restores in the same pages).
#[test]
fn a_draft_model_on_its_greedy_graph_proposes_as_on_its_logits_graph() {
    use runtime::serving::{CpuGreedyServing, DraftModel};
    for fixture in ["hf-tiny/llama_rope_yarn", "hf-tiny/qwen3_5_rope_yarn"] {
        let draft = Model::open(ModelSpec::for_weights(&common::fixture(fixture))).unwrap();
        let greedy = draft.lower(LogitsFor::GreedyToken).unwrap();
        for (graph, head) in [
            (greedy.clone(), "int8_bound_top_k"),
            (passes::shortlisted_draft_head(&greedy).unwrap(), "shortlist_top_k"),
        ] {
            let graph = passes::optimized(&graph, passes::CostModel::CPU).unwrap();
            assert!(
                graph.nodes().iter().any(|n| n.op.name() == head),
                "{fixture}: no {head}"
            );
            let greedy = CpuBackend::new(graph, &draft.weights, draft.config.context_length).unwrap();
            let serving = CpuGreedyServing::new(backend(&draft), Some(greedy)).unwrap();
            let mut on_greedy = DraftModel::new(serving, 64, 4, 16, 2048).unwrap();
            let mut on_logits = DraftModel::new(backend(&draft), 64, 4, 16, 2048).unwrap();
            let sequences = vec![(0..13u32).map(|j| 5 + 11 * j).collect(), vec![3, 1, 4]];
            common::drafting::propose_alike(
                &mut on_logits,
                &mut on_greedy,
                sequences,
                5,
                &format!("{fixture} {head}"),
            );
        }
    }
}

/// `requests` served with `draft` drafting up to four tokens a step for `target`: each one's
/// tokens, and the drafts drafted and accepted over the run.
fn serve_drafting(
    target: &Model,
    draft: &Model,
    requests: &[(Vec<u32>, SamplingParams)],
    max_tokens: usize,
) -> (Vec<Vec<u32>>, usize, usize) {
    let mut engine = ServingEngine::new(backend(target), speculation_config(DRAFT_FOUR));
    let drafter = runtime::serving::DraftModel::new(backend(draft), 128, 8, 64, 2048).unwrap();
    assert!(engine.use_drafter(Box::new(drafter)));
    serve_counting_drafts(&mut engine, requests, max_tokens)
}

/// Prompt lookup drafting up to four tokens.
const DRAFT_FOUR: runtime::serving::NgramConfig = runtime::serving::NgramConfig {
    tokens: 4,
    min: 1,
    max: 3,
};

/// Draft models and targets with recurrent state (Gated DeltaNet): a hybrid target drafted
/// for by itself (every greedy draft accepted), by the other hybrid family and by a Llama
/// (drafts refused, so a hybrid drafter goes back to its snapshots), and a Llama target
/// drafted for by a hybrid: the tokens of no speculation, greedy and sampled.
#[test]
fn draft_models_with_recurrent_state_keep_every_token() {
    let sampled = SamplingParams {
        temperature: 0.8,
        seed: 11,
        ..SamplingParams::default()
    };
    let greedy = greedy_requests(11);
    let mut mixed = greedy.clone();
    mixed.push((stepped(40, 12, 11), sampled));
    let tiny = |name: &str| Model::open(ModelSpec::for_weights(&common::fixture(name))).unwrap();
    for (target_name, draft_name) in [
        ("qwen3_5", "qwen3_5"),
        ("qwen3_5", "qwen3_next"),
        ("qwen3_5", "llama"),
        ("llama", "qwen3_5"),
    ] {
        let (target, draft) = (
            tiny(&format!("hf-tiny/{target_name}")),
            tiny(&format!("hf-tiny/{draft_name}")),
        );
        let plain = serve_speculating(&target, &mixed, 20, runtime::serving::NgramConfig::OFF).0;
        let pair = format!("{draft_name} drafting for {target_name}");
        drafting_keeps_the_tokens(
            &target,
            &draft,
            (&greedy, &mixed, &plain),
            target_name == draft_name,
            &pair,
        );
    }
}

/// On hybrid models (the tiny Qwen3.5 and Qwen3-Next), drafts run through each sequence's
/// recurrent state, and refused ones are taken back out of it: with speculation, greedy
/// requests generate exactly what they generate without, some drafts accepted and some
/// refused (a state left past the refused drafts changes the tokens after them).
#[test]
fn speculation_on_hybrid_models_takes_refused_drafts_back_out_of_the_state() {
    for family in ["qwen3_5", "qwen3_next"] {
        let model = Model::open(ModelSpec::for_weights(&common::fixture(&format!("hf-tiny/{family}")))).unwrap();
        // Repeating prompts (a period of 6, of 5, one token), where the tiny random models'
        // greedy tokens sometimes follow what prompt lookup drafts.
        let repeating = |base: u32, period: u32| (0..40u32).map(|j| base + 17 * (j % period)).collect();
        let requests: Vec<(Vec<u32>, SamplingParams)> = [repeating(30, 6), repeating(30, 5), repeating(100, 1)]
            .into_iter()
            .map(|p| (p, SamplingParams::default()))
            .collect();
        let (plain, _, _) = serve_speculating(&model, &requests, 32, runtime::serving::NgramConfig::OFF);
        let (speculative, drafted, accepted) = serve_speculating(&model, &requests, 32, DRAFT_FOUR);
        assert_eq!(speculative, plain, "{family}");
        assert!(
            accepted > 0 && drafted > accepted,
            "{family}: {accepted} of {drafted} drafts accepted; both kinds were meant to happen"
        );
    }
}

/// The mechanism beneath: after a step verifying three drafts, rewinding a hybrid model's
/// state to keep `kept` of its four sampled rows leaves the sequence exactly where one that
/// ran only those rows is: the next step's logits are bit for bit the same, for every `kept`.
#[test]
fn a_rewound_state_continues_like_one_that_never_saw_the_refused_drafts() {
    use runtime::kv::{BlockId, Segment};
    use runtime::serving::PagedBackend;
    for family in ["qwen3_5", "qwen3_next"] {
        let model = Model::open(ModelSpec::for_weights(&common::fixture(&format!("hf-tiny/{family}")))).unwrap();
        let backend = backend(&model);
        let (prompt, drafts, next) = ([5u32, 40, 77, 120, 3, 9, 250, 31, 64, 200], [17u32, 93, 141], 58u32);
        let table: Vec<BlockId> = (0..4).map(BlockId).collect();
        let all = [&prompt[..], &drafts[..]].concat();
        let step = |pages: &mut runtime::KvPages, start: usize, ids: &[u32], sampled_rows: usize| {
            let segment = Segment {
                hidden_states: &[],
                table: &table,
                start,
                ids,
                state_slot: 0,
                sampled_rows,
                drafts: sampled_rows - 1,
                snapshots: runtime::kv::StateSnapshots::NONE,
            };
            backend
                .step_batch(pages, &[segment])
                .unwrap()
                .remove(0)
                .remove("logits")
                .unwrap()
                .data
        };
        for kept in 1..=4 {
            let mut verified = PagedBackend::new_pages(&backend, 8);
            step(&mut verified, 0, &all, 4);
            backend.rewind_state(&mut verified, 0, 4, kept).unwrap();
            let mut plain = PagedBackend::new_pages(&backend, 8);
            let end = prompt.len() + kept - 1;
            step(&mut plain, 0, &all[..end], 1);
            assert_eq!(
                step(&mut verified, end, &[next], 1),
                step(&mut plain, end, &[next], 1),
                "{family}: {kept} of 4 sampled rows kept"
            );
        }
    }
}

/// Structured outputs' mechanism in the engine: a sequence under a constraint takes only the
/// tokens its constraint allows at each point, and the constraint hears exactly the tokens
/// taken (refused drafts never reach it), with or without speculation, greedy or sampled; it
/// is asked to get ready for each sampled step's first row while the backend runs, never for
/// a stale row; the requests beside it without one generate what they generate alone.
#[test]
fn constrained_sequences_take_only_what_their_constraint_allows() {
    let model = Model::open(ModelSpec::for_weights(&common::fixture("hf-tiny/llama"))).unwrap();
    // The alphabet the constraint allows (a repeating prompt over it, so that drafts come).
    let alphabet: Vec<u32> = (0..6u32).map(|j| 40 + 13 * j).collect();
    let prompt: Vec<u32> = (0..36).map(|j| alphabet[j % alphabet.len()]).collect();
    let sampled = SamplingParams {
        temperature: 0.9,
        seed: 3,
        ..SamplingParams::default()
    };
    let free_prompt: Vec<u32> = (0..20u32).map(|j| 7 + 11 * j).collect();
    let mut results = Vec::new();
    for speculation in [runtime::serving::NgramConfig::OFF, DRAFT_FOUR] {
        let mut engine = ServingEngine::new(backend(&model), speculation_config(speculation));
        let mut heard = Vec::new();
        let mut constrained = Vec::new();
        let prepares = Arc::new(Mutex::new(0));
        for params in [SamplingParams::default(), sampled] {
            let log = Arc::new(Mutex::new(Vec::new()));
            let constraint = NoRepeatsWithin {
                alphabet: alphabet.clone(),
                heard: log.clone(),
                prepared: None,
                prepares: prepares.clone(),
            };
            let id = engine
                .add_processed(prompt.clone(), 24, vec![], params, vec![Box::new(constraint)], 0)
                .unwrap();
            constrained.push(id);
            heard.push(log);
        }
        let free = engine
            .add(free_prompt.clone(), 24, vec![], SamplingParams::default())
            .unwrap();
        let (mut drafted, mut accepted) = (0, 0);
        let got = run_to_idle(&mut engine, |out, _| {
            drafted += out.drafted;
            accepted += out.accepted;
        });
        for (id, log) in constrained.iter().zip(&heard) {
            let tokens = &got[id];
            assert_eq!(tokens.len(), 24);
            assert_eq!(
                &*log.lock().unwrap(),
                tokens,
                "the constraint hears the tokens taken, no more"
            );
            assert!(tokens.iter().all(|t| alphabet.contains(t)), "{tokens:?}");
            assert!(tokens.windows(2).all(|w| w[0] != w[1]), "{tokens:?}");
        }
        assert_eq!(got[&free], alone(&model, std::slice::from_ref(&free_prompt), 24)[0]);
        assert!(
            *prepares.lock().unwrap() >= 24,
            "processors get ready while the backend runs"
        );
        if speculation.tokens > 0 {
            assert!(
                drafted > accepted && accepted > 0,
                "{accepted} of {drafted} drafts accepted"
            );
        }
        results.push(constrained.iter().map(|id| got[id].clone()).collect::<Vec<_>>());
    }
    assert_eq!(results[0], results[1], "drafting changes no constrained token");
}

/// Forced drafts (what a sequence's processors propose, as a grammar proposes its forced
/// text) are verified like any drafts, with speculation off: proposals of the very tokens the
/// sequence goes on to take are all accepted, wrong ones all refused, and either way every
/// sequence (greedy, sampled, and one beside them proposing nothing) takes what it takes
/// without proposals; on the tiny Llama and on the tiny Qwen3.5, whose refused drafts are
/// rewound out of its recurrent state.
#[test]
fn forced_drafts_change_no_token() {
    let sampled = SamplingParams {
        temperature: 0.8,
        seed: 5,
        ..SamplingParams::default()
    };
    for family in ["llama", "qwen3_5"] {
        let model = Model::open(ModelSpec::for_weights(&common::fixture(&format!("hf-tiny/{family}")))).unwrap();
        let requests = [
            (stepped(30, 12, 5), SamplingParams::default()),
            (stepped(9, 7, 3), sampled),
            (stepped(50, 5, 7), SamplingParams::default()),
        ];
        let run = |script: Option<(&[Vec<u32>], u32)>| {
            let mut engine =
                ServingEngine::new(backend(&model), speculation_config(runtime::serving::NgramConfig::OFF));
            let ids: Vec<SeqId> = requests
                .iter()
                .enumerate()
                .map(|(i, (prompt, params))| {
                    // The last request proposes nothing.
                    let processors: Vec<Box<dyn LogitsProcessor>> = match script {
                        Some((tokens, shift)) if i < 2 => vec![Box::new(Foreseeing::new(tokens[i].clone(), shift))],
                        _ => Vec::new(),
                    };
                    engine
                        .add_processed(prompt.clone(), 20, vec![], *params, processors, 0)
                        .unwrap()
                })
                .collect();
            let (mut drafted, mut accepted) = (0, 0);
            let got = run_to_idle(&mut engine, |out, _| {
                drafted += out.drafted;
                accepted += out.accepted;
            });
            (
                ids.iter().map(|id| got[id].clone()).collect::<Vec<_>>(),
                drafted,
                accepted,
            )
        };
        let (plain, drafted, _) = run(None);
        assert_eq!(drafted, 0, "{family}: no drafts without proposals or speculation");
        let (foreseen, drafted, accepted) = run(Some((&plain, 0)));
        assert_eq!(foreseen, plain, "{family}");
        assert!(
            drafted > 0 && accepted == drafted,
            "{family}: {accepted} of {drafted} accepted"
        );
        let (misled, drafted, accepted) = run(Some((&plain, 1)));
        assert_eq!(misled, plain, "{family}");
        assert!(
            drafted > 0 && accepted == 0,
            "{family}: {accepted} of {drafted} wrong drafts accepted"
        );
    }
}

/// A constraint for the test above: tokens of `alphabet` only, never the one just taken.
struct NoRepeatsWithin {
    alphabet: Vec<u32>,
    heard: Arc<Mutex<Vec<u32>>>,
    /// What `prepare` was last called after (the tokens heard then), until the next `process`.
    prepared: Option<usize>,
    prepares: Arc<Mutex<usize>>,
}

impl LogitsProcessor for NoRepeatsWithin {
    fn process(&mut self, logits: &mut [f32]) {
        let heard = self.heard.lock().unwrap().len();
        if let Some(ready_for) = self.prepared.take() {
            assert_eq!(ready_for, heard, "prepared for another row");
        }
        let last = self.heard.lock().unwrap().last().copied();
        for (id, logit) in logits.iter_mut().enumerate() {
            let id = id as u32;
            if !self.alphabet.contains(&id) || Some(id) == last {
                *logit = f32::NEG_INFINITY;
            }
        }
    }

    fn accept(&mut self, token: u32) {
        self.heard.lock().unwrap().push(token);
    }

    fn prepare(&mut self) {
        self.prepared = Some(self.heard.lock().unwrap().len());
        *self.prepares.lock().unwrap() += 1;
    }
}

/// `requests` (prompt, sampling) served together, `max_tokens` each, four at a time with
/// `speculation`: each one's tokens, and the drafts drafted and accepted over the run.
fn serve_speculating(
    model: &Model,
    requests: &[(Vec<u32>, SamplingParams)],
    max_tokens: usize,
    speculation: runtime::serving::NgramConfig,
) -> (Vec<Vec<u32>>, usize, usize) {
    let mut engine = ServingEngine::new(backend(model), speculation_config(speculation));
    serve_counting_drafts(&mut engine, requests, max_tokens)
}

/// `requests` served together on `engine`, `max_tokens` each: each one's tokens, and the
/// drafts drafted and accepted over the run.
fn serve_counting_drafts<B: runtime::serving::PagedBackend>(
    engine: &mut ServingEngine<B>,
    requests: &[(Vec<u32>, SamplingParams)],
    max_tokens: usize,
) -> (Vec<Vec<u32>>, usize, usize) {
    let ids: Vec<_> = requests
        .iter()
        .map(|(p, s)| engine.add(p.clone(), max_tokens, vec![], *s).unwrap())
        .collect();
    let (mut drafted, mut accepted) = (0, 0);
    let got = run_to_idle(engine, |out, _| {
        drafted += out.drafted;
        accepted += out.accepted;
    });
    (ids.iter().map(|id| got[id].clone()).collect(), drafted, accepted)
}

/// Four sequences at a time with `speculation`, and room for them.
fn speculation_config(speculation: runtime::serving::NgramConfig) -> SchedulerConfig {
    SchedulerConfig {
        max_waiting: 16,
        max_running: 4,
        token_budget: 64,
        kv_blocks: 64,
        block_size: 8,
        context_length: 2048,
        prefix_caching: true,
        speculation,
        recurrent_state: false,
        state_cache: runtime::serving::StateCacheConfig::OFF,
    }
}

/// A request scoring its prompt (`prompt_logprobs`) gets each position's log-probability
/// once, in order, all before its first token; where the prompt is a greedy continuation's
/// own text, those positions score exactly what the continuation's tokens reported as they
/// were generated (what lm-eval's log-likelihoods rest on), however the prompt is chunked,
/// and though its blocks are in the prefix cache (a cached position is never computed, so a
/// scored prompt reads none). Also for a model with recurrent state (Qwen3.5: its scored rows
/// are not drafts, so no checkpoints are kept for them), Gemma 4's KV-shared layers (which run
/// on the rows sampled from alone) and GLM-5's sparse latent attention (each row's indexer
/// cut).
#[test]
fn prompt_logprobs_score_each_position_as_decoding_it_would() {
    for family in ["llama", "qwen3_5", "gemma4_kv_shared", "glm_moe_dsa"] {
        let model = Model::open(ModelSpec::for_weights(&common::fixture(&format!("hf-tiny/{family}")))).unwrap();
        let prompt: Vec<u32> = (0..11u32).map(|j| 40 + 23 * j).collect();
        let logprobs = |top| SamplingParams {
            logprobs: Some(top),
            ..SamplingParams::default()
        };
        // The continuation, with its tokens' log-probabilities.
        let mut engine = ServingEngine::new(backend(&model), scoring_config(64));
        let id = engine.add(prompt.clone(), 9, vec![], logprobs(3)).unwrap();
        let mut generated = Vec::new();
        run_to_idle(&mut engine, |out, _| {
            generated.extend(
                out.tokens
                    .iter()
                    .filter(|t| t.seq == id)
                    .map(|t| (t.token, t.logprobs.clone().unwrap())),
            );
        });
        let text: Vec<u32> = prompt.iter().copied().chain(generated.iter().map(|g| g.0)).collect();

        let scored = |budget: usize| {
            let mut engine = ServingEngine::new(backend(&model), scoring_config(budget));
            // The same text served once first, so that its blocks are cached.
            engine.add(text.clone(), 2, vec![], SamplingParams::default()).unwrap();
            run_to_idle(&mut engine, |_, _| {});
            let hits = engine.scheduler().prefix_cache_stats().hit;
            let scoring = SamplingParams {
                prompt_logprobs: Some(3),
                ..SamplingParams::default()
            };
            let id = engine.add(text.clone(), 2, vec![], scoring).unwrap();
            // A request beside it, sharing its steps (not its prefix).
            let other: Vec<u32> = (0..7u32).map(|j| 7 + 31 * j).collect();
            engine.add(other, 4, vec![], SamplingParams::default()).unwrap();
            let (mut positions, mut got, mut tokens_before) = (Vec::new(), Vec::new(), None);
            run_to_idle(&mut engine, |out, _| {
                for p in out.prompt_logprobs.iter().filter(|p| p.seq == id) {
                    positions.extend(p.first..p.first + p.logprobs.len());
                    got.extend(p.logprobs.iter().cloned());
                }
                if out.tokens.iter().any(|t| t.seq == id) {
                    tokens_before.get_or_insert(got.len());
                }
            });
            assert_eq!(
                positions,
                (1..text.len()).collect::<Vec<_>>(),
                "{family}: each position once, in order"
            );
            assert_eq!(
                tokens_before,
                Some(text.len() - 1),
                "{family}: all before the first token"
            );
            assert_eq!(
                engine.scheduler().prefix_cache_stats().hit,
                hits,
                "{family}: read from the cache"
            );
            got
        };
        let whole = scored(64);
        for (i, (token, lp)) in generated.iter().enumerate().take(generated.len() - 1) {
            let at = &whole[prompt.len() + i - 1];
            assert_eq!(
                (at.logprob, &at.top),
                (lp.logprob, &lp.top),
                "{family}: token {i} ({token})"
            );
            assert_eq!(at.rank, 1, "{family}: greedy tokens rank first");
        }
        assert_eq!(scored(4), whole, "{family}: prompt chunked in 4s");
        // Scored from position 9 on only (a perplexity window's second half): the same values.
        let mut engine = ServingEngine::new(backend(&model), scoring_config(4));
        let scoring = SamplingParams {
            prompt_logprobs: Some(3),
            ..SamplingParams::default()
        };
        let id = engine.add(text.clone(), 1, vec![], scoring).unwrap();
        assert!(engine.score_prompt_from(id, 9));
        let mut late = Vec::new();
        run_to_idle(&mut engine, |out, _| {
            for p in &out.prompt_logprobs {
                assert!(p.first >= 9, "{family}: scored position {}", p.first);
                late.extend(p.logprobs.iter().cloned());
            }
        });
        assert_eq!(late, whole[8..], "{family}: scored from position 9");
    }
}

/// Room for a few sequences; `budget` tokens a step (so prompts longer than it are chunked).
fn scoring_config(budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        token_budget: budget,
        ..speculation_config(runtime::serving::NgramConfig::OFF)
    }
}
