//! `bbc serve --speculative-model`: the draft model, on the CPU backend, checked to share the
//! target's vocabulary (the engine verifies a draft by its id, so an id must mean the same
//! token to both models).

use crate::model_ref;
use anyhow::{bail, Context, Result};
use models::{LogitsFor, Tokenizer};
use runtime::serving::{DraftModel, Drafter};

/// Cache blocks, block size and token budget for the draft model's own cache and passes.
pub struct DraftCache {
    pub blocks: usize,
    pub block_size: usize,
    pub token_budget: usize,
}

/// The draft model `arg` names (an artifact for the CPU, a model.toml, weights or a model
/// name), ready to draft for a target whose tokenizer is `target`.
pub fn load(arg: &str, target: &Tokenizer, cache: DraftCache) -> Result<Box<dyn Drafter>> {
    let options = model_ref::LoadOptions {
        dtype: None,
        kv_cache_dtype: None,
        max_model_len: None,
        logits: LogitsFor::LastToken,
        greedy: false,
        fuse: true,
        quiet: false,
    };
    let mut loaded = model_ref::load(arg, options).with_context(|| format!("--speculative-model {arg}"))?;
    if loaded.gpu_plan.is_some() {
        bail!("--speculative-model {arg}: a GPU artifact; the draft model runs on the CPU backend (give its weights or a CPU artifact)");
    }
    let draft_tokenizer = loaded.model.tokenizer.as_ref().with_context(|| {
        format!("--speculative-model {arg}: the model has no tokenizer to check against the target's")
    })?;
    same_vocabulary(target, draft_tokenizer).with_context(|| format!("--speculative-model {arg}"))?;
    let context_length = loaded.model.config.context_length;
    let mut weights = loaded.weight_cache();
    let backend = runtime::CpuBackend::with_cache(loaded.graph, &loaded.model.weights, context_length, &mut weights)?;
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
