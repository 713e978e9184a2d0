//! The INT8-bound LM head: the exact top-k of `h · Wᵀ` at a quarter of the weight traffic.
//!
//! Prepared once per weight: every row `w_v` is quantized to int8 with its own scale,
//! `ŵ_v = s_v·q_v`, keeping `E_v = ‖w_v − ŵ_v‖`, `‖ŵ_v‖` and `‖w_v‖`. Per query, `h` is
//! quantized the same way (`ĥ = s_h·q_h`, error `e_h`) and every row gets an integer score
//! `A_v = s_v·s_h·Σ q_v q_h` with a rigorous bound on its distance to the full-precision score
//! `S_v` that the plain head computes (`simd::dot` of the f32 row with `h`):
//!
//! `|S_v − A_v| ≤ ‖h‖·E_v + ‖e_h‖·‖ŵ_v‖   (quantization: h·w − ĥ·ŵ = h·e_w + e_h·ŵ)`
//! `            + γ_d·‖h‖·‖w_v‖          (rounding of S_v's f32 dot, γ_d = d·u/(1 − d·u))`
//! `            + 4u·|A_v|                (rounding of A_v's scale products)`
//!
//! Let τ be the k-th largest lower bound `A_v − B_v`. A row whose upper bound `A_v + B_v` is
//! below τ has at least k rows certainly above it, so only rows reaching τ are rescored with
//! the plain head's own dot product; their exact top-k (ties to the lowest id) is the answer.

use super::simd;
use super::Matrix;

/// Unit roundoff of f32.
const U: f64 = f32::EPSILON as f64 / 2.0;

pub struct Int8Head {
    rows: usize,
    cols: usize,
    q: Vec<i8>,
    scale: Vec<f32>,
    /// ‖w_v − ŵ_v‖, ‖ŵ_v‖ and ‖w_v‖ per row, rounded up.
    err_norm: Vec<f32>,
    quant_norm: Vec<f32>,
    norm: Vec<f32>,
}

/// One query's answer and how much rescoring it took.
#[derive(Debug, Clone, PartialEq)]
pub struct TopK {
    pub ids: Vec<usize>,
    pub rescored: usize,
}

/// `x` quantized with one scale: (q, scale, ‖x − scale·q‖ rounded up).
fn quantize_row(x: &[f32], q: &mut [i8]) -> (f32, f64) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = if amax > 0.0 { amax / 127.0 } else { 1.0 };
    let mut err = 0f64;
    for (qi, &v) in q.iter_mut().zip(x) {
        *qi = (v / scale).round().clamp(-127.0, 127.0) as i8;
        let e = v as f64 - scale as f64 * *qi as f64;
        err += e * e;
    }
    (scale, err.sqrt() * (1.0 + 4.0 * U))
}

fn norm(x: impl Iterator<Item = f64>) -> f64 {
    x.map(|v| v * v).sum::<f64>().sqrt()
}

impl Int8Head {
    /// Quantize the rows of a full-precision head (f32 or bf16 storage).
    pub fn prepare(w: &Matrix) -> Self {
        let (rows, cols) = (w.rows, w.cols);
        let mut head = Self {
            rows,
            cols,
            q: vec![0; rows * cols],
            scale: vec![0.0; rows],
            err_norm: vec![0.0; rows],
            quant_norm: vec![0.0; rows],
            norm: vec![0.0; rows],
        };
        let mut buf = vec![0f32; cols];
        for r in 0..rows {
            let row = w.row_f32(r, &mut buf);
            let q = &mut head.q[r * cols..(r + 1) * cols];
            let (scale, err) = quantize_row(row, q);
            head.scale[r] = scale;
            head.err_norm[r] = round_up(err);
            head.quant_norm[r] = round_up(norm(q.iter().map(|&v| v as f64 * scale as f64)));
            head.norm[r] = round_up(norm(row.iter().map(|&v| v as f64)));
        }
        head
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The exact top-k of `h · Wᵀ` as `full` (the same weights, full precision) computes it.
    pub fn top_k(&self, h: &[f32], k: usize, full: &Matrix) -> TopK {
        let d = self.cols;
        let mut qh = vec![0i8; d];
        let (sh, eh) = quantize_row(h, &mut qh);
        let h_norm = norm(h.iter().map(|&v| v as f64)) * (1.0 + 4.0 * U);
        let gamma = d as f64 * U / (1.0 - d as f64 * U);
        let mut approx = vec![0f32; self.rows];
        let mut bound = vec![0f32; self.rows];
        for v in 0..self.rows {
            let isum = idot(&self.q[v * d..(v + 1) * d], &qh);
            let a = (self.scale[v] as f64 * sh as f64 * isum as f64) as f32;
            let b = h_norm * self.err_norm[v] as f64
                + eh * self.quant_norm[v] as f64
                + gamma * h_norm * self.norm[v] as f64
                + 4.0 * U * (a as f64).abs();
            approx[v] = a;
            bound[v] = round_up(b * (1.0 + 8.0 * U));
        }
        let k = k.min(self.rows);
        let mut lower: Vec<f32> = approx.iter().zip(&bound).map(|(a, b)| a - b).collect();
        let (_, tau, _) = lower.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        let tau = *tau;
        let mut row = vec![0f32; d];
        let mut scored: Vec<(usize, f32)> = (0..self.rows)
            .filter(|&v| approx[v] + bound[v] >= tau)
            .map(|v| (v, simd::dot(full.row_f32(v, &mut row), h)))
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

fn idot(a: &[i8], b: &[i8]) -> i32 {
    a.iter().zip(b).map(|(&x, &y)| x as i32 * y as i32).sum()
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
