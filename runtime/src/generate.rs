//! The generation loop: prefill the prompt in chunks, then decode one token at a time.

use crate::cpu::{CpuBackend, WeightCache};
use crate::error::{Result, RuntimeError};
use crate::logits_processor::{sample_processed, LogitsProcessor};
use crate::plan_exec::{PlanDevice, PlanExecutor};
use crate::sampling::{Sampler, SamplingParams};
use ir::Graph;
use quant::tensor::Tensors;

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops after emitting one of these (e.g. EOS); empty to never stop early.
    pub stop_tokens: Vec<u32>,
    /// Prompt tokens per prefill step (bounds activation memory on long prompts).
    pub prefill_chunk: usize,
    /// Every step's logits are wanted (e.g. to dump them), so greedy decoding must not take
    /// the greedy graph, which computes only the argmax.
    pub need_logits: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: 64,
            sampling: SamplingParams::default(),
            stop_tokens: Vec::new(),
            prefill_chunk: 512,
            need_logits: false,
        }
    }
}

/// What each step produced: the chosen token and, unless the greedy graph chose it, the logits
/// it was chosen from.
pub struct StepEvent<'a> {
    pub token: u32,
    pub logits: Option<&'a [f32]>,
}

/// What generation needs of a backend: sequences and steps over them.
pub trait Backend {
    type Sequence;
    fn new_sequence(&self) -> Self::Sequence;
    /// Process `ids` as the next tokens of `seq`; the graph's outputs by name.
    fn step(&self, seq: &mut Self::Sequence, ids: &[u32]) -> Result<std::collections::HashMap<String, ir::Tensor>>;
    fn context_length(&self) -> usize;
}

impl Backend for CpuBackend {
    type Sequence = crate::cpu::CpuSequence;
    fn new_sequence(&self) -> Self::Sequence {
        CpuBackend::new_sequence(self)
    }
    fn step(&self, seq: &mut Self::Sequence, ids: &[u32]) -> Result<std::collections::HashMap<String, ir::Tensor>> {
        CpuBackend::step(self, seq, ids)
    }
    fn context_length(&self) -> usize {
        CpuBackend::context_length(self)
    }
}

/// A GPU plan on any device (the CUDA backend, the emulator).
impl<D: PlanDevice> Backend for PlanExecutor<D> {
    type Sequence = crate::plan_exec::PlanSequence;
    fn new_sequence(&self) -> Self::Sequence {
        PlanExecutor::new_sequence(self)
    }
    fn step(&self, seq: &mut Self::Sequence, ids: &[u32]) -> Result<std::collections::HashMap<String, ir::Tensor>> {
        PlanExecutor::step(self, seq, ids)
    }
    fn context_length(&self) -> usize {
        PlanExecutor::context_length(self)
    }
}

/// A model ready to generate: its logits graph, and its greedy graph when it has one (whose LM
/// head may be the INT8-bound top-k). Both share weights and read the same KV cache layout.
/// Either may be left out where the run will not use it (a GPU backend holds its own copy of
/// the weights): greedy decoding needs only the greedy graph, sampling and logits dumps only
/// the logits graph.
pub struct Engine<B: Backend = CpuBackend> {
    pub logits: Option<B>,
    pub greedy: Option<B>,
}

impl<B: Backend> Engine<B> {
    /// An engine with the logits graph only.
    pub fn logits_only(logits: B) -> Self {
        Self {
            logits: Some(logits),
            greedy: None,
        }
    }
}

impl Engine {
    pub fn new(logits: Graph, greedy: Option<Graph>, source: &dyn Tensors, context_length: usize) -> Result<Self> {
        Self::with_cache(logits, greedy, source, context_length, WeightCache::default())
    }

    /// Like `new`, starting from weights prepared elsewhere (an artifact's INT8 heads).
    pub fn with_cache(
        logits: Graph,
        greedy: Option<Graph>,
        source: &dyn Tensors,
        context_length: usize,
        mut cache: WeightCache,
    ) -> Result<Self> {
        let logits = CpuBackend::with_cache(logits, source, context_length, &mut cache)?;
        let greedy = greedy
            .map(|g| CpuBackend::with_cache(g, source, context_length, &mut cache))
            .transpose()?;
        Ok(Self {
            logits: Some(logits),
            greedy,
        })
    }
}

