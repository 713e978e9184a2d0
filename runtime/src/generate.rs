//! The generation loop: prefill the prompt in chunks, then decode one token at a time.

use crate::cpu::{CpuBackend, CpuSequence};
use crate::error::{Result, RuntimeError};
use crate::sampling::{Sampler, SamplingParams};

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops after emitting one of these (e.g. EOS); empty to never stop early.
    pub stop_tokens: Vec<u32>,
    /// Prompt tokens per prefill step (bounds activation memory on long prompts).
    pub prefill_chunk: usize,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: 64,
            sampling: SamplingParams::default(),
            stop_tokens: Vec::new(),
            prefill_chunk: 512,
        }
    }
}

/// What each step produced: the chosen token and the logits it was chosen from.
pub struct StepEvent<'a> {
    pub token: u32,
    pub logits: &'a [f32],
}

/// Generate up to `max_tokens` after `prompt`. `on_step` sees every token as it is chosen and
/// returns `false` to stop. Returns the generated ids.
pub fn generate(
    backend: &CpuBackend,
    prompt: &[u32],
    options: &GenerateOptions,
    mut on_step: impl FnMut(StepEvent) -> Result<bool>,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(RuntimeError::Input("the prompt is empty".into()));
    }
    let needed = prompt.len() + options.max_tokens;
    if needed > backend.context_length() {
        return Err(RuntimeError::ContextOverflow {
            needed,
            limit: backend.context_length(),
        });
    }
    let mut seq: CpuSequence = backend.new_sequence();
    let mut logits = Vec::new();
    for chunk in prompt.chunks(options.prefill_chunk.max(1)) {
        logits = last_logits(backend, &mut seq, chunk)?;
    }
    let mut sampler = Sampler::new(options.sampling);
    let mut out = Vec::with_capacity(options.max_tokens);
    while out.len() < options.max_tokens {
        let token = sampler.sample(&logits);
        out.push(token);
        let go_on = on_step(StepEvent { token, logits: &logits })?;
        if !go_on || options.stop_tokens.contains(&token) || out.len() == options.max_tokens {
            break;
        }
        logits = last_logits(backend, &mut seq, &[token])?;
    }
    Ok(out)
}

fn last_logits(backend: &CpuBackend, seq: &mut CpuSequence, ids: &[u32]) -> Result<Vec<f32>> {
    let outputs = backend.step(seq, ids)?;
    let logits = outputs
        .get("logits")
        .ok_or_else(|| RuntimeError::Graph("the graph has no `logits` output".into()))?;
    Ok(logits.row(logits.rows() - 1).to_vec())
}
