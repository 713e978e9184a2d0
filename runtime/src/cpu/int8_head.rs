//! The INT8-bound LM head: the exact top-k of `h · Wᵀ` at about a quarter of the weight traffic.
//!
//! Prepared once per weight (`quant::int8_rows::Int8Rows`, at compile time when the
//! artifact carries it): every row `w_v` is quantized to int8 in blocks of 32 with one scale
//! per block, `ŵ_vb = s_vb·q_vb`, keeping per block `E_vb = ‖w_vb − ŵ_vb‖` and
//! `N_vb = ‖ŵ_vb‖`, and per row `‖w_v‖`. Per query, `h` is quantized the same way (`ĥ_b`,
//! error `e_hb`) and every row gets a score `A_v = Σ_b s_vb·s_hb·Σ q_vb q_hb` (integer sums are
//! exact) with a rigorous bound on its distance to the full-precision score `S_v` that the
//! plain head computes (`simd::dot` of the f32 row with `h`):
//!
//! `|S_v − A_v| ≤ Σ_b (‖h_b‖·E_vb + ‖e_hb‖·N_vb)   (h·w − ĥ·ŵ = h·e_w + e_h·ŵ, per block)`
//! `            + γ_d·‖h‖·‖w_v‖                      (rounding of S_v's f32 dot, γ_d = d·u/(1 − d·u))`
//! `            + γ_(B+3)·Σ_b |s_vb·s_hb·Σ q q|      (rounding of A_v's products and sum)`
//!
//! Let τ be the k-th largest lower bound `A_v − B_v`. A row whose upper bound `A_v + B_v` is
//! below τ has at least k rows certainly above it, so only rows reaching τ are rescored with
//! the plain head's own dot product; their exact top-k (ties to the lowest id) is the answer.
//! The scoring pass runs sixteen rows a vector (`int8_scores`), the rescoring a row a task.
//!
//! Soft-capped logits (`c(x) = cap · tanh(x / cap)`) keep the order but may join values that
//! were apart, so a row outside the candidates could tie a capped winner and, with a lower
//! id, win. The comparison is made after capping instead: a row with `c(A_v + B_v) < c(τ)`
//! has at least k rows whose capped logits are above its own (`c` is monotone), so the
//! candidates are the rows with `c(A_v + B_v) ≥ c(τ)`, and their capped logits are ranked.
//! That test is `A_v + B_v ≥ τ'` for the least `τ'` with `c(τ') ≥ c(τ)`, found once per query
//! by bisection ([`least_reaching`]), so no row's bound is capped.

use super::int8_scores::{Query, ScoringRows};
use super::pool;
use super::simd;
use super::Matrix;
use crate::cpu::quant::int8::Int8Kernel;
use quant::int8_rows::Int8Rows;
use std::sync::Arc;

/// A head's INT8 rows, regrouped for the scoring pass; cloning shares them.
#[derive(Clone)]
pub struct Int8Head {
    rows: Arc<ScoringRows>,
}

/// One query's answer and how much rescoring it took.
#[derive(Debug, Clone, PartialEq)]
pub struct TopK {
    pub ids: Vec<usize>,
    pub rescored: usize,
}

impl Int8Head {
    /// Quantize the rows of a full-precision head (f32, bf16 or half values) now.
    pub fn prepare(w: &Matrix) -> Self {
        Self::from_rows(&Int8Rows::quantize(w.rows, w.cols, |r, buf| {
            let row = w.row_f32(r, buf).to_vec();
            buf.copy_from_slice(&row);
        }))
    }

    /// A head quantized at compile time (or by [`prepare`](Self::prepare)).
    pub fn from_rows(rows: &Int8Rows) -> Self {
        Self {
            rows: Arc::new(ScoringRows::new(rows)),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows.rows()
    }

    pub fn cols(&self) -> usize {
        self.rows.cols()
    }

    /// The exact top-k of `h · Wᵀ` (soft-capped by `soft_cap` where given) as `full` (the
    /// same weights, full precision) computes it.
    pub fn top_k(&self, h: &[f32], k: usize, soft_cap: Option<f32>, full: &Matrix) -> TopK {
        let capped = |x: f32| soft_cap.map_or(x, |cap| ir::reference::ops::soft_cap(x, cap));
        let d = self.cols();
        let query = Query::new(h);
        // The INT8 pass: (approximate score, bound) per row.
        let scored = self.rows.scores(&query, Int8Kernel::detected());
        let (approx, bound): (Vec<f32>, Vec<f32>) = scored.into_iter().unzip();
        let rows = self.rows();
        let k = k.min(rows);
        let mut lower: Vec<f32> = approx.iter().zip(&bound).map(|(a, b)| a - b).collect();
        let (_, tau, _) = lower.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        let tau = match soft_cap {
            Some(_) => least_reaching(*tau, capped),
            None => *tau,
        };
        let candidates: Vec<usize> = (0..rows).filter(|&v| approx[v] + bound[v] >= tau).collect();
        let mut scored: Vec<(usize, f32)> = pool::global().map(
            candidates.len(),
            || vec![0f32; d],
            |row, i| {
                let v = candidates[i];
                (v, capped(simd::dot(full.row_f32(v, row), h)))
            },
        );
        let rescored = scored.len();
        scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        TopK {
            ids: scored.into_iter().take(k).map(|(v, _)| v).collect(),
            rescored,
        }
    }
}

/// The least `x` with `c(x) ≥ c(τ)`, for `c` monotone non-decreasing: `c(y) ≥ c(τ)` exactly
/// where `y ≥ x`. A bisection over the floats from −∞ to `τ` in their order (32 steps); a NaN
/// `τ` comes back as it is (no row reaches it either way).
fn least_reaching(tau: f32, c: impl Fn(f32) -> f32) -> f32 {
    if tau.is_nan() {
        return tau;
    }
    // Floats as integers in the same order (`f32::total_cmp`'s key; it is its own inverse).
    let key = |x: f32| {
        let bits = x.to_bits() as i32;
        (bits ^ (((bits >> 31) as u32) >> 1) as i32) as i64
    };
    let float = |k: i64| {
        let bits = k as i32;
        f32::from_bits((bits ^ (((bits >> 31) as u32) >> 1) as i32) as u32)
    };
    let target = c(tau);
    let (mut below, mut reaching) = (key(f32::NEG_INFINITY), key(tau));
    if c(f32::NEG_INFINITY) >= target {
        return f32::NEG_INFINITY;
    }
    while reaching - below > 1 {
        let mid = below + (reaching - below) / 2;
        match c(float(mid)) >= target {
            true => reaching = mid,
            false => below = mid,
        }
    }
    float(reaching)
}

#[cfg(test)]
mod tests {
    use super::super::Storage;
    use super::*;