impl From<CpuBackend> for Engine {
    fn from(logits: CpuBackend) -> Self {
        Self::logits_only(logits)
    }
}

/// Generate up to `max_tokens` after `prompt`. `on_step` sees every token as it is chosen and
/// returns `false` to stop. Returns the generated ids.
pub fn generate<B: Backend>(
    engine: &Engine<B>,
    prompt: &[u32],
    options: &GenerateOptions,
    on_step: impl FnMut(StepEvent) -> Result<bool>,
) -> Result<Vec<u32>> {
    generate_processed(engine, prompt, options, &mut [], on_step)
}

/// [`generate`], each token chosen from the logits as `processors` leave them, in order (a
/// structured output's grammar, say); each processor hears every token taken. The events'
/// logits stay the model's.
pub fn generate_processed<B: Backend>(
    engine: &Engine<B>,
    prompt: &[u32],
    options: &GenerateOptions,
    processors: &mut [Box<dyn LogitsProcessor>],
    mut on_step: impl FnMut(StepEvent) -> Result<bool>,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(RuntimeError::Input("the prompt is empty".into()));
    }
    // The greedy graph computes only the argmax: processed logits need the logits graph.
    let greedy = engine
        .greedy
        .as_ref()
        .filter(|_| options.sampling.temperature <= 0.0 && !options.need_logits && processors.is_empty());
    let backend = greedy.or(engine.logits.as_ref()).ok_or_else(|| {
        RuntimeError::Input("sampling and logits need the logits graph, which this engine does not hold".into())
    })?;
    let needed = prompt.len() + options.max_tokens;
    if needed > backend.context_length() {
        return Err(RuntimeError::ContextOverflow {
            needed,
            limit: backend.context_length(),
        });
    }
    let mut seq = backend.new_sequence();
    let mut out = Vec::with_capacity(options.max_tokens);
    if let Some(greedy) = greedy {
        let mut next = 0;
        for chunk in prompt.chunks(options.prefill_chunk.max(1)) {
            next = next_token(greedy, &mut seq, chunk)?;
        }
        while out.len() < options.max_tokens {
            out.push(next);
            let go_on = on_step(StepEvent {
                token: next,
                logits: None,
            })?;
            if !go_on || options.stop_tokens.contains(&next) || out.len() == options.max_tokens {
                break;
            }
            next = next_token(greedy, &mut seq, &[next])?;
        }
        return Ok(out);
    }
    let mut logits = Vec::new();
    for chunk in prompt.chunks(options.prefill_chunk.max(1)) {
        logits = last_logits(backend, &mut seq, chunk)?;
    }
    let mut sampler = Sampler::new(options.sampling);
    let mut processed = Vec::new();
    while out.len() < options.max_tokens {
        let token = match processors.is_empty() {
            true => sampler.sample(&logits),
            false => sample_processed(&mut sampler, processors, &logits, &mut processed),
        };
        out.push(token);
        let go_on = on_step(StepEvent {
            token,
            logits: Some(&logits),
        })?;
        if !go_on || options.stop_tokens.contains(&token) || out.len() == options.max_tokens {
            break;
        }
        logits = last_logits(backend, &mut seq, &[token])?;
    }
    Ok(out)
}

fn last_logits<B: Backend>(backend: &B, seq: &mut B::Sequence, ids: &[u32]) -> Result<Vec<f32>> {
    let outputs = backend.step(seq, ids)?;
    let logits = outputs
        .get("logits")
        .ok_or_else(|| RuntimeError::Graph("the graph has no `logits` output".into()))?;
    Ok(logits.row(logits.rows() - 1).to_vec())
}

fn next_token<B: Backend>(backend: &B, seq: &mut B::Sequence, ids: &[u32]) -> Result<u32> {
    let outputs = backend.step(seq, ids)?;
    let next = outputs
        .get("next_token")
        .ok_or_else(|| RuntimeError::Graph("the greedy graph has no `next_token` output".into()))?;
    Ok(next.data[next.data.len() - 1] as u32)
}
