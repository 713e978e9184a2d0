//! Attention over the paged KV cache on the CPU: one task per (query row, head) across every
//! sequence of the step, f32 softmax with the running max subtracted, grouped KV heads. Each
//! row is computed alone (the same arithmetic whatever else is in the step), so a batched step
//! gives every sequence bit-identical results to running it by itself. Tested against the IR
//! reference.

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
pub fn attention(spec: &AttentionSpec, q: &[f32], rows: &[QueryRow], kv: &LayerPages, out: &mut [f32]) {
    let hd = spec.head_dim;
    let group = spec.heads / spec.kv_heads;
    let q_dim = spec.heads * hd;
    let scale = spec.scale as f32;
    let block_size = kv.block_size();
    out.par_chunks_mut(hd).enumerate().for_each_init(
        || (Vec::<f32>::new(), Vec::<&[f32]>::new()),
        |(scores, cache_rows), (task, o)| {
            let (t, h) = (task / spec.heads, task % spec.heads);
            let QueryRow { pos, table } = rows[t];
            let kv_cols = (h / group) * hd..(h / group + 1) * hd;
            let qh = &q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd];
            let lo = spec.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            debug_assert!((lo..=pos).all(|j| attends(pos, j, spec.window)));
            let row = |j: usize| cache_row(table, block_size, j);
            // Scores and the weighted sum a batch of cache rows at a time (`simd::dots`,
            // `simd::axpys`): bit for bit the one-row forms.
            cache_rows.clear();
            cache_rows.extend((lo..=pos).map(|j| kv.key(row(j), kv_cols.clone())));
            scores.clear();
            scores.resize(cache_rows.len(), 0.0);
            simd::dots(qh, cache_rows, scores);
            scores.iter_mut().for_each(|s| *s *= scale);
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                total += *s;
            }
            scores.iter_mut().for_each(|p| *p /= total);
            cache_rows.clear();
            cache_rows.extend((lo..=pos).map(|j| kv.value(row(j), kv_cols.clone())));
            o.fill(0.0);
            simd::axpys(scores, cache_rows, o);
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::reference::{attention_over_slot, KvSlot};
    use ir::Tensor;

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