    fn plain_top_k(w: &Matrix, h: &[f32], k: usize, soft_cap: Option<f32>) -> Vec<usize> {
        let mut buf = vec![0f32; w.cols];
        let scores: Vec<f32> = (0..w.rows)
            .map(|v| simd::dot(w.row_f32(v, &mut buf), h))
            .map(|x| soft_cap.map_or(x, |cap| ir::reference::ops::soft_cap(x, cap)))
            .collect();
        ir::reference::ops::top_k(&scores, k)
    }

    #[test]
    fn matches_the_plain_head_with_ties() {
        let (rows, cols) = (300, 64);
        let mut data: Vec<f32> = (0..rows * cols)
            .map(|i| (((i * 2654435761) >> 9) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        // Exact ties at the top: rows 7, 150 and 299 are copies of row 3, made the largest.
        for v in &mut data[3 * cols..4 * cols] {
            *v *= 4.0;
        }
        for copy in [7, 150, 299] {
            let (src, dst) = (3 * cols, copy * cols);
            data.copy_within(src..src + cols, dst);
        }
        let w = Matrix {
            rows,
            cols,
            storage: Storage::F32(data),
        };
        let head = Int8Head::prepare(&w);
        let h: Vec<f32> = w.row_f32(3, &mut vec![0.0; cols]).to_vec();
        let got = head.top_k(&h, 5, None, &w);
        assert_eq!(got.ids, plain_top_k(&w, &h, 5, None));
        assert_eq!(&got.ids[..4], &[3, 7, 150, 299], "ties go to the lowest index first");
    }

    /// The bisection's threshold is where the capped values reach τ's: the float just below it
    /// caps lower, it and τ alike, for caps that join many values (saturating) and few.
    #[test]
    fn the_threshold_is_the_least_float_capped_as_high_as_tau() {
        for cap in [0.01f32, 2.0, 30.0] {
            let c = |x: f32| ir::reference::ops::soft_cap(x, cap);
            for tau in [-3.5f32, -1e-3, 0.0, 0.37, 1.0, 4.25, 29.9, 1e4] {
                let t = least_reaching(tau, c);
                assert!(t <= tau && c(t) >= c(tau), "cap {cap}, τ {tau}: {t}");
                // At −∞ every float reaches τ's cap (a saturated negative τ).
                assert!(
                    t == f32::NEG_INFINITY || c(t.next_down()) < c(tau),
                    "cap {cap}, τ {tau}: {t} is not the least"
                );
            }
        }
        assert!(least_reaching(f32::NAN, |x| x).is_nan());
    }

    /// Over soft-capped logits the top-k is the capped values' own: a cap small enough to
    /// saturate ties every large logit, and the lowest ids among them win, wherever the
    /// uncapped maximum lies.
    #[test]
    fn matches_the_plain_head_over_soft_capped_logits() {
        let (rows, cols) = (400, 48);
        let data: Vec<f32> = (0..rows * cols)
            .map(|i| (((i * 2654435761) >> 7) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let w = Matrix {
            rows,
            cols,
            storage: Storage::F32(data),
        };
        let head = Int8Head::prepare(&w);
        for (query, cap) in [(11, 0.01), (11, 2.0), (200, 0.01), (200, 30.0)] {
            let h: Vec<f32> = w.row_f32(query, &mut vec![0.0; cols]).to_vec();
            let want = plain_top_k(&w, &h, 4, Some(cap));
            assert_eq!(head.top_k(&h, 4, Some(cap), &w).ids, want, "row {query}, cap {cap}");
            if cap == 0.01 {
                assert_ne!(want, plain_top_k(&w, &h, 4, None), "the cap should reorder ties here");
            }
        }
    }
}
