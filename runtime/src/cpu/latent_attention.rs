//! GLM-5's multi-head latent attention (`ir::Op::SparseMla`) over a cache of latents: a
//! position's cache row is `[c | k_pe | index key]`, and its keys and values, `kv_b · c` per
//! head, are never formed. Each head's query is carried into the latent's space instead
//! (DeepSeek's absorbed form): `q̃ = W_UKᵀ · q_nope`, so `q_nope · k_nope = q̃ · c`; the head
//! attends over the kept positions' latents, and its value is `W_UV · Σ p·c`. The same
//! numbers as the expanded form up to rounding, at `latent + rope + index` cached values a
//! position instead of `heads·(nope + value) + rope + index`.
//!
//! Every row is computed on its own, in a fixed order: a row's result does not depend on what
//! shares its step.

use super::kv_pages::{KvPages, PagesOf};
use super::matrix::Matrix;
use super::{rows, Arg, StepRows, Tensor};
use crate::error::{Result, RuntimeError};
use ir::reference::ops;
use ir::SparseMlaSpec;

/// The step's latent rows appended to the spec's cache slot, then every row's attention,
/// ranking positions by the index keys in the spec's `index_slot` (its own, or those of the
/// full layer whose indexer it shares). `args` are the op's inputs (`ir::Op::SparseMla`):
/// activations, and the weights `k_b` and `v_b` fifth and sixth.
pub(super) fn sparse_mla(spec: &SparseMlaSpec, args: &[Arg], pages: &mut KvPages, rows: &StepRows) -> Result<Tensor> {
    let x = |k: usize| args[k].value().tensor();
    let up = UpProjections {
        k_b: args[4].matrix(),
        v_b: args[5].matrix(),
    };
    let layer = pages.layer_mut(spec.cache_slot);
    for (seg, r) in rows.segments.iter().zip(&rows.ranges) {
        let latents: Vec<f32> = r
            .clone()
            .flat_map(|t| {
                let index_key = if spec.has_own_indexer() { x(8).row(t) } else { &[] };
                [x(2).row(t), x(3).row(t), index_key].concat()
            })
            .collect();
        layer.write(seg.table, seg.start, &latents, &[]);
    }
    let block_size = pages.block_size();
    // The backend keeps latent caches in f32 (`CpuBackend::new`).
    let (PagesOf::F32(layer), PagesOf::F32(index_layer)) = (
        pages.layer(spec.cache_slot).typed(),
        pages.layer(spec.index_slot).typed(),
    ) else {
        return Err(RuntimeError::Graph("latent attention reads f32 caches".into()));
    };
    let index_keys = spec.index_key_offset()..spec.index_key_offset() + spec.index_dim;
    let width = spec.out_width();
    let mut out = vec![0f32; x(0).rows() * width];
    rows::for_row_runs(&mut out, width, |first, run| {
        for (i, o) in run.chunks_exact_mut(width).enumerate() {
            let t = first + i;
            let query = Query {
                q_nope: x(0).row(t),
                q_pe: x(1).row(t),
                index_q: x(6).row(t),
                index_weights: x(7).row(t),
            };
            let cached: Vec<Cached> = crate::kv::cache_rows(rows.query[t].table, block_size, 0..rows.query[t].pos + 1)
                .map(|row| Cached {
                    latent_and_rope: layer.key(row, 0..spec.index_key_offset()),
                    index_key: index_layer.key(row, index_keys.clone()),
                })
                .collect();
            attend(spec, &query, &cached, &up, o);
        }
    });
    Ok(Tensor::new(vec![x(0).rows(), width], out))
}

/// A cached position: its `[c | k_pe]`, and the index key it is ranked by.
struct Cached<'a> {
    latent_and_rope: &'a [f32],
    index_key: &'a [f32],
}

/// One row's inputs.
struct Query<'a> {
    q_nope: &'a [f32],
    q_pe: &'a [f32],
    index_q: &'a [f32],
    index_weights: &'a [f32],
}

/// The latent's up-projections: `k_b` (`[heads·latent, nope]`, each head's `W_UKᵀ`) and `v_b`
/// (`[heads·value, latent]`, each head's `W_UV`).
struct UpProjections<'a> {
    k_b: &'a Matrix,
    v_b: &'a Matrix,
}

