//! The mixture-of-experts MLP, shared by the families that have one (GLM-4.5, Qwen3-Next,
//! Qwen3.5-MoE): the router's logits, one `Op::Moe` over every expert's weights stacked
//! (`concat_rows`; an expert reads its own rows), and the shared experts' MLP beside it, gated
//! by `sigmoid(x · shared_expert_gate)` where the model has that gate. HF names, or llama.cpp's
//! for GGUF files (each projection's experts in one `[experts, rows, cols]` tensor, read as the
//! matrix of all their rows; the shared experts' `*_shexp`).

use super::{Builder, ExpertTensor, LayerTensor, Naming};
use crate::config::{ModelConfig, MoeConfig};
use crate::error::Result;
use ir::{GluAct, MoeSpec, NodeId, Op};

/// How a family names its shared experts: GLM's `mlp.shared_experts`, Qwen's
/// `mlp.shared_expert` (one, with `mlp.shared_expert_gate`).
#[derive(Debug, Clone, Copy)]
pub(super) enum SharedNames {
    Experts,
    Expert,
}

impl SharedNames {
    /// The shared experts' projection `t` (`gate`, `up` or `down`).
    fn name(self, naming: Naming, i: usize, t: &str) -> String {
        match (naming, self) {
            (Naming::Gguf, _) => format!("blk.{i}.ffn_{t}_shexp.weight"),
            (Naming::Hf(_), Self::Experts) => naming.hf_layer(i, &format!("mlp.shared_experts.{t}_proj.weight")),
            (Naming::Hf(_), Self::Expert) => naming.hf_layer(i, &format!("mlp.shared_expert.{t}_proj.weight")),
        }
    }

    /// Qwen's gate on its shared expert's output (`[1, hidden]`).
    fn gate(naming: Naming, i: usize) -> String {
        match naming {
            Naming::Gguf => format!("blk.{i}.ffn_gate_inp_shexp.weight"),
            Naming::Hf(_) => naming.hf_layer(i, "mlp.shared_expert_gate.weight"),
        }
    }
}

/// Layer `i`'s MLP over the normed `h`: the MoE one where the model has one in that layer
/// (layers after the model's, its multi-token prediction layers, as its last), else the dense
/// SwiGLU.
pub(super) fn mlp(c: &ModelConfig, b: &mut Builder, i: usize, h: NodeId, shared: SharedNames) -> Result<NodeId> {
    let sparse = |moe: &crate::config::MoeConfig| moe.sparse_layers.get(i).or(moe.sparse_layers.last()) == Some(&true);
    match &c.moe {
        Some(moe) if sparse(moe) => moe_mlp(c, moe, b, i, h, shared),
        _ => {
            let names = [LayerTensor::Gate, LayerTensor::Up, LayerTensor::Down].map(|t| b.naming.layer(i, t));
            b.gated_mlp(h, &names, c.hidden, c.intermediate, GluAct::Silu)
        }
    }
}

/// The MoE MLP of layer `i` over the normed `h`.
pub(super) fn moe_mlp(
    c: &ModelConfig,
    moe: &MoeConfig,
    b: &mut Builder,
    i: usize,
    h: NodeId,
    shared: SharedNames,
) -> Result<NodeId> {
    let (d, n) = (c.hidden, moe.expert_intermediate);
    let router = b.matrix(&b.naming.layer(i, LayerTensor::Router), moe.experts, d)?;
    let logits = b.matmul(h, router)?;
    let spec = MoeSpec {
        experts: moe.experts,
        experts_per_token: moe.experts_per_token,
        normalize: moe.normalize,
        intermediate: n,
        act: GluAct::Silu,
        router: moe.router,
    };
    let mut inputs = vec![h, logits];
    if spec.has_expert_vector() {
        inputs.push(b.vector(&b.naming.router_score_bias(i), moe.experts)?);
    }
    let (gate_up, down) = match b.naming {
        Naming::Hf(_) => experts_from_hf(moe, b, i, n, d)?,
        Naming::Gguf => experts_stacked(moe, b, i, n, d)?,
    };
    inputs.extend([gate_up, down]);
    let routed = b.op(Op::Moe(spec), &inputs)?;
    if moe.shared_intermediate == 0 {
        return Ok(routed);
    }
    let names = ["gate", "up", "down"].map(|t| shared.name(b.naming, i, t));
    let mut shared_out = b.gated_mlp(h, &names, d, moe.shared_intermediate, GluAct::Silu)?;
    if moe.shared_gate {
        let w = b.matrix(&SharedNames::gate(b.naming, i), 1, d)?;
        let gate = b.matmul(h, w)?;
        let gate = b.op(Op::Sigmoid, &[gate])?;
        shared_out = b.op(Op::ScaleRows, &[shared_out, gate])?;
    }
    b.add(routed, shared_out)
}

