//! Attention over the paged KV cache on the CPU: one task per (query row, query heads of one
//! KV head) across every sequence of the step, f32 softmax with the maximum subtracted. Each
//! row is computed alone (the same arithmetic whatever else is in the step), so a batched step
//! gives every sequence bit-identical results to running it by itself. Tested against the IR
//! reference.

use super::activation;
use super::kv_pages::LayerPages;
use super::simd;
use crate::kv::{cache_row, BlockId};
use ir::reference::ops::attends;
use ir::AttentionSpec;
use rayon::prelude::*;

/// A query row of the step: its position, and the block table of its sequence, whose cache
/// already holds the keys and values of every position up to and including `pos`.
#[derive(Debug, Clone, Copy)]
pub struct QueryRow<'a> {
    pub pos: usize,
    pub table: &'a [BlockId],
}

/// `q` is `[rows.len(), heads·hd]`; writes `[rows.len(), heads·hd]` into `out`.
///
/// A task takes a query row and up to [`simd::MANY`] query heads of one KV head, so each cache
/// row it reads serves all of them; where that would leave fewer tasks than the pool has
/// threads to keep busy (decode of a few sequences), a task takes one head. Either way each
/// head's scores, softmax and weighted sum are the one-head operations, bit for bit.
pub fn attention(spec: &AttentionSpec, q: &[f32], rows: &[QueryRow], kv: &LayerPages, out: &mut [f32]) {
    let group = spec.heads / spec.kv_heads;
    let shared = (1..=simd::MANY.min(group))
        .rev()
        .find(|g| group.is_multiple_of(*g))
        .unwrap_or(1);
    let enough_tasks = rows.len() * spec.heads / shared >= 2 * rayon::current_num_threads();
    match if enough_tasks { shared } else { 1 } {
        4 => attend::<4>(spec, q, rows, kv, out),
        3 => attend::<3>(spec, q, rows, kv, out),
        2 => attend::<2>(spec, q, rows, kv, out),
        _ => attend::<1>(spec, q, rows, kv, out),
    }
}

/// [`attention`] with tasks of `G` query heads (of one KV head).
fn attend<const G: usize>(spec: &AttentionSpec, q: &[f32], rows: &[QueryRow], kv: &LayerPages, out: &mut [f32]) {
    let hd = spec.head_dim;
    let group = spec.heads / spec.kv_heads;
    let q_dim = spec.heads * hd;
    let scale = spec.scale as f32;
    let block_size = kv.block_size();
    let tasks_a_row = spec.heads / G;
    out.par_chunks_mut(G * hd).enumerate().for_each_init(
        || (Vec::<f32>::new(), Vec::<&[f32]>::new()),
        |(scores, cache_rows), (task, o)| {
            let (t, first_head) = (task / tasks_a_row, task % tasks_a_row * G);
            let QueryRow { pos, table } = rows[t];
            let kv_cols = (first_head / group) * hd..(first_head / group + 1) * hd;
            let queries: [&[f32]; G] = std::array::from_fn(|g| {
                let at = t * q_dim + (first_head + g) * hd;
                &q[at..at + hd]
            });
            let lo = spec.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            debug_assert!((lo..=pos).all(|j| attends(pos, j, spec.window)));
            let row = |j: usize| cache_row(table, block_size, j);
            // Scores and the weighted sum a batch of cache rows at a time (`simd::dots_many`,
            // `simd::axpys_many`): bit for bit the one-row, one-head forms.
            let len = pos + 1 - lo;
            cache_rows.clear();
            cache_rows.extend((lo..=pos).map(|j| kv.key(row(j), kv_cols.clone())));
            scores.clear();
            scores.resize(G * len, 0.0);
            let mut head_scores: [&mut [f32]; G] = split(scores, len);
            simd::dots_many(&queries, cache_rows, &mut head_scores);
            for scores in head_scores.iter_mut() {
                softmax(scores, scale);
            }
            cache_rows.clear();
            cache_rows.extend((lo..=pos).map(|j| kv.value(row(j), kv_cols.clone())));
            o.fill(0.0);
            let weights: [&[f32]; G] = head_scores.map(|s| &*s);
            let mut head_out: [&mut [f32]; G] = split(o, hd);
            simd::axpys_many(&weights, cache_rows, &mut head_out);
        },
    );
}

/// `v` as `G` consecutive slices of `len`.
fn split<const G: usize>(v: &mut [f32], len: usize) -> [&mut [f32]; G] {
    let mut rest = Some(v);
    std::array::from_fn(|_| {
        let (head, tail) = rest.take().expect("G slices").split_at_mut(len);
        rest = Some(tail);
        head
    })
}

