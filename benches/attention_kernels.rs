//! Attention's inner loops on the CPU, alone: `simd::dots_many` (scores: the query heads of one
//! KV head against each cache row) and `simd::axpys_many` (weighted sums: a tile's queries'
//! sums over the value rows), over 1024 cache rows in a line-aligned pool as the KV cache
//! keeps them, in halves (the default cache of quantized models) and f32, at head sizes 64
//! (SmolLM2) and 128 (Llama 3 8B). Prints ns per dot / per (query, row) pair and the
//! multiply-adds' rate in 512-bit FMAs per second, so a change to either kernel can be timed
//! without a model. `cargo bench --bench attention_kernels`.

use half::f16;
use runtime::cpu::kv_element::KvElement;
use runtime::cpu::line_aligned::LineAligned;
use runtime::cpu::simd;
use std::time::Instant;

const ROWS: usize = 1024;

/// Calls of each kernel per timing: about two million dots or pairs.
const CALLS: usize = 2_000_000 / ROWS;

fn pool<T: KvElement>(head_dim: usize) -> LineAligned<T> {
    let mut pool = LineAligned::<T>::new();
    pool.grow(ROWS * head_dim);
    for (i, x) in pool.as_mut_slice().iter_mut().enumerate() {
        *x = T::narrow(((i * 13) % 23) as f32 * 0.071 - 0.8);
    }
    pool
}

/// Seconds per call of `f`, the best of three timings of `CALLS` calls.
fn time(mut f: impl FnMut()) -> f64 {
    (0..3)
        .map(|_| {
            let started = Instant::now();
            for _ in 0..CALLS {
                f();
            }
            started.elapsed().as_secs_f64() / CALLS as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn dots<const G: usize, T: KvElement>(name: &str, head_dim: usize) {
    let pool = pool::<T>(head_dim);
    let rows: Vec<&[T]> = pool.as_slice().chunks(head_dim).collect();
    let queries: [Vec<f32>; G] = std::array::from_fn(|g| (0..head_dim).map(|i| (i + g) as f32 * 0.01).collect());
    let queries = queries.each_ref().map(Vec::as_slice);
    let mut scores: [Vec<f32>; G] = std::array::from_fn(|_| vec![0f32; ROWS]);
    let seconds = time(|| simd::dots_many(&queries, &rows, &mut scores.each_mut().map(Vec::as_mut_slice)));
    report(
        &format!("dots_many<{G}> {name} hd {head_dim}"),
        seconds,
        G,
        head_dim,
        "dot",
    );
}

fn axpys<const N: usize, T: KvElement>(name: &str, head_dim: usize) {
    let pool = pool::<T>(head_dim);
    let rows: Vec<&[T]> = pool.as_slice().chunks(head_dim).collect();
    let weights: [Vec<f32>; N] = std::array::from_fn(|n| (0..ROWS).map(|i| ((i + n) % 7) as f32 * 0.01).collect());
    let weights = weights.each_ref().map(Vec::as_slice);
    let mut sums: [Vec<f32>; N] = std::array::from_fn(|_| vec![0f32; head_dim]);
    let seconds = time(|| simd::axpys_many(&weights, &rows, &mut sums.each_mut().map(Vec::as_mut_slice)));
    report(
        &format!("axpys_many<{N}> {name} hd {head_dim}"),
        seconds,
        N,
        head_dim,
        "pair",
    );
}

fn report(what: &str, seconds: f64, vectors: usize, head_dim: usize, unit: &str) {
    let each = seconds * 1e9 / (vectors * ROWS) as f64;
    let fmas = (vectors * ROWS * head_dim / 16) as f64 / seconds;
    println!("{what:<32} {each:>7.2} ns/{unit:<4} {:>6.2} G FMA512/s", fmas / 1e9);
}

fn main() {
    println!("{} rows, instruction set: {}", ROWS, simd::isa());
    for head_dim in [64, 128] {
        dots::<3, f16>("f16", head_dim);
        dots::<4, f16>("f16", head_dim);
        dots::<3, f32>("f32", head_dim);
        axpys::<3, f16>("f16", head_dim);
        axpys::<12, f16>("f16", head_dim);
        axpys::<16, f16>("f16", head_dim);
        axpys::<12, f32>("f32", head_dim);
    }
}