/// The `Op::Moe` weights from an HF checkpoint: its experts' fused tensors where it has them
/// (transformers 5's `mlp.experts.gate_up_proj`, `[experts, 2·I, hidden]` with each expert's
/// gate rows before its up rows, and `down_proj`, `[experts, hidden, I]`: the op's own
/// layout), else each expert's gate and up rows stacked after the previous expert's, and the
/// down projections likewise.
fn experts_from_hf(moe: &MoeConfig, b: &mut Builder, i: usize, n: usize, d: usize) -> Result<(NodeId, NodeId)> {
    for suffix in ["", ".weight"] {
        let fused = b.naming.hf_layer(i, &format!("mlp.experts.gate_up_proj{suffix}"));
        if b.has_weight(&fused) {
            let down = b.naming.hf_layer(i, &format!("mlp.experts.down_proj{suffix}"));
            return Ok((
                b.matrix(&fused, 2 * moe.experts * n, d)?,
                b.matrix(&down, moe.experts * d, n)?,
            ));
        }
    }
    let mut gate_up = Vec::with_capacity(2 * moe.experts);
    let mut down = Vec::with_capacity(moe.experts);
    for e in 0..moe.experts {
        gate_up.push(b.matrix(&b.naming.expert(i, e, ExpertTensor::Gate), n, d)?);
        gate_up.push(b.matrix(&b.naming.expert(i, e, ExpertTensor::Up), n, d)?);
        down.push(b.matrix(&b.naming.expert(i, e, ExpertTensor::Down), d, n)?);
    }
    Ok((b.op(Op::ConcatRows, &gate_up)?, b.op(Op::ConcatRows, &down)?))
}

/// The same from llama.cpp's stacked tensors: the down projections are already in order; each
/// expert's gate and up rows are picked from `ffn_gate_exps` and `ffn_up_exps` (a
/// `row_group_slice` of one group) and stacked in the op's order, unless the file holds them
/// fused (`ffn_gate_up_exps`, the converter's `--fuse-gate-up-exps`: per expert its gate rows
/// then its up rows, the op's order already).
pub(super) fn experts_stacked(
    moe: &MoeConfig,
    b: &mut Builder,
    i: usize,
    n: usize,
    d: usize,
) -> Result<(NodeId, NodeId)> {
    let rows = moe.experts * n;
    let down = b.matrix(&format!("blk.{i}.ffn_down_exps.weight"), moe.experts * d, n)?;
    let fused = format!("blk.{i}.ffn_gate_up_exps.weight");
    if b.has_weight(&fused) {
        return Ok((b.matrix(&fused, 2 * rows, d)?, down));
    }
    let gate = b.matrix(&format!("blk.{i}.ffn_gate_exps.weight"), rows, d)?;
    let up = b.matrix(&format!("blk.{i}.ffn_up_exps.weight"), rows, d)?;
    let mut gate_up = Vec::with_capacity(2 * moe.experts);
    for e in 0..moe.experts {
        for w in [gate, up] {
            let pick = Op::RowGroupSlice {
                group: rows,
                start: e * n,
                len: n,
            };
            gate_up.push(b.op(pick, &[w])?);
        }
    }
    Ok((b.op(Op::ConcatRows, &gate_up)?, down))
}
