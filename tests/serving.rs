//! Continuous batching on the CPU backend: many greedy requests in flight together, with a KV
//! budget tight enough to force preemption and recomputation, each produce exactly the tokens
//! they produce alone; aborts free their blocks at once.

mod common;

use models::{LogitsFor, Model, ModelSpec};
use runtime::serving::{SchedulerConfig, ServingEngine};
use runtime::{generate, CpuBackend, Engine, GenerateOptions, SamplingParams};
use std::collections::HashMap;

fn backend(model: &Model) -> CpuBackend {
    let graph = passes::optimize(
        &model.lower(LogitsFor::LastToken).unwrap(),
        passes::CostModel::CPU,
        None,
    )
    .unwrap()
    .pop()
    .unwrap()
    .graph;
    CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap()
}

#[test]
fn concurrent_requests_generate_what_they_generate_alone() {
    let model = Model::open(ModelSpec::for_weights(&common::real_model("smollm2"))).unwrap();
    let prompts: Vec<Vec<u32>> = (0..12u32)
        .map(|i| (0..(5 + 3 * i)).map(|j| 100 + 13 * i + 7 * j).collect())
        .collect();
    let max_tokens = 12;
    let alone = Engine::from(backend(&model));
    let options = GenerateOptions {
        max_tokens,
        ..Default::default()
    };
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| generate(&alone, p, &options, |_| Ok(true)).unwrap())
        .collect();

    // 12 blocks of 8 positions: far fewer than 12 sequences of up to 50 positions need.
    let config = SchedulerConfig {
        max_waiting: 64,
        max_running: 8,
        token_budget: 64,
        kv_blocks: 12,
        block_size: 8,
        context_length: 2048,
    };
    let mut engine = ServingEngine::new(backend(&model), config);
    let ids: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine
                .add(p.clone(), max_tokens, vec![], SamplingParams::default())
                .unwrap()
        })
        .collect();
    let mut got: HashMap<_, Vec<u32>> = HashMap::new();
    let mut preempted_any = false;
    while !engine.scheduler().is_idle() {
        let out = engine.step().unwrap();
        for done in out.finished {
            got.insert(done.seq, done.generated);
        }
        assert!(engine.scheduler().check().is_ok());
        preempted_any |= engine.scheduler().used_blocks() == 12;
    }
    assert!(preempted_any, "the KV budget was meant to be exhausted");
    for (id, want) in ids.iter().zip(&want) {
        assert_eq!(&got[id], want, "{id:?}");
    }
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
