//! `bbc serve` with `method: mtp`: the served model's multi-token prediction layers draft for
//! it. On the CPU backend the target's graphs are lowered again to also output its hidden
//! state at every row, which the head reads, and the head's graph shares the target's weights
//! (its embedding and LM head are the target's own, loaded once). A GPU artifact carries both
//! plans as `bbc compile` made them (its serving plan outputs the hidden states); the head's
//! plan runs beside the target's on the device.

use super::draft::DraftCache;
use crate::model_ref::{GpuPlanFiles, Loaded};
use anyhow::{bail, Context, Result};
use ir::multi_token::TARGET_HIDDEN_STATES;
use models::{LogitsFor, LowerOptions};
use runtime::serving::{Drafter, MtpDrafter, PagedBackend};

/// Make `loaded` (on the CPU backend) ready to be drafted for by its multi-token prediction
/// layers: its logits and greedy graphs output the hidden states the head reads. The head's
/// graph, giving its greedy token from `head`, optimized for the CPU.
pub fn prepare(loaded: &mut Loaded, head: super::DraftHead) -> Result<ir::Graph> {
    let model = &loaded.model;
    let options = LowerOptions {
        logits: LogitsFor::GreedyToken,
        compute: model.spec.dtype,
        kv_cache: model.spec.kv_cache_dtype,
    };
    let greedy_head = models::lower_mtp(&model.config, &model.weights, options).context("method `mtp`")?;
    let with_states = |logits| -> Result<ir::Graph> {
        let graph = models::with_hidden_states(&model.lower(logits)?)?;
        Ok(passes::optimized(&graph, passes::CostModel::CPU)?)
    };
    loaded.graph = with_states(LogitsFor::LastToken)?;
    if loaded.greedy.is_some() {
        loaded.greedy = Some(with_states(LogitsFor::GreedyToken)?);
    }
    head.optimized(&greedy_head)
}

/// A GPU artifact's multi-token prediction plan and graph, checked to draft for its serving
/// plan's graph `serving` (which outputs the hidden states the head reads).
pub fn gpu_plan(plans: &GpuPlanFiles, serving: &ir::Graph) -> Result<(String, ir::Graph)> {
    if let Some(head) = &plans.eagle_head {
        bail!(
            "method `mtp`: this GPU artifact's draft plan is the {} head in {}; serve it with that method and head",
            head.method,
            head.dir.display()
        );
    }
    let Some(mtp) = plans.mtp.clone() else {
        bail!(
            "method `mtp`: this GPU artifact has no multi-token prediction plan (its checkpoint carries no MTP layers bbc reads, or an older bbc compiled it)"
        );
    };
    if serving.output(TARGET_HIDDEN_STATES).is_none() {
        bail!("method `mtp`: this GPU artifact's serving plan does not output the hidden states its MTP plan reads; compile it again");
    }
    Ok(mtp)
}

/// A GPU artifact's draft head plan (`plan` in `dir`, its `graph`: multi-token prediction
/// layers' or an EAGLE head's) loaded over `weights` beside `target`'s plan (the embedding and
/// LM head read from its buffers, not uploaded again) with a pool of `cache`'s blocks (to be
/// resized beside the target's), its decode passes (a row per sequence) replayed as CUDA
/// graphs.
pub fn gpu_head(
    dir: &std::path::Path,
    plan: &str,
    graph: ir::Graph,
    (weights, context_length): (runtime::plan_exec::PlanWeights<'_>, usize),
    cache: &DraftCache,
    target: &runtime_cuda::CudaBackend,
) -> Result<runtime_cuda::CudaBackend> {
    let plan_cache = codegen::gpu::BatchedCache {
        blocks: cache.blocks,
        block_size: cache.block_size,
        sequences: cache.sequences,
    };
    let beside = target.shared_weights()?;
    Ok(
        runtime_cuda::load_batched_plan_beside(dir, plan, graph, weights, context_length, plan_cache, &beside)
            .context("the draft head's plan")?
            .capture_graphs_up_to(cache.graph_rows()),
    )
}

/// The drafter over the head's backend, with `cache`'s room.
pub fn drafter<B>(head: B, hidden: usize, context_length: usize, cache: &DraftCache) -> Result<Box<dyn Drafter>>
where
    B: PagedBackend + Send + 'static,
    B::Pages: Send,
{
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
