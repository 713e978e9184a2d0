//! Weight matrices as the CPU kernels consume them, and `x · Wᵀ` over them.
//!
//! A matrix keeps the storage its graph node asks for: f32, bf16, or a GGML block format.
//! The product walks W's rows in parallel chunks; each row is widened to f32 once (a
//! dequantized row of a few KiB stays in L1) and dotted with every token's activation, so
//! prefill reads the weights once per step and decode is a pass over the weights.

use super::simd;
use half::bf16;
use models::quant::GgmlType;
use rayon::prelude::*;

pub enum Storage {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    Quant {
        dtype: GgmlType,
        bytes: Vec<u8>,
        row_bytes: usize,
    },
}

pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub storage: Storage,
}

/// Rows per parallel task: enough work to amortise scheduling, enough tasks to balance.
const ROWS_PER_TASK: usize = 32;

impl Matrix {
    pub fn bytes(&self) -> usize {
        match &self.storage {
            Storage::F32(v) => v.len() * 4,
            Storage::Bf16(v) => v.len() * 2,
            Storage::Quant { bytes, .. } => bytes.len(),
        }
    }

    /// Row `r` widened to f32 in `out` (`cols` long).
    pub fn row_f32<'a>(&'a self, r: usize, out: &'a mut [f32]) -> &'a [f32] {
        let c = self.cols;
        match &self.storage {
            Storage::F32(v) => &v[r * c..(r + 1) * c],
            Storage::Bf16(v) => {
                for (o, w) in out.iter_mut().zip(&v[r * c..(r + 1) * c]) {
                    *o = w.to_f32();
                }
                out
            }
            Storage::Quant {
                dtype,
                bytes,
                row_bytes,
            } => {
                dtype.dequantize(&bytes[r * row_bytes..(r + 1) * row_bytes], out);
                out
            }
        }
    }

    /// `out[t, n] = Σ_k x[t, k]·W[n, k]` for `x` of `tokens` rows.
    pub fn matmul(&self, x: &[f32], tokens: usize, out: &mut [f32]) {
        let (n, k) = (self.rows, self.cols);
        debug_assert_eq!(x.len(), tokens * k);
        debug_assert_eq!(out.len(), tokens * n);
        // Each task fills a [chunk_rows, tokens] block; blocks are scattered into `out` after.
        let blocks: Vec<Vec<f32>> = (0..n.div_ceil(ROWS_PER_TASK))
            .into_par_iter()
            .map_init(
                || vec![0f32; k],
                |row_buf, chunk| {
                    let start = chunk * ROWS_PER_TASK;
                    let end = (start + ROWS_PER_TASK).min(n);
                    let mut block = Vec::with_capacity((end - start) * tokens);
                    for r in start..end {
                        let w = self.row_f32(r, row_buf);
                        block.extend(x.chunks_exact(k).map(|xt| simd::dot(w, xt)));
                    }
                    block
                },
            )
            .collect();
        for (chunk, block) in blocks.iter().enumerate() {
            let start = chunk * ROWS_PER_TASK;
            for (i, row) in block.chunks_exact(tokens).enumerate() {
                for (t, &v) in row.iter().enumerate() {
                    out[t * n + start + i] = v;
                }
            }
        }
    }

    /// Copy row `r` as f32 into `out` (embedding gather).
    pub fn gather_row(&self, r: usize, out: &mut [f32]) {
        if let Storage::F32(v) = &self.storage {
            out.copy_from_slice(&v[r * self.cols..(r + 1) * self.cols]);
        } else {
            self.row_f32(r, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_matches_reference_for_every_storage() {
        let (n, k, t) = (70, 64, 3);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 97) as f32 - 48.0) / 32.0)
            .collect();
        let x: Vec<f32> = (0..t * k)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0)
            .collect();
        let mut want = vec![0f32; t * n];
        ir::reference::ops::matmul(&x, &w, k, &mut want);
        let storages = [
            Storage::F32(w.clone()),
            Storage::Bf16(w.iter().map(|&v| bf16::from_f32(v)).collect()),
        ];
        for storage in storages {
            let m = Matrix {
                rows: n,
                cols: k,
                storage,
            };
            let mut got = vec![f32::NAN; t * n];
            m.matmul(&x, t, &mut got);
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-3 * w.abs().max(1.0), "{g} vs {w}");
            }
        }
    }
}
