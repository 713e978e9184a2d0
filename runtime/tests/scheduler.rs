//! The scheduler and block manager under random interleavings of requests, steps and aborts
//! (with a KV pool small enough to force preemption, and prompts that share prefixes so the
//! prefix cache is hit): the invariants hold after every operation; a simulated KV cache shows
//! that every position a sequence reads holds exactly what that sequence's own tokens put
//! there, whoever computed it; every scheduled work computes at least one token; and once
//! everything is done or aborted no block is in use. For models with a recurrent state, a
//! simulated state shows that every work continues the state of its own sequence's prefix, in
//! a slot nobody else's work touches meanwhile, or starts from a snapshot that holds exactly
//! that prefix's state (prefix caching with snapshots), and that no step saves a snapshot
//! into a place another of its works restores from (nor, for a backend that saves only at a
//! work's end, anywhere else). With speculation,
//! works carry drafted tokens of which a random number is accepted: the same checks hold, and
//! no draft takes a sequence past its `max_tokens` or a step past its budget. Drafts offered
//! as a draft model offers them (`offer_drafts`, more than a sequence may carry, none for
//! some) are carried as offered, cut to the sequence's limit, and only where offered. Forced
//! drafts (`offer_forced_drafts`, as a grammar's forced text is offered, whether speculation is
//! on or not) are carried where offered in place of others, cut to `FORCED_DRAFTS_MOST`, the
//! sequence's `max_tokens` and the step's budget. Where drafts are capped (`cap_drafts`, a
//! backend's checkpoints), no work carries more, of any kind. A sequence that
//! computes its whole prompt (`compute_whole_prompt`, for prompt log-probabilities) never
//! starts from the prefix cache, however often it is preempted. Under the priority policy,
//! requests of random priorities wait and run in (priority, arrival) order, every sequence a
//! step preempts comes after every sequence that step gives work, and after a step with
//! budget to spare no sequence waits while one of lower priority runs.

use proptest::prelude::*;
use runtime::kv::cache_row;
use runtime::serving::{
    NgramConfig, Scheduler, SchedulerConfig, SchedulingPolicy, SeqId, StateCacheConfig, Work, FORCED_DRAFTS_MOST,
};
use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone)]
enum Action {
    /// A prompt: the first `shared` tokens of one of a few common prefixes, then its own tail.
    Add {
        family: u32,
        shared: usize,
        tail: usize,
        max_tokens: usize,
        /// Computing every prompt position (`compute_whole_prompt`).
        whole_prompt: bool,
        /// Its priority (the priority policy's order; lower first).
        priority: i32,
    },
    Step {
        stop: bool,
        /// How many of a work's drafted tokens the "model" agrees with.
        accept: usize,
    },
    Abort(usize),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        (0u32..3, 0usize..24, 0usize..16, 1usize..20, 0u8..4, -1i32..2).prop_map(
            |(family, shared, tail, max_tokens, whole, priority)| Action::Add {
                family,
                shared,
                tail,
                max_tokens,
                whole_prompt: whole == 0,
                priority,
            }
        ),
        (any::<bool>(), 0usize..4).prop_map(|(stop, accept)| Action::Step { stop, accept }),
        (0usize..64).prop_map(Action::Abort),
    ]
}

/// Tokens come from a four-letter alphabet, so equal blocks after different prefixes are
/// common: a cache keyed by a block's tokens alone would hand out the wrong keys and values.
fn prompt(family: u32, shared: usize, tail: usize, salt: u32) -> Vec<u32> {
    let letter = |x: u32| x.wrapping_mul(2_654_435_761) >> 30;
    let common = (0..shared as u32).map(|t| letter(family * 1000 + t / 2));
    let own = (0..tail as u32).map(|t| letter(salt * 1000 + t));
    let mut p: Vec<u32> = common.chain(own).collect();
    if p.is_empty() {
        p.push(1);
    }
    p
}

