//! One serving step of the CPU backend at several batch sizes (SmolLM2 native Q4_1, or the
//! model `BBC_BENCH_MODEL` names, e.g. `gemma3-270m`, or the weights at the path it gives: a
//! GGUF file or an HF directory): decode steps of 1, 4, 16 and 64
//! sequences over a paged KV cache holding 64 positions each (`BBC_BENCH_CONTEXT` positions, to
//! time decode at long contexts, where attention's reads of the cache grow), and one prefill
//! chunk of 128 tokens (`BBC_BENCH_PREFILL` tokens; 0: none).
//! Prints time per step and tokens per second, and each batch's speed-up over the first measured
//! in the same run. `cargo bench --bench batched_step`; `BBC_BENCH_BATCHES=1,16` picks the decode
//! batches (empty: the prefill chunk alone, e.g. to profile it); `BBC_BENCH_DTYPE=f32` (or
//! `bf16`) runs the matrices widened to that type instead of the file's blocks;
//! `BBC_BENCH_QUANTIZATION=fp8` quantizes a checkpoint of floats to FP8 as it loads;
//! `BBC_BENCH_KV_DTYPE=f32` (or `bf16`, `f16`) keeps the KV cache in that type.

use models::{ComputeDtype, LogitsFor, Model, ModelSpec};
use runtime::kv::{BlockId, Segment, StateSnapshots};
use runtime::CpuBackend;
use std::time::Instant;

/// Large buffers on cache lines: the CPU kernels' 64-byte writes then never straddle two
/// (`runtime::cpu::line_alloc`).
#[global_allocator]
static ALLOCATOR: runtime::cpu::line_alloc::LineAlignedAlloc = runtime::cpu::line_alloc::LineAlignedAlloc;

const BLOCK: usize = 16;

fn main() {
    let name = std::env::var("BBC_BENCH_MODEL").unwrap_or_else(|_| "smollm2".into());
    let path = match std::path::Path::new(&name).exists() {
        true => name.into(),
        false => {
            let known = bbc::fetch::known(&name)
                .unwrap_or_else(|| panic!("`{name}` is neither a path nor a model bbc fetches"));
            bbc::fetch::ensure(known, true).expect("fetching the model")
        }
    };
    let mut spec = ModelSpec::for_weights(&path);
    if let Ok(dtype) = std::env::var("BBC_BENCH_DTYPE") {
        spec.dtype = ComputeDtype::parse(&dtype)
            .unwrap_or_else(|| panic!("BBC_BENCH_DTYPE: `{dtype}` is not one of {}", ComputeDtype::choices()));
    }
    spec.quantization = std::env::var("BBC_BENCH_QUANTIZATION").ok().filter(|q| !q.is_empty());
    if let Ok(dtype) = std::env::var("BBC_BENCH_KV_DTYPE") {
        spec.kv_cache_dtype = models::KvCacheDtype::parse(&dtype).unwrap_or_else(|| {
            panic!(
                "BBC_BENCH_KV_DTYPE: `{dtype}` is not one of {}",
                models::KvCacheDtype::choices()
            )
        });
    }
    let model = Model::open(spec).expect("opening the model");
    let graph = passes::optimized(&model.lower(LogitsFor::LastToken).unwrap(), passes::CostModel::CPU).unwrap();
    let backend = CpuBackend::new(graph, &model.weights, model.config.context_length).unwrap();
    let context = count_from_env("BBC_BENCH_CONTEXT", 64);
    let blocks_per_seq = (context + 1).div_ceil(BLOCK);
    let mut base = None;
    println!(
        "{:>10} {:>12} {:>12} {:>10}",
        "batch", "ms/step", "tokens/s", "vs first"
    );
    for batch in decode_batches() {
        let tables: Vec<Vec<BlockId>> = (0..batch)
            .map(|s| {
                (0..blocks_per_seq)
                    .map(|b| BlockId((s * blocks_per_seq + b) as u32))
                    .collect()
            })
            .collect();
        let mut pages = backend.new_pages(BLOCK);
        // Fill every sequence's cache with `context` positions, then time decode steps after it.
        let prompt: Vec<u32> = (0..context as u32).map(|i| 100 + 7 * i % 20000).collect();
        for (i, table) in tables.iter().enumerate() {
            let fill = Segment {
                hidden_states: &[],
                table,
                start: 0,
                ids: &prompt,
                state_slot: i,
                sampled_rows: 1,
                drafts: 0,
                snapshots: StateSnapshots::NONE,
            };
            backend.step_batch(&mut pages, &[fill]).unwrap();
        }
        let next = [42u32];
        let segments: Vec<Segment> = tables
            .iter()
            .enumerate()
            .map(|(i, table)| Segment {
                hidden_states: &[],
                table,
                start: context,
                ids: &next,
                state_slot: i,
                sampled_rows: 1,
                drafts: 0,
                snapshots: StateSnapshots::NONE,
            })
            .collect();
        let seconds = time(|| {
            backend.step_batch(&mut pages, &segments).unwrap();
        });
        let tokens_per_s = batch as f64 / seconds;
        let speedup = tokens_per_s / *base.get_or_insert(tokens_per_s);
        println!(
            "{batch:>10} {:>12.2} {tokens_per_s:>12.1} {speedup:>9.2}x",
            seconds * 1e3
        );
    }
    let prefill = count_from_env("BBC_BENCH_PREFILL", 128);
    if prefill == 0 {
        return;
    }
    let table: Vec<BlockId> = (0..prefill.div_ceil(BLOCK) as u32).map(BlockId).collect();
    let chunk: Vec<u32> = (0..prefill as u32).map(|i| 300 + 3 * i).collect();
    let mut pages = backend.new_pages(BLOCK);
    let seconds = time(|| {
        let prefill = Segment {
            hidden_states: &[],
            table: &table,
            start: 0,
            ids: &chunk,
            state_slot: 0,
            sampled_rows: 1,
            drafts: 0,
            snapshots: StateSnapshots::NONE,
        };
        backend.step_batch(&mut pages, &[prefill]).unwrap();
    });
    println!(
        "{:>10} {:>12.2} {:>12.1}",
        format!("prefill {prefill}"),
        seconds * 1e3,
        prefill as f64 / seconds
    );
}

/// The count the variable `name` gives, else `default`.
fn count_from_env(name: &str, default: usize) -> usize {
    std::env::var(name).map_or(default, |n| {
        n.parse().unwrap_or_else(|_| panic!("{name}: `{n}` is not a count"))
    })
}

/// The decode batch sizes to time: `BBC_BENCH_BATCHES` (comma-separated), else 1, 4, 16, 64.
fn decode_batches() -> Vec<usize> {
    let Ok(list) = std::env::var("BBC_BENCH_BATCHES") else {
        return vec![1, 4, 16, 64];
    };
    list.split(',')
        .filter(|b| !b.trim().is_empty())
        .map(|b| {
            b.trim()
                .parse()
                .unwrap_or_else(|_| panic!("BBC_BENCH_BATCHES: `{b}` is not a batch size"))
        })
        .collect()
}

/// Median seconds of `f` over enough runs to take about two seconds (at least five).
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    f();
    let once = start.elapsed().as_secs_f64();
    let runs = ((2.0 / once) as usize).clamp(5, 200);
    let mut samples: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[runs / 2]
}
