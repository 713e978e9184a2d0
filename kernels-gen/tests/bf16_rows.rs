//! The TMA GEMM's rows (`templates::bf16_rows`) on the emulator: each row as bf16 after the
//! matmul's prologue (none, the RMSNorm, the residual add then the norm, whose sum also goes to
//! `out`), rows strided on both sides; no blocks for steps under its rows.

mod common;

use common::{ints, Rng};
use half::bf16;
use kernels_gen::emulator::{run, Array};
use kernels_gen::templates::bf16_rows::bf16_rows;
use kernels_gen::templates::gemv::NormPrologue;
use std::collections::HashMap;

const MIN_TOKENS: usize = 16;

/// The rows `bf16_rows` makes for `norm` over `tokens` rows of `k` (x and b rows `k + 3`
/// apart, the bf16 rows `k + 5`, `out`'s `2k`): the bf16 rows and `out`.
fn made(norm: Option<NormPrologue>, tokens: usize, k: usize, rng: &mut Rng) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (x_stride, xb_stride, out_stride) = (k + 3, k + 5, 2 * k);
    let (x, b, g) = (rng.vec(tokens * x_stride), rng.vec(tokens * x_stride), rng.vec(k));
    let kernel = bf16_rows("rows", "test", norm, MIN_TOKENS);
    let mut bufs = HashMap::from([
        ("x".to_string(), Array::f32(&x)),
        ("b".to_string(), Array::f32(&b)),
        ("g".to_string(), Array::f32(&g)),
        ("xb".to_string(), Array::bf16(&vec![bf16::ZERO; tokens * xb_stride])),
        ("out".to_string(), Array::f32(&vec![0.0; tokens * out_stride])),
    ]);
    let scalars = ints(&[
        ("tokens", tokens as i64),
        ("k", k as i64),
        ("x_stride", x_stride as i64),
        ("xb_stride", xb_stride as i64),
        ("b_stride", x_stride as i64),
        ("out_stride", out_stride as i64),
    ]);
    run(&kernel, &mut bufs, &scalars).unwrap();
    // What the rows should hold, in f64 then rounded as the kernel rounds.
    let mut want_xb = vec![0f32; tokens * xb_stride];
    let mut want_out = vec![0f32; tokens * out_stride];
    for t in 0..tokens {
        let row: Vec<f32> = (0..k)
            .map(|c| match norm {
                Some(n) if n.residual => x[t * x_stride + c] + b[t * x_stride + c],
                _ => x[t * x_stride + c],
            })
            .collect();
        let inv = match norm {
            Some(n) => 1.0 / ((row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / k as f64) + n.eps as f64).sqrt(),
            None => 1.0,
        };
        for c in 0..k {
            let scaled = match norm {
                Some(n) => row[c] as f64 * inv * (g[c] + n.offset) as f64,
                None => row[c] as f64,
            };
            want_xb[t * xb_stride + c] = bf16::from_f64(scaled).to_f32();
            if norm.is_some_and(|n| n.residual) {
                want_out[t * out_stride + c] = row[c];
            }
        }
    }
    let got_xb = bufs["xb"].to_f32().unwrap();
    let got_out = bufs["out"].to_f32().unwrap();
    (got_xb, want_xb, [got_out, want_out].concat())
}

#[test]
fn rows_are_the_prologues_values_in_bf16() {
    let mut rng = Rng(5);
    let forms = [
        None,
        Some(NormPrologue::new(1e-5, 0.0)),
        Some(NormPrologue::new(1e-6, 1.0).with_residual()),
    ];
    for norm in forms {
        for (tokens, k) in [(MIN_TOKENS, 8), (19, 300)] {
            let (got, want, outs) = made(norm, tokens, k, &mut rng);
            let what = format!("{norm:?}, {tokens}×{k}");
            // Plain rows are exact; a norm's scale is summed in another order than here, so a
            // value may round to the neighbouring bf16 (relative 2⁻⁸).
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let tolerance = if norm.is_some() { w.abs() / 128.0 } else { 0.0 };
                assert!((g - w).abs() <= tolerance, "{what}: element {i}: {g} vs {w}");
            }
            // The residual sum is exact; without one `out` is not touched.
            let (got_out, want_out) = outs.split_at(outs.len() / 2);
            assert_eq!(got_out, want_out, "{what}: out");
        }
    }
}

#[test]
fn steps_under_its_rows_launch_no_blocks() {
    let mut rng = Rng(9);
    let (got, _, _) = made(Some(NormPrologue::new(1e-5, 0.0)), MIN_TOKENS - 1, 64, &mut rng);
    assert!(got.iter().all(|&v| v == 0.0), "rows written below {MIN_TOKENS} rows");
}