/// The tests' stand-in for the KV cache: per cache row, the token prefix whose last position
/// was computed into it (a key and value are a function of exactly that).
#[derive(Default)]
struct SimulatedKv {
    rows: HashMap<usize, Vec<u32>>,
    /// Every sequence's tokens so far (prompt and sampled).
    tokens: HashMap<SeqId, Vec<u32>>,
    /// Per state slot, the prefix its recurrent state has consumed (checked when `Some`).
    states: Option<HashMap<usize, Vec<u32>>>,
    /// Per snapshot place, the prefix its state had consumed when saved.
    snapshots: HashMap<usize, Vec<u32>>,
    /// Whether the backend saves a state only at the end of a work (a GPU plan).
    saves_at_ends: bool,
    /// Sequences computing their whole prompt: its length, and how far their works took it.
    whole_prompts: HashMap<SeqId, (usize, usize)>,
    /// Every sequence's priority.
    priorities: HashMap<SeqId, i32>,
}

impl SimulatedKv {
    /// For a model with recurrent state: states checked from the start.
    fn recurrent() -> Self {
        Self {
            states: Some(HashMap::new()),
            ..Default::default()
        }
    }

    /// Check what `w` reads, then write what it computes (its drafted tokens included).
    fn run(&mut self, w: &Work, block_size: usize) {
        let known = &self.tokens[&w.seq];
        let own = w.end - w.drafts;
        assert_eq!(&known[w.start..own], &w.tokens[..own - w.start]);
        if w.drafts > 0 {
            assert_eq!(own, known.len(), "drafts follow the sequence's last token: {w:?}");
        }
        if let Some((len, reached)) = self.whole_prompts.get_mut(&w.seq) {
            if w.start < *len {
                assert!(
                    w.start == 0 || w.start == *reached,
                    "{w:?} computes its whole prompt, yet starts at {} (its prompt reached {reached})",
                    w.start
                );
                *reached = w.end.min(*len);
            }
        }
        let tokens: Vec<u32> = known[..w.start].iter().chain(&w.tokens).copied().collect();
        let tokens = &tokens;
        for pos in 0..w.start {
            let row = cache_row(&w.table, block_size, pos);
            assert_eq!(
                self.rows.get(&row).map(Vec::as_slice),
                Some(&tokens[..=pos]),
                "{:?} reads position {pos} from row {row}, which holds another prefix",
                w.seq
            );
        }
        for pos in w.start..w.end {
            self.rows
                .insert(cache_row(&w.table, block_size, pos), tokens[..=pos].to_vec());
        }
        if let Some(states) = &mut self.states {
            // A backend starts the slot afresh at position 0, from the snapshot it restores,
            // else continues it.
            let state = states.entry(w.state_slot).or_default();
            match w.restore {
                Some(place) => state.clone_from(&self.snapshots[&place]),
                None if w.start == 0 => state.clear(),
                None => {}
            }
            assert_eq!(
                state.as_slice(),
                &tokens[..w.start],
                "{:?} continues state slot {} from another prefix",
                w.seq,
                w.state_slot
            );
            state.extend_from_slice(&w.tokens);
            for save in &w.saves {
                assert!(w.start < save.positions && save.positions <= own, "{w:?}");
                assert!(
                    !self.saves_at_ends || (save.positions == w.end && w.drafts == 0),
                    "{w:?}"
                );
                self.snapshots.insert(save.snapshot, tokens[..save.positions].to_vec());
            }
        } else {
            assert!(w.restore.is_none() && w.saves.is_empty(), "no recurrent state: {w:?}");
        }
    }

    /// As a backend's `rewind_state`: the slot's state without the last `sampled_rows − kept`
    /// rows it consumed.
    fn rewind_state(&mut self, slot: usize, sampled_rows: usize, kept: usize) {
        if let Some(state) = self.states.as_mut().and_then(|states| states.get_mut(&slot)) {
            state.truncate(state.len() - (sampled_rows - kept));
        }
    }
}

/// Drafts offered for the next step as a draft model offers them, where `offer` is set: for
/// every sequence that may draft but a third of them, more tokens than it may carry.
fn offer_drafts(s: &mut Scheduler, offer: bool) -> Option<BTreeMap<SeqId, (usize, Vec<u32>)>> {
    if !offer {
        return None;
    }
    let offered: BTreeMap<SeqId, (usize, Vec<u32>)> = s
        .draft_requests()
        .iter()
        .inspect(|r| assert!(r.limit > 0 && !r.tokens.is_empty(), "{r:?}"))
        .filter(|r| r.seq.0 % 3 != 0)
        .map(|r| (r.seq, (r.limit, (0..r.limit as u32 + 2).map(|j| 40 + j).collect())))
        .collect();
    s.offer_drafts(offered.iter().map(|(id, (_, drafts))| (*id, drafts.clone())).collect());
    Some(offered)
}

