//! The serving engine on a backend of its own, with no model, compiler, GPU or HTTP server:
//! a "history model" whose next token is a function of every token the KV cache holds for the
//! sequence up to the row, read back through the sequence's block table. A step sees exactly
//! what the blocks hold, so a table pointing at another sequence's block, a prefix-cache hit
//! on blocks that do not hold the prefix, or a preempted sequence not recomputed all change
//! the tokens. It mostly continues what followed the last token's previous occurrence (as
//! an induction head does), so prompt-lookup drafts are often accepted and sometimes refused.
//!
//! Requests in flight together, under a KV budget that forces preemption, sharing prefixes,
//! drafting, and aborted, each generate what greedy decoding of the model alone gives.

use runtime::kv::{BlockId, Segment};
use runtime::serving::{NgramConfig, PagedBackend, SchedulerConfig, SeqId, ServingEngine, StateCacheConfig};
use runtime::{Result, RuntimeError, SamplingParams};
use std::collections::HashMap;

const VOCAB: usize = 64;

/// FNV-1a over the tokens, then one more mix with `salt`.
fn hash(tokens: &[u32], salt: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &t in tokens {
        h = (h ^ t as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h ^ salt).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 16
}

/// The history model's next token: what followed the last token's previous occurrence, three
/// times in four, else a token of the history's hash.
fn next_token(history: &[u32]) -> u32 {
    let (last, before) = history.split_last().expect("a position has a token");
    let repeat = before.iter().rposition(|t| t == last).map(|q| history[q + 1]);
    match repeat {
        Some(t) if !hash(history, 1).is_multiple_of(4) => t,
        _ => (hash(history, 2) % VOCAB as u64) as u32,
    }
}

/// Logits whose greedy choice is `next_token`: 10 there, below 9 elsewhere.
fn logits(history: &[u32]) -> Vec<f32> {
    let next = next_token(history) as usize;
    (0..VOCAB)
        .map(|j| match j == next {
            true => 10.0,
            false => (hash(history, 3 + j as u64) % 900) as f32 / 100.0,
        })
        .collect()
}

/// Greedy decoding of the history model alone: the reference.
fn alone(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut tokens = prompt.to_vec();
    for _ in 0..max_tokens {
        let next = runtime::sampling::argmax(&logits(&tokens));
        tokens.push(next);
    }
    tokens[prompt.len()..].to_vec()
}

struct HistoryModel;

/// The KV cache: per block, the token each of its positions holds (`None`: never written).
struct Pages {
    block_size: usize,
    blocks: Vec<Vec<Option<u32>>>,
}

impl Pages {
    fn slot(&mut self, block: BlockId, offset: usize) -> &mut Option<u32> {
        let b = block.0 as usize;
        if self.blocks.len() <= b {
            self.blocks.resize(b + 1, vec![None; self.block_size]);
        }
        &mut self.blocks[b][offset]
    }
}

impl PagedBackend for HistoryModel {
    type Pages = Pages;

    fn new_pages(&self, block_size: usize) -> Pages {
        Pages {
            block_size,
            blocks: Vec::new(),
        }
    }

    fn samples_several_rows(&self) -> bool {
        true
    }

    fn verifies_drafts(&self) -> bool {
        true
    }

    /// Each segment's tokens written into its blocks, then its sampled rows' logits from the
    /// history its blocks hold.
    fn step_batch(&self, pages: &mut Pages, batch: &[Segment]) -> Result<Vec<HashMap<String, ir::Tensor>>> {
        let bs = pages.block_size;
        let block = |table: &[BlockId], position: usize| {
            table
                .get(position / bs)
                .copied()
                .ok_or_else(|| RuntimeError::Graph(format!("position {position} is past the block table")))
        };
        let mut outputs = Vec::new();
        for segment in batch {
            for (i, &id) in segment.ids.iter().enumerate() {
                let position = segment.start + i;
                *pages.slot(block(segment.table, position)?, position % bs) = Some(id);
            }
            let end = segment.start + segment.ids.len();
            let mut rows = Vec::new();
            for last in end - segment.sampled_rows..end {
                let history = (0..=last)
                    .map(|q| {
                        pages
                            .slot(block(segment.table, q)?, q % bs)
                            .ok_or_else(|| RuntimeError::Graph(format!("position {q} was never computed")))
                    })
                    .collect::<Result<Vec<u32>>>()?;
                rows.extend(logits(&history));
            }
            let tensor = ir::Tensor::new(vec![segment.sampled_rows, VOCAB], rows);
            outputs.push(HashMap::from([("logits".to_string(), tensor)]));
        }
        Ok(outputs)
    }
}

fn config(kv_blocks: usize, speculation: NgramConfig) -> SchedulerConfig {
    SchedulerConfig {
        max_waiting: 64,
        max_running: 8,
        token_budget: 48,
        kv_blocks,
        block_size: 4,
        context_length: 256,
        prefix_caching: true,
        speculation,
        recurrent_state: false,
        state_cache: StateCacheConfig::OFF,
    }
}

/// Step `engine` until it is idle, checking the scheduler's invariants after every step:
/// every finished sequence's tokens, whether all `blocks` of the KV pool were ever in use,
/// and the drafted and accepted tokens.
fn run_to_idle(
    engine: &mut ServingEngine<HistoryModel>,
    blocks: usize,
) -> (HashMap<SeqId, Vec<u32>>, bool, usize, usize) {
    let (mut got, mut full, mut drafted, mut accepted) = (HashMap::new(), false, 0, 0);
    while !engine.scheduler().is_idle() {
        let out = engine.step().unwrap();
        assert_eq!(engine.scheduler().check(), Ok(()));
        full |= engine.scheduler().used_blocks() == blocks;
        drafted += out.drafted;
        accepted += out.accepted;
        got.extend(out.finished.into_iter().map(|d| (d.seq, d.generated)));
    }
    (got, full, drafted, accepted)
}

/// Prompts of 5 to 38 tokens, with repeats for prompt lookup to find.
fn prompts() -> Vec<Vec<u32>> {
    (0..12u32)
        .map(|i| {
            (0..5 + 3 * i)
                .map(|j| (7 * i + 5 * (j % (3 + i % 4))) % VOCAB as u32)
                .collect()
        })
        .collect()
}

#[test]
fn requests_under_preemption_generate_what_they_generate_alone() {
    let max_tokens = 16;
    let prompts = prompts();
    for speculation in [
        NgramConfig::OFF,
        NgramConfig {
            tokens: 3,
            min: 1,
            max: 3,
        },
    ] {
        // 14 blocks of 4 positions: far fewer than 12 sequences of up to 54 positions need.
        let mut engine = ServingEngine::new(HistoryModel, config(14, speculation));
        let ids: Vec<SeqId> = prompts
            .iter()
            .map(|p| {
                engine
                    .add(p.clone(), max_tokens, vec![], SamplingParams::default())
                    .unwrap()
            })
            .collect();
        let (got, full, drafted, accepted) = run_to_idle(&mut engine, 14);
        assert!(full, "the KV pool was meant to run out");
        for (id, prompt) in ids.iter().zip(&prompts) {
            assert_eq!(got[id], alone(prompt, max_tokens), "{id:?} {speculation:?}");
        }
        if speculation.tokens > 0 {
            assert!(
                accepted > 0 && accepted < drafted,
                "{accepted} of {drafted} drafts accepted"
            );
        }
        assert_eq!(engine.scheduler().used_blocks(), 0);
    }
}

#[test]
fn requests_sharing_a_prefix_start_from_its_cached_blocks() {
    let max_tokens = 8;
    let prefix: Vec<u32> = (0..16).map(|j| (11 * j + 3) % VOCAB as u32).collect();
    let prompts: Vec<Vec<u32>> = (0..5u32)
        .map(|i| prefix.iter().copied().chain([i, i + 1, 2 * i]).collect())
        .collect();
    let mut engine = ServingEngine::new(HistoryModel, config(64, NgramConfig::OFF));
    // The first alone fills the cache; the others find its 16 positions there.
    let first = engine
        .add(prompts[0].clone(), max_tokens, vec![], SamplingParams::default())
        .unwrap();
    let (mut got, ..) = run_to_idle(&mut engine, 64);
    let others: Vec<SeqId> = prompts[1..]
        .iter()
        .map(|p| {
            engine
                .add(p.clone(), max_tokens, vec![], SamplingParams::default())
                .unwrap()
        })
        .collect();
    got.extend(run_to_idle(&mut engine, 64).0);
    for (id, prompt) in std::iter::once(&first).chain(&others).zip(&prompts) {
        assert_eq!(got[id], alone(prompt, max_tokens), "{id:?}");
    }
    assert!(engine.scheduler().prefix_cache_stats().hit >= 4 * 16);
}

#[test]
fn aborted_requests_free_their_blocks_and_leave_the_others_alone() {
    let max_tokens = 12;
    let prompts = prompts();
    let mut engine = ServingEngine::new(HistoryModel, config(64, NgramConfig::OFF));
    let ids: Vec<SeqId> = prompts
        .iter()
        .map(|p| {
            engine
                .add(p.clone(), max_tokens, vec![], SamplingParams::default())
                .unwrap()
        })
        .collect();
    for _ in 0..4 {
        engine.step().unwrap();
    }
    let before = engine.scheduler().used_blocks();
    for id in ids.iter().step_by(2) {
        assert!(engine.abort(*id));
    }
    assert!(engine.scheduler().used_blocks() < before);
    assert_eq!(engine.scheduler().check(), Ok(()));
    let (got, ..) = run_to_idle(&mut engine, 64);
    for (i, (id, prompt)) in ids.iter().zip(&prompts).enumerate() {
        match i % 2 {
            0 => assert!(!got.contains_key(id), "{id:?} was aborted"),
            _ => assert_eq!(got[id], alone(prompt, max_tokens), "{id:?}"),
        }
    }
    assert_eq!(engine.scheduler().used_blocks(), 0);
}

/// A request that asks for its logits gets, with each token, the row it was sampled from;
/// one that does not gets none.
#[test]
fn logits_come_back_with_the_tokens_of_a_request_that_asks() {
    let prompt: Vec<u32> = vec![3, 9, 3, 9, 4];
    let mut engine = ServingEngine::new(HistoryModel, config(16, NgramConfig::OFF));
    let asking = engine
        .add(prompt.clone(), 6, vec![], SamplingParams::default())
        .unwrap();
    let other = engine
        .add(prompt.clone(), 6, vec![], SamplingParams::default())
        .unwrap();
    assert!(engine.return_logits(asking));
    let mut history = prompt.clone();
    let mut rows = 0;
    while !engine.scheduler().is_idle() {
        for sampled in engine.step().unwrap().tokens {
            match sampled.seq == asking {
                true => {
                    assert_eq!(sampled.logits.as_deref(), Some(&logits(&history)[..]));
                    history.push(sampled.token);
                    rows += 1;
                }
                false => assert_eq!((sampled.seq, sampled.logits), (other, None)),
            }
        }
    }
    assert_eq!(rows, 6);
    assert!(!engine.return_logits(asking), "a finished request returns nothing more");
}

/// With speculation limited to batches of at most two sequences (vLLM's
/// `disable_by_batch_size`), no step drafts while more run, the last sequences still draft
/// once the batch has shrunk, and every request generates what it generates alone.
#[test]
fn speculation_pauses_while_the_batch_is_larger_than_asked() {
    let prompts = prompts();
    // The first ten short, so that the last two run on alone.
    let max_tokens = |i: usize| if i < 10 { 8 } else { 40 };
    let speculation = NgramConfig {
        tokens: 3,
        min: 1,
        max: 3,
    };
    let drafted_with = |limit: Option<usize>| {
        // Room for every sequence: no preemption, so a step's batch only grows as it is made.
        let mut engine = ServingEngine::new(HistoryModel, config(256, speculation));
        if let Some(limit) = limit {
            engine.speculate_up_to(limit);
        }
        let ids: Vec<SeqId> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                engine
                    .add(p.clone(), max_tokens(i), vec![], SamplingParams::default())
                    .unwrap()
            })
            .collect();
        let (mut got, mut drafted) = (HashMap::new(), 0);
        while !engine.scheduler().is_idle() {
            let running = engine.scheduler().running();
            let out = engine.step().unwrap();
            if limit.is_some_and(|limit| running > limit) {
                assert_eq!(out.drafted, 0, "drafts in a step of more than {limit:?} sequences");
            }
            drafted += out.drafted;
            got.extend(out.finished.into_iter().map(|d| (d.seq, d.generated)));
        }
        for (i, (id, prompt)) in ids.iter().zip(&prompts).enumerate() {
            assert_eq!(got[id], alone(prompt, max_tokens(i)), "{id:?}, limit {limit:?}");
        }
        drafted
    };
    let (all, limited) = (drafted_with(None), drafted_with(Some(2)));
    assert!(limited > 0 && limited < all, "{limited} of {all} drafts");
}
