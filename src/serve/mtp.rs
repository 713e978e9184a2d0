//! `bbc serve` with `method: mtp`: the served model's multi-token prediction layers draft for
//! it on the CPU backend. The target's graph is lowered again to also output its hidden state
//! at every row, which the head reads; the head's graph shares the target's weights (its
//! embedding and LM head are the target's own, loaded once).

use super::draft::DraftCache;
use crate::model_ref::Loaded;
use anyhow::{bail, Context, Result};
use models::{LogitsFor, LowerOptions};
use runtime::serving::{Drafter, MtpDrafter};

/// Make `loaded` ready to be drafted for by its multi-token prediction layers: its logits
/// graph outputs the hidden states the head reads, and it has no greedy graph (whose steps
/// return ids alone, not the hidden states). The head's graph, giving its greedy token from
/// `head`, optimized for the CPU.
pub fn prepare(loaded: &mut Loaded, head: super::DraftHead) -> Result<ir::Graph> {
    if loaded.gpu_plan.is_some() {
        bail!(
            "method `mtp` drafts on the CPU backend: serve the model's weights or a CPU artifact, not a GPU artifact"
        );
    }
    let model = &loaded.model;
    let options = LowerOptions {
        logits: LogitsFor::GreedyToken,
        compute: model.spec.dtype,
        kv_cache: model.spec.kv_cache_dtype,
    };
    let greedy = models::lower_mtp(&model.config, &model.weights, options).context("method `mtp`")?;
    let target = models::with_hidden_states(&model.lower(LogitsFor::LastToken)?)?;
    let graph = head.optimized(&greedy)?;
    loaded.graph = passes::optimized(&target, passes::CostModel::CPU)?;
    loaded.greedy = None;
    Ok(graph)
}

/// The drafter over the head's backend, with `cache`'s room.
pub fn drafter(
    head: runtime::CpuBackend,
    hidden: usize,
    context_length: usize,
    cache: &DraftCache,
) -> Result<Box<dyn Drafter>> {
    let drafter = MtpDrafter::new(
        head,
        hidden,
        cache.blocks,
        cache.block_size,
        cache.token_budget,
        context_length,
    )
    .context("method `mtp`")?;
    Ok(Box::new(drafter))
}
