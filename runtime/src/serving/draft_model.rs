//! Drafting with a second, smaller model (vLLM's draft-model speculative decoding): for each
//! decoding sequence the draft model continues the sequence's tokens greedily for a few
//! tokens, and the serving engine verifies them in the target's next step, keeping those the
//! target samples itself (so the output is the target's, whatever the draft model says).
//!
//! The draft model keeps its own paged KV cache, in blocks of its own, per sequence: what it
//! holds is the tokens it has computed, which after a step are the sequence's tokens up to
//! the first draft the target refused, so each proposal computes only the tokens since then
//! (the accepted drafts' positions are already there) and a new sequence's prompt once. Its
//! cache is a prefix cache too: full blocks of a sequence's own tokens (never of drafts) are
//! registered, and a new sequence starts from the longest prefix cached, so a conversation's
//! next turn, or a request repeating a system prompt, computes only what is new to it.
//! Its proposals are batched: one pass over every sequence's catch-up (within a token budget:
//! a long new prompt goes through it over several steps, drafting nothing until it is done),
//! then one pass per drafted token over every sequence still drafting.
//!
//! A draft model with recurrent layers (a small Qwen3.5 drafting for a large one) also keeps
//! each sequence's state, in a slot of its own, which its drafts advance past the tokens the
//! target will keep. So the catch-up pass saves the state as it stands after the sequence's
//! tokens (a snapshot in the sequence's own place), and a proposal whose earlier drafts the
//! state has seen starts from that snapshot and computes the kept drafts again: a few
//! positions more than a model without state computes, in the same pass.

use super::block_manager::{BlockManager, Serial};
use super::engine::{PagedBackend, StateSnapshotting};
use super::scheduler::{DraftRequest, SeqId};
use crate::error::{Result, RuntimeError};
use crate::kv::{BlockId, Segment, StateSave, StateSnapshots};
use ir::Tensor;
use std::collections::{BTreeMap, HashMap};

/// What the serving engine asks of a drafter.
pub trait Drafter: Send {
    /// Up to each request's `limit` tokens to follow its `tokens`, by sequence; a sequence
    /// may get fewer or none (out of room).
    fn propose(&mut self, requests: &[DraftRequest<'_>]) -> Result<BTreeMap<SeqId, Vec<u32>>>;
    /// Let go of what it keeps for sequences `keep` says are gone.
    fn retain(&mut self, keep: &mut dyn FnMut(SeqId) -> bool);
    /// The output of the target's steps it reads (a multi-token prediction head reads the
    /// target's hidden states), where it reads one; the target's graph must then have it.
    fn reads_target_output(&self) -> Option<&'static str> {
        None
    }
    /// That output's rows for positions `first..first + rows.rows()` of sequence `seq`,
    /// which it now holds (its refused drafts' rows left out), after each step computing them.
    fn observe(&mut self, _seq: SeqId, _first: usize, _rows: &ir::Tensor) {}
}

/// What a drafter runs its passes on: its graph's backend with a paged cache of its own, the
/// most tokens a pass computes (catch-up is cut to it), and the contexts it drafts within.
pub(super) struct DraftRoom<B: PagedBackend> {
    pub backend: B,
    pub pages: B::Pages,
    /// The cache's blocks (low ids and released ones first, so the pages grow only to the
    /// most ever held at once).
    pub blocks: BlockManager,
    pub token_budget: usize,
    pub context_length: usize,
    /// What the drafter is, for errors ("a draft model").
    drafter: &'static str,
}

impl<B: PagedBackend> DraftRoom<B> {
    /// `blocks` blocks of `block_size` positions, passes of at most `token_budget` tokens
    /// (and what the backend takes in a step); `drafter` names it in the error where one of
    /// them is 0.
    pub fn new(
        backend: B,
        blocks: usize,
        block_size: usize,
        token_budget: usize,
        context_length: usize,
        drafter: &'static str,
    ) -> Result<Self> {
        if block_size == 0 || blocks == 0 || token_budget == 0 {
            return Err(RuntimeError::Graph(format!(
                "{drafter} needs blocks, a block size and a token budget"
            )));
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
            drafter,
        })
    }