/// Row `q` over the cached rows of the positions it may see (ascending), into `out` (every
/// head's values).
fn attend(spec: &SparseMlaSpec, q: &Query, cached: &[Cached], up: &UpProjections, out: &mut [f32]) {
    let (n, r, v, l) = (spec.nope_dim, spec.rope_dim, spec.value_dim, spec.latent_dim);
    let index_keys: Vec<&[f32]> = cached.iter().map(|c| c.index_key).collect();
    let kept = ops::sparse_index_kept(spec, q.index_q, q.index_weights, &index_keys);
    let (mut k_row, mut v_row) = (vec![0f32; n], vec![0f32; l]);
    let mut absorbed = vec![0f32; l];
    let mut latent_sum = vec![0f32; l];
    for head in 0..spec.heads {
        // q̃[j] = W_UKᵀ[j, :] · q_nope: one row of `k_b` a latent dim.
        let q_nope = &q.q_nope[head * n..(head + 1) * n];
        for (j, a) in absorbed.iter_mut().enumerate() {
            *a = dot(up.k_b.row_f32(head * l + j, &mut k_row), q_nope);
        }
        let q_pe = &q.q_pe[head * r..(head + 1) * r];
        let scores: Vec<f32> = kept
            .iter()
            .map(|&j| {
                let (latent, k_pe) = cached[j].latent_and_rope.split_at(l);
                (dot(&absorbed, latent) + dot(q_pe, k_pe)) * spec.scale as f32
            })
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f32 = exps.iter().sum();
        latent_sum.fill(0.0);
        for (&j, &e) in kept.iter().zip(&exps) {
            let p = e / total;
            latent_sum
                .iter_mut()
                .zip(&cached[j].latent_and_rope[..l])
                .for_each(|(a, &c)| *a += p * c);
        }
        for (d, o) in out[head * v..(head + 1) * v].iter_mut().enumerate() {
            *o = dot(up.v_b.row_f32(head * v + d, &mut v_row), &latent_sum);
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matrix::Storage;

    /// The absorbed form gives the reference's expanded attention (`ops::mla_expand` then
    /// `ops::sparse_mla_query`), with the indexer keeping fewer positions than it sees.
    #[test]
    fn absorbed_attention_matches_the_expanded_reference() {
        let spec = SparseMlaSpec {
            heads: 2,
            nope_dim: 3,
            rope_dim: 2,
            value_dim: 4,
            latent_dim: 5,
            scale: 0.4,
            index_heads: 2,
            index_dim: 3,
            index_topk: 3,
            cache_slot: 0,
            index_slot: 0,
        };
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let mut take = |len: usize| -> Vec<f32> { (0..len).map(|_| next()).collect() };
        let k_b = take(spec.heads * spec.latent_dim * spec.nope_dim);
        let v_b = take(spec.heads * spec.value_dim * spec.latent_dim);
        let cached: Vec<Vec<f32>> = (0..6).map(|_| take(spec.cache_width())).collect();
        let (q_nope, q_pe) = (take(spec.heads * 3), take(spec.heads * 2));
        let (index_q, index_weights) = (take(6), take(2));
        let matrix = |data: &[f32], cols: usize| Matrix {
            rows: data.len() / cols,
            cols,
            storage: Storage::F32(data.to_vec()),
        };
        let (k_matrix, v_matrix) = (matrix(&k_b, spec.nope_dim), matrix(&v_b, spec.latent_dim));
        let up = UpProjections {
            k_b: &k_matrix,
            v_b: &v_matrix,
        };
        let query = Query {
            q_nope: &q_nope,
            q_pe: &q_pe,
            index_q: &index_q,
            index_weights: &index_weights,
        };
        let offset = spec.index_key_offset();
        let rows: Vec<Cached> = cached
            .iter()
            .map(|r| Cached {
                latent_and_rope: &r[..offset],
                index_key: &r[offset..],
            })
            .collect();
        let mut got = vec![0f32; spec.out_width()];
        attend(&spec, &query, &rows, &up, &mut got);
        let expanded: Vec<(Vec<f32>, Vec<f32>)> =
            cached.iter().map(|r| ops::mla_expand(&spec, &k_b, &v_b, r)).collect();
        let candidates: Vec<ops::MlaCandidate> = expanded
            .iter()
            .zip(&cached)
            .map(|((key, value), r)| ops::MlaCandidate {
                key,
                value,
                index_key: &r[offset..],
            })
            .collect();
        let want = ops::sparse_mla_query(&spec, [&q_nope, &q_pe, &index_q, &index_weights], &candidates);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "{got:?} against {want:?}");
        }
    }
}
