//! Per-row ops (norms, rope, the residual stream's copies) over a step's rows: a prefill chunk's
//! rows spread over the pool in contiguous runs, a few rows (decode) stay on the calling thread.
//! Each row is computed by the same function either way, so results never depend on the split.

use super::pool;
use std::ops::Range;

/// Rows from which a per-row op is worth splitting over the pool's threads.
pub const PARALLEL_FROM_ROWS: usize = 8;

/// `f(first_row, rows)` over `data` cut into runs of whole rows of `row_len`, in parallel where
/// there are enough rows; `f` sees every row exactly once.
pub fn for_row_runs(data: &mut [f32], row_len: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    let rows = data.len().checked_div(row_len).unwrap_or(0);
    if rows < PARALLEL_FROM_ROWS {
        return f(0, data);
    }
    let run_rows = rows.div_ceil(2 * pool::global().threads());
    pool::global().for_chunks_mut(
        data,
        run_rows * row_len,
        || (),
        |_, run, chunk| f(run * run_rows, chunk),
    );
}

/// `[a | b]` per row into `out`, rows of `a` `a_len` and of `b` `b_len` elements wide.
pub fn concat_columns(a: &[f32], a_len: usize, b: &[f32], b_len: usize, out: &mut [f32]) {
    let width = a_len + b_len;
    debug_assert_eq!(out.len(), a.len() + b.len());
    for_row_runs(out, width, |first, run| {
        for (i, row) in run.chunks_exact_mut(width).enumerate() {
            let r = first + i;
            row[..a_len].copy_from_slice(&a[r * a_len..(r + 1) * a_len]);
            row[a_len..].copy_from_slice(&b[r * b_len..(r + 1) * b_len]);
        }
    });
}

/// Columns `columns` of every row of `x` (rows of `row_len`) into `out`: a fused projection's
/// part (`Slice`), copied a row at a time.
pub fn slice_columns(x: &[f32], row_len: usize, columns: Range<usize>, out: &mut [f32]) {
    let len = columns.len();
    debug_assert_eq!(out.len(), x.len().checked_div(row_len).unwrap_or(0) * len);
    if len == 0 {
        return;
    }
    for_row_runs(out, len, |first, run| {
        for (i, row) in run.chunks_exact_mut(len).enumerate() {
            let at = (first + i) * row_len + columns.start;
            row.copy_from_slice(&x[at..at + len]);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_cover_every_row_once_in_place() {
        for rows in [0, 1, 7, 8, 9, 100] {
            let mut data = vec![0f32; rows * 3];
            for_row_runs(&mut data, 3, |first, run| {
                for (i, row) in run.chunks_exact_mut(3).enumerate() {
                    row.iter_mut().for_each(|v| *v += (first + i) as f32);
                }
            });
            let want: Vec<f32> = (0..rows).flat_map(|r| [r as f32; 3]).collect();
            assert_eq!(data, want, "{rows} rows");
        }
    }

    #[test]
    fn column_slices_match_the_reference() {
        for rows in [0, 1, 20] {
            let x: Vec<f32> = (0..rows * 7).map(|i| i as f32).collect();
            for (start, len) in [(0, 7), (0, 3), (2, 4), (6, 1), (3, 0)] {
                let mut out = vec![f32::NAN; rows * len];
                slice_columns(&x, 7, start..start + len, &mut out);
                assert_eq!(
                    out,
                    ir::reference::ops::slice_columns(&x, 7, start, len),
                    "{rows} rows, columns {start}..{}",
                    start + len
                );
            }
        }
    }

    #[test]
    fn concatenation_matches_the_reference() {
        for rows in [1, 20] {
            let a: Vec<f32> = (0..rows * 3).map(|i| i as f32).collect();
            let b: Vec<f32> = (0..rows * 5).map(|i| -(i as f32)).collect();
            let mut out = vec![f32::NAN; rows * 8];
            concat_columns(&a, 3, &b, 5, &mut out);
            assert_eq!(out, ir::reference::ops::concat_columns(&a, 3, &b, 5));
        }
    }
}