    /// One pass over `batch`: each segment's outputs.
    pub fn step(&mut self, batch: &[Segment]) -> Result<Vec<HashMap<String, Tensor>>> {
        let outputs = self.backend.step_batch(&mut self.pages, batch)?;
        match outputs.len() == batch.len() {
            true => Ok(outputs),
            false => Err(self.missing("a result per segment")),
        }
    }

    /// One pass over `batch` giving each segment's greedy tokens (`next_token`) and the
    /// outputs in `also` in place of its logits, where the backend computes them itself
    /// ([`PagedBackend::step_batch_greedy`]); `None`, running nothing, where it does not.
    pub fn step_greedy(&mut self, batch: &[Segment], also: &[&str]) -> Result<Option<Vec<HashMap<String, Tensor>>>> {
        match self
            .backend
            .step_batch_greedy(&mut self.pages, batch, also)
            .transpose()?
        {
            Some(outputs) if outputs.len() != batch.len() => Err(self.missing("a result per segment")),
            outputs => Ok(outputs),
        }
    }

    /// Register the blocks of `table` that its first `positions` fill with `tokens`, past the
    /// ones `serials` already names (each block under the prefix before it); their serials
    /// appended to `serials`, a twin's where another block held that prefix first.
    pub fn register_blocks(&mut self, table: &[BlockId], serials: &mut Vec<Serial>, tokens: &[u32], positions: usize) {
        let block_size = self.blocks.block_size();
        for b in serials.len()..positions / block_size {
            let parent = serials.last().copied();
            let serial = self
                .blocks
                .register(table[b], parent, &tokens[b * block_size..(b + 1) * block_size]);
            serials.push(serial);
        }
    }

    /// The last row of a segment's output `name`.
    pub fn last_row<'o>(&self, outputs: &'o HashMap<String, Tensor>, name: &str) -> Result<&'o [f32]> {
        let t = outputs
            .get(name)
            .ok_or_else(|| self.missing(&format!("`{name}` output")))?;
        match t.rows() {
            0 => Err(self.missing(&format!("row of `{name}`"))),
            rows => Ok(t.row(rows - 1)),
        }
    }

    /// The error of a pass that returned no `what`.
    pub fn missing(&self, what: &str) -> RuntimeError {
        RuntimeError::Graph(format!("{}'s step returned no {what}", self.drafter))
    }
}

/// A draft model on a paged backend, with the cache it keeps per sequence (full blocks of
/// sequences' own tokens registered for its prefix cache).
pub struct DraftModel<B: PagedBackend> {
    room: DraftRoom<B>,
    seqs: HashMap<SeqId, DraftSeq>,
    /// Where the model keeps recurrent states: the most sequences it can keep them for at
    /// once (state slots, each with a snapshot place of the same number); `None` for a model
    /// without them.
    state_slots: Option<usize>,
}

/// A sequence's share of the draft model's cache.
struct DraftSeq {
    table: Vec<BlockId>,
    /// The registrations of its table's first blocks, in order (a model without recurrent
    /// state: those blocks hold the sequence's own tokens, never drafts, and never change).
    serials: Vec<Serial>,
    /// The tokens whose keys and values its blocks hold, in order from position 0 (and, for
    /// a model with recurrent state, which its slot's state has seen, exactly).
    computed: Vec<u32>,
    /// Its state slot, and its snapshot place: the lowest free when it came (slots differ
    /// within a step, as batched steps require).
    slot: usize,
    /// A model with recurrent state: the positions its snapshot holds the state after (where
    /// its last catch-up ended), and the greedy token that catch-up gave after them.
    saved: Option<(usize, u32)>,
}

