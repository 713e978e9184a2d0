//! Timing a batched plan's decode steps, as `bbc serve` runs them: sequences are prefilled,
//! then each batch size decodes a few steps (one row per sequence, or one per token and draft
//! where the run verifies drafts, replayed from a CUDA graph
//! where the executor captures them; ids written, each sequence's logits read back), as many
//! again reading back only token ids where the plan has `next_token` (what serving does when
//! every request is greedy), and one more step runs kernel by kernel with every launch timed. Any device: the GPU check runs it on
//! a Llama-8B-shaped model on the GPU, the tests on a tiny model on the emulator.

use crate::error::{Result, RuntimeError};
use crate::kv::{BlockId, Segment, StateSnapshots};
use crate::plan_exec::{LaunchProfile, PlanDevice, PlanExecutor};
use crate::serving::PagedBackend;

/// What to time.
#[derive(Debug, Clone)]
pub struct DecodeRun {
    /// Prompt tokens prefilled into every sequence first (the context decode attends to).
    pub prompt: usize,
    /// Batch sizes (sequences decoding together), each timed in turn.
    pub batches: Vec<usize>,
    /// Timed steps per batch size, after one untimed step (which captures the graph).
    pub steps: usize,
    /// Prompt rows per prefill step, at most the plan's: below `PREFILL_TOKENS` the prompts
    /// go through the GEMV, not the tensor-core GEMM (a fallback where that GEMM fails).
    pub prefill_chunk: usize,
    /// Drafted tokens each sequence verifies a step (0: plain decode): `drafts + 1` rows a
    /// sequence, every one sampled and kept, as a speculating server's step whose drafts were
    /// all accepted (a model's recurrent states keep their checkpoints all the same: the
    /// executor must verify that many, `PlanExecutor::verify_drafts_up_to`).
    pub drafts: usize,
}

impl DecodeRun {
    /// Positions each sequence needs: its prompt and every step it may take part in (per
    /// batch size, an untimed and `steps` timed steps reading logits, as many reading ids, and
    /// the profiled one), each of `rows_per_sequence`.
    pub fn positions_per_sequence(&self) -> usize {
        self.prompt + self.batches.len() * (2 * (self.steps + 1) + 1) * self.rows_per_sequence()
    }

    /// Rows each sequence takes a step: its next token and its drafts.
    pub fn rows_per_sequence(&self) -> usize {
        self.drafts + 1
    }

    /// Sequences the largest batch holds.
    pub fn sequences(&self) -> usize {
        self.batches.iter().copied().max().unwrap_or(0)
    }
}

/// One batch size's decode step.
#[derive(Debug, Clone)]
pub struct DecodeTiming {
    pub batch: usize,
    /// Wall time of a step as serving sees it (inputs written, launches, logits read back).
    pub wall_seconds: f64,
    /// The same, reading back only each sequence's greedy token; where the plan has one.
    pub greedy_wall_seconds: Option<f64>,
    /// Each launch of the profiled step.
    pub launches: Vec<LaunchProfile>,
}

impl DecodeTiming {
    /// Device time of the step's launches back to back, where the device measures it.
    pub fn device_seconds(&self) -> Option<f64> {
        self.launches.iter().map(|l| l.seconds).sum()
    }

    /// Bytes of weights one step reads.
    pub fn weight_bytes(&self) -> usize {
        self.launches.iter().map(|l| l.weight_bytes).sum()
    }

    /// The step's launches summed per kernel, in order of first launch.
    pub fn by_kernel(&self) -> Vec<KernelTotal> {
        kernel_totals(&self.launches)
    }
}

/// `launches` summed per kernel, in order of first launch.
pub fn kernel_totals(launches: &[LaunchProfile]) -> Vec<KernelTotal> {
    let mut rows: Vec<KernelTotal> = Vec::new();
    for l in launches {
        match rows.iter_mut().find(|r| r.kernel == l.kernel) {
            Some(row) => {
                row.launches += 1;
                row.seconds = row.seconds.zip(l.seconds).map(|(a, b)| a + b);
                row.weight_bytes += l.weight_bytes;
            }
            None => rows.push(KernelTotal {
                kernel: l.kernel.clone(),
                launches: 1,
                seconds: l.seconds,
                weight_bytes: l.weight_bytes,
            }),
        }
    }
    rows
}

