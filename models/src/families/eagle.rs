//! An EAGLE head's draft step as a graph (see `crate::eagle` for what each method computes).

use super::{Builder, Catalog, LowerOptions, Naming};
use crate::config::ModelConfig;
use crate::eagle::{EagleHead, EagleMethod, HeadWeights};
use crate::error::Result;
use ir::{GluAct, Graph, InputKind, Op, RopeLayout};

/// The graph of one draft step of `head` drafting for `target` (see [`EagleHead::lower`]).
pub(crate) fn lower_eagle(
    head: &EagleHead,
    target: &ModelConfig,
    weights: HeadWeights<'_>,
    options: LowerOptions,
) -> Result<Graph> {
    let naming = Naming::detect(weights.target);
    let name = format!("{}-{}", target.family.name(), head.method.name());
    let mut b = Builder::new(&name, Catalog::WithEagleHead(weights), naming, options);
    let c = &head.config;
    let ids = b.graph.input(InputKind::TokenIds);
    let positions = b.graph.input(InputKind::Positions);
    let table = head.own_embedding().unwrap_or_else(|| naming.embedding());
    let table = b.matrix(&table, target.vocab_size, c.hidden)?;
    let embedded = b.op(Op::Embedding, &[table, ids])?;
    let hidden = b.graph.hidden_states_input(c.hidden);
    let layer = |name: &str| head.layer_tensor(name);
    // What the attention reads, its width, and the residual it adds to.
    let (attention_input, width, residual) = match head.method {
        EagleMethod::Eagle => {
            let joined = b.op(Op::ConcatColumns, &[embedded, hidden])?;
            let fc = b.matrix(&head.tensor_name("fc.weight"), c.hidden, 2 * c.hidden)?;
            let mut x = b.matmul(joined, fc)?;
            if let Some(bias) = head.fc_bias() {
                let bias = b.vector(&bias, c.hidden)?;
                x = b.op(Op::AddBias, &[x, bias])?;
            }
            // The first layer has no input norm.
            (x, c.hidden, x)
        }
        EagleMethod::Eagle3 => {
            let e = b.rms_norm(embedded, &layer("input_layernorm.weight"), c.hidden, c.rms_eps, 0.0)?;
            let h = b.rms_norm(hidden, &layer("hidden_norm.weight"), c.hidden, c.rms_eps, 0.0)?;
            let joined = b.op(Op::ConcatColumns, &[e, h])?;
            let residual = if head.norm_before_residual { h } else { hidden };
            (joined, 2 * c.hidden, residual)
        }
    };
    let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let wq = b.matrix(&layer("self_attn.q_proj.weight"), q_dim, width)?;
    let wk = b.matrix(&layer("self_attn.k_proj.weight"), kv_dim, width)?;
    let wv = b.matrix(&layer("self_attn.v_proj.weight"), kv_dim, width)?;
    let q = b.matmul(attention_input, wq)?;
    let k = b.matmul(attention_input, wk)?;
    let v = b.matmul(attention_input, wv)?;
    // The head's own RoPE (its config's θ and scaling), over HF's layout.
    let rope = super::llama::rope(c, RopeLayout::RotateHalf);
    let spec = b.causal_attention(c.heads, c.kv_heads, c.head_dim, 0);
    let a = b.rotary_attention([q, k, v], positions, rope, spec)?;
    let wo = b.matrix(&layer("self_attn.o_proj.weight"), c.hidden, q_dim)?;
    let o = b.matmul(a, wo)?;
    let x = b.add(residual, o)?;
    let h = b.rms_norm(x, &layer("post_attention_layernorm.weight"), c.hidden, c.rms_eps, 0.0)?;
    let mlp = ["gate_proj", "up_proj", "down_proj"].map(|p| layer(&format!("mlp.{p}.weight")));
    let m = b.gated_mlp(h, &mlp, c.hidden, c.intermediate, GluAct::Silu)?;
    let mut x = b.add(x, m)?;
    if options.logits != super::LogitsFor::AllTokens {
        x = b.op(Op::LastToken, &[x])?;
    }
    // The next chained step reads the state before any norm.
    b.graph.set_output(ir::multi_token::DRAFT_HIDDEN_STATE, x);
    match head.method {
        EagleMethod::Eagle => {
            // The target's head over the un-normed state.
            let lm_head = match target.tied_embeddings || !b.has_weight(&naming.lm_head()) {
                true => naming.embedding(),
                false => naming.lm_head(),
            };
            b.vocabulary_head(x, &lm_head, [target.vocab_size, c.hidden], target.final_logit_softcap)?;
        }
        EagleMethod::Eagle3 => {
            let normed = b.rms_norm(x, &head.tensor_name("norm.weight"), c.hidden, c.rms_eps, 0.0)?;
            b.vocabulary_head(
                normed,
                &head.tensor_name("lm_head.weight"),
                [head.draft_vocab, c.hidden],
                None,
            )?;
        }
    }
    b.finish()
}