/// One sequence's proposal in the making.
struct Proposal<'a> {
    seq: SeqId,
    tokens: &'a [u32],
    limit: usize,
    /// The first position its first pass computes, and whether its state starts there from
    /// the sequence's snapshot.
    start: usize,
    restore: bool,
    drafts: Vec<u32>,
}

/// Where a proposal starts.
#[derive(Debug, PartialEq, Eq)]
enum Resume {
    /// Catching up from position `start` (from the sequence's snapshot, where `restore`).
    CatchUp { start: usize, restore: bool },
    /// At the snapshot, which is where the tokens end, with the first draft it gave then:
    /// the drafting passes go on from it.
    Snapshot { first_draft: u32 },
}

/// One sequence's share of a drafting pass.
struct PassSegment {
    seq: SeqId,
    start: usize,
    ids: Vec<u32>,
    snapshots: PassSnapshots,
}

/// What a pass segment does with its sequence's snapshot place.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PassSnapshots {
    None,
    /// Save the state after the segment's last position.
    Save,
    /// Start from the snapshot.
    Restore,
    /// Start from the snapshot, and save after the last position.
    RestoreAndSave,
}

impl<B: PagedBackend> DraftModel<B> {
    /// A drafter over `backend`, holding at most `blocks` cache blocks of `block_size`
    /// positions, computing at most `token_budget` tokens a pass, over contexts of
    /// `context_length`. A model with recurrent state needs a backend that keeps snapshots of
    /// it (a GPU plan: a place per sequence, `keep_state_snapshots`).
    pub fn new(
        backend: B,
        blocks: usize,
        block_size: usize,
        token_budget: usize,
        context_length: usize,
    ) -> Result<Self> {
        let state_slots = match (backend.has_recurrent_state(), backend.snapshots_states()) {
            (false, _) => None,
            (true, StateSnapshotting::AfterAnyRow) => Some(backend.max_sequences().unwrap_or(usize::MAX)),
            (true, StateSnapshotting::AtSegmentEnds { places }) => {
                Some(backend.max_sequences().map_or(places, |slots| slots.min(places)))
            }
            (true, StateSnapshotting::None) => {
                return Err(RuntimeError::Graph(
                    "a draft model with recurrent layers (Gated DeltaNet) needs snapshots of its states, to undo the drafts the target refuses, and this backend keeps none"
                        .into(),
                ))
            }
        };
        Ok(Self {
            room: DraftRoom::new(
                backend,
                blocks,
                block_size,
                token_budget,
                context_length,
                "a draft model",
            )?,
            seqs: HashMap::new(),
            state_slots,
        })
    }

    pub fn backend(&self) -> &B {
        &self.room.backend
    }

    /// Blocks held by sequences now.
    pub fn used_blocks(&self) -> usize {
        self.room.blocks.used_blocks()
    }

    /// Whether the sequence has a share of the cache, given one in the lowest free slot if
    /// it had none (not where every slot a model with recurrent state has is taken). A new
    /// one starts from the longest cached prefix of `tokens` but their last (whose row gives
    /// the first draft, so it is always computed), where the model keeps no state.
    fn admit(&mut self, id: SeqId, tokens: &[u32]) -> bool {
        if self.seqs.contains_key(&id) {
            return true;
        }
        let taken: std::collections::HashSet<usize> = self.seqs.values().map(|s| s.slot).collect();
        let slot = (0..).find(|slot| !taken.contains(slot)).expect("a free slot");
        if self.state_slots.is_some_and(|slots| slot >= slots) {
            return false;
        }
        let mut table = Vec::new();
        let serials = match self.state_slots {
            None => self.room.blocks.share_prefix(&mut table, &tokens[..tokens.len() - 1]),
            Some(_) => Vec::new(),
        };
        let seq = DraftSeq {
            computed: tokens[..serials.len() * self.room.blocks.block_size()].to_vec(),
            table,
            serials,
            slot,
            saved: None,
        };
        self.seqs.insert(id, seq);
        true
    }