/// Forced drafts offered for the next step, where `offer` is set: for every other known
/// sequence (running or not; the scheduler takes them only for decoding ones), more than any
/// sequence may carry.
fn offer_forced_drafts(s: &mut Scheduler, kv: &SimulatedKv, offer: bool) -> BTreeMap<SeqId, Vec<u32>> {
    if !offer {
        return BTreeMap::new();
    }
    let forced: BTreeMap<SeqId, Vec<u32>> = kv
        .tokens
        .keys()
        .filter(|id| id.0 % 2 == 0)
        .map(|&id| (id, (0..FORCED_DRAFTS_MOST as u32 + 3).map(|j| 60 + j).collect()))
        .collect();
    s.offer_forced_drafts(forced.clone());
    forced
}

#[allow(clippy::too_many_arguments)]
fn run_step(
    s: &mut Scheduler,
    kv: &mut SimulatedKv,
    stop: bool,
    accept: usize,
    config: &SchedulerConfig,
    offer: bool,
    force: bool,
) -> usize {
    let offered = offer_drafts(s, offer);
    let forced = offer_forced_drafts(s, kv, force);
    let schedule = s.schedule();
    // Under the priority policy, whoever was preempted (and not given work again) comes
    // after everyone given work, in (priority, arrival) order.
    if s.policy() == SchedulingPolicy::Priority {
        let key = |id: &SeqId| (kv.priorities[id], *id);
        for victim in schedule
            .preempted
            .iter()
            .filter(|v| !schedule.work.iter().any(|w| w.seq == **v))
        {
            for w in &schedule.work {
                assert!(
                    key(&w.seq) < key(victim),
                    "{:?} ran while {victim:?} was preempted",
                    w.seq
                );
            }
        }
    }
    // Offered drafts are carried as offered, cut to what the sequence may carry; a sequence
    // offered none carries none.
    for w in schedule.work.iter().filter(|w| w.drafts > 0) {
        assert!(
            w.drafts <= s.draft_cap(),
            "{w:?} carries more than the cap {}",
            s.draft_cap()
        );
        if w.forced {
            let drafts = forced.get(&w.seq).expect("forced drafts only where offered");
            assert!(w.drafts <= FORCED_DRAFTS_MOST, "{w:?}");
            assert_eq!(w.drafted(), &drafts[..w.drafts]);
            continue;
        }
        if let Some(offered) = &offered {
            let (limit, drafts) = offered.get(&w.seq).expect("drafts only where offered");
            assert!(w.drafts <= *limit, "{w:?} carries more than its limit {limit}");
            assert_eq!(w.drafted(), &drafts[..w.drafts]);
        }
    }
    let scheduled: usize = schedule.work.iter().map(|w| w.end - w.start).sum();
    assert!(
        scheduled <= config.token_budget,
        "{scheduled} tokens scheduled over a budget of {}",
        config.token_budget
    );
    // Under the priority policy, a step with budget to spare admitted every waiting sequence
    // of higher priority than a running one, preempting as it had to.
    if s.policy() == SchedulingPolicy::Priority && scheduled < config.token_budget {
        let (s, kv) = (&*s, &*kv);
        let priorities = |running: bool| {
            kv.tokens
                .keys()
                .filter(move |id| s.is_running(**id) == running)
                .map(|id| kv.priorities[id])
        };
        if let (Some(lowest_running), Some(highest_waiting)) = (priorities(true).max(), priorities(false).min()) {
            assert!(
                highest_waiting >= lowest_running,
                "priority {highest_waiting} waits while {lowest_running} runs"
            );
        }
    }
    // Every restore reads what the snapshot held before the step.
    let saved: Vec<usize> = schedule
        .work
        .iter()
        .flat_map(|w| w.saves.iter().map(|s| s.snapshot))
        .collect();
    for w in &schedule.work {
        assert!(
            w.restore.is_none_or(|place| !saved.contains(&place)),
            "{w:?} restores a place saved into"
        );
    }
    let mut finished = 0;
    for w in &schedule.work {
        // Only running sequences have work: a preempted one's is withdrawn.
        assert!(s.is_running(w.seq), "{w:?} is for a sequence not running");
        // Computes at least one token, even when the whole prompt was cached.
        assert!(w.start < w.end && w.tokens.len() == w.end - w.start, "{w:?}");
        kv.run(w, config.block_size);
        assert!(
            w.drafts == 0 || ((config.speculation.is_on() || w.forced) && w.samples && w.end - w.drafts - w.start == 1)
        );
        // Token 7 is the stop token; `stop` decides whether this step emits it after the
        // drafts it accepts.
        if complete(s, kv, w, accept, if stop { 7 } else { 3 }) {
            finished += 1;
        }
    }
    finished
}

