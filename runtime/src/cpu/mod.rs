//! The CPU backend: executes a graph op by op on f32 activations, with multithreaded kernels
//! for the heavy ops (matmul, attention) and the IR's reference functions for the light ones.
//!
//! A step takes any number of sequences at once (a batch of [`Segment`]s): their tokens are
//! stacked into one activation matrix, so every weight is read once per step for all of them,
//! and only attention looks at which sequence a row belongs to. Every op computes a row the
//! same way whatever else is in the step, so batching never changes a sequence's results.

pub(crate) mod activation;
mod attention;
pub mod delta_net;
mod dense;
mod fp8_rows;
pub mod int8_head;
mod int8_scores;
pub mod kv_element;
mod kv_pages;
mod latent_attention;
pub mod line_aligned;
pub mod line_alloc;
mod matrix;
mod moe;
mod pool;
pub mod quant;
mod rope;
mod rows;
pub mod shortlist_head;
pub mod simd;
mod spares;

pub use int8_head::Int8Head;
pub use kv_pages::{KvLayout, KvPages, LayerPages};
pub use matrix::{Matrix, Storage};

use crate::error::{Result, RuntimeError};
use crate::kv::{BlockId, Segment};
use attention::QueryRow;
use half::bf16;
use ir::reference::ops;
use ir::{DType, Graph, InputKind, Op, Tensor};
use quant::tensor::Tensors;
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

pub enum CpuWeight {
    Matrix(Matrix),
    Vector(Vec<f32>),
}

pub struct CpuBackend {
    graph: Graph,
    /// Per node: its weight, for weight nodes and weight transforms folded at load time.
    weights: Vec<Option<Arc<CpuWeight>>>,
    /// Per `Int8BoundTopK` node: its head, quantized at load time.
    int8_heads: HashMap<usize, Int8Head>,
    /// Per `ShortlistTopK` node: its head's 4-bit copy, made at load time.
    shortlist_heads: HashMap<usize, shortlist_head::ShortlistHead>,
    /// Per `PermuteColumns` node: its order, read and checked at load time.
    column_orders: HashMap<usize, Vec<usize>>,
    /// Per node: the index of the last node reading it (values are freed after).
    last_use: Vec<usize>,
    /// Per attention cache slot: what a position is cached as.
    kv_layouts: Vec<KvLayout>,
    /// Per recurrent state slot (Gated DeltaNet layers): one sequence's state length.
    state_lens: Vec<usize>,
    vocab: usize,
    context_length: usize,
}

/// One sequence on its own (`bbc run`): a private page pool whose blocks it takes in order.
#[derive(Debug, Clone)]
pub struct CpuSequence {
    pages: KvPages,
    table: Vec<BlockId>,
    len: usize,
}

impl CpuSequence {
    /// Positions computed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Positions per block of a lone sequence's pool: nothing shares its blocks, so they are large.
const LONE_SEQUENCE_BLOCK: usize = 256;

/// Where each row of a batched step comes from.
struct StepRows<'a> {
    segments: &'a [Segment<'a>],
    /// Per segment, its rows of the stacked activations.
    ranges: Vec<std::ops::Range<usize>>,
    /// Per segment, its rows of the per-sequence outputs (after `LastToken`).
    sampled: Vec<std::ops::Range<usize>>,
    /// Per row, its position and its sequence's block table.
    query: Vec<QueryRow<'a>>,
    /// Per row, its position (the graph's `Positions` input), and the rope tables for them.
    rope: rope::StepRope,
}

impl<'a> StepRows<'a> {
    fn of(segments: &'a [Segment<'a>]) -> Self {
        let mut ranges = Vec::with_capacity(segments.len());
        let mut query = Vec::new();
        for seg in segments {
            ranges.push(query.len()..query.len() + seg.ids.len());
            query.extend((seg.start..seg.end()).map(|pos| QueryRow { pos, table: seg.table }));
        }
        let rope = rope::StepRope::new(query.iter().map(|q| q.pos).collect());
        Self {
            segments,
            ranges,
            sampled: crate::kv::sampled_ranges(segments),
            query,
            rope,
        }
    }

    /// The rows `LastToken` keeps, in order: each segment's last `sampled_rows`.
    fn sampled_rows(&self) -> impl Iterator<Item = usize> + '_ {
        self.segments
            .iter()
            .zip(&self.ranges)
            .flat_map(|(seg, r)| r.end - seg.sampled_rows..r.end)
    }

    /// The query rows of a value with `count` rows: the step's, or its sampled ones (after
    /// `LastToken`; where every row is sampled the two are the same rows).
    fn query_rows_of(&self, count: usize) -> Result<std::borrow::Cow<'_, [QueryRow<'a>]>> {
        if count == self.query.len() {
            return Ok(std::borrow::Cow::Borrowed(&self.query));
        }
        let sampled: Vec<QueryRow<'a>> = self.sampled_rows().map(|r| self.query[r]).collect();
        match sampled.len() == count {
            true => Ok(std::borrow::Cow::Owned(sampled)),
            false => Err(RuntimeError::Graph(format!(
                "a query of {count} rows in a step of {} rows, {} of them sampled",
                self.query.len(),
                sampled.len()
            ))),
        }
    }

    /// Split a graph output into one tensor per segment: its rows when the output has a row per
    /// token, its sampled rows when it has those (after `LastToken`).
    fn split(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        let width = t.row_len();
        let rows = |r: std::ops::Range<usize>| {
            Tensor::new(vec![r.len(), width], t.data[r.start * width..r.end * width].to_vec())
        };
        if t.rows() == self.query.len() {
            Ok(self.ranges.iter().map(|r| rows(r.clone())).collect())
        } else if t.rows() == self.sampled.last().map_or(0, |r| r.end) {
            Ok(self.sampled.iter().map(|r| rows(r.clone())).collect())
        } else {
            Err(RuntimeError::Graph(format!(
                "an output has {} rows for a step of {} tokens in {} sequences",
                t.rows(),
                self.query.len(),
                self.segments.len()
            )))
        }
    }
}

