//! Drafting with the target's own multi-token prediction head (vLLM's `method: mtp`), or an
//! EAGLE head (`eagle`, `eagle3`): a small graph that reads a token and the target's hidden
//! state at the position before it and predicts the token after it (an EAGLE-3 head over a
//! draft vocabulary of its own, whose ids the drafter maps to the target's).
//!
//! The head's row for position `p` reads token `p + 1` and the target's hidden state at `p`,
//! and its argmax is a guess at token `p + 2`. So once the target has computed a sequence's
//! positions up to `n − 2` and sampled token `n − 1`, the head's row at `n − 2` gives the
//! first draft (for position `n`); each further draft is a row one position on that reads the
//! draft before it and, in place of the target's state (which the target has not computed
//! yet), the hidden state the head's own previous row left.
//!
//! The head keeps its own paged KV cache per sequence. Its rows up to `n − 2` read the
//! target's states and stay; its drafting rows past them are written over by the next
//! proposal's catch-up, which starts where the kept rows end. The target's states come from
//! the serving engine after each step ([`Drafter::observe`]): rows of the positions a sequence
//! keeps, refused drafts' left out.
//!
//! A sequence whose first positions came from the target's prefix cache has no states for
//! them: its rows of them come from the head's own prefix cache. Full blocks of rows it
//! computed are registered under the sequence's tokens there, as the target's are. A block's
//! last row read the token after the block too, so each registration also records that
//! token, and a sequence takes the cached rows only where its own token there is the same
//! (where the target's hit ends inside a shared prompt, it is): then its rows are the ones it
//! would have computed. Where the head does not hold them all, it drafts nothing for the
//! sequence.

use super::block_manager::Serial;
use super::draft_model::{DraftRoom, Drafter};
use super::engine::PagedBackend;
use super::scheduler::{DraftRequest, SeqId};
use crate::error::{Result, RuntimeError};
use crate::kv::{BlockId, Segment, StateSnapshots};
use ir::multi_token::{DRAFT_HIDDEN_STATE, TARGET_HIDDEN_STATES};
use ir::Tensor;
use std::collections::{BTreeMap, HashMap};

/// A multi-token prediction head on a paged backend (its graph reads `HiddenStates` and has
/// `next_token` or `logits`, and [`DRAFT_HIDDEN_STATE`], outputs of its last row), with the
/// cache it keeps per sequence.
pub struct MtpDrafter<B: PagedBackend> {
    room: DraftRoom<B>,
    /// The target's hidden size.
    width: usize,
    seqs: HashMap<SeqId, MtpSeq>,
    /// The token after each registered block of rows (its last row read it).
    next_tokens: HashMap<Serial, u32>,
    /// The target's id of each id the head gives, where its vocabulary is its own (an EAGLE-3
    /// head's draft vocabulary).
    token_map: Option<Vec<u32>>,
}

/// A sequence's share of the head's cache, and the target's states it has not read yet.
struct MtpSeq {
    table: Vec<BlockId>,
    /// The registrations of its table's first blocks, in order.
    serials: Vec<Serial>,
    /// Rows computed from the target's states: positions `0..computed`.
    computed: usize,
    /// The target's states at positions `states_from..`, row after row: those not computed
    /// yet, and the last one computed (a proposal whose sequence a step left out computes
    /// that row again for its first draft).
    states: Vec<f32>,
    states_from: usize,
    /// The target's states skip positions the head's prefix cache does not hold: it drafts
    /// nothing.
    broken: bool,
}

impl MtpSeq {
    /// Positions up to which the target's states are known.
    fn states_end(&self, width: usize) -> usize {
        self.states_from + self.states.len() / width
    }
}

/// One sequence's share of a pass.
struct PassRow {
    seq: SeqId,
    start: usize,
    ids: Vec<u32>,
    /// A hidden state per id.
    states: Vec<f32>,
}

/// What a pass gives each segment: its greedy token and the hidden state of its last row.
struct PassResult {
    token: u32,
    hidden: Vec<f32>,
}

impl<B: PagedBackend> MtpDrafter<B> {
    /// A drafter over `backend` (the head's graph) for a target of hidden size `width`,
    /// holding at most `blocks` cache blocks of `block_size` positions, computing at most
    /// `token_budget` rows a pass, over contexts of `context_length`.
    pub fn new(
        backend: B,
        width: usize,
        blocks: usize,
        block_size: usize,
        token_budget: usize,
        context_length: usize,
    ) -> Result<Self> {
        if width == 0 {
            return Err(RuntimeError::Graph(
                "a multi-token prediction head needs a hidden size".into(),
            ));
        }
        if backend.has_recurrent_state() {
            return Err(RuntimeError::Graph(
                "a multi-token prediction head has attention layers only; this one keeps a recurrent state".into(),
            ));
        }
        Ok(Self {
            room: DraftRoom::new(
                backend,
                blocks,
                block_size,
                token_budget,
                context_length,
                "a multi-token prediction head",
            )?,
            width,
            seqs: HashMap::new(),
            next_tokens: HashMap::new(),
            token_map: None,
        })
    }