/// Record that `w` ran and, where it samples, accepted `accept` of its drafts and then chose
/// `token`; whether its sequence finished.
fn complete(s: &mut Scheduler, kv: &mut SimulatedKv, w: &Work, accept: usize, token: u32) -> bool {
    let mut sampled: Vec<u32> = w.tokens[w.tokens.len() - w.drafts..]
        .iter()
        .take(accept)
        .copied()
        .collect();
    sampled.push(token);
    let sampled = if w.samples { sampled } else { Vec::new() };
    let (taken, done) = s.complete(w, &sampled);
    // As the engine does: refused drafts are taken back out of the state.
    if taken > 0 && w.drafts > 0 {
        kv.rewind_state(w.state_slot, w.drafts + 1, w.accepted(taken) + 1);
    }
    match done {
        Some(_) => {
            kv.tokens.remove(&w.seq);
            true
        }
        None => {
            let tokens = kv.tokens.get_mut(&w.seq).expect("running");
            tokens.extend_from_slice(&sampled[..taken]);
            false
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn blocks_never_leak_and_invariants_hold(
        blocks in 4usize..16,
        block_size in 2usize..8,
        budget in 1usize..24,
        prefix_caching in any::<bool>(),
        drafts in 0usize..4,
        offer in any::<bool>(),
        force in any::<bool>(),
        recurrent_state in any::<bool>(),
        snapshots in 0usize..4,
        interval in 1usize..12,
        at_segment_ends in any::<bool>(),
        by_priority in any::<bool>(),
        draft_cap in proptest::option::of(0usize..3),
        actions in proptest::collection::vec(action(), 1..120),
    ) {
        let speculation = NgramConfig { tokens: drafts, min: 1, max: 3 };
        let config = SchedulerConfig {
            max_waiting: 8,
            max_running: 4,
            token_budget: budget,
            kv_blocks: blocks,
            block_size,
            context_length: 64,
            prefix_caching,
            speculation,
            recurrent_state,
            state_cache: StateCacheConfig { capacity: snapshots, interval, at_segment_ends },
        };
        let mut s = Scheduler::new(config);
        if by_priority {
            prop_assert!(s.set_policy(SchedulingPolicy::Priority));
        }
        if let Some(most) = draft_cap {
            s.cap_drafts(most);
        }
        let mut kv = SimulatedKv {
            states: recurrent_state.then(HashMap::new),
            saves_at_ends: at_segment_ends,
            ..Default::default()
        };
        let mut ids: Vec<SeqId> = Vec::new();
        for (salt, a) in actions.into_iter().enumerate() {
            match a {
                Action::Add { family, shared, tail, max_tokens, whole_prompt, priority } => {
                    let p = prompt(family, shared, tail, salt as u32);
                    if let Ok(id) = s.add_with_priority(p.clone(), max_tokens, vec![7], priority) {
                        kv.priorities.insert(id, priority);
                        if whole_prompt {
                            prop_assert!(s.compute_whole_prompt(id));
                            kv.whole_prompts.insert(id, (p.len(), 0));
                        }
                        kv.tokens.insert(id, p);
                        ids.push(id);
                    }
                }
                Action::Step { stop, accept } => {
                    run_step(&mut s, &mut kv, stop, accept, &config, offer, force);
                }
                Action::Abort(i) => {
                    if let Some(&id) = ids.get(i % ids.len().max(1)) {
                        s.abort(id);
                        kv.tokens.remove(&id);
                    }
                }
            }
            prop_assert_eq!(s.check(), Ok(()));
        }
        // Everything still queued completes: no livelock, and every block comes back.
        let mut steps = 0;
        while !s.is_idle() {
            run_step(&mut s, &mut kv, false, 1, &config, offer, force);
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
        prefix_caching: true,
        speculation: runtime::serving::NgramConfig::OFF,
        recurrent_state: false,
        state_cache: runtime::serving::StateCacheConfig::OFF,
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
        prefix_caching: true,
        speculation: runtime::serving::NgramConfig::OFF,
        recurrent_state: false,
        state_cache: runtime::serving::StateCacheConfig::OFF,
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
            let sampled = if w.samples { vec![9] } else { Vec::new() };
            if let (_, Some(done)) = s.complete(w, &sampled) {
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

/// Under the priority policy a waiting request of strictly higher priority preempts a running
/// one that keeps it out, whether by the running limit or by the cache; one of equal priority
/// waits its turn.
#[test]
fn a_waiting_request_of_higher_priority_preempts_a_running_one_of_lower() {
    for (max_running, kv_blocks) in [(1, 8), (2, 2)] {
        let config = SchedulerConfig {
            max_waiting: 8,
            max_running,
            token_budget: 16,
            kv_blocks,
            block_size: 4,
            context_length: 32,
            prefix_caching: false,
            speculation: runtime::serving::NgramConfig::OFF,
            recurrent_state: false,
            state_cache: runtime::serving::StateCacheConfig::OFF,
        };
        let mut s = Scheduler::new(config);
        assert!(s.set_policy(SchedulingPolicy::Priority));
        let step = |s: &mut Scheduler| {
            let schedule = s.schedule();
            for w in &schedule.work {
                s.complete(w, if w.samples { &[9] } else { &[] });
            }
            s.check().unwrap();
            schedule
        };
        // Running with all the cache (two blocks of 4: 5 prompt tokens and 2 generated).
        let low = s.add_with_priority(vec![1; 5], 3, vec![], 5).unwrap();
        step(&mut s);
        let equal = s.add_with_priority(vec![2; 5], 3, vec![], 5).unwrap();
        let schedule = step(&mut s);
        assert!(schedule.preempted.is_empty() && s.is_running(low) && !s.is_running(equal));
        let high = s.add_with_priority(vec![3; 5], 3, vec![], 1).unwrap();
        let schedule = step(&mut s);
        assert_eq!(
            schedule.preempted,
            [low],
            "max_running {max_running}, {kv_blocks} blocks"
        );
        assert_eq!(schedule.work.iter().map(|w| w.seq).collect::<Vec<_>>(), [high]);
        assert!(s.is_running(high) && !s.is_running(low));
    }
}

#[test]
fn a_cached_prefix_is_reused_but_the_last_prompt_token_is_always_computed() {
    let config = SchedulerConfig {
        max_waiting: 8,
        max_running: 4,
        token_budget: 64,
        kv_blocks: 16,
        block_size: 4,
        context_length: 64,
        prefix_caching: true,
        speculation: runtime::serving::NgramConfig::OFF,
        recurrent_state: false,
        state_cache: runtime::serving::StateCacheConfig::OFF,
    };
    let mut s = Scheduler::new(config);
    let mut kv = SimulatedKv::default();
    let prompt: Vec<u32> = (1..=8).collect();
    let first_work = |s: &mut Scheduler, kv: &mut SimulatedKv, prompt: Vec<u32>| {
        let id = s.add(prompt.clone(), 2, vec![]).unwrap();
        kv.tokens.insert(id, prompt);
        let work = s.schedule().work.into_iter().find(|w| w.seq == id).unwrap();
        let span = (work.start, work.end);
        kv.run(&work, config.block_size);
        complete(s, kv, &work, 0, 3);
        while !s.is_idle() {
            run_step(s, kv, false, 0, &config, false, false);
        }
        span
    };
    assert_eq!(
        first_work(&mut s, &mut kv, prompt.clone()),
        (0, 8),
        "nothing cached yet"
    );
    // The same 8 tokens: both blocks are cached, but the last token must be computed, so only
    // the first block is taken from the cache.
    assert_eq!(first_work(&mut s, &mut kv, prompt.clone()), (4, 8));
    // One token more: both blocks come from the cache.
    let longer: Vec<u32> = (1..=9).collect();
    assert_eq!(first_work(&mut s, &mut kv, longer), (8, 9));
    // A different first token shares nothing, even though later blocks repeat.
    let other: Vec<u32> = [99].into_iter().chain(2..=9).collect();
    assert_eq!(first_work(&mut s, &mut kv, other), (0, 9));
    let stats = s.prefix_cache_stats();
    assert_eq!((stats.queried, stats.hit), (8 + 8 + 9 + 9, 4 + 8));
    assert_eq!(s.used_blocks(), 0);
    assert!(s.cached_blocks() > 0);
    s.check().unwrap();
}

/// A model with recurrent state: a sequence saves a snapshot at every multiple of the interval
/// it computes, and a later one sharing its prefix starts from the deepest snapshot within
/// what it shares (restoring it), not from every cached block; without snapshots it starts
/// from position 0.
#[test]
fn a_recurrent_model_starts_from_the_deepest_snapshot_of_its_cached_prefix() {
    let config = |capacity| SchedulerConfig {
        max_waiting: 8,
        max_running: 2,
        token_budget: 64,
        kv_blocks: 32,
        block_size: 4,
        context_length: 64,
        prefix_caching: true,
        speculation: runtime::serving::NgramConfig::OFF,
        recurrent_state: true,
        state_cache: StateCacheConfig::every(8, capacity),
    };
    // The first work of `prompt` run to completion: its span, what it restores, the positions
    // it saves after.
    let first_work = |s: &mut Scheduler, kv: &mut SimulatedKv, prompt: Vec<u32>| {
        let id = s.add(prompt.clone(), 1, vec![]).unwrap();
        kv.tokens.insert(id, prompt);
        let work = s.schedule().work.into_iter().find(|w| w.seq == id).unwrap();
        kv.run(&work, 4);
        complete(s, kv, &work, 0, 3);
        s.check().unwrap();
        let saves: Vec<usize> = work.saves.iter().map(|save| save.positions).collect();
        ((work.start, work.end), work.restore.is_some(), saves)
    };
    let prompt: Vec<u32> = (1..=21).collect();
    let mut s = Scheduler::new(config(4));
    let mut kv = SimulatedKv::recurrent();
    assert_eq!(
        first_work(&mut s, &mut kv, prompt.clone()),
        ((0, 21), false, vec![8, 16])
    );
    assert_eq!(s.state_snapshots(), 2);
    // 20 tokens shared: five cached blocks, but the state only as far as 16.
    let mut again = prompt.clone();
    again[20] = 99;
    assert_eq!(first_work(&mut s, &mut kv, again), ((16, 21), true, vec![]));
    // 13 shared: from the snapshot at 8; it saves its own at 16 (another prefix).
    let diverging: Vec<u32> = (1..=13).chain(50..60).collect();
    assert_eq!(first_work(&mut s, &mut kv, diverging), ((8, 23), true, vec![16]));
    assert_eq!(s.state_snapshots(), 3);
    let stats = s.prefix_cache_stats();
    assert_eq!(stats.hit, 16 + 8);

    // No snapshots kept: nothing is shared.
    let mut s = Scheduler::new(config(0));
    let mut kv = SimulatedKv::recurrent();
    assert_eq!(first_work(&mut s, &mut kv, prompt.clone()), ((0, 21), false, vec![]));
    assert_eq!(first_work(&mut s, &mut kv, prompt.clone()), ((0, 21), false, vec![]));
    assert_eq!(s.prefix_cache_stats().hit, 0);

    // Asked for more snapshots than there are blocks: as many as blocks, nothing allocated
    // for the rest.
    let mut s = Scheduler::new(config(usize::MAX));
    let mut kv = SimulatedKv::recurrent();
    assert_eq!(
        first_work(&mut s, &mut kv, prompt.clone()),
        ((0, 21), false, vec![8, 16])
    );
    assert_eq!(first_work(&mut s, &mut kv, prompt), ((16, 21), true, vec![]));
}
