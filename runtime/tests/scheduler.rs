//! The scheduler and block manager under random interleavings of requests, steps and aborts
//! (with a KV pool small enough to force preemption): the invariants hold after every
//! operation, and once everything is done or aborted every block is free again.

use proptest::prelude::*;
use runtime::serving::{Scheduler, SchedulerConfig, SeqId};

#[derive(Debug, Clone)]
enum Action {
    Add { prompt: usize, max_tokens: usize },
    Step { stop: bool },
    Abort(usize),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        (1usize..40, 1usize..20).prop_map(|(prompt, max_tokens)| Action::Add { prompt, max_tokens }),
        any::<bool>().prop_map(|stop| Action::Step { stop }),
        (0usize..64).prop_map(Action::Abort),
    ]
}

fn run_step(s: &mut Scheduler, stop: bool, budget: usize) -> usize {
    let schedule = s.schedule();
    let scheduled: usize = schedule.work.iter().map(|w| w.end - w.start).sum();
    assert!(
        scheduled <= budget,
        "{scheduled} tokens scheduled over a budget of {budget}"
    );
    let mut finished = 0;
    for w in &schedule.work {
        assert!(w.start < w.end && w.tokens.len() == w.end - w.start, "{w:?}");
        // Token 7 is the stop token; `stop` decides whether this step emits it.
        let token = if stop { 7 } else { 3 };
        if s.complete(w, w.samples.then_some(token)).is_some() {
            finished += 1;
        }
    }
    finished
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn blocks_never_leak_and_invariants_hold(
        blocks in 4usize..16,
        block_size in 2usize..8,
        budget in 1usize..24,
        actions in proptest::collection::vec(action(), 1..120),
    ) {
        let config = SchedulerConfig { max_waiting: 8, max_running: 4, token_budget: budget, kv_blocks: blocks, block_size, context_length: 64 };
        let mut s = Scheduler::new(config);
        let mut ids: Vec<SeqId> = Vec::new();
        for a in actions {
            match a {
                Action::Add { prompt, max_tokens } => {
                    if let Ok(id) = s.add((0..prompt as u32).map(|t| 10 + t).collect(), max_tokens, vec![7]) {
                        ids.push(id);
                    }
                }
                Action::Step { stop } => {
                    run_step(&mut s, stop, budget);
                }
                Action::Abort(i) => {
                    if let Some(&id) = ids.get(i % ids.len().max(1)) {
                        s.abort(id);
                    }
                }
            }
            prop_assert_eq!(s.check(), Ok(()));
        }
        // Everything still queued completes: no livelock, and every block comes back.
        let mut steps = 0;
        while !s.is_idle() {
            run_step(&mut s, false, budget);
            prop_assert_eq!(s.check(), Ok(()));
            steps += 1;
            prop_assert!(steps < 10_000, "the scheduler stopped making progress");
        }
        prop_assert_eq!(s.used_blocks(), 0);
    }
}

#[test]
fn a_full_queue_refuses_and_oversized_requests_are_named() {
    let config = SchedulerConfig {
        max_waiting: 2,
        max_running: 1,
        token_budget: 8,
        kv_blocks: 4,
        block_size: 4,
        context_length: 32,
    };
    let mut s = Scheduler::new(config);
    s.add(vec![1, 2], 4, vec![]).unwrap();
    s.add(vec![1, 2], 4, vec![]).unwrap();
    assert!(s
        .add(vec![1, 2], 4, vec![])
        .unwrap_err()
        .to_string()
        .contains("queue is full"));
    assert!(s
        .add(vec![1; 30], 4, vec![])
        .unwrap_err()
        .to_string()
        .contains("maximum context length is 32"));
    assert!(s
        .add(vec![1; 10], 20, vec![])
        .unwrap_err()
        .to_string()
        .contains("never fit"));
    assert!(s.add(vec![], 4, vec![]).is_err());
}

#[test]
fn preemption_recomputes_and_still_finishes_everyone() {
    // Two blocks of 4: two sequences of 3 prompt + 4 generated cannot both stay resident.
    let config = SchedulerConfig {
        max_waiting: 8,
        max_running: 2,
        token_budget: 16,
        kv_blocks: 2,
        block_size: 4,
        context_length: 16,
    };
    let mut s = Scheduler::new(config);
    let a = s.add(vec![1, 2, 3], 4, vec![]).unwrap();
    let b = s.add(vec![4, 5, 6], 4, vec![]).unwrap();
    let mut preempted = 0;
    let mut finished = Vec::new();
    for _ in 0..100 {
        let schedule = s.schedule();
        preempted += schedule.preempted.len();
        for w in &schedule.work {
            if let Some(done) = s.complete(w, w.samples.then_some(9)) {
                finished.push(done.seq);
            }
        }
        s.check().unwrap();
        if s.is_idle() {
            break;
        }
    }
    assert!(preempted > 0, "the pool was meant to force a preemption");
    finished.sort();
    assert_eq!(finished, vec![a, b]);
    assert_eq!(s.used_blocks(), 0);
}
