//! The multi-token prediction layers a checkpoint carries after its decoder layers, lowered
//! to a draft graph of their own, and the target's graph made to output what they read.

use super::{
    glm4_moe, glm_moe_dsa, graph_error, qwen3_5, Builder, Catalog, HfPrefix, LowerOptions, Naming, TextPrefix,
};
use crate::config::{Family, ModelConfig};
use crate::error::{ModelError, Result};
use crate::weights::WeightSource;
use ir::{Graph, Op};

/// Lower the checkpoint's multi-token prediction layers (`ModelConfig::mtp_layers`) to the
/// graph of one draft step: from each token's id and the target's `hidden` state at the
/// position before it (the `HiddenStates` input), the logits of the token after it, through
/// the target's embedding and LM head. Its own attention layers keep their caches in slots
/// from 0; it outputs the hidden state its next chained step reads
/// (`ir::multi_token::DRAFT_HIDDEN_STATE`).
pub fn lower_mtp(config: &ModelConfig, weights: &WeightSource, options: LowerOptions) -> Result<Graph> {
    let naming = match (Naming::detect(weights), config.family) {
        // GLM's layers are numbered after the model's, under its own prefix.
        (naming, Family::Glm4Moe | Family::GlmMoeDsa) => naming,
        (Naming::Hf(prefix), _) => Naming::Hf(HfPrefix::Mtp(prefix.text())),
        (Naming::Gguf, family) => {
            return Err(mtp_unsupported(format!(
                "llama.cpp's {} files carry no multi-token prediction layers bbc reads",
                family.name()
            )))
        }
    };
    build_mtp(config, Catalog::Source(weights), naming, options)
}

/// [`lower_mtp`] of a model without weights (see [`lower_without_weights`]): HF names.
pub fn lower_mtp_without_weights(config: &ModelConfig, options: LowerOptions) -> Result<Graph> {
    let naming = match config.family {
        Family::Glm4Moe | Family::GlmMoeDsa => Naming::Hf(HfPrefix::Text),
        _ => Naming::Hf(HfPrefix::Mtp(TextPrefix::Text)),
    };
    build_mtp(config, Catalog::Implied { blocks: None }, naming, options)
}

impl Family {
    /// Whether bbc lowers this family's multi-token prediction layers ([`lower_mtp`]).
    pub fn lowers_mtp(self) -> bool {
        matches!(self, Self::Qwen35 | Self::Qwen3Next | Self::Glm4Moe | Self::GlmMoeDsa)
    }
}

fn mtp_unsupported(what: String) -> ModelError {
    ModelError::TensorShape {
        name: "mtp".into(),
        what,
    }
}

fn build_mtp(config: &ModelConfig, weights: Catalog<'_>, naming: Naming, options: LowerOptions) -> Result<Graph> {
    if config.mtp_layers == 0 {
        return Err(mtp_unsupported(format!(
            "this {} checkpoint has no multi-token prediction layers",
            config.family.name()
        )));
    }
    let name = format!("{}-mtp", config.family.name());
    let mut b = Builder::new(&name, weights, naming, options);
    match config.family {
        Family::Qwen35 | Family::Qwen3Next => qwen3_5::lower_mtp(config, &mut b)?,
        Family::Glm4Moe => glm4_moe::lower_mtp(config, &mut b)?,
        Family::GlmMoeDsa => glm_moe_dsa::lower_mtp(config, &mut b)?,
        family => {
            return Err(mtp_unsupported(format!(
                "bbc reads multi-token prediction layers of qwen3_5, qwen3_next, glm4_moe and glm_moe_dsa checkpoints, not {}",
                family.name()
            )))
        }
    }
    b.finish()
}

/// `graph` whose `hidden` output (the normed state its LM head reads) is also output for
/// every row of a step (`ir::multi_token::TARGET_HIDDEN_STATES`): what a multi-token
/// prediction head drafting for the model reads at each position it computed.
pub fn with_hidden_states(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    let missing = || ModelError::TensorShape {
        name: "graph".into(),
        what: "has no `hidden` output of a final norm".into(),
    };
    let hidden = g.output("hidden").ok_or_else(missing)?;
    let norm = g.node(hidden).clone();
    if !matches!(norm.op, Op::RmsNorm { .. }) {
        return Err(missing());
    }
    let rows = g.node(norm.inputs[0]);
    let every_row = match rows.op {
        Op::LastToken => rows.inputs[0],
        _ => norm.inputs[0],
    };
    let all = g
        .add(norm.op.clone(), &[every_row, norm.inputs[1]])
        .map_err(graph_error)?;
    g.set_output(ir::multi_token::TARGET_HIDDEN_STATES, all);
    g.validate().map_err(graph_error)?;
    Ok(g)
}