enum Value {
    F32(Tensor),
    Ids(Vec<usize>),
}

impl Value {
    fn tensor(&self) -> &Tensor {
        match self {
            Value::F32(t) => t,
            Value::Ids(_) => unreachable!("validated graphs feed ids only to id operands"),
        }
    }
    fn ids(&self) -> &[usize] {
        match self {
            Value::Ids(ids) => ids,
            Value::F32(_) => unreachable!("validated graphs feed floats only to float operands"),
        }
    }
}

impl CpuBackend {
    /// Prepare the graph's weights from `source` in the storage each weight node names.
    pub fn new(graph: Graph, source: &dyn Tensors, context_length: usize) -> Result<Self> {
        Self::with_cache(graph, source, context_length, &mut WeightCache::default())
    }

    /// Like `new`, sharing weights already loaded for another graph of the same model (the
    /// greedy and the logits graphs of one engine hold one copy).
    pub fn with_cache(
        graph: Graph,
        source: &dyn Tensors,
        context_length: usize,
        cache: &mut WeightCache,
    ) -> Result<Self> {
        graph.validate().map_err(|e| RuntimeError::Graph(e.to_string()))?;
        let mut weights = load_weights(&graph, source, cache)?;
        fold_weight_transforms(&graph, &mut weights, cache)?;
        widen_conv_weights(&graph, &mut weights)?;
        let int8_heads = prepare_int8_heads(&graph, &weights, cache)?;
        let shortlist_heads = prepare_shortlist_heads(&graph, &weights)?;
        let column_orders = prepare_column_orders(&graph, &weights)?;
        release_folded_sources(&graph, &mut weights);
        let mut last_use = vec![0; graph.nodes().len()];
        let mut kv_layouts = Vec::new();
        let mut state_lens = Vec::new();
        let mut vocab = 0;
        for (i, node) in graph.nodes().iter().enumerate() {
            for input in &node.inputs {
                last_use[input.0] = i;
            }
            let layout = |dim, v_dim, dtype| KvLayout { dim, v_dim, dtype };
            let cache = match &node.op {
                op if op.appended_attention().is_some() => op.appended_attention().map(|s| {
                    let dim = s.kv_heads * s.head_dim;
                    (s.cache_slot, layout(dim, dim, s.cache_dtype))
                }),
                // Latents stay f32 (`latent_attention` reads them so).
                Op::SparseMla(s) => Some((s.cache_slot, layout(s.cache_width(), 0, DType::F32))),
                _ => None,
            };
            if let Some((slot, cached)) = cache {
                if kv_layouts.len() <= slot {
                    kv_layouts.resize(slot + 1, layout(0, 0, DType::F32));
                }
                kv_layouts[slot] = cached;
            }
            if let Op::GatedDeltaNet(spec) = &node.op {
                if state_lens.len() <= spec.state_slot {
                    state_lens.resize(spec.state_slot + 1, 0);
                }
                state_lens[spec.state_slot] = spec.state_len();
            }
            if node.op == Op::Embedding {
                vocab = graph.node(node.inputs[0]).shape.resolve(0, 0)[0];
            }
        }
        for (_, out) in graph.outputs() {
            last_use[out.0] = usize::MAX;
        }
        Ok(Self {
            graph,
            weights,
            int8_heads,
            shortlist_heads,
            column_orders,
            last_use,
            kv_layouts,
            state_lens,
            vocab,
            context_length,
        })
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    pub fn context_length(&self) -> usize {
        self.context_length
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Bytes of weights read by one decode step.
    pub fn weight_bytes(&self) -> usize {
        let mut seen = std::collections::HashSet::new();
        self.weights
            .iter()
            .flatten()
            .filter(|w| seen.insert(Arc::as_ptr(w)))
            .map(|w| match w.as_ref() {
                CpuWeight::Matrix(m) => m.bytes(),
                CpuWeight::Vector(v) => v.len() * 4,
            })
            .sum()
    }

    /// Whether the graph keeps a recurrent state per sequence (Gated DeltaNet layers).
    pub fn has_recurrent_state(&self) -> bool {
        self.state_lens.iter().any(|&l| l > 0)
    }

    /// Bytes of recurrent state one sequence keeps (one snapshot of it as much).
    pub fn state_bytes_per_sequence(&self) -> usize {
        self.state_lens.iter().sum::<usize>() * std::mem::size_of::<f32>()
    }

    /// Whether `other`'s graph caches positions and keeps states as this one's does, so that
    /// either can run over pages the other made (two graphs of one model).
    pub fn shares_cache_with(&self, other: &CpuBackend) -> bool {
        self.kv_layouts == other.kv_layouts && self.state_lens == other.state_lens
    }

    /// Bytes of keys and values one cached position takes, over every attention slot.
    pub fn kv_bytes_per_position(&self) -> usize {
        self.kv_layouts.iter().map(KvLayout::bytes_per_position).sum()
    }

    pub fn new_sequence(&self) -> CpuSequence {
        CpuSequence {
            pages: self.new_pages(LONE_SEQUENCE_BLOCK),
            table: Vec::new(),
            len: 0,
        }
    }

    /// An empty KV pool for this graph's attention slots, in blocks of `block_size` positions.
    pub fn new_pages(&self, block_size: usize) -> KvPages {
        KvPages::new(&self.kv_layouts, &self.state_lens, block_size)
    }

    /// Process `ids` as the next tokens of `seq`; returns the graph's outputs by name.
    pub fn step(&self, seq: &mut CpuSequence, ids: &[u32]) -> Result<HashMap<String, Tensor>> {
        let end = seq.len + ids.len();
        if end > self.context_length {
            return Err(RuntimeError::ContextOverflow {
                needed: end,
                limit: self.context_length,
            });
        }
        while seq.table.len() * seq.pages.block_size() < end {
            seq.table.push(BlockId(seq.table.len() as u32));
        }
        let segment = Segment {
            hidden_states: &[],
            table: &seq.table,
            start: seq.len,
            ids,
            state_slot: 0,
            sampled_rows: 1,
            drafts: 0,
            snapshots: crate::kv::StateSnapshots::NONE,
        };
        let out = self.step_batch(&mut seq.pages, &[segment])?.pop();
        seq.len = end;
        Ok(out.expect("one output per segment"))
    }

    /// Process every segment's tokens in one pass, keys and values going to `pages`; returns
    /// each segment's outputs by name (in the order of `batch`).
    ///
    /// The calling thread runs the serial ops and takes part in the parallel ones ([`pool`]).
    pub fn step_batch(&self, pages: &mut KvPages, batch: &[Segment]) -> Result<Vec<HashMap<String, Tensor>>> {
        self.check_batch(pages, batch)?;
        let rows = StepRows::of(batch);
        let ids: Vec<usize> = batch.iter().flat_map(|s| s.ids).map(|&t| t as usize).collect();
        let mut values: Vec<Option<Value>> = Vec::with_capacity(self.graph.nodes().len());
        let mut spares = spares::Spares::default();
        for (i, node) in self.graph.nodes().iter().enumerate() {
            let value = match &node.op {
                Op::Input(InputKind::TokenIds) => Some(Value::Ids(ids.clone())),
                Op::Input(InputKind::Positions) => Some(Value::Ids(rows.rope.positions().to_vec())),
                Op::Input(InputKind::HiddenStates) => {
                    let hidden: Vec<f32> = batch.iter().flat_map(|s| s.hidden_states).copied().collect();
                    let width = node.shape.resolve(ids.len(), 0)[1];
                    if hidden.len() != ids.len() * width {
                        return Err(RuntimeError::Input(format!(
                            "{} hidden-state values for a step of {} tokens of {width}",
                            hidden.len(),
                            ids.len()
                        )));
                    }
                    Some(Value::F32(Tensor::new(vec![ids.len(), width], hidden)))
                }
                Op::Weight { .. } => None,
                op if op.is_weight_transform() => None,
                // The positions of the sampled rows, for what runs on those rows only.
                Op::LastToken if self.graph.node(node.inputs[0]).dtype == ir::DType::I32 => {
                    let Some(Value::Ids(positions)) = &values[node.inputs[0].0] else {
                        return Err(RuntimeError::Graph("last_token of positions that are not ids".into()));
                    };
                    Some(Value::Ids(rows.sampled_rows().map(|r| positions[r]).collect()))
                }
                op => {
                    let args: Vec<Arg> = node
                        .inputs
                        .iter()
                        .map(|x| match &self.weights[x.0] {
                            Some(w) => Arg::Weight(w),
                            None => Arg::Value(values[x.0].as_ref().expect("inputs are computed before use")),
                        })
                        .collect();
                    Some(Value::F32(self.eval(i, op, &args, pages, &rows, &mut spares)?))
                }
            };
            values.push(value);
            for input in &node.inputs {
                if self.last_use[input.0] == i {
                    if let Some(Value::F32(dead)) = values[input.0].take() {
                        spares.keep(dead.data);
                    }
                }
            }
        }
        let mut per_segment: Vec<HashMap<String, Tensor>> = vec![HashMap::new(); batch.len()];
        for (name, id) in self.graph.outputs() {
            let output = values[id.0].as_ref().expect("outputs are kept").tensor();
            for (outputs, t) in per_segment.iter_mut().zip(rows.split(output)?) {
                outputs.insert(name.clone(), t);
            }
        }
        Ok(per_segment)
    }

    /// A batch the graph can run: tokens in every segment, positions within the context and
    /// within the segment's blocks, ids within the vocabulary, and (for recurrent models) a
    /// state slot of its own for each sequence.
    fn check_batch(&self, pages: &KvPages, batch: &[Segment]) -> Result<()> {
        if batch.is_empty() {
            return Err(RuntimeError::Input("a step needs at least one sequence".into()));
        }
        if self.has_recurrent_state() {
            // The pool keeps a state for any slot it is given.
            crate::kv::check_state_slots(batch, None)?;
        }
        for seg in batch {
            if seg.ids.is_empty() {
                return Err(RuntimeError::Input("a step needs at least one token".into()));
            }
            seg.check_sampled_rows()?;
            seg.check_snapshots()?;
            if seg.end() > self.context_length {
                return Err(RuntimeError::ContextOverflow {
                    needed: seg.end(),
                    limit: self.context_length,
                });
            }
            if seg.table.len() * pages.block_size() < seg.end() {
                return Err(RuntimeError::Input(format!(
                    "a block table of {} blocks cannot hold {} positions",
                    seg.table.len(),
                    seg.end()
                )));
            }
            if let Some(&bad) = seg.ids.iter().find(|&&id| id as usize >= self.vocab) {
                return Err(RuntimeError::Input(format!(
                    "token id {bad} is outside the vocabulary (size {})",
                    self.vocab
                )));
            }
        }
        Ok(())
    }

    /// `op` on `args`. Outputs that the op writes whole come from `spares`, and so do its own
    /// temporaries, which go back there.
    fn eval(
        &self,
        node: usize,
        op: &Op,
        args: &[Arg],
        pages: &mut KvPages,
        rows: &StepRows,
        spares: &mut spares::Spares,
    ) -> Result<Tensor> {
        Ok(match op {
            Op::Embedding => {
                let table = args[0].matrix();
                let ids = args[1].value().ids();
                let mut out = spares.take(ids.len() * table.cols);
                for (row, &id) in out.chunks_exact_mut(table.cols).zip(ids) {
                    table.gather_row(id, row);
                }
                Tensor::new(vec![ids.len(), table.cols], out)
            }
            Op::MatMul => {
                let x = args[0].value().tensor();
                let w = args[1].matrix();
                let mut out = spares.take(x.rows() * w.rows);
                w.matmul(&x.data, x.rows(), &mut out);
                Tensor::new(vec![x.rows(), w.rows], out)
            }
            Op::RmsNorm { eps, weight_offset, .. } => {
                let x = args[0].value().tensor();
                let mut out = spares.take(x.data.len());
                rms_norm(&x.data, args[1].vector(), *eps, *weight_offset, &mut out);
                Tensor::new(x.shape.clone(), out)
            }
            Op::Rope(spec) => {
                let mut x = spares.copy_of(args[0].value().tensor());
                rows.rope.apply(spec, &mut x.data, args[1].value().ids());
                x
            }
            Op::Attention(spec) => {
                let (q, k, v) = (
                    args[0].value().tensor(),
                    args[1].value().tensor(),
                    args[2].value().tensor(),
                );
                append_and_attend(spec, q, k, v, pages, rows, spares)
            }
            Op::RopeAttention { rope, attention } => {
                let (mut q, mut k) = (
                    spares.copy_of(args[0].value().tensor()),
                    spares.copy_of(args[1].value().tensor()),
                );
                let (heads, kv_heads) = (attention.heads, attention.kv_heads);
                let positions = args[3].value().ids();
                for (x, heads) in [(&mut q.data, heads), (&mut k.data, kv_heads)] {
                    rows.rope.apply(&ir::RopeSpec { heads, ..*rope }, x, positions);
                }
                let out = append_and_attend(attention, &q, &k, args[2].value().tensor(), pages, rows, spares);
                spares.keep(q.data);
                spares.keep(k.data);
                out
            }
            Op::Add => zip_map(args[0].value().tensor(), args[1].value().tensor(), |a, b| a + b),
            Op::Mul => zip_map(args[0].value().tensor(), args[1].value().tensor(), |a, b| a * b),
            Op::Scale { factor } => map(args[0].value().tensor(), |a| a * factor),
            Op::Silu => map(args[0].value().tensor(), activation::silu),
            Op::GeluTanh => map(args[0].value().tensor(), activation::gelu_tanh),
            Op::LastToken => {
                let x = args[0].value().tensor();
                let data: Vec<f32> = rows.sampled_rows().flat_map(|r| x.row(r)).copied().collect();
                Tensor::new(vec![data.len() / x.row_len().max(1), x.row_len()], data)
            }
            Op::AddBias => {
                let x = args[0].value().tensor();
                Tensor::new(x.shape.clone(), ops::add_bias(&x.data, args[1].vector()))
            }
            // As the reference computes it (and fused expressions do, `Expr::Sigmoid`).
            Op::Sigmoid => map(args[0].value().tensor(), ops::sigmoid),
            Op::SoftCap { cap } => map(args[0].value().tensor(), |x| ops::soft_cap(x, *cap)),
            Op::SharedKvAttention(spec) => {
                let q = args[0].value().tensor();
                let mut out = spares.take(q.data.len());
                let query = rows.query_rows_of(q.rows())?;
                attention::attention(spec, &q.data, &query, pages.layer(spec.cache_slot), &mut out);
                Tensor::new(q.shape.clone(), out)
            }
            Op::PermuteColumns => {
                let x = args[0].value().tensor();
                let order = &self.column_orders[&node];
                let mut out = spares.take(x.data.len());
                ops::permute_columns_into(&x.data, order, &mut out);
                Tensor::new(x.shape.clone(), out)
            }
            Op::ScaleRows => {
                let x = args[0].value().tensor();
                let scalars = match &args[1] {
                    Arg::Weight(_) => args[1].vector(),
                    Arg::Value(v) => &v.tensor().data,
                };
                Tensor::new(x.shape.clone(), ops::scale_rows(&x.data, x.row_len(), scalars))
            }
            Op::LayerNorm { eps } => {
                let x = args[0].value().tensor();
                Tensor::new(
                    x.shape.clone(),
                    ops::layer_norm(&x.data, args[1].vector(), args[2].vector(), *eps),
                )
            }
            Op::SparseMla(spec) => latent_attention::sparse_mla(spec, args, pages, rows)?,
            Op::UnitRmsNorm { eps, group } => {
                let x = args[0].value().tensor();
                Tensor::new(x.shape.clone(), ops::unit_rms_norm(&x.data, *group, *eps))
            }
            Op::GroupSlice { group, start, len } => {
                let x = args[0].value().tensor();
                let data = ops::group_slice(&x.data, *group, *start, *len);
                Tensor::new(vec![x.rows(), data.len() / x.rows().max(1)], data)
            }
            Op::GatedDeltaNet(spec) => gated_delta_net(spec, args, pages, rows)?,
            Op::Moe(spec) => {
                let (bias, weights) = match spec.has_expert_vector() {
                    true => (args[2].vector(), 3),
                    false => (&[][..], 2),
                };
                let (x, logits) = (args[0].value().tensor(), args[1].value().tensor());
                moe::moe(
                    spec,
                    x,
                    logits,
                    bias,
                    args[weights].matrix(),
                    args[weights + 1].matrix(),
                )
            }
            Op::Slice { start, len } => {
                let x = args[0].value().tensor();
                let mut out = spares.take(x.rows() * len);
                rows::slice_columns(&x.data, x.row_len(), *start..*start + *len, &mut out);
                Tensor::new(vec![x.rows(), *len], out)
            }
            Op::ConcatColumns => {
                let (a, b) = (args[0].value().tensor(), args[1].value().tensor());
                let width = a.row_len() + b.row_len();
                let mut out = spares.take(a.rows() * width);
                for ((row, x), y) in out
                    .chunks_exact_mut(width)
                    .zip(a.data.chunks_exact(a.row_len()))
                    .zip(b.data.chunks_exact(b.row_len()))
                {
                    row[..x.len()].copy_from_slice(x);
                    row[x.len()..].copy_from_slice(y);
                }
                Tensor::new(vec![a.rows(), width], out)
            }
            Op::AddRmsNorm { eps, weight_offset } => {
                let (a, b) = (args[0].value().tensor(), args[1].value().tensor());
                let mut out = spares.take(2 * a.data.len());
                add_rms_norm(&a.data, &b.data, args[2].vector(), *eps, *weight_offset, &mut out);
                Tensor::new(vec![a.rows(), 2 * a.row_len()], out)
            }
            Op::RmsNormMatMul { eps, weight_offset } => {
                let x = args[0].value().tensor();
                let mut normed = spares.take(x.data.len());
                rms_norm(&x.data, args[1].vector(), *eps, *weight_offset, &mut normed);
                let w = args[2].matrix();
                let mut out = spares.take(x.rows() * w.rows);
                w.matmul(&normed, x.rows(), &mut out);
                spares.keep(normed);
                Tensor::new(vec![x.rows(), w.rows], out)
            }
            Op::AddRmsNormMatMul {
                eps,
                weight_offset,
                glu,
            } => {
                let (a, b) = (args[0].value().tensor(), args[1].value().tensor());
                let (d, w) = (a.row_len(), args[3].matrix());
                let (mut sum, mut normed) = (spares.take(a.data.len()), spares.take(a.data.len()));
                add_rms_norm_apart(
                    &a.data,
                    &b.data,
                    args[2].vector(),
                    *eps,
                    *weight_offset,
                    &mut sum,
                    &mut normed,
                );
                let mut product = spares.take(a.rows() * w.rows);
                w.matmul(&normed, a.rows(), &mut product);
                let (product, n) = match glu {
                    Some(act) => {
                        let mut out = spares.take(product.len() / 2);
                        activation::glu(&product, w.rows, *act, &mut out);
                        spares.keep(product);
                        (out, w.rows / 2)
                    }
                    None => (product, w.rows),
                };
                let mut out = spares.take(a.rows() * (d + n));
                rows::concat_columns(&sum, d, &product, n, &mut out);
                for temporary in [sum, normed, product] {
                    spares.keep(temporary);
                }
                Tensor::new(vec![a.rows(), d + n], out)
            }
            Op::Glu { act } => {
                let x = args[0].value().tensor();
                let mut out = spares.take(x.data.len() / 2);
                activation::glu(&x.data, x.row_len(), *act, &mut out);
                Tensor::new(vec![x.rows(), x.row_len() / 2], out)
            }
            Op::Elementwise { expr } => {
                let inputs: Vec<&Tensor> = args.iter().map(|a| a.value().tensor()).collect();
                let mut scratch = vec![0f32; inputs.len()];
                let data = (0..inputs[0].data.len())
                    .map(|i| {
                        for (s, t) in scratch.iter_mut().zip(&inputs) {
                            *s = t.data[i];
                        }
                        expr.eval(&scratch)
                    })
                    .collect();
                Tensor::new(inputs[0].shape.clone(), data)
            }
            Op::TopK { k } => {
                let x = args[0].value().tensor();
                let data = (0..x.rows())
                    .flat_map(|r| ops::top_k(x.row(r), *k))
                    .map(|i| i as f32)
                    .collect();
                Tensor::new(vec![x.rows(), *k], data)
            }
            Op::Int8BoundTopK { k, soft_cap } => {
                let h = args[0].value().tensor();
                let head = &self.int8_heads[&node];
                let full = args[1].matrix();
                let data = (0..h.rows())
                    .flat_map(|r| head.top_k(h.row(r), *k, *soft_cap, full).ids)
                    .map(|i| i as f32)
                    .collect();
                Tensor::new(vec![h.rows(), *k], data)
            }
            Op::ShortlistTopK { k, candidates } => {
                let h = args[0].value().tensor();
                let head = &self.shortlist_heads[&node];
                let full = args[1].matrix();
                let ids = head.top_k(&h.data, h.rows(), *k, *candidates, full);
                Tensor::new(vec![h.rows(), *k], ids.into_iter().map(|i| i as f32).collect())
            }
            Op::ConcatRows | Op::RowGroupSlice { .. } | Op::TransposeRowGroups { .. } => {
                unreachable!("weight transforms are folded at load time")
            }
            Op::Input(_) | Op::Weight { .. } => unreachable!("handled by step"),
        })
    }
}

enum Arg<'a> {
    Value(&'a Value),
    Weight(&'a CpuWeight),
}

impl Arg<'_> {
    fn value(&self) -> &Value {
        match self {
            Arg::Value(v) => v,
            Arg::Weight(_) => unreachable!("validated graphs feed weights only to weight operands"),
        }
    }
    fn matrix(&self) -> &Matrix {
        match self {
            Arg::Weight(CpuWeight::Matrix(m)) => m,
            _ => unreachable!("validated graphs feed matrices to matrix operands"),
        }
    }
    fn vector(&self) -> &[f32] {
        match self {
            Arg::Weight(CpuWeight::Vector(v)) => v,
            _ => unreachable!("validated graphs feed vectors to vector operands"),
        }
    }
}

/// Append the step's keys and values to `spec`'s cache layer (each row at its sequence's
/// position), then attend over it with `q`.
fn append_and_attend(
    spec: &ir::AttentionSpec,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pages: &mut KvPages,
    rows: &StepRows,
    spares: &mut spares::Spares,
) -> Tensor {
    // The pages round the values to the cache's element type as they store them.
    let layer = pages.layer_mut(spec.cache_slot);
    let dim = layer.dim();
    for (seg, r) in rows.segments.iter().zip(&rows.ranges) {
        let (k, v) = (&k.data[r.start * dim..r.end * dim], &v.data[r.start * dim..r.end * dim]);
        layer.write(seg.table, seg.start, k, v);
    }
    let mut out = spares.take(q.data.len());
    attention::attention(spec, &q.data, &rows.query, pages.layer(spec.cache_slot), &mut out);
    Tensor::new(q.shape.clone(), out)
}

/// Each segment's rows through the Gated DeltaNet in order, from its sequence's recurrent state
/// (fresh at position 0, or a snapshot's where it restores one) to the state after its last
/// row, keeping the states a verifying step may have to go back to (see [`delta_net`]) and
/// the snapshots it saves.
fn gated_delta_net(spec: &ir::DeltaNetSpec, args: &[Arg], pages: &mut KvPages, rows: &StepRows) -> Result<Tensor> {
    let (mixed, b, a) = (
        args[0].value().tensor(),
        args[1].value().tensor(),
        args[2].value().tensor(),
    );
    let weights = || delta_net::Weights {
        // Widened at load time (`widen_conv_weights`).
        conv: args[3].vector(),
        a_log: args[4].vector(),
        dt_bias: args[5].vector(),
    };
    let (c, vh, layer) = (spec.conv_channels(), spec.value_heads, spec.state_slot);
    let mut out = Vec::with_capacity(mixed.rows() * vh * spec.value_dim);
    for (seg, r) in rows.segments.iter().zip(&rows.ranges) {
        if let Some(snapshot) = seg.snapshots.restore {
            pages.restore_state(layer, seg.state_slot, snapshot)?;
        }
        let n = r.len();
        // After each verified row but the last: where a verifying step may rewind to.
        let checkpoint_rows = n - 1 - seg.drafts..n - 1;
        // The segment's row after which each snapshot is saved.
        let snapshot_rows: Vec<(usize, usize)> = seg
            .snapshots
            .save
            .iter()
            .map(|save| (save.positions - seg.start - 1, save.snapshot))
            .collect();
        let mut save_after: Vec<usize> = checkpoint_rows
            .clone()
            .chain(snapshot_rows.iter().map(|&(row, _)| row))
            .collect();
        save_after.sort_unstable();
        save_after.dedup();
        let (state, checkpoints) = pages.recurrent_state_and_checkpoints(layer, seg.state_slot, seg.start == 0);
        let seg_rows = delta_net::Rows {
            mixed: &mixed.data[r.start * c..r.end * c],
            b: &b.data[r.start * vh..r.end * vh],
            a: &a.data[r.start * vh..r.end * vh],
        };
        let (seg_out, saved) = delta_net::gated_delta_net(spec, seg_rows, weights(), state, &save_after);
        out.extend(seg_out);
        let mut snapshots = Vec::with_capacity(snapshot_rows.len());
        for (row, state) in save_after.into_iter().zip(saved) {
            let saves = snapshot_rows.iter().filter(|&&(at, _)| at == row);
            snapshots.extend(saves.map(|&(_, snapshot)| (snapshot, state.clone())));
            if checkpoint_rows.contains(&row) {
                checkpoints.push(state);
            }
        }
        for (snapshot, state) in snapshots {
            pages.save_state(layer, snapshot, state);
        }
    }
    Ok(Tensor::new(vec![mixed.rows(), vh * spec.value_dim], out))
}

/// The reference's RMSNorm over groups of `w.len()`, spread over rows.
fn rms_norm(x: &[f32], w: &[f32], eps: f64, weight_offset: f32, out: &mut [f32]) {
    rows::for_row_runs(out, w.len(), |first, run| {
        let at = first * w.len();
        ops::rms_norm(&x[at..at + run.len()], w, eps, weight_offset, run);
    });
}

/// The reference's `[a + b | rms_norm(a + b)]` rows into `out`, in one pass over row runs.
fn add_rms_norm(a: &[f32], b: &[f32], w: &[f32], eps: f64, weight_offset: f32, out: &mut [f32]) {
    let d = w.len();
    rows::for_row_runs(out, 2 * d, |first, run| {
        let at = first * d;
        let inputs = a[at..].chunks_exact(d).zip(b[at..].chunks_exact(d));
        // Each row's sum is written as the norm takes the row.
        let halves = run.chunks_exact_mut(2 * d).zip(inputs).map(|(row, (a, b))| {
            let (sum, normed) = row.split_at_mut(d);
            for ((s, x), y) in sum.iter_mut().zip(a).zip(b) {
                *s = x + y;
            }
            (&*sum, normed)
        });
        ops::rms_norm_rows(halves, w, eps, weight_offset);
    });
}

/// `a + b` and its RMSNorm, apart, for an op that reads the normed rows whole.
fn add_rms_norm_apart(
    a: &[f32],
    b: &[f32],
    w: &[f32],
    eps: f64,
    weight_offset: f32,
    sum: &mut [f32],
    normed: &mut [f32],
) {
    for ((s, x), y) in sum.iter_mut().zip(a).zip(b) {
        *s = x + y;
    }
    rms_norm(sum, w, eps, weight_offset, normed);
}

/// Elementwise maps run on one thread: at decode sizes a parallel region costs more than it saves.
fn map(x: &Tensor, f: impl Fn(f32) -> f32) -> Tensor {
    Tensor::new(x.shape.clone(), x.data.iter().map(|&v| f(v)).collect())
}

fn zip_map(a: &Tensor, b: &Tensor, f: impl Fn(f32, f32) -> f32) -> Tensor {
    Tensor::new(
        a.shape.clone(),
        a.data.iter().zip(&b.data).map(|(&x, &y)| f(x, y)).collect(),
    )
}

/// Weights loaded for a model, by name and storage, and stacked weights by their parts: graphs
/// of one model share them.
#[derive(Default)]
pub struct WeightCache {
    loaded: HashMap<(String, DType), Arc<CpuWeight>>,
    /// Stacked weights by their parts' addresses (parts the cache keeps alive, so an address
    /// names one weight for as long as the cache lives).
    stacked: HashMap<Vec<usize>, Arc<CpuWeight>>,
    /// Picked rows by (the weight's address, group, start, len).
    picked: HashMap<(usize, usize, usize, usize), Arc<CpuWeight>>,
    /// INT8 heads by weight name: quantized at compile time (from the artifact) or at load.
    int8: HashMap<String, Int8Head>,
}

impl WeightCache {
    /// Provide the INT8 rows of weight `name`, computed at compile time.
    pub fn insert_int8(&mut self, name: String, rows: &quant::int8_rows::Int8Rows) {
        self.int8.insert(name, Int8Head::from_rows(rows));
    }
}

/// Give each Gated DeltaNet layer its convolution weights as f32 values, once at load time (its
/// kernel reads them all every step, in whatever storage they came).
fn widen_conv_weights(graph: &Graph, weights: &mut [Option<Arc<CpuWeight>>]) -> Result<()> {
    for (i, node) in graph.nodes().iter().enumerate() {
        if !matches!(node.op, Op::GatedDeltaNet(_)) {
            continue;
        }
        let conv = node.inputs[3].0;
        let widened = match weights[conv].as_deref() {
            Some(CpuWeight::Matrix(m)) => {
                let mut row = vec![0f32; m.cols];
                (0..m.rows).flat_map(|r| m.row_f32(r, &mut row).to_vec()).collect()
            }
            Some(CpuWeight::Vector(_)) => continue,
            // A graph from elsewhere (an edited artifact) may wire it to anything.
            None => {
                return Err(RuntimeError::Graph(format!(
                    "gated_delta_net %{i}: the convolution must be a weight matrix"
                )))
            }
        };
        weights[conv] = Some(Arc::new(CpuWeight::Vector(widened)));
    }
    Ok(())
}

/// Let go of the weights only weight transforms read (an MoE layer's experts one by one, once
/// stacked; the rows a `row_group_slice` picked from): steps read the transforms' results, so
/// the backend holds each weight's bytes once rather than its parts beside them.
fn release_folded_sources(graph: &Graph, weights: &mut [Option<Arc<CpuWeight>>]) {
    let mut read_by_steps = vec![false; weights.len()];
    for node in graph.nodes().iter().filter(|n| !n.op.is_weight_transform()) {
        for input in &node.inputs {
            read_by_steps[input.0] = true;
        }
    }
    for (_, out) in graph.outputs() {
        read_by_steps[out.0] = true;
    }
    for (weight, read) in weights.iter_mut().zip(read_by_steps) {
        if !read {
            *weight = None;
        }
    }
}

/// Fold the weight transforms of loaded weights into matrices: `RowGroupSlice` picks rows,
/// `ConcatRows` stacks them (rows are independent in every storage, so both move row bytes),
/// `TransposeRowGroups` transposes picked rows (moving values).
fn fold_weight_transforms(
    graph: &Graph,
    weights: &mut [Option<Arc<CpuWeight>>],
    cache: &mut WeightCache,
) -> Result<()> {
    for (i, node) in graph.nodes().iter().enumerate() {
        if let Op::TransposeRowGroups { group, start, len } = node.op {
            let transposed = match weights[node.inputs[0].0].as_deref() {
                Some(CpuWeight::Matrix(m)) => m.transpose_row_groups(group, start, len),
                _ => Err("it takes rows of something that is not a weight matrix".into()),
            };
            let transposed = transposed.map_err(|e| RuntimeError::Graph(format!("transpose_row_groups %{i}: {e}")))?;
            weights[i] = Some(Arc::new(CpuWeight::Matrix(transposed)));
            continue;
        }
        if let Op::RowGroupSlice { group, start, len } = node.op {
            let source = weights[node.inputs[0].0].clone();
            let key = (
                source.as_ref().map_or(0, |w| Arc::as_ptr(w) as usize),
                group,
                start,
                len,
            );
            if let Some(done) = cache.picked.get(&key) {
                weights[i] = Some(done.clone());
                continue;
            }
            let picked = match source.as_deref() {
                Some(CpuWeight::Matrix(m)) => m.row_group_slice(group, start, len),
                _ => Err("it takes rows of something that is not a weight matrix".into()),
            };
            let picked = picked.map_err(|e| RuntimeError::Graph(format!("row_group_slice %{i}: {e}")))?;
            let picked = Arc::new(CpuWeight::Matrix(picked));
            cache.picked.insert(key, picked.clone());
            weights[i] = Some(picked);
            continue;
        }
        if node.op != Op::ConcatRows {
            continue;
        }
        let parts: Vec<&Matrix> = node
            .inputs
            .iter()
            .map(|x| match weights[x.0].as_deref() {
                Some(CpuWeight::Matrix(m)) => Ok(m),
                _ => Err(RuntimeError::Graph(format!(
                    "concat_rows %{i} stacks something that is not a weight matrix"
                ))),
            })
            .collect::<Result<_>>()?;
        let key: Vec<usize> = node
            .inputs
            .iter()
            .map(|x| weights[x.0].as_ref().map_or(0, |w| Arc::as_ptr(w) as usize))
            .collect();
        if let Some(done) = cache.stacked.get(&key) {
            weights[i] = Some(done.clone());
            continue;
        }
        let stacked = Matrix::stack_rows(&parts).map_err(|e| RuntimeError::Graph(format!("concat_rows %{i}: {e}")))?;
        let stacked = Arc::new(CpuWeight::Matrix(stacked));
        cache.stacked.insert(key, stacked.clone());
        weights[i] = Some(stacked);
    }
    Ok(())
}

/// The order of every `PermuteColumns`: a weight naming each column once.
fn prepare_column_orders(graph: &Graph, weights: &[Option<Arc<CpuWeight>>]) -> Result<HashMap<usize, Vec<usize>>> {
    let mut orders = HashMap::new();
    for (i, node) in graph.nodes().iter().enumerate() {
        if node.op == Op::PermuteColumns {
            let Some(CpuWeight::Vector(values)) = weights[node.inputs[1].0].as_deref() else {
                return Err(RuntimeError::Graph(format!(
                    "permute_columns %{i} needs a weight vector"
                )));
            };
            let order =
                ops::column_order(values).map_err(|e| RuntimeError::Graph(format!("permute_columns %{i}: {e}")))?;
            orders.insert(i, order);
        }
    }
    Ok(orders)
}

/// The 4-bit copy of every `ShortlistTopK`'s head.
fn prepare_shortlist_heads(
    graph: &Graph,
    weights: &[Option<Arc<CpuWeight>>],
) -> Result<HashMap<usize, shortlist_head::ShortlistHead>> {
    let mut heads = HashMap::new();
    for (i, node) in graph.nodes().iter().enumerate() {
        if let Op::ShortlistTopK { .. } = node.op {
            let Some(CpuWeight::Matrix(w)) = weights[node.inputs[1].0].as_deref() else {
                return Err(RuntimeError::Graph(format!(
                    "shortlist_top_k %{i} needs a weight matrix"
                )));
            };
            let head = shortlist_head::ShortlistHead::prepare(w)
                .map_err(|e| RuntimeError::Graph(format!("shortlist_top_k %{i}: {e}")))?;
            heads.insert(i, head);
        }
    }
    Ok(heads)
}

/// The head of every `Int8BoundTopK`: quantized at compile time when the cache has it, else now.
fn prepare_int8_heads(
    graph: &Graph,
    weights: &[Option<Arc<CpuWeight>>],
    cache: &mut WeightCache,
) -> Result<HashMap<usize, Int8Head>> {
    let mut heads = HashMap::new();
    for (i, node) in graph.nodes().iter().enumerate() {
        if let Op::Int8BoundTopK { .. } = node.op {
            let w = node.inputs[1];
            let full = match weights[w.0].as_deref() {
                Some(CpuWeight::Matrix(m)) if !m.storage.is_block_quantized() => m,
                _ => {
                    return Err(RuntimeError::Graph(format!(
                        "int8_bound_top_k %{i} needs a full-precision (f32, bf16 or f16) head"
                    )))
                }
            };
            let name = match &graph.node(w).op {
                Op::Weight { name } => name.clone(),
                _ => format!("%{}", w.0),
            };
            let head = match cache.int8.get(&name) {
                Some(head) if head.rows() == full.rows && head.cols() == full.cols => head.clone(),
                _ => {
                    let head = Int8Head::prepare(full);
                    cache.int8.insert(name, head.clone());
                    head
                }
            };
            heads.insert(i, head);
        }
    }
    Ok(heads)
}

/// Load every weight node not cached yet, in parallel; a weight used twice (a tied LM head, two
/// graphs of one model) is loaded once.
fn load_weights(graph: &Graph, source: &dyn Tensors, cache: &mut WeightCache) -> Result<Vec<Option<Arc<CpuWeight>>>> {
    // Weights not in the cache yet, each once, loaded in parallel.
    let mut jobs: Vec<usize> = Vec::new();
    let mut queued = std::collections::HashSet::new();
    for (i, node) in graph.nodes().iter().enumerate() {
        if let Op::Weight { name } = &node.op {
            let key = (name.clone(), node.dtype);
            if !cache.loaded.contains_key(&key) && queued.insert(key) {
                jobs.push(i);
            }
        }
    }
    let loaded: Vec<Arc<CpuWeight>> = jobs
        .par_iter()
        .map(|&i| load_weight(graph, i, source).map(Arc::new))
        .collect::<Result<_>>()?;
    for (&i, w) in jobs.iter().zip(loaded) {
        let node = graph.node(ir::NodeId(i));
        let Op::Weight { name } = &node.op else {
            unreachable!("jobs are weight nodes")
        };
        cache.loaded.insert((name.clone(), node.dtype), w);
    }
    Ok(graph
        .nodes()
        .iter()
        .map(|node| match &node.op {
            Op::Weight { name } => cache.loaded.get(&(name.clone(), node.dtype)).cloned(),
            _ => None,
        })
        .collect())
}

fn load_weight(graph: &Graph, i: usize, source: &dyn Tensors) -> Result<CpuWeight> {
    let node = &graph.nodes()[i];
    let Op::Weight { name } = &node.op else {
        unreachable!("only weight nodes are loaded")
    };
    // A weight the source makes as it is read is taken as made, never held twice.
    let made = source.made_afresh(name);
    let view = match &made {
        Some(t) => quant::tensor::TensorView {
            shape: &t.shape,
            dtype: t.dtype,
            bytes: &t.bytes,
        },
        None => source
            .tensor(name)
            .ok_or_else(|| RuntimeError::Weight(format!("`{name}` is not in the weights")))?,
    };
    let shape = node.shape.resolve(0, 0);
    if view.shape != shape.as_slice() {
        return Err(RuntimeError::Weight(format!(
            "`{name}` has shape {:?}, the graph expects {shape:?}",
            view.shape
        )));
    }
    if let [len] = shape[..] {
        let data = view.to_f32().data;
        debug_assert_eq!(data.len(), len);
        return Ok(CpuWeight::Vector(data));
    }
    let (rows, cols) = (shape[0], shape[1]);
    let storage = match node.dtype {
        DType::F32 => Storage::F32(view.to_f32().data),
        // A file's halves as they are, others rounded to half (`--dtype f16` of a bf16 or f32
        // checkpoint); widened exactly as the kernels load them.
        DType::F16 => Storage::F16(match view.dtype {
            quant::GgmlType::F16 => view
                .bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]))
                .collect(),
            _ => view.to_f32().data.into_iter().map(half::f16::from_f32).collect(),
        }),
        DType::BF16 => Storage::Bf16(view.to_f32().data.into_iter().map(bf16::from_f32).collect()),
        DType::I32 => return Err(RuntimeError::Weight(format!("`{name}`: i32 weights are not matrices"))),
        quant => {
            if quant::tensor::ir_dtype(view.dtype) != quant {
                return Err(RuntimeError::Weight(format!(
                    "`{name}` is stored as {}, the graph expects {quant}",
                    view.dtype.name()
                )));
            }
            let (dtype, row_bytes) = (view.dtype, view.row_bytes());
            let bytes = match made {
                Some(t) => t.bytes,
                None => view.bytes.to_vec(),
            };
            Storage::block_rows(dtype, bytes, row_bytes).map_err(|e| RuntimeError::Weight(format!("`{name}`: {e}")))?
        }
    };
    Ok(CpuWeight::Matrix(Matrix { rows, cols, storage }))
}