    /// After a catch-up of `tokens`: register the sequence's blocks that its own tokens
    /// (never drafts) now fill, but not one holding their last token, which a later proposal
    /// computes again (where the target's step left the sequence out).
    fn register_full_blocks(&mut self, id: SeqId, tokens: &[u32]) {
        if self.state_slots.is_some() {
            return;
        }
        let seq = self.seqs.get_mut(&id).expect("proposing");
        // A catch-up leaves the cache holding a prefix of `tokens` exactly.
        debug_assert!(tokens.starts_with(&seq.computed));
        let own = seq.computed.len().min(tokens.len() - 1);
        self.room.register_blocks(&seq.table, &mut seq.serials, tokens, own);
    }

    /// Run one pass over `segments`; each one's greedy token after its last row.
    fn pass(&mut self, segments: &[PassSegment]) -> Result<Vec<u32>> {
        let saves: Vec<[StateSave; 1]> = segments
            .iter()
            .map(|s| {
                [StateSave {
                    positions: s.start + s.ids.len(),
                    snapshot: self.seqs[&s.seq].slot,
                }]
            })
            .collect();
        let batch: Vec<Segment> = segments
            .iter()
            .zip(&saves)
            .map(|(s, save)| {
                let seq = &self.seqs[&s.seq];
                let snapshots = match s.snapshots {
                    PassSnapshots::None => StateSnapshots::NONE,
                    PassSnapshots::Save => StateSnapshots { restore: None, save },
                    PassSnapshots::Restore => StateSnapshots {
                        restore: Some(seq.slot),
                        save: &[],
                    },
                    PassSnapshots::RestoreAndSave => StateSnapshots {
                        restore: Some(seq.slot),
                        save,
                    },
                };
                Segment {
                    hidden_states: &[],
                    table: &seq.table,
                    start: s.start,
                    ids: &s.ids,
                    state_slot: seq.slot,
                    sampled_rows: 1,
                    drafts: 0,
                    snapshots,
                }
            })
            .collect();
        if let Some(outputs) = self.room.step_greedy(&batch, &[])? {
            return outputs
                .iter()
                .map(|out| Ok(super::engine::greedy_ids(out, 1)?[0]))
                .collect();
        }
        let outputs = self.room.step(&batch)?;
        outputs
            .iter()
            .map(|out| Ok(crate::sampling::argmax(self.room.last_row(out, "logits")?)))
            .collect()
    }