/// One kernel's launches in a step, summed.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTotal {
    pub kernel: String,
    pub launches: usize,
    pub seconds: Option<f64>,
    pub weight_bytes: usize,
}

/// Prefill `run.sequences()` sequences of `run.prompt` tokens into `executor`'s pool (each
/// sequence its own run of blocks), then time each batch size of `run`.
pub fn time_decode<D: PlanDevice>(executor: &PlanExecutor<D>, run: &DecodeRun) -> Result<Vec<DecodeTiming>> {
    let cache = executor
        .batched_cache()
        .ok_or_else(|| RuntimeError::Artifact("decode timing needs a batched plan".into()))?;
    let max_rows = executor.max_step_tokens().unwrap_or(1).min(run.prefill_chunk).max(1);
    let per_sequence = run.positions_per_sequence().div_ceil(cache.block_size);
    let sequences = run.sequences();
    if sequences * per_sequence > cache.blocks || run.positions_per_sequence() > executor.context_length() {
        return Err(RuntimeError::Input(format!(
            "{sequences} sequences of {} positions do not fit {} blocks of {} (context {})",
            run.positions_per_sequence(),
            cache.blocks,
            cache.block_size,
            executor.context_length()
        )));
    }
    let tables: Vec<Vec<BlockId>> = (0..sequences)
        .map(|s| {
            (s * per_sequence..(s + 1) * per_sequence)
                .map(|b| BlockId(b as u32))
                .collect()
        })
        .collect();
    prefill(executor, &tables, run.prompt, max_rows)?;
    let greedy = executor.has_greedy_tokens();
    let mut lengths = vec![run.prompt; sequences];
    let mut timings = Vec::new();
    for &batch in &run.batches {
        let rows = run.rows_per_sequence();
        let mut step = |read: Read| -> Result<Vec<LaunchProfile>> {
            let ids: Vec<Vec<u32>> = (0..batch)
                .map(|s| (lengths[s]..lengths[s] + rows).map(|p| id(s, p)).collect())
                .collect();
            let segments: Vec<Segment> = (0..batch)
                .map(|s| Segment {
                    hidden_states: &[],
                    table: &tables[s],
                    start: lengths[s],
                    ids: &ids[s],
                    state_slot: s,
                    sampled_rows: rows,
                    drafts: rows - 1,
                    snapshots: StateSnapshots::NONE,
                })
                .collect();
            let launches = match read {
                Read::Profile => executor.profile_step_batch(&segments)?,
                Read::Logits => executor.step_batch_last_rows(&segments).map(|_| Vec::new())?,
                Read::Tokens => match executor.step_batch_greedy_tokens(&segments) {
                    Some(tokens) => tokens.map(|_| Vec::new())?,
                    None => return Err(RuntimeError::Artifact("the plan has no `next_token`".into())),
                },
            };
            lengths[..batch].iter_mut().for_each(|l| *l += rows);
            Ok(launches)
        };
        let mut time = |read: Read| -> Result<f64> {
            step(read)?;
            let started = std::time::Instant::now();
            for _ in 0..run.steps {
                step(read)?;
            }
            Ok(started.elapsed().as_secs_f64() / run.steps.max(1) as f64)
        };
        let wall_seconds = time(Read::Logits)?;
        let greedy_wall_seconds = match greedy {
            true => Some(time(Read::Tokens)?),
            false => None,
        };
        let launches = step(Read::Profile)?;
        timings.push(DecodeTiming {
            batch,
            wall_seconds,
            greedy_wall_seconds,
            launches,
        });
    }
    Ok(timings)
}

