//! `bbc serve` with method `eagle` or `eagle3`: an EAGLE head, in a directory of its own,
//! drafts for the served model. On the CPU backend the target's graphs are lowered again to
//! also output the hidden states the head reads (EAGLE-3's `fc` computed in the target's own
//! step); a GPU artifact carries both plans as `bbc compile --speculative-config` made them.
//! Every graph reads the target's tensors and the head's through one source, so the embedding
//! and LM head the head shares with the target are loaded once.

use super::draft::DraftCache;
use crate::model_ref::{GpuPlanFiles, Loaded};
use anyhow::{bail, ensure, Context, Result};
use models::eagle::{EagleHead, EagleMethod};
use models::LogitsFor;
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
    let eagle = open(loaded, method, dir)?;
    let model = &loaded.model;
    let greedy_head = eagle
        .lower(
            &model.config,
            &model.weights,
            model.lower_options(LogitsFor::GreedyToken),
        )
        .with_context(|| format!("method `{name}`"))?;
    let with_states = |logits| -> Result<ir::Graph> {
        let graph = eagle.target_graph(&model.lower(logits)?, &model.weights, model.lower_options(logits))?;
        Ok(passes::optimized(&graph, passes::CostModel::CPU)?)
    };
    loaded.graph = with_states(LogitsFor::LastToken)?;
    if loaded.greedy.is_some() {
        loaded.greedy = Some(with_states(LogitsFor::GreedyToken)?);
    }
    Ok((head.optimized(&greedy_head)?, eagle))
}

/// The EAGLE head in `dir`, read as `method` for `loaded`'s model.
fn open(loaded: &Loaded, method: EagleMethod, dir: &str) -> Result<EagleHead> {
    let name = method.name();
    let path = Path::new(dir);
    ensure!(
        path.is_dir(),
        "method `{name}`: `model` must be the head's directory (config.json and safetensors), not {dir}"
    );
    EagleHead::open(path, method, &loaded.model.config).with_context(|| format!("method `{name}`"))
}

/// The EAGLE head in `dir` read as `method`, checked to be the one `loaded`'s GPU artifact
/// (`plans`) was compiled with, and the artifact's plan of it and its graph.
pub fn gpu_plan(
    loaded: &Loaded,
    plans: &GpuPlanFiles,
    method: EagleMethod,
    dir: &str,
) -> Result<(EagleHead, (String, ir::Graph))> {
    let name = method.name();
    let head = open(loaded, method, dir)?;
    let compile_with =
        format!("compile it with --speculative-config '{{\"method\": \"{name}\", \"model\": \"{dir}\"}}'");
    let (Some(compiled), Some(plan)) = (&plans.eagle_head, plans.mtp.clone()) else {
        bail!("method `{name}`: this GPU artifact has no EAGLE head's plan; {compile_with}");
    };
    let here = std::fs::canonicalize(&head.dir).with_context(|| head.dir.display().to_string())?;
    if compiled.method != name || compiled.dir != here {
        bail!(
            "method `{name}`: this GPU artifact was compiled with the {} head in {}, not this one; {compile_with}",
            compiled.method,
            compiled.dir.display()
        );
    }
    if codegen::hash_weights(&here)? != compiled.weights_sha256 {
        bail!(
            "method `{name}`: the head in {} changed since the artifact was compiled; {compile_with}",
            here.display()
        );
    }
    Ok((head, plan))
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
