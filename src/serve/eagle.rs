//! `bbc serve` with method `eagle` or `eagle3`: an EAGLE head, in a directory of its own,
//! drafts for the served model on the CPU backend. The target's graphs are lowered again to
//! also output the hidden states the head reads (EAGLE-3's `fc` computed in the target's own
//! step), and every graph reads the target's tensors and the head's through one source, so the
//! embedding and LM head the head shares with the target are loaded once.

use super::draft::DraftCache;
use crate::model_ref::Loaded;
use anyhow::{ensure, Context, Result};
use models::eagle::{EagleHead, EagleMethod};
use models::{LogitsFor, LowerOptions};
use runtime::serving::{Drafter, MtpDrafter, PagedBackend};
use std::path::Path;

/// The EAGLE head in `dir` read as `method`, drafting for `loaded` (on the CPU backend), whose
/// graphs are made to output the states it reads; the head's graph, giving its greedy token
/// from `head`, optimized for the CPU.
pub fn prepare(
    loaded: &mut Loaded,
    method: EagleMethod,
    dir: &str,
    head: super::DraftHead,
) -> Result<(ir::Graph, EagleHead)> {
    let name = method.name();
    ensure!(
        loaded.gpu_plan.is_none(),
        "method `{name}`: EAGLE heads draft on the CPU backend; a GPU artifact drafts with method `mtp`, a draft model or `ngram`"
    );
    let path = Path::new(dir);
    ensure!(
        path.is_dir(),
        "method `{name}`: `model` must be the head's directory (config.json and safetensors), not {dir}"
    );
    let model = &loaded.model;
    let eagle = EagleHead::open(path, method, &model.config).with_context(|| format!("method `{name}`"))?;
    let options = |logits| LowerOptions {
        logits,
        compute: model.spec.dtype,
        kv_cache: model.spec.kv_cache_dtype,
    };
    let greedy_head = eagle
        .lower(&model.config, &model.weights, options(LogitsFor::GreedyToken))
        .with_context(|| format!("method `{name}`"))?;
    let with_states = |logits| -> Result<ir::Graph> {
        let graph = eagle.target_graph(&model.lower(logits)?, &model.weights, options(logits))?;
        Ok(passes::optimized(&graph, passes::CostModel::CPU)?)
    };
    loaded.graph = with_states(LogitsFor::LastToken)?;
    if loaded.greedy.is_some() {
        loaded.greedy = Some(with_states(LogitsFor::GreedyToken)?);
    }
    Ok((head.optimized(&greedy_head)?, eagle))
}

/// The drafter over the head's backend, with `cache`'s room; its ids mapped to the target's
/// where the head has a vocabulary of its own.
pub fn drafter<B>(head: B, eagle: &EagleHead, context_length: usize, cache: &DraftCache) -> Result<Box<dyn Drafter>>
where
    B: PagedBackend + Send + 'static,
    B::Pages: Send,
{
    let drafter = MtpDrafter::new(
        head,
        eagle.config.hidden,
        cache.blocks,
        cache.block_size,
        cache.token_budget,
        context_length,
    )
    .with_context(|| format!("method `{}`", eagle.method.name()))?;
    Ok(Box::new(match &eagle.token_map {
        Some(map) => drafter.with_token_map(map.clone()),
        None => drafter,
    }))
}
