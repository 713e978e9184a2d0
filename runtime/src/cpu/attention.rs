//! Attention over a sequence's KV cache on the CPU: one task per (token, head), f32 softmax
//! with the running max subtracted, grouped KV heads. Tested against the IR reference.

use super::simd;
use ir::reference::ops::attends;
use ir::AttentionSpec;
use rayon::prelude::*;

/// Keys and values of one layer of one sequence: row `j` is position `j`.
#[derive(Debug, Default, Clone)]
pub struct LayerKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl LayerKv {
    pub fn len(&self, kv_dim: usize) -> usize {
        self.k.len() / kv_dim
    }
}

/// `q` is `[tokens, heads·hd]` for positions `first..first+tokens`; the cache already holds
/// their keys and values. Writes `[tokens, heads·hd]` into `out`.
pub fn attention(spec: &AttentionSpec, q: &[f32], first: usize, kv: &LayerKv, out: &mut [f32]) {
    let hd = spec.head_dim;
    let kv_dim = spec.kv_heads * hd;
    let group = spec.heads / spec.kv_heads;
    let q_dim = spec.heads * hd;
    let scale = spec.scale as f32;
    out.par_chunks_mut(hd)
        .enumerate()
        .for_each_init(Vec::<f32>::new, |scores, (task, o)| {
            let (t, h) = (task / spec.heads, task % spec.heads);
            let pos = first + t;
            let kvh = h / group;
            let qh = &q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd];
            let lo = spec.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            debug_assert!((lo..=pos).all(|j| attends(pos, j, spec.window)));
            scores.clear();
            scores.extend(
                (lo..=pos).map(|j| simd::dot(qh, &kv.k[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd]) * scale),
            );
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                total += *s;
            }
            o.fill(0.0);
            for (j, &p) in (lo..=pos).zip(scores.iter()) {
                simd::axpy(p / total, &kv.v[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd], o);
            }
        });
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
            };
            let (len, tokens) = (9, 4);
            let kv_dim = 16;
            let val = |i: usize, m: usize| ((i * m % 23) as f32 - 11.0) / 7.0;
            let kv = LayerKv {
                k: (0..len * kv_dim).map(|i| val(i, 7)).collect(),
                v: (0..len * kv_dim).map(|i| val(i, 5)).collect(),
            };
            let q: Vec<f32> = (0..tokens * 32).map(|i| val(i, 3)).collect();
            let first = len - tokens;
            let mut got = vec![f32::NAN; tokens * 32];
            attention(&spec, &q, first, &kv, &mut got);
            let slot = KvSlot {
                positions: (0..len).collect(),
                k: kv.k.clone(),
                v: kv.v.clone(),
            };
            let positions: Vec<usize> = (first..len).collect();
            let want = attention_over_slot(&spec, &Tensor::new(vec![tokens, 32], q), &slot, &positions);
            for (g, w) in got.iter().zip(&want.data) {
                assert!((g - w).abs() < 1e-5, "{window:?}: {g} vs {w}");
            }
        }
    }
}
