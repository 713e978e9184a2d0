//! The prefix cache on a hybrid model (Gated DeltaNet layers) on the CPU backend, with snapshots
//! of recurrent states against without (`--state-snapshots 0`, how such models served before),
//! side by side in one run. The model is Qwen3.5-shaped with random bf16 weights written to a
//! scratch directory (8 layers, every fourth full attention, hidden 512, DeltaNet 4 key / 8
//! value heads of 128). Measured through the serving engine:
//! - a second request sharing a 1 000-token prefix with the first (a chat's second turn, a long
//!   system prompt): its time to first token;
//! - what saving snapshots costs the first request: its prefill, and 128 decode steps.
//!
//! Prints medians of alternated runs and the ratios. `cargo bench --bench hybrid_prefix`.

use models::{ComputeDtype, LogitsFor, LowerOptions, ModelConfig, WeightSource};
use runtime::serving::{NgramConfig, SchedulerConfig, ServingEngine, StateCacheConfig};
use runtime::{CpuBackend, SamplingParams};
use std::time::{Duration, Instant};

/// Large buffers on cache lines: the CPU kernels' 64-byte writes then never straddle two
/// (`runtime::cpu::line_alloc`).
#[global_allocator]
static ALLOCATOR: runtime::cpu::line_alloc::LineAlignedAlloc = runtime::cpu::line_alloc::LineAlignedAlloc;

const SHARED: usize = 1000;
const DECODE: usize = 128;
const RUNS: usize = 5;

fn config() -> ModelConfig {
    let layers = 8;
    let mut config = ModelConfig::qwen3_5_27b();
    config.vocab_size = 16_000;
    config.hidden = 512;
    config.layers = layers;
    config.heads = 4;
    config.kv_heads = 2;
    config.head_dim = 128;
    config.intermediate = 1536;
    config.context_length = 4096;
    config.layer_attention.truncate(layers);
    let linear = config.linear_attention.as_mut().expect("a hybrid");
    (linear.key_heads, linear.value_heads) = (4, 8);
    config
}

fn engine(backend: CpuBackend, snapshots: usize) -> ServingEngine<CpuBackend> {
    let config = SchedulerConfig {
        max_waiting: 4,
        max_running: 2,
        token_budget: 512,
        kv_blocks: 512,
        block_size: 16,
        context_length: 4096,
        prefix_caching: true,
        speculation: NgramConfig::OFF,
        recurrent_state: true,
        state_cache: StateCacheConfig::every(128, snapshots),
    };
    ServingEngine::new(backend, config)
}

/// Step until `engine` has produced `tokens` tokens (or is idle); the time it took.
fn run_until(engine: &mut ServingEngine<CpuBackend>, tokens: usize) -> Duration {
    let start = Instant::now();
    let mut produced = 0;
    while produced < tokens && !engine.scheduler().is_idle() {
        produced += engine.step().unwrap().tokens.len();
    }
    start.elapsed()
}

struct Times {
    first_prefill: Vec<f64>,
    first_decode: Vec<f64>,
    second_ttft: Vec<f64>,
}

/// One run: the first request's prefill (to its first token) and decode, then the second
/// request's time to first token.
fn measure(backend: CpuBackend, snapshots: usize, times: &mut Times) -> CpuBackend {
    let mut engine = engine(backend, snapshots);
    let shared: Vec<u32> = (0..SHARED as u32).map(|i| 100 + (i * 37) % 15_000).collect();
    let greedy = SamplingParams::default();
    let first: Vec<u32> = shared.iter().copied().chain([5, 6, 7]).collect();
    engine.add(first, DECODE + 1, vec![], greedy).unwrap();
    times.first_prefill.push(run_until(&mut engine, 1).as_secs_f64() * 1e3);
    times
        .first_decode
        .push(run_until(&mut engine, DECODE).as_secs_f64() * 1e3);
    let second: Vec<u32> = shared.iter().copied().chain([8, 9, 10, 11]).collect();
    engine.add(second, 1, vec![], greedy).unwrap();
    times.second_ttft.push(run_until(&mut engine, 1).as_secs_f64() * 1e3);
    assert!(engine.scheduler().is_idle());
    engine.into_backend()
}

fn median(t: &[f64]) -> f64 {
    let mut t = t.to_vec();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    let config = config();
    let options = LowerOptions {
        logits: LogitsFor::LastToken,
        compute: ComputeDtype::Bf16,
        kv_cache: models::KvCacheDtype::Auto,
    };
    let graph = models::lower_without_weights(&config, options).unwrap();
    let dir = tempfile::tempdir().unwrap();
    runtime::random_weights::write_checkpoint(&graph, 7, &dir.path().join("model.safetensors")).unwrap();
    let weights = WeightSource::open_safetensors(dir.path()).unwrap();
    let graph = passes::optimized(&graph, passes::CostModel::CPU).unwrap();
    let mut backend = CpuBackend::new(graph, &weights, config.context_length).unwrap();
    println!(
        "Qwen3.5-shaped, 8 layers, hidden 512, bf16; a recurrent state of {} KiB a sequence; {SHARED}-token shared prefix, snapshots every 128 positions",
        backend.state_bytes_per_sequence() >> 10
    );
    let new_times = || Times {
        first_prefill: Vec::new(),
        first_decode: Vec::new(),
        second_ttft: Vec::new(),
    };
    let (mut without, mut with) = (new_times(), new_times());
    // One untimed run of each first.
    backend = measure(backend, 0, &mut new_times());
    backend = measure(backend, 16, &mut new_times());
    for _ in 0..RUNS {
        backend = measure(backend, 0, &mut without);
        backend = measure(backend, 16, &mut with);
    }
    println!("{:>34} {:>14} {:>14} {:>8}", "", "no snapshots", "snapshots", "ratio");
    let rows = [
        (
            "first request's prefill, ms",
            &without.first_prefill,
            &with.first_prefill,
        ),
        ("its 128 decode steps, ms", &without.first_decode, &with.first_decode),
        ("second request's TTFT, ms", &without.second_ttft, &with.second_ttft),
    ];
    for (label, a, b) in rows {
        let (a, b) = (median(a), median(b));
        println!("{label:>34} {a:>14.1} {b:>14.1} {:>7.2}×", a / b);
    }
}
