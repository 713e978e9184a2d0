//! The INT8-bound LM head: the exact top-k of `h · Wᵀ` at about a quarter of the weight traffic.
//!
//! Prepared once per weight: every row `w_v` is quantized to int8 in blocks of 32 with one
//! scale per block, `ŵ_vb = s_vb·q_vb`, keeping per block `E_vb = ‖w_vb − ŵ_vb‖` and
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

use super::simd;
use super::Matrix;
use rayon::prelude::*;

/// Unit roundoff of f32.
const U: f64 = f32::EPSILON as f64 / 2.0;
/// Elements per quantization block.
const BLOCK: usize = 32;

pub struct Int8Head {
    rows: usize,
    cols: usize,
    q: Vec<i8>,
    /// Per row and block: scale, ‖w − ŵ‖ and ‖ŵ‖ (norms rounded up).
    scale: Vec<f32>,
    err_norm: Vec<f32>,
    quant_norm: Vec<f32>,
    /// ‖w_v‖ per row, rounded up.
    norm: Vec<f32>,
}

/// One query's answer and how much rescoring it took.
#[derive(Debug, Clone, PartialEq)]
pub struct TopK {
    pub ids: Vec<usize>,
    pub rescored: usize,
}

/// `x` quantized with one scale: (scale, ‖x − scale·q‖, ‖scale·q‖), norms rounded up.
fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32, f32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = if amax > 0.0 { amax / 127.0 } else { 1.0 };
    let (mut err, mut quant) = (0f64, 0f64);
    for (qi, &v) in q.iter_mut().zip(x) {
        *qi = (v / scale).round().clamp(-127.0, 127.0) as i8;
        let w = scale as f64 * *qi as f64;
        err += (v as f64 - w) * (v as f64 - w);
        quant += w * w;
    }
    (
        scale,
        round_up(err.sqrt() * (1.0 + 4.0 * U)),
        round_up(quant.sqrt() * (1.0 + 4.0 * U)),
    )
}

fn norm(x: &[f32]) -> f64 {
    x.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt() * (1.0 + 4.0 * U)
}

impl Int8Head {
    /// Quantize the rows of a full-precision head (f32 or bf16 storage).
    pub fn prepare(w: &Matrix) -> Self {
        let (rows, cols) = (w.rows, w.cols);
        let blocks = cols.div_ceil(BLOCK);
        let mut head = Self {
            rows,
            cols,
            q: vec![0; rows * cols],
            scale: vec![0.0; rows * blocks],
            err_norm: vec![0.0; rows * blocks],
            quant_norm: vec![0.0; rows * blocks],
            norm: vec![0.0; rows],
        };
        let mut buf = vec![0f32; cols];
        for r in 0..rows {
            let row = w.row_f32(r, &mut buf);
            head.norm[r] = round_up(norm(row));
            for (b, x) in row.chunks(BLOCK).enumerate() {
                let q = &mut head.q[r * cols + b * BLOCK..r * cols + b * BLOCK + x.len()];
                let (s, e, n) = quantize_block(x, q);
                (
                    head.scale[r * blocks + b],
                    head.err_norm[r * blocks + b],
                    head.quant_norm[r * blocks + b],
                ) = (s, e, n);
            }
        }
        head
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The exact top-k of `h · Wᵀ` as `full` (the same weights, full precision) computes it.
    pub fn top_k(&self, h: &[f32], k: usize, full: &Matrix) -> TopK {
        let d = self.cols;
        let blocks = d.div_ceil(BLOCK);
        let mut qh = vec![0i8; d];
        let mut hq = Vec::with_capacity(blocks);
        for (b, x) in h.chunks(BLOCK).enumerate() {
            let (s, e, _) = quantize_block(x, &mut qh[b * BLOCK..b * BLOCK + x.len()]);
            hq.push((s as f64, e as f64, norm(x)));
        }
        let h_norm = norm(h);
        let gamma = |n: usize| n as f64 * U / (1.0 - n as f64 * U);
        let (gamma_d, gamma_sum) = (gamma(d), gamma(blocks + 3));
        // The INT8 pass: (approximate score, bound) per row, rows split across threads.
        let scored: Vec<(f32, f32)> = (0..self.rows)
            .into_par_iter()
            .with_min_len(1024)
            .map(|v| {
                let (mut a, mut magnitude, mut quant_err) = (0f64, 0f64, 0f64);
                for (b, &(sh, eh, hn)) in hq.iter().enumerate() {
                    let range = v * d + b * BLOCK..(v * d + (b + 1) * BLOCK).min((v + 1) * d);
                    let isum = simd::idot_i8(&self.q[range.clone()], &qh[range.start - v * d..range.end - v * d]);
                    let i = v * blocks + b;
                    let term = self.scale[i] as f64 * sh * isum as f64;
                    a += term;
                    magnitude += term.abs();
                    quant_err += hn * self.err_norm[i] as f64 + eh * self.quant_norm[i] as f64;
                }
                let a = a as f32;
                let b =
                    quant_err + gamma_d * h_norm * self.norm[v] as f64 + gamma_sum * magnitude + U * (a as f64).abs();
                (a, round_up(b * (1.0 + 8.0 * U)))
            })
            .collect();
        let (approx, bound): (Vec<f32>, Vec<f32>) = scored.into_iter().unzip();
        let k = k.min(self.rows);
        let mut lower: Vec<f32> = approx.iter().zip(&bound).map(|(a, b)| a - b).collect();
        let (_, tau, _) = lower.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        let tau = *tau;
        let candidates: Vec<usize> = (0..self.rows).filter(|&v| approx[v] + bound[v] >= tau).collect();
        let mut scored: Vec<(usize, f32)> = candidates
            .par_iter()
            .map_init(|| vec![0f32; d], |row, &v| (v, simd::dot(full.row_f32(v, row), h)))
            .collect();
        let rescored = scored.len();
        scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        TopK {
            ids: scored.into_iter().take(k).map(|(v, _)| v).collect(),
            rescored,
        }
    }
}

/// The next f32 above `x` (bounds must never round down).
fn round_up(x: f64) -> f32 {
    let f = x as f32;
    if (f as f64) < x {
        f32::from_bits(f.to_bits() + 1)
    } else {
        f
    }
}

#[cfg(test)]
mod tests {
    use super::super::Storage;
    use super::*;

    fn plain_top_k(w: &Matrix, h: &[f32], k: usize) -> Vec<usize> {
        let mut buf = vec![0f32; w.cols];
        let scores: Vec<f32> = (0..w.rows).map(|v| simd::dot(w.row_f32(v, &mut buf), h)).collect();
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
        let got = head.top_k(&h, 5, &w);
        assert_eq!(got.ids, plain_top_k(&w, &h, 5));
        assert_eq!(&got.ids[..4], &[3, 7, 150, 299], "ties go to the lowest index first");
    }
}