/// Scaled scores to probabilities: f32 softmax with the maximum subtracted, `e^x` by
/// [`activation::exp`] (libm's `expf`, a call a score, took a seventh of a 512-token prefill)
/// and the sum over sixteen lanes reduced pairwise as `simd::dot` sums; with AVX2 where the
/// CPU has it, so the loops run 8 lanes wide (the same operations, so the same bits).
fn softmax(scores: &mut [f32], scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { softmax_avx2(scores, scale) };
    }
    softmax_body(scores, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_avx2(scores: &mut [f32], scale: f32) {
    softmax_body(scores, scale)
}

/// Lanes of a softmax's maximum and sum: element `i` goes to lane `i % LANES`.
const LANES: usize = 16;

#[inline(always)]
fn softmax_body(scores: &mut [f32], scale: f32) {
    let mut max = [f32::NEG_INFINITY; LANES];
    for_lanes(scores, |lane, s| {
        *s *= scale;
        max[lane] = max[lane].max(*s);
    });
    let max = max.into_iter().fold(f32::NEG_INFINITY, f32::max);
    let mut total = [0f32; LANES];
    for_lanes(scores, |lane, s| {
        *s = activation::exp(*s - max);
        total[lane] += *s;
    });
    let total = simd::reduce(total);
    scores.iter_mut().for_each(|p| *p /= total);
}

/// `f(i % LANES, &mut v[i])` for each element in order, whole chunks of `LANES` first so the
/// lane is a constant the compiler can vectorise over.
#[inline(always)]
fn for_lanes(v: &mut [f32], mut f: impl FnMut(usize, &mut f32)) {
    let mut chunks = v.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for (lane, x) in chunk.iter_mut().enumerate() {
            f(lane, x);
        }
    }
    for (lane, x) in chunks.into_remainder().iter_mut().enumerate() {
        f(lane, x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::reference::{attention_over_slot, KvSlot};
    use ir::Tensor;

    /// Tasks of one, two or four query heads give every head the same bits.
    #[test]
    fn heads_sharing_a_task_get_their_one_head_results() {
        let spec = AttentionSpec {
            heads: 8,
            kv_heads: 2,
            head_dim: 40,
            scale: 0.2,
            window: None,
            cache_slot: 0,
            cache_dtype: ir::DType::F32,
        };
        let (len, tokens, kv_dim) = (11, 3, 80);
        let val = |i: usize, m: usize| ((i * m % 29) as f32 - 14.0) / 9.0;
        let k: Vec<f32> = (0..len * kv_dim).map(|i| val(i, 7)).collect();
        let v: Vec<f32> = (0..len * kv_dim).map(|i| val(i, 5)).collect();
        let table = [2, 0, 5, 1, 4, 3].map(BlockId);
        let mut pages = super::super::KvPages::new(&[(kv_dim, kv_dim)], &[], 2);
        pages.layer_mut(0).write(&table, 0, &k, &v);
        let q: Vec<f32> = (0..tokens * 320).map(|i| val(i, 3)).collect();
        let rows: Vec<QueryRow> = (len - tokens..len).map(|pos| QueryRow { pos, table: &table }).collect();
        let run = |attend: fn(&AttentionSpec, &[f32], &[QueryRow], &LayerPages, &mut [f32])| {
            let mut out = vec![f32::NAN; tokens * 320];
            attend(&spec, &q, &rows, pages.layer(0), &mut out);
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let one = run(attend::<1>);
        assert_eq!(run(attend::<2>), one);
        assert_eq!(run(attend::<4>), one);
    }

    #[test]
    fn agrees_with_reference_including_windows_and_groups() {
        for window in [None, Some(3)] {
            let spec = AttentionSpec {
                heads: 4,
                kv_heads: 2,
                head_dim: 8,
                scale: 0.3,
                window,
                cache_slot: 0,
                cache_dtype: ir::DType::F32,
            };
            let (len, tokens) = (9, 4);
            let kv_dim = 16;
            let val = |i: usize, m: usize| ((i * m % 23) as f32 - 11.0) / 7.0;
            let k: Vec<f32> = (0..len * kv_dim).map(|i| val(i, 7)).collect();
            let v: Vec<f32> = (0..len * kv_dim).map(|i| val(i, 5)).collect();
            // Blocks of 2 positions, scattered: the table is not in block order.
            let table = [4, 0, 3, 1, 2].map(BlockId);
            let mut pages = super::super::KvPages::new(&[(kv_dim, kv_dim)], &[], 2);
            pages.layer_mut(0).write(&table, 0, &k, &v);
            let q: Vec<f32> = (0..tokens * 32).map(|i| val(i, 3)).collect();
            let first = len - tokens;
            let rows: Vec<QueryRow> = (first..len).map(|pos| QueryRow { pos, table: &table }).collect();
            let mut got = vec![f32::NAN; tokens * 32];
            attention(&spec, &q, &rows, pages.layer(0), &mut got);
            let slot = KvSlot {
                positions: (0..len).collect(),
                k,
                v,
            };
            let positions: Vec<usize> = (first..len).collect();
            let want = attention_over_slot(&spec, &Tensor::new(vec![tokens, 32], q), &slot, &positions);
            for (g, w) in got.iter().zip(&want.data) {
                assert!((g - w).abs() < 1e-5, "{window:?}: {g} vs {w}");
            }
        }
    }
}
