//! A draft head's 4-bit shortlist (`Op::ShortlistTopK`): its rows are copied once into Q4_0
//! blocks (`quant::q4_0::quantize_row`), a query scores every row of that copy through the
//! integer kernels of GGUF's Q4_0 weights (an eighth of the traffic of f32 rows, a quarter of
//! bf16's), and only the best-scoring candidates are scored again in the head's own precision.
//! Approximate by design: the top k of the exact scores are found wherever they are among the
//! candidates, which a draft head needs (the target verifies every guess).

use super::matrix::{Matrix, Storage};
use super::simd;
use quant::GgmlType;
use std::sync::Arc;

/// A head's rows in 4 bits; cloning shares them.
#[derive(Clone)]
pub struct ShortlistHead {
    coarse: Arc<Matrix>,
}

impl ShortlistHead {
    /// The 4-bit copy of `w` (f32, bf16, half or blocks, rows of whole blocks of 32).
    pub fn prepare(w: &Matrix) -> Result<Self, String> {
        if !w.cols.is_multiple_of(32) {
            return Err(format!(
                "a 4-bit shortlist needs rows of whole blocks of 32, not {}",
                w.cols
            ));
        }
        let mut bytes = Vec::new();
        let mut row = vec![0f32; w.cols];
        for r in 0..w.rows {
            bytes.extend(quant::q4_0::quantize_row(w.row_f32(r, &mut row)));
        }
        let row_bytes = bytes.len() / w.rows.max(1);
        Ok(Self {
            coarse: Arc::new(Matrix {
                rows: w.rows,
                cols: w.cols,
                storage: Storage::block_rows(GgmlType::Q4_0, bytes, row_bytes)?,
            }),
        })
    }

    /// Bytes its copy holds.
    pub fn bytes(&self) -> usize {
        self.coarse.bytes()
    }

    /// For each of the `queries` rows of `h`: the `candidates` best rows by the 4-bit scores
    /// (one pass over the copy for all of them), and of those the `k` best by `full`'s own rows
    /// (ties to the lowest id), query after query.
    pub fn top_k(&self, h: &[f32], queries: usize, k: usize, candidates: usize, full: &Matrix) -> Vec<usize> {
        let vocab = self.coarse.rows;
        let mut scores = vec![0f32; queries * vocab];
        self.coarse.matmul(h, queries, &mut scores);
        let mut row = vec![0f32; full.cols];
        let mut out = Vec::with_capacity(queries * k);
        for (query, scores) in h.chunks_exact(full.cols).zip(scores.chunks_exact(vocab)) {
            let shortlist = ir::reference::ops::top_k(scores, candidates.min(vocab));
            let exact: Vec<f32> = shortlist
                .iter()
                .map(|&v| simd::dot(full.row_f32(v, &mut row), query))
                .collect();
            let mut ranked: Vec<usize> = (0..shortlist.len()).collect();
            ranked.sort_by(|&a, &b| exact[b].total_cmp(&exact[a]).then(shortlist[a].cmp(&shortlist[b])));
            out.extend(ranked.into_iter().take(k).map(|i| shortlist[i]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic stream of values in (−1, 1).
    fn noise(seed: u64, len: usize) -> Vec<f32> {
        let mut state = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn exact_top_k(w: &Matrix, h: &[f32], k: usize) -> Vec<usize> {
        let mut scores = vec![0f32; w.rows];
        let mut row = vec![0f32; w.cols];
        for (v, s) in scores.iter_mut().enumerate() {
            *s = simd::dot(w.row_f32(v, &mut row), h);
        }
        ir::reference::ops::top_k(&scores, k)
    }

    /// With every row a candidate the shortlist is the exact top k; with 64 of 2 048 rows, a
    /// query's exact best three are among them for every one of 100 random queries (a 4-bit
    /// copy errs by far less than the gaps between the best rows and the 65th), ranked by
    /// their exact scores.
    #[test]
    fn the_shortlist_holds_the_exact_best_rows() {
        let (rows, cols) = (2048, 256);
        let w = Matrix {
            rows,
            cols,
            storage: Storage::F32(noise(1, rows * cols)),
        };
        let head = ShortlistHead::prepare(&w).unwrap();
        assert_eq!(head.bytes(), rows * cols / 32 * 18);
        // A hundred queries in one call, as a step's rows.
        let queries = 100;
        let h = noise(100, queries * cols);
        let all = head.top_k(&h, queries, 3, rows, &w);
        let shortlisted = head.top_k(&h, queries, 3, 64, &w);
        for (q, query) in h.chunks(cols).enumerate() {
            let exact = exact_top_k(&w, query, 3);
            assert_eq!(all[3 * q..3 * q + 3], exact, "query {q}, all rows");
            assert_eq!(shortlisted[3 * q..3 * q + 3], exact, "query {q}, 64 rows");
        }
        let odd = Matrix {
            rows: 2,
            cols: 40,
            storage: Storage::F32(vec![0.0; 80]),
        };
        assert!(ShortlistHead::prepare(&odd).is_err());
    }
}
