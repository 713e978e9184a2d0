//! `bbc serve --speculative-model`: the draft model, on the CPU backend, checked to share the
//! target's vocabulary (the engine verifies a draft by its id, so an id must mean the same
//! token to both models).

use crate::model_ref;
use anyhow::{bail, Context, Result};
use models::Tokenizer;
use runtime::serving::{DraftModel, Drafter, PagedBackend};

/// Cache blocks, block size, token budget and sequences at once for the draft model's own
/// cache and passes.
#[derive(Debug, Clone, Copy)]
pub struct DraftCache {
    pub blocks: usize,
    pub block_size: usize,
    pub token_budget: usize,
    pub sequences: usize,
    /// Whether a GPU drafter's passes replay CUDA graphs (not under `--enforce-eager`).
    pub graphs: bool,
}

impl DraftCache {
    /// The rows of a GPU drafter's passes that replay CUDA graphs: a row per sequence, or none.
    pub fn graph_rows(&self) -> usize {
        match self.graphs {
            true => self.sequences,
            false => 0,
        }
    }
}

/// The draft model `arg` names (an artifact, a model.toml, weights or a model name), ready
/// to draft for a target whose tokenizer is `target`, and where it runs: a GPU artifact on
/// its batched serving plan (decode passes replayed as CUDA graphs), anything else on the CPU
/// backend, whose greedy passes take its head as `head` says.
pub fn load(
    arg: &str,
    target: &Tokenizer,
    cache: DraftCache,
    head: super::DraftHead,
) -> Result<(Box<dyn Drafter>, &'static str)> {
    // Its greedy graph is lowered below, with the head asked for (none on a GPU plan).
    let mut loaded = model_ref::load(arg, model_ref::LoadOptions::default())
        .with_context(|| format!("--speculative-model {arg}"))?;
    let draft_tokenizer = loaded.model.tokenizer.as_ref().with_context(|| {
        format!("--speculative-model {arg}: the model has no tokenizer to check against the target's")
    })?;
    same_vocabulary(target, draft_tokenizer).with_context(|| format!("--speculative-model {arg}"))?;
    let context_length = loaded.model.config.context_length;
    match loaded.gpu_plan.take() {
        Some(plans) => {
            let (plan, graph) = plans.serving.with_context(|| {
                format!("--speculative-model {arg}: this GPU artifact has no serving plan (an older bbc compiled it); compile it again")
            })?;
            let plan_cache = codegen::gpu::BatchedCache {
                blocks: cache.blocks,
                block_size: cache.block_size,
                sequences: cache.sequences,
            };
            let (weights, int8) = (loaded.plan_weights(), &loaded.int8_heads);
            let backend =
                runtime_cuda::load_batched_plan(&plans.dir, &plan, graph, weights, int8, context_length, plan_cache)?
                    // A drafting pass has a row per sequence.
                    .capture_graphs_up_to(cache.graph_rows())
                    // A model with recurrent state: a snapshot place per sequence, to go back to
                    // past the drafts the target refuses.
                    .keep_state_snapshots(cache.sequences)?;
            Ok((drafter(backend, &cache, context_length, arg)?, "on the GPU"))
        }
        None => {
            // Its greedy steps (every drafting pass) through the head as asked.
            let greedy = loaded.model.lower(models::LogitsFor::GreedyToken)?;
            loaded.greedy = Some(head.optimized(&greedy)?);
            Ok((
                drafter(super::cpu_serving(loaded)?, &cache, context_length, arg)?,
                "on the CPU backend",
            ))
        }
    }
}

/// A drafter over `backend` with `cache`'s room, over contexts of `context_length`.
fn drafter<B>(backend: B, cache: &DraftCache, context_length: usize, arg: &str) -> Result<Box<dyn Drafter>>
where
    B: PagedBackend + Send + 'static,
    B::Pages: Send,
{
    let drafter = DraftModel::new(
        backend,
        cache.blocks,
        cache.block_size,
        cache.token_budget,
        context_length,
    )
    .with_context(|| format!("--speculative-model {arg}"))?;
    Ok(Box::new(drafter))
}

/// Whether every id decodes to the same text under both tokenizers.
fn same_vocabulary(target: &Tokenizer, draft: &Tokenizer) -> Result<()> {
    let (size, draft_size) = (target.vocab_size(), draft.vocab_size());
    if size != draft_size {
        bail!("its vocabulary has {draft_size} tokens, the target's {size}: a draft model must share the target's tokenizer");
    }
    for id in 0..size as u32 {
        let (a, b) = (target.decode(&[id])?, draft.decode(&[id])?);
        if a != b {
            bail!("token {id} is {b:?} to it and {a:?} to the target: a draft model must share the target's tokenizer");
        }
    }
    Ok(())
}