    /// The drafter whose head's ids are `map`'s indices, each drafting the target's id
    /// `map[id]`.
    pub fn with_token_map(self, map: Vec<u32>) -> Self {
        Self {
            token_map: Some(map),
            ..self
        }
    }

    pub fn backend(&self) -> &B {
        &self.room.backend
    }

    /// Blocks held by sequences now.
    pub fn used_blocks(&self) -> usize {
        self.room.blocks.used_blocks()
    }

    /// Run one pass over `rows`, one segment each.
    fn pass(&mut self, rows: &[PassRow]) -> Result<Vec<PassResult>> {
        let batch: Vec<Segment> = rows
            .iter()
            .map(|r| Segment {
                table: &self.seqs[&r.seq].table,
                start: r.start,
                ids: &r.ids,
                state_slot: 0,
                sampled_rows: 1,
                drafts: 0,
                snapshots: StateSnapshots::NONE,
                hidden_states: &r.states,
            })
            .collect();
        // Its greedy token and hidden state alone where the backend reads back just those (a
        // GPU plan); else every output.
        let outputs = match self.room.step_greedy(&batch, &[DRAFT_HIDDEN_STATE])? {
            Some(outputs) => outputs,
            None => self.room.step(&batch)?,
        };
        outputs
            .iter()
            .map(|out| {
                let last = |name: &str| self.room.last_row(out, name);
                // A head lowered for greedy drafting gives its token (`next_token`, from a
                // shortlisted or INT8-bound head, or a plan's argmax); else its logits' argmax.
                let token = match out.contains_key("next_token") {
                    true => last("next_token")?[0] as u32,
                    false => crate::sampling::argmax(last("logits")?),
                };
                let token = match &self.token_map {
                    None => token,
                    Some(map) => *map.get(token as usize).ok_or_else(|| {
                        RuntimeError::Graph(format!(
                            "the draft head gave id {token}, past its vocabulary of {}",
                            map.len()
                        ))
                    })?,
                };
                Ok(PassResult {
                    token,
                    hidden: last(DRAFT_HIDDEN_STATE)?.to_vec(),
                })
            })
            .collect()
    }
}

/// One sequence's proposal in the making.
struct Proposal<'a> {
    seq: SeqId,
    /// The sequence's tokens (its last not computed by the target yet).
    tokens: &'a [u32],
    /// Their number.
    len: usize,
    limit: usize,
    drafts: Vec<u32>,
    /// The hidden state of the head's last row, which the next draft's row reads.
    hidden: Vec<f32>,
}

