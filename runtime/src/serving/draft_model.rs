//! Drafting with a second, smaller model (vLLM's draft-model speculative decoding): for each
//! decoding sequence the draft model continues the sequence's tokens greedily for a few
//! tokens, and the serving engine verifies them in the target's next step, keeping those the
//! target samples itself (so the output is the target's, whatever the draft model says).
//!
//! The draft model keeps its own paged KV cache, in blocks of its own, per sequence: what it
//! holds is the tokens it has computed, which after a step are the sequence's tokens up to
//! the first draft the target refused, so each proposal computes only the tokens since then
//! (the accepted drafts' positions are already there) and a new sequence's whole prompt once.
//! Its proposals are batched: one pass over every sequence's catch-up (within a token budget:
//! a long new prompt goes through it over several steps, drafting nothing until it is done),
//! then one pass per drafted token over every sequence still drafting.

use super::block_manager::BlockManager;
use super::engine::PagedBackend;
use super::scheduler::{DraftRequest, SeqId};
use crate::error::{Result, RuntimeError};
use crate::kv::{BlockId, Segment, StateSnapshots};
use std::collections::{BTreeMap, HashMap};

/// What the serving engine asks of a drafter.
pub trait Drafter: Send {
    /// Up to each request's `limit` tokens to follow its `tokens`, by sequence; a sequence
    /// may get fewer or none (out of room).
    fn propose(&mut self, requests: &[DraftRequest<'_>]) -> Result<BTreeMap<SeqId, Vec<u32>>>;
    /// Let go of what it keeps for sequences `keep` says are gone.
    fn retain(&mut self, keep: &mut dyn FnMut(SeqId) -> bool);
}

/// A draft model on a paged backend, with the cache it keeps per sequence.
pub struct DraftModel<B: PagedBackend> {
    backend: B,
    pages: B::Pages,
    /// Its cache's blocks (none registered: it shares no prefixes; low ids and released ones
    /// first, so the pages grow only to the most ever held at once).
    blocks: BlockManager,
    /// Tokens a pass computes at most (catch-up chunks are cut to it).
    token_budget: usize,
    context_length: usize,
    seqs: HashMap<SeqId, DraftSeq>,
}

/// A sequence's share of the draft model's cache.
#[derive(Default)]
struct DraftSeq {
    table: Vec<BlockId>,
    /// The tokens whose keys and values its blocks hold, in order from position 0.
    computed: Vec<u32>,
}

/// One sequence's proposal in the making.
struct Proposal<'a> {
    seq: SeqId,
    tokens: &'a [u32],
    limit: usize,
    drafts: Vec<u32>,
}

impl<B: PagedBackend> DraftModel<B> {
    /// A drafter over `backend` (a model without recurrent state: a refused draft's keys and
    /// values lie past the kept positions and are overwritten, where a recurrent state would
    /// have to be rewound), holding at most `blocks` cache blocks of `block_size` positions,
    /// computing at most `token_budget` tokens a pass, over contexts of `context_length`.
    pub fn new(
        backend: B,
        blocks: usize,
        block_size: usize,
        token_budget: usize,
        context_length: usize,
    ) -> Result<Self> {
        if backend.has_recurrent_state() {
            return Err(RuntimeError::Graph(
                "a draft model with recurrent layers (Gated DeltaNet) is not supported: its state cannot be rewound past refused drafts"
                    .into(),
            ));
        }
        if block_size == 0 || blocks == 0 || token_budget == 0 {
            return Err(RuntimeError::Graph(
                "a draft model needs blocks, a block size and a token budget".into(),
            ));
        }
        let token_budget = backend
            .max_step_tokens()
            .map_or(token_budget, |most| token_budget.min(most));
        Ok(Self {
            pages: backend.new_pages(block_size),
            backend,
            blocks: BlockManager::new(blocks, block_size),
            token_budget,
            context_length,
            seqs: HashMap::new(),
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Blocks held by sequences now.
    pub fn used_blocks(&self) -> usize {
        self.blocks.used_blocks()
    }

    /// Run one pass over `segments` (sequence, first position, tokens); each one's greedy
    /// token after its last row.
    fn pass(&mut self, segments: &[(SeqId, usize, Vec<u32>)]) -> Result<Vec<u32>> {
        let batch: Vec<Segment> = segments
            .iter()
            .enumerate()
            .map(|(i, (id, start, ids))| Segment {
                table: &self.seqs[id].table,
                start: *start,
                ids,
                // The model keeps no state (checked at `new`); slots still differ in a step,
                // as a GPU plan's step inputs expect.
                state_slot: i,
                sampled_rows: 1,
                drafts: 0,
                snapshots: StateSnapshots::NONE,
            })
            .collect();
        if let Some(tokens) = self.backend.step_batch_greedy(&mut self.pages, &batch) {
            return tokens?
                .into_iter()
                .map(|t| t.last().copied().ok_or_else(|| missing("a greedy token")))
                .collect();
        }
        let outputs = self.backend.step_batch(&mut self.pages, &batch)?;
        if outputs.len() != segments.len() {
            return Err(missing("a result per segment"));
        }
        outputs
            .iter()
            .map(|out| {
                let logits = out.get("logits").ok_or_else(|| missing("the `logits` output"))?;
                let rows = logits.rows();
                match rows {
                    0 => Err(missing("a row of logits")),
                    _ => Ok(crate::sampling::argmax(logits.row(rows - 1))),
                }
            })
            .collect()
    }

    /// One pass bringing proposals' sequences up to their last token, which gives each its
    /// first draft: what each cache lacks, in running order, as far as the token budget goes.
    /// A sequence it does not bring all the way (a long new prompt) drafts nothing this step
    /// and goes on from there in the next, so no step waits on more than a budget's worth of
    /// the draft model's prefill.
    fn catch_up(&mut self, proposals: &mut [Proposal<'_>]) -> Result<()> {
        let mut budget = self.token_budget;
        let mut segments = Vec::new();
        let mut finishing = Vec::new();
        for (i, p) in proposals.iter().enumerate() {
            let done = self.seqs[&p.seq].computed.len();
            if budget == 0 {
                break;
            }
            let end = p.tokens.len().min(done + budget);
            budget -= end - done;
            segments.push((p.seq, done, p.tokens[done..end].to_vec()));
            finishing.push((i, end == p.tokens.len()));
        }
        if segments.is_empty() {
            return Ok(());
        }
        let tokens = self.pass(&segments)?;
        for (((i, last), (id, _, ids)), token) in finishing.into_iter().zip(&segments).zip(tokens) {
            self.seqs.get_mut(id).expect("proposing").computed.extend(ids);
            if last {
                proposals[i].drafts.push(token);
            }
        }
        Ok(())
    }

    /// Extend every proposal short of its limit by one token: its last draft computed.
    fn extend(&mut self, proposals: &mut [Proposal<'_>]) -> Result<bool> {
        let growing: Vec<usize> = (0..proposals.len())
            .filter(|&i| !proposals[i].drafts.is_empty() && proposals[i].drafts.len() < proposals[i].limit)
            .collect();
        if growing.is_empty() {
            return Ok(false);
        }
        let segments: Vec<(SeqId, usize, Vec<u32>)> = growing
            .iter()
            .map(|&i| {
                let p = &proposals[i];
                let at = p.tokens.len() + p.drafts.len() - 1;
                (p.seq, at, vec![*p.drafts.last().expect("drafting")])
            })
            .collect();
        let tokens = self.pass(&segments)?;
        for ((i, (id, _, ids)), token) in growing.into_iter().zip(&segments).zip(tokens) {
            self.seqs.get_mut(id).expect("proposing").computed.extend(ids);
            proposals[i].drafts.push(token);
        }
        Ok(true)
    }
}

impl<B: PagedBackend + Send> Drafter for DraftModel<B>
where
    B::Pages: Send,
{
    fn propose(&mut self, requests: &[DraftRequest<'_>]) -> Result<BTreeMap<SeqId, Vec<u32>>> {
        let mut proposals = Vec::new();
        for r in requests {
            if r.limit == 0 || r.tokens.is_empty() {
                continue;
            }
            let seq = self.seqs.entry(r.seq).or_default();
            // What the cache holds of these tokens; the last token is always computed again,
            // as its row gives the first draft.
            let kept = common_prefix(&seq.computed, r.tokens).min(r.tokens.len() - 1);
            seq.computed.truncate(kept);
            // Positions up to the last draft but one (the last is never computed).
            let limit = r.limit.min(self.context_length.saturating_sub(r.tokens.len()));
            // Where the blocks are not to be had, no drafts (the table stays as it was).
            if limit == 0 || self.blocks.grow(&mut seq.table, r.tokens.len() + limit - 1).is_err() {
                continue;
            }
            proposals.push(Proposal {
                seq: r.seq,
                tokens: r.tokens,
                limit,
                drafts: Vec::new(),
            });
        }
        self.catch_up(&mut proposals)?;
        while self.extend(&mut proposals)? {}
        Ok(proposals.into_iter().map(|p| (p.seq, p.drafts)).collect())
    }

    fn retain(&mut self, keep: &mut dyn FnMut(SeqId) -> bool) {
        let gone: Vec<SeqId> = self.seqs.keys().copied().filter(|&id| !keep(id)).collect();
        for id in gone {
            let mut seq = self.seqs.remove(&id).expect("listed");
            self.blocks.release(&mut seq.table);
        }
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn missing(what: &str) -> RuntimeError {
    RuntimeError::Graph(format!("the draft model's step returned no {what}"))
}
