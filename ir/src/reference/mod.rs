//! The reference interpreter: runs a [`Graph`] step by step on f32 tensors, keeping a KV cache
//! per attention cache slot. Slow and simple on purpose: it defines the numbers.

pub mod ops;

use crate::op::{AttentionSpec, InputKind, Op};
use crate::{Graph, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// Where the interpreter gets weights from (as dequantized f32).
pub trait WeightProvider {
    fn weight_f32(&self, name: &str) -> Result<Arc<Tensor>, String>;
}

#[derive(Debug, thiserror::Error)]
pub enum InterpError {
    #[error("weight `{name}`: {message}")]
    Weight { name: String, message: String },
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("{0}")]
    Input(String),
    #[error(transparent)]
    Graph(#[from] crate::GraphError),
}

/// The cached keys and values of one attention slot, with the position of each entry.
#[derive(Debug, Default, Clone)]
pub struct KvSlot {
    pub positions: Vec<usize>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

enum Value {
    F32(Tensor),
    Weight(Arc<Tensor>),
    Ids(Vec<usize>),
}

impl Value {
    fn tensor(&self) -> &Tensor {
        match self {
            Value::F32(t) => t,
            Value::Weight(t) => t,
            Value::Ids(_) => unreachable!("validated graphs never feed ids to a float operand"),
        }
    }
    fn ids(&self) -> &[usize] {
        match self {
            Value::Ids(ids) => ids,
            _ => unreachable!("validated graphs only feed i32 inputs to id operands"),
        }
    }
}

pub struct Interpreter<'w> {
    weights: &'w dyn WeightProvider,
    caches: HashMap<usize, KvSlot>,
    /// Per recurrent state slot (Gated DeltaNet layers): the sequence's state so far.
    states: HashMap<usize, Vec<f32>>,
}

impl<'w> Interpreter<'w> {
    pub fn new(weights: &'w dyn WeightProvider) -> Self {
        Self {
            weights,
            caches: HashMap::new(),
            states: HashMap::new(),
        }
    }

    /// Tokens held in the cache (the position the next step starts at).
    pub fn cached_len(&self) -> usize {
        self.caches.values().map(|c| c.positions.len()).max().unwrap_or(0)
    }

    /// Run one step over `token_ids` at `positions`; returns every named output.
    pub fn step(
        &mut self,
        graph: &Graph,
        token_ids: &[u32],
        positions: &[usize],
    ) -> Result<HashMap<String, Tensor>, InterpError> {
        self.step_with_hidden_states(graph, token_ids, positions, &[])
    }

    /// Like [`step`](Self::step), for a graph that also reads a hidden state per token (its
    /// `HiddenStates` input): `hidden_states` holds them row after row.
    pub fn step_with_hidden_states(
        &mut self,
        graph: &Graph,
        token_ids: &[u32],
        positions: &[usize],
        hidden_states: &[f32],
    ) -> Result<HashMap<String, Tensor>, InterpError> {
        if token_ids.len() != positions.len() || token_ids.is_empty() {
            return Err(InterpError::Input(format!(
                "{} token ids with {} positions",
                token_ids.len(),
                positions.len()
            )));
        }
        graph.validate()?;
        let mut values: Vec<Option<Value>> = Vec::with_capacity(graph.nodes().len());
        for node in graph.nodes() {
            let args: Vec<&Value> = node
                .inputs
                .iter()
                .map(|i| values[i.0].as_ref().expect("inputs precede"))
                .collect();
            let value = match &node.op {
                Op::Input(InputKind::TokenIds) => Value::Ids(token_ids.iter().map(|&t| t as usize).collect()),
                Op::Input(InputKind::Positions) => Value::Ids(positions.to_vec()),
                Op::Input(InputKind::HiddenStates) => {
                    let width = node.shape.resolve(token_ids.len(), 0)[1];
                    if hidden_states.len() != token_ids.len() * width {
                        return Err(InterpError::Input(format!(
                            "{} hidden-state values for {} tokens of {width}",
                            hidden_states.len(),
                            token_ids.len()
                        )));
                    }
                    Value::F32(Tensor::new(vec![token_ids.len(), width], hidden_states.to_vec()))
                }
                Op::Weight { name } => {
                    let t = self.weights.weight_f32(name).map_err(|message| InterpError::Weight {
                        name: name.clone(),
                        message,
                    })?;
                    let want = node.shape.resolve(0, 0);
                    if t.shape != want {
                        return Err(InterpError::Weight {
                            name: name.clone(),
                            message: format!("has shape {:?}, graph expects {want:?}", t.shape),
                        });
                    }
                    Value::Weight(t)
                }
                Op::LastToken if matches!(args[0], Value::Ids(_)) => {
                    Value::Ids(args[0].ids().last().copied().into_iter().collect())
                }
                op => Value::F32(self.eval(op, &args, positions)?),
            };
            values.push(Some(value));
        }
        Ok(graph
            .outputs()
            .iter()
            .map(|(name, id)| (name.clone(), values[id.0].as_ref().expect("evaluated").tensor().clone()))
            .collect())
    }

    /// Append `k` and `v` to the spec's cache slot, then attend over it with `q`.
    fn attend(&mut self, spec: &AttentionSpec, q: &Tensor, k: &Tensor, v: &Tensor, positions: &[usize]) -> Tensor {
        let slot = self.caches.entry(spec.cache_slot).or_default();
        let stored = |x: &f32| ops::stored_as(*x, spec.cache_dtype);
        slot.k.extend(k.data.iter().map(stored));
        slot.v.extend(v.data.iter().map(stored));
        slot.positions.extend_from_slice(positions);
        attention_over_slot(spec, q, slot, positions)
    }

    /// Attend with `q` over the spec's cache slot as an earlier attention of this step left it;
    /// `q` holds the step's rows, or its last ones (after `last_token`).
    fn attend_shared(&mut self, spec: &AttentionSpec, q: &Tensor, positions: &[usize]) -> Tensor {
        let slot = self.caches.entry(spec.cache_slot).or_default();
        let rows = q.rows().min(positions.len());
        attention_over_slot(spec, q, slot, &positions[positions.len() - rows..])
    }

    /// Append the step's latent rows (`[c | k_pe | index key]`, without the key where the layer
    /// shares another's indexer) to the spec's cache slot, then run every query over the
    /// positions it may see, their keys and values expanded from the latents
    /// (`ops::mla_expand`), ranked by the index keys in the spec's `index_slot`.
    fn sparse_mla(&mut self, spec: &crate::SparseMlaSpec, x: &[&Tensor], positions: &[usize]) -> Tensor {
        let slot = self.caches.entry(spec.cache_slot).or_default();
        for t in 0..x[0].rows() {
            slot.k.extend_from_slice(x[2].row(t));
            slot.k.extend_from_slice(x[3].row(t));
            if spec.has_own_indexer() {
                slot.k.extend_from_slice(x[8].row(t));
            }
        }
        slot.positions.extend_from_slice(positions);
        let slot = &self.caches[&spec.cache_slot];
        let expanded: Vec<(Vec<f32>, Vec<f32>)> = slot
            .k
            .chunks_exact(spec.cache_width())
            .map(|row| ops::mla_expand(spec, &x[4].data, &x[5].data, row))
            .collect();
        // The index keys' slot caches the same positions, in the same order, with rows of the
        // full layer's width.
        let index = &self.caches[&spec.index_slot];
        let index_width = spec.latent_dim + spec.rope_dim + spec.index_dim;
        let index_key = |j: usize| &index.k[j * index_width + spec.index_key_offset()..(j + 1) * index_width];
        let mut out = Vec::with_capacity(x[0].rows() * spec.out_width());
        for (t, &p) in positions.iter().enumerate() {
            let candidates: Vec<ops::MlaCandidate> = (0..slot.positions.len())
                .filter(|&j| slot.positions[j] <= p)
                .map(|j| ops::MlaCandidate {
                    key: &expanded[j].0,
                    value: &expanded[j].1,
                    index_key: index_key(j),
                })
                .collect();
            let q = [x[0].row(t), x[1].row(t), x[6].row(t), x[7].row(t)];
            out.extend(ops::sparse_mla_query(spec, q, &candidates));
        }
        Tensor::new(vec![x[0].rows(), spec.out_width()], out)
    }

    fn eval(&mut self, op: &Op, args: &[&Value], positions: &[usize]) -> Result<Tensor, InterpError> {
        Ok(match op {
            Op::Embedding => embedding(args[0].tensor(), args[1].ids())?,
            Op::MatMul => {
                let (x, w) = (args[0].tensor(), args[1].tensor());
                let (k, n) = (x.row_len(), w.rows());
                let mut out = Tensor::zeros(vec![x.rows(), n]);
                ops::matmul(&x.data, &w.data, k, &mut out.data);
                out
            }
            Op::RmsNorm { eps, weight_offset, .. } => {
                let x = args[0].tensor();
                let mut out = Tensor::zeros(x.shape.clone());
                ops::rms_norm(&x.data, &args[1].tensor().data, *eps, *weight_offset, &mut out.data);
                out
            }
            Op::Rope(spec) => {
                let mut x = args[0].tensor().clone();
                ops::rope(spec, &mut x.data, args[1].ids());
                x
            }
            Op::Attention(spec) => self.attend(spec, args[0].tensor(), args[1].tensor(), args[2].tensor(), positions),
            Op::RopeAttention { rope, attention } => {
                let (mut q, mut k) = (args[0].tensor().clone(), args[1].tensor().clone());
                let (heads, kv_heads) = (attention.heads, attention.kv_heads);
                ops::rope_q_k(rope, heads, kv_heads, &mut q.data, &mut k.data, args[3].ids());
                self.attend(attention, &q, &k, args[2].tensor(), positions)
            }
            Op::Add => zip_map(args[0].tensor(), args[1].tensor(), |a, b| a + b),
            Op::Mul => zip_map(args[0].tensor(), args[1].tensor(), |a, b| a * b),
            Op::Scale { factor } => map(args[0].tensor(), |a| a * factor),
            Op::Silu => map(args[0].tensor(), ops::silu),
            Op::GeluTanh => map(args[0].tensor(), ops::gelu_tanh),
            Op::LastToken => {
                let x = args[0].tensor();
                Tensor::new(vec![1, x.row_len()], x.row(x.rows() - 1).to_vec())
            }
            Op::AddBias => {
                let x = args[0].tensor();
                Tensor::new(x.shape.clone(), ops::add_bias(&x.data, &args[1].tensor().data))
            }
            Op::Moe(spec) => {
                let x = args[0].tensor();
                let data = |i: usize| args[i].tensor().data.as_slice();
                let (bias, weights) = match spec.has_expert_vector() {
                    true => (data(2), 3),
                    false => (&[][..], 2),
                };
                let out = ops::moe(&x.data, data(1), bias, data(weights), data(weights + 1), spec);
                Tensor::new(x.shape.clone(), out)
            }
            Op::RowGroupSlice { group, start, len } => {
                let w = args[0].tensor();
                let data = ops::row_group_slice(&w.data, w.row_len(), *group, *start, *len);
                Tensor::new(vec![data.len() / w.row_len(), w.row_len()], data)
            }
            Op::TransposeRowGroups { group, start, len } => {
                let w = args[0].tensor();
                let data = ops::transpose_row_groups(&w.data, w.row_len(), *group, *start, *len);
                Tensor::new(vec![data.len() / len, *len], data)
            }
            Op::Sigmoid => map(args[0].tensor(), ops::sigmoid),
            Op::SoftCap { cap } => map(args[0].tensor(), |x| ops::soft_cap(x, *cap)),
            Op::SharedKvAttention(spec) => self.attend_shared(spec, args[0].tensor(), positions),
            Op::PermuteColumns => {
                let (x, order) = (args[0].tensor(), args[1].tensor());
                let order = ops::column_order(&order.data).map_err(InterpError::Input)?;
                Tensor::new(x.shape.clone(), ops::permute_columns(&x.data, &order))
            }
            Op::ScaleRows => {
                let (x, scalars) = (args[0].tensor(), args[1].tensor());
                Tensor::new(x.shape.clone(), ops::scale_rows(&x.data, x.row_len(), &scalars.data))
            }
            Op::LayerNorm { eps } => {
                let x = args[0].tensor();
                let (w, b) = (&args[1].tensor().data, &args[2].tensor().data);
                Tensor::new(x.shape.clone(), ops::layer_norm(&x.data, w, b, *eps))
            }
            Op::SparseMla(spec) => {
                let inputs: Vec<&Tensor> = args.iter().map(|a| a.tensor()).collect();
                self.sparse_mla(spec, &inputs, positions)
            }
            Op::UnitRmsNorm { eps, group } => {
                let x = args[0].tensor();
                Tensor::new(x.shape.clone(), ops::unit_rms_norm(&x.data, *group, *eps))
            }
            Op::GroupSlice { group, start, len } => {
                let x = args[0].tensor();
                let data = ops::group_slice(&x.data, *group, *start, *len);
                Tensor::new(vec![x.rows(), data.len() / x.rows()], data)
            }
            Op::GatedDeltaNet(spec) => {
                let state = self
                    .states
                    .entry(spec.state_slot)
                    .or_insert_with(|| vec![0.0; spec.state_len()]);
                let [mixed, b, a, conv, a_log, dt_bias] = [0, 1, 2, 3, 4, 5].map(|i| &args[i].tensor().data);
                let out = ops::gated_delta_net(spec, mixed, b, a, conv, a_log, dt_bias, state);
                Tensor::new(vec![args[0].tensor().rows(), spec.value_heads * spec.value_dim], out)
            }
            Op::Slice { start, len } => {
                let x = args[0].tensor();
                Tensor::new(
                    vec![x.rows(), *len],
                    ops::slice_columns(&x.data, x.row_len(), *start, *len),
                )
            }
            Op::ConcatColumns => {
                let (a, b) = (args[0].tensor(), args[1].tensor());
                let data = a
                    .data
                    .chunks(a.row_len())
                    .zip(b.data.chunks(b.row_len()))
                    .flat_map(|(x, y)| x.iter().chain(y).copied())
                    .collect();
                Tensor::new(vec![a.rows(), a.row_len() + b.row_len()], data)
            }
            Op::ConcatRows => {
                let k = args[0].tensor().row_len();
                let data: Vec<f32> = args.iter().flat_map(|a| a.tensor().data.iter().copied()).collect();
                Tensor::new(vec![data.len() / k, k], data)
            }
            Op::AddRmsNorm { eps, weight_offset } => {
                let (a, b, w) = (args[0].tensor(), args[1].tensor(), args[2].tensor());
                Tensor::new(
                    vec![a.rows(), 2 * a.row_len()],
                    ops::add_rms_norm(&a.data, &b.data, &w.data, *eps, *weight_offset),
                )
            }
            Op::RmsNormMatMul { eps, weight_offset } => {
                let (x, w, m) = (args[0].tensor(), args[1].tensor(), args[2].tensor());
                let mut normed = vec![0f32; x.data.len()];
                ops::rms_norm(&x.data, &w.data, *eps, *weight_offset, &mut normed);
                let mut out = Tensor::zeros(vec![x.rows(), m.rows()]);
                ops::matmul(&normed, &m.data, x.row_len(), &mut out.data);
                out
            }
            Op::AddRmsNormMatMul {
                eps,
                weight_offset,
                glu,
            } => {
                let (a, b, w, m) = (args[0].tensor(), args[1].tensor(), args[2].tensor(), args[3].tensor());
                let (d, n) = (a.row_len(), m.rows());
                let summed = ops::add_rms_norm(&a.data, &b.data, &w.data, *eps, *weight_offset);
                let mut product = vec![0f32; a.rows() * n];
                ops::matmul(&ops::slice_columns(&summed, 2 * d, d, d), &m.data, d, &mut product);
                let (product, n) = match glu {
                    Some(act) => (ops::glu(&product, n, *act), n / 2),
                    None => (product, n),
                };
                let sum = ops::slice_columns(&summed, 2 * d, 0, d);
                Tensor::new(vec![a.rows(), d + n], ops::concat_columns(&sum, d, &product, n))
            }
            Op::Glu { act } => {
                let x = args[0].tensor();
                Tensor::new(vec![x.rows(), x.row_len() / 2], ops::glu(&x.data, x.row_len(), *act))
            }
            Op::Elementwise { expr } => {
                let first = args[0].tensor();
                let mut inputs = vec![0f32; args.len()];
                let data = (0..first.data.len())
                    .map(|i| {
                        for (slot, a) in inputs.iter_mut().zip(args) {
                            *slot = a.tensor().data[i];
                        }
                        expr.eval(&inputs)
                    })
                    .collect();
                Tensor::new(first.shape.clone(), data)
            }
            Op::TopK { k } => top_k_rows(args[0].tensor(), *k),
            // The meaning of the INT8-bound head is the exact top-k of the full product; how it
            // gets there (bounds, rescoring) is the backend's business.
            Op::Int8BoundTopK { k, soft_cap } => {
                let (h, w) = (args[0].tensor(), args[1].tensor());
                let mut logits = Tensor::zeros(vec![h.rows(), w.rows()]);
                ops::matmul(&h.data, &w.data, h.row_len(), &mut logits.data);
                if let Some(cap) = soft_cap {
                    logits = map(&logits, |x| ops::soft_cap(x, *cap));
                }
                top_k_rows(&logits, *k)
            }
            Op::ShortlistTopK { k, candidates } => {
                let (h, w) = (args[0].tensor(), args[1].tensor());
                let d = w.row_len();
                let coarse: Vec<f32> = w.data.chunks(d).flat_map(ops::four_bit_row).collect();
                let data = (0..h.rows())
                    .flat_map(|r| {
                        let row = h.row(r);
                        let scores = |w: &[f32]| -> Vec<f32> { w.chunks(d).map(|v| ops::dot(row, v) as f32).collect() };
                        let shortlist = ops::top_k(&scores(&coarse), (*candidates).min(w.rows()));
                        let exact: Vec<f32> = shortlist.iter().map(|&v| ops::dot(row, w.row(v)) as f32).collect();
                        // The shortlist's own order is by coarse score: rank by exact score,
                        // ties to the lowest id.
                        let mut ranked: Vec<usize> = (0..shortlist.len()).collect();
                        ranked.sort_by(|&a, &b| exact[b].total_cmp(&exact[a]).then(shortlist[a].cmp(&shortlist[b])));
                        ranked
                            .into_iter()
                            .take(*k)
                            .map(|i| shortlist[i] as f32)
                            .collect::<Vec<_>>()
                    })
                    .collect();
                Tensor::new(vec![h.rows(), *k], data)
            }
            Op::Input(_) | Op::Weight { .. } => unreachable!("handled by step"),
        })
    }
}

/// Token ids as values of an f32 tensor (exact below 2²⁴, far above any vocabulary).
fn top_k_rows(x: &Tensor, k: usize) -> Tensor {
    let data = (0..x.rows())
        .flat_map(|r| ops::top_k(x.row(r), k))
        .map(|i| i as f32)
        .collect();
    Tensor::new(vec![x.rows(), k], data)
}

fn embedding(table: &Tensor, ids: &[usize]) -> Result<Tensor, InterpError> {
    let d = table.row_len();
    let mut out = Vec::with_capacity(ids.len() * d);
    for &id in ids {
        if id >= table.rows() {
            return Err(InterpError::TokenOutOfRange {
                id: id as u32,
                vocab: table.rows(),
            });
        }
        out.extend_from_slice(table.row(id));
    }
    Ok(Tensor::new(vec![ids.len(), d], out))
}

/// Causal (optionally windowed) softmax attention of `q` over everything in `slot`, with
/// grouped KV heads (query head h reads KV head h / (heads / kv_heads)); f64 accumulation.
pub fn attention_over_slot(spec: &AttentionSpec, q: &Tensor, slot: &KvSlot, q_positions: &[usize]) -> Tensor {
    let hd = spec.head_dim;
    let kv_dim = spec.kv_heads * hd;
    let group = spec.heads / spec.kv_heads;
    let mut out = Tensor::zeros(q.shape.clone());
    for (t, &qp) in q_positions.iter().enumerate() {
        for h in 0..spec.heads {
            let kvh = h / group;
            let qv = &q.row(t)[h * hd..(h + 1) * hd];
            let visible: Vec<usize> = (0..slot.positions.len())
                .filter(|&j| ops::attends(qp, slot.positions[j], spec.window))
                .collect();
            let scores: Vec<f64> = visible
                .iter()
                .map(|&j| {
                    let kr = &slot.k[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd];
                    qv.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * spec.scale
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = exps.iter().sum();
            let o = &mut out.data[t * spec.heads * hd + h * hd..t * spec.heads * hd + (h + 1) * hd];
            for (d, od) in o.iter_mut().enumerate() {
                let acc: f64 = visible
                    .iter()
                    .zip(&exps)
                    .map(|(&j, &e)| e * slot.v[j * kv_dim + kvh * hd + d] as f64)
                    .sum();
                *od = (acc / total) as f32;
            }
        }
    }
    out
}

fn map(x: &Tensor, f: impl Fn(f32) -> f32) -> Tensor {
    Tensor::new(x.shape.clone(), x.data.iter().map(|&a| f(a)).collect())
}

fn zip_map(a: &Tensor, b: &Tensor, f: impl Fn(f32, f32) -> f32) -> Tensor {
    Tensor::new(
        a.shape.clone(),
        a.data.iter().zip(&b.data).map(|(&x, &y)| f(x, y)).collect(),
    )
}