/// Token `p` of sequence `s`: ids that vary with both, inside any vocabulary.
fn id(s: usize, p: usize) -> u32 {
    ((7 + 13 * s + 31 * p) % 251) as u32
}

/// Wall seconds to prefill one sequence's `run.prompt` tokens, `run.prefill_chunk` rows a
/// step, results read back (into the first sequence's blocks and state slot, which
/// [`time_decode`] prefills again).
pub fn time_prefill<D: PlanDevice>(executor: &PlanExecutor<D>, run: &DecodeRun) -> Result<f64> {
    let blocks = prefill_blocks(executor, run)?;
    let table: Vec<BlockId> = (0..blocks).map(|b| BlockId(b as u32)).collect();
    let max_rows = executor.max_step_tokens().unwrap_or(1).min(run.prefill_chunk).max(1);
    let started = std::time::Instant::now();
    prefill(executor, &[table], run.prompt, max_rows)?;
    Ok(started.elapsed().as_secs_f64())
}

/// The blocks one sequence's prompt of `run.prompt` tokens takes in `executor`'s pool (its
/// first), or why it does not fit.
fn prefill_blocks<D: PlanDevice>(executor: &PlanExecutor<D>, run: &DecodeRun) -> Result<usize> {
    let cache = executor
        .batched_cache()
        .ok_or_else(|| RuntimeError::Artifact("prefill timing needs a batched plan".into()))?;
    let blocks = run.prompt.div_ceil(cache.block_size);
    if blocks > cache.blocks || run.prompt > executor.context_length() {
        return Err(RuntimeError::Input(format!(
            "a prompt of {} positions does not fit {} blocks of {} (context {})",
            run.prompt,
            cache.blocks,
            cache.block_size,
            executor.context_length()
        )));
    }
    Ok(blocks)
}

/// Each launch of one sequence's prefill of `run.prompt` tokens as [`time_prefill`] runs it,
/// timed one by one: what each kernel's share of a prefill is.
pub fn profile_prefill<D: PlanDevice>(executor: &PlanExecutor<D>, run: &DecodeRun) -> Result<Vec<LaunchProfile>> {
    let blocks = prefill_blocks(executor, run)?;
    let table: Vec<BlockId> = (0..blocks).map(|b| BlockId(b as u32)).collect();
    let max_rows = executor.max_step_tokens().unwrap_or(1).min(run.prefill_chunk).max(1);
    let mut launches = Vec::new();
    prefill_steps(&[table], run.prompt, max_rows, |segment| {
        launches.extend(executor.profile_step_batch(&[segment])?);
        Ok(())
    })?;
    Ok(launches)
}

/// `prompt` tokens into each sequence (one per table), `chunk` rows a step.
fn prefill<D: PlanDevice>(
    executor: &PlanExecutor<D>,
    tables: &[Vec<BlockId>],
    prompt: usize,
    chunk: usize,
) -> Result<()> {
    prefill_steps(tables, prompt, chunk, |segment| {
        executor.step_batch_last_rows(&[segment]).map(|_| ())
    })
}

/// Each prefill step's segment of `prompt` tokens into each sequence (one per table),
/// `chunk` rows a step, handed to `step`.
fn prefill_steps(
    tables: &[Vec<BlockId>],
    prompt: usize,
    chunk: usize,
    mut step: impl FnMut(Segment) -> Result<()>,
) -> Result<()> {
    for (s, table) in tables.iter().enumerate() {
        for start in (0..prompt).step_by(chunk) {
            let ids: Vec<u32> = (start..prompt.min(start + chunk)).map(|p| id(s, p)).collect();
            step(Segment {
                hidden_states: &[],
                table,
                start,
                ids: &ids,
                state_slot: s,
                sampled_rows: 1,
                drafts: 0,
                snapshots: StateSnapshots::NONE,
            })?;
        }
    }
    Ok(())
}

/// What a timed step reads back.
#[derive(Debug, Clone, Copy)]
enum Read {
    Logits,
    Tokens,
    Profile,
}