impl<B: PagedBackend + Send> Drafter for MtpDrafter<B>
where
    B::Pages: Send,
{
    fn propose(&mut self, requests: &[DraftRequest<'_>]) -> Result<BTreeMap<SeqId, Vec<u32>>> {
        let width = self.width;
        let mut budget = self.room.token_budget;
        let mut proposals = Vec::new();
        let mut rows = Vec::new();
        for r in requests {
            let len = r.tokens.len();
            if !self.rows_before_states(r.seq, r.tokens) {
                continue;
            }
            let Some(seq) = self.seqs.get_mut(&r.seq) else {
                continue;
            };
            // The target's states must reach position `len − 2` (the row of the first draft).
            if seq.broken || len < 2 || seq.states_end(width) < len - 1 || budget == 0 {
                continue;
            }
            // Drafting rows reach position `len − 2 + limit − 1`; the last draft's own row is
            // never computed.
            let limit = r.limit.min(self.room.context_length.saturating_sub(len));
            if limit == 0 || self.room.blocks.grow(&mut seq.table, len - 2 + limit).is_err() {
                continue;
            }
            let start = seq.computed.min(len - 2).max(seq.states_from);
            let end = (len - 1).min(start + budget);
            budget -= end - start;
            let states = &seq.states[(start - seq.states_from) * width..(end - seq.states_from) * width];
            rows.push(PassRow {
                seq: r.seq,
                start,
                ids: r.tokens[start + 1..end + 1].to_vec(),
                states: states.to_vec(),
            });
            proposals.push(Proposal {
                seq: r.seq,
                tokens: r.tokens,
                len,
                // A catch-up cut short by the budget drafts nothing this step.
                limit: if end == len - 1 { limit } else { 0 },
                drafts: Vec::new(),
                hidden: Vec::new(),
            });
        }
        if rows.is_empty() {
            return Ok(BTreeMap::new());
        }
        let results = self.pass(&rows)?;
        for ((p, row), result) in proposals.iter_mut().zip(&rows).zip(results) {
            let end = row.start + row.ids.len();
            self.register_full_blocks(p.seq, end, p.tokens);
            let seq = self.seqs.get_mut(&p.seq).expect("proposing");
            seq.computed = end;
            // Keep the states from the last row computed on.
            let keep_from = end - 1;
            seq.states.drain(..(keep_from - seq.states_from) * width);
            seq.states_from = keep_from;
            if p.limit > 0 {
                p.drafts.push(result.token);
                p.hidden = result.hidden;
            }
        }
        loop {
            let growing: Vec<usize> = (0..proposals.len())
                .filter(|&i| !proposals[i].drafts.is_empty() && proposals[i].drafts.len() < proposals[i].limit)
                .collect();
            if growing.is_empty() {
                break;
            }
            let rows: Vec<PassRow> = growing
                .iter()
                .map(|&i| {
                    let p = &proposals[i];
                    PassRow {
                        seq: p.seq,
                        start: p.len - 2 + p.drafts.len(),
                        ids: vec![*p.drafts.last().expect("drafting")],
                        states: p.hidden.clone(),
                    }
                })
                .collect();
            let results = self.pass(&rows)?;
            for (i, result) in growing.into_iter().zip(results) {
                proposals[i].drafts.push(result.token);
                proposals[i].hidden = result.hidden;
            }
        }
        Ok(proposals
            .into_iter()
            .filter(|p| !p.drafts.is_empty())
            .map(|p| (p.seq, p.drafts))
            .collect())
    }

    fn retain(&mut self, keep: &mut dyn FnMut(SeqId) -> bool) {
        let gone: Vec<SeqId> = self.seqs.keys().copied().filter(|&id| !keep(id)).collect();
        for id in gone {
            let mut seq = self.seqs.remove(&id).expect("listed");
            self.room.blocks.release(&mut seq.table);
        }
    }

    fn reads_target_output(&self) -> Option<&'static str> {
        Some(TARGET_HIDDEN_STATES)
    }

    fn observe(&mut self, id: SeqId, first: usize, rows: &Tensor) {
        let width = self.width;
        let seq = self.seqs.entry(id).or_insert_with(|| MtpSeq::starting_at(first));
        // Rows of another width are not of the target this head was made for.
        if rows.row_len() != width || first > seq.states_end(width) {
            seq.broken = true;
        }
        if seq.broken {
            return;
        }
        // Positions already known (computed again after a preemption) keep their states.
        let skip = (seq.states_end(width) - first).min(rows.rows());
        seq.states.extend_from_slice(&rows.data[skip * width..]);
    }
}

impl<B: PagedBackend> MtpDrafter<B> {
    /// Whether sequence `id` (its `tokens`) has the head's rows of every position before the
    /// target's first state it holds: a sequence whose states start past 0 takes them from
    /// the head's prefix cache when it first proposes, or is marked broken.
    fn rows_before_states(&mut self, id: SeqId, tokens: &[u32]) -> bool {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return false;
        };
        if seq.broken || seq.computed >= seq.states_from {
            return !seq.broken;
        }
        let from = seq.states_from;
        let serials = self
            .room
            .blocks
            .share_prefix(&mut seq.table, &tokens[..from.min(tokens.len())]);
        // The last shared block's last row read the token after it.
        let same_next = serials
            .last()
            .is_some_and(|s| self.next_tokens.get(s) == tokens.get(from));
        if serials.len() * self.room.blocks.block_size() == from && same_next {
            seq.computed = from;
            seq.serials = serials;
        } else {
            self.room.blocks.release(&mut seq.table);
            seq.broken = true;
        }
        !seq.broken
    }

    /// After a catch-up that computed sequence `id`'s rows up to `end` (each reading the
    /// token after its position in `tokens`): register its blocks those rows now fill, each
    /// with the token after it.
    fn register_full_blocks(&mut self, id: SeqId, end: usize, tokens: &[u32]) {
        for serial in self.room.blocks.take_evicted() {
            self.next_tokens.remove(&serial);
        }
        let block_size = self.room.blocks.block_size();
        let seq = self.seqs.get_mut(&id).expect("proposing");
        let registered = seq.serials.len();
        self.room.register_blocks(&seq.table, &mut seq.serials, tokens, end);
        for (b, serial) in seq.serials.iter().enumerate().skip(registered) {
            // A twin registered first keeps the token it recorded.
            self.next_tokens.entry(*serial).or_insert(tokens[(b + 1) * block_size]);
        }
    }
}

impl MtpSeq {
    /// A sequence whose first target states are of position `first` (past 0: its beginning
    /// came from the target's prefix cache).
    fn starting_at(first: usize) -> Self {
        Self {
            table: Vec::new(),
            serials: Vec::new(),
            computed: 0,
            states: Vec::new(),
            states_from: first,
            broken: false,
        }
    }
}