    /// One pass bringing proposals' sequences up to their last token, which gives each its
    /// first draft: what each cache lacks, in running order, as far as the token budget goes.
    /// A sequence it does not bring all the way (a long new prompt) drafts nothing this step
    /// and goes on from there in the next, so no step waits on more than a budget's worth of
    /// the draft model's prefill.
    fn catch_up(&mut self, proposals: &mut [Proposal<'_>]) -> Result<()> {
        let mut budget = self.room.token_budget;
        let mut segments = Vec::new();
        let mut finishing = Vec::new();
        for (i, p) in proposals.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if p.start == p.tokens.len() {
                continue; // resumed at its snapshot, its first draft known
            }
            let end = p.tokens.len().min(p.start + budget);
            budget -= end - p.start;
            let last = end == p.tokens.len();
            // The state where the sequence's tokens end, for the next proposal to go back to
            // once this one's drafts have moved it on.
            let snapshots = match (self.state_slots.is_some(), p.restore, last) {
                (false, _, _) => PassSnapshots::None,
                (true, true, _) => PassSnapshots::RestoreAndSave,
                (true, false, true) => PassSnapshots::Save,
                (true, false, false) => PassSnapshots::None,
            };
            segments.push(PassSegment {
                seq: p.seq,
                start: p.start,
                ids: p.tokens[p.start..end].to_vec(),
                snapshots,
            });
            finishing.push((i, last));
        }
        if segments.is_empty() {
            return Ok(());
        }
        let tokens = self.pass(&segments)?;
        for (((i, last), segment), token) in finishing.into_iter().zip(&segments).zip(tokens) {
            let seq = self.seqs.get_mut(&segment.seq).expect("proposing");
            seq.computed.truncate(segment.start);
            seq.computed.extend(&segment.ids);
            if segment.snapshots != PassSnapshots::None {
                seq.saved = Some((seq.computed.len(), token));
            }
            proposals[i].restore = false;
            self.register_full_blocks(segment.seq, proposals[i].tokens);
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
        let segments: Vec<PassSegment> = growing
            .iter()
            .map(|&i| {
                let p = &proposals[i];
                PassSegment {
                    seq: p.seq,
                    start: p.tokens.len() + p.drafts.len() - 1,
                    ids: vec![*p.drafts.last().expect("drafting")],
                    snapshots: match p.restore {
                        true => PassSnapshots::Restore,
                        false => PassSnapshots::None,
                    },
                }
            })
            .collect();
        let tokens = self.pass(&segments)?;
        for ((i, segment), token) in growing.into_iter().zip(&segments).zip(tokens) {
            let seq = self.seqs.get_mut(&segment.seq).expect("proposing");
            seq.computed.truncate(segment.start);
            seq.computed.extend(&segment.ids);
            proposals[i].restore = false;
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
        // Prefixes whose blocks were evicted are simply not found again.
        self.room.blocks.take_evicted();
        let mut proposals = Vec::new();
        for r in requests {
            if r.limit == 0 || r.tokens.is_empty() {
                continue;
            }
            // Positions up to the last draft but one (the last is never computed).
            let limit = r.limit.min(self.room.context_length.saturating_sub(r.tokens.len()));
            if limit == 0 || !self.admit(r.seq, r.tokens) {
                continue;
            }
            let seq = self.seqs.get_mut(&r.seq).expect("admitted");
            // Where the blocks are not to be had, no drafts (the table stays as it was).
            if self
                .room
                .blocks
                .grow(&mut seq.table, r.tokens.len() + limit - 1)
                .is_err()
            {
                continue;
            }
            let (start, restore, drafts) = match resume_at(seq, r.tokens, self.state_slots.is_some()) {
                Resume::CatchUp { start, restore } => (start, restore, Vec::new()),
                Resume::Snapshot { first_draft } => (r.tokens.len(), true, vec![first_draft]),
            };
            proposals.push(Proposal {
                seq: r.seq,
                tokens: r.tokens,
                limit,
                start,
                restore,
                drafts,
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
            self.room.blocks.release(&mut seq.table);
        }
    }
}

/// Where a proposal for `tokens` starts: after what the sequence's cache holds of them, but
/// for their last token, whose row gives the first draft. A recurrent state that has seen
/// more than that (earlier drafts, or that last token) is taken back to the snapshot where
/// the last catch-up ended: from there the kept tokens are computed again, or, where the
/// tokens end there (a step left the sequence out), drafting goes on with the first draft
/// that catch-up gave; a snapshot past the kept tokens is no use, and the state starts afresh.
fn resume_at(seq: &DraftSeq, tokens: &[u32], recurrent: bool) -> Resume {
    let common = common_prefix(&seq.computed, tokens);
    let kept = common.min(tokens.len() - 1);
    if !recurrent || kept == seq.computed.len() {
        return Resume::CatchUp {
            start: kept,
            restore: false,
        };
    }
    match seq.saved {
        Some((saved, first_draft)) if saved == tokens.len() && common >= saved => Resume::Snapshot { first_draft },
        Some((saved, _)) if saved <= kept => Resume::CatchUp {
            start: saved,
            restore: true,
        },
        // A segment from position 0 starts the state afresh.
        _ => Resume::CatchUp {
            start: 0,
            restore: false,
        },
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
