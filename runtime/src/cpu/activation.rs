//! Activations as the CPU backend computes them: in f32, as `x / (1 + e^{-z})` (SiLU with
//! `z = x`, GELU's tanh form with `z = 2y`), with an `exp` of our own that the compiler
//! vectorises (libm's `expf` is a call per element: a third of GeGLU's time went to it).
//! The IR reference computes GELU's tanh in f64 (the ground truth); here
//! `0.5·x·(1 + tanh(y)) = x·σ(2y)` gives the same value within f32 rounding at a fraction of
//! the cost, with no cancellation for negative x.

use super::{rows, simd};
use ir::GluAct;

/// `e^x` within 2 ulp (Cephes' `expf`: `x = n·ln 2 + r`, `|r| ≤ ln 2 / 2`, a degree-6
/// polynomial for `e^r`, then `2^n` from the exponent bits), for the denominators of the
/// activations: above 88 it is `+∞` and below −87 it is 0, where f32's `e^x` overflows or
/// goes subnormal. Only `+`, `×`, comparisons and bit moves, none fused, so every CPU and
/// every vector width rounds it the same.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, the first exact in few bits, so `n·LN2_HIGH` is exact.
    const LN2_HIGH: f32 = 0.693_359_4;
    const LN2_LOW: f32 = -2.121_944_4e-4;
    // Adding and taking away 1.5·2^23 rounds to the nearest integer (|t| < 2^22).
    const ROUND: f32 = 12_582_912.0;
    let clamped = x.clamp(-87.0, 88.0);
    let shifted = clamped * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = (clamped - n * LN2_HIGH) - n * LN2_LOW;
    let mut p = 1.987_569_1e-4;
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = p * r + c;
    }
    let e_r = p * (r * r) + r + 1.0;
    // `shifted`'s mantissa holds `n` (its ulp is 1), so `2^n`'s exponent bits are read from
    // it: `n as i32` would be a saturating conversion, which LLVM does a lane at a time
    // (half of a long prefill's softmax went to it).
    let two_to_n = f32::from_bits(shifted.to_bits().wrapping_sub(ROUND.to_bits() - 127) << 23);
    if x > 88.0 {
        f32::INFINITY
    } else if x < -87.0 {
        0.0
    } else {
        e_r * two_to_n
    }
}

/// `x·σ(x)`.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// PyTorch's `gelu(x, approximate="tanh")`, as `x / (1 + e^{-2y})`, `y = √(2/π)(x + 0.044715x³)`.
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let y = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    x / (1.0 + exp(-2.0 * y))
}

/// `act(x[:, :n]) · x[:, n:]` for rows of `row_len = 2n`, into `out`; a prefill chunk's rows
/// spread over the pool (each element is computed the same either way).
pub fn glu(x: &[f32], row_len: usize, act: GluAct, out: &mut [f32]) {
    let n = row_len / 2;
    debug_assert_eq!(out.len(), x.len() / 2);
    rows::for_row_runs(out, n, |first, run| {
        let inputs = x[first * row_len..].chunks_exact(row_len);
        for (o, r) in run.chunks_exact_mut(n).zip(inputs) {
            glu_row(act, &r[..n], &r[n..], o);
        }
    });
}

simd::widest_vectors! {
    /// One row of [`glu`]: with AVX-512 or AVX2 where the CPU has them, so the loop runs 16 or
    /// 8 lanes wide (the same operations, so the same bits, as the scalar loop).
    fn glu_row(act: GluAct, gate: &[f32], up: &[f32], out: &mut [f32]) => glu_row_body
}

#[inline(always)]
fn glu_row_body(act: GluAct, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let lanes = out.iter_mut().zip(gate).zip(up);
    match act {
        GluAct::Silu => lanes.for_each(|((o, &g), &u)| *o = silu(g) * u),
        GluAct::GeluTanh => lanes.for_each(|((o, &g), &u)| *o = gelu_tanh(g) * u),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::reference::ops;

    /// Within 2 ulp of the f64 `exp` across f32's normal range, exactly 1 at 0, and the
    /// documented ends.
    #[test]
    fn exp_is_within_two_ulp() {
        let mut worst = 0f64;
        for i in -870_000..=880_000 {
            let x = i as f32 * 1e-4;
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst <= 2.0 * f32::EPSILON as f64, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!((exp(88.5), exp(f32::INFINITY)), (f32::INFINITY, f32::INFINITY));
        assert_eq!((exp(-90.0), exp(f32::NEG_INFINITY)), (0.0, 0.0));
        assert!(exp(f32::NAN).is_nan());
    }

    /// `2^n` from `shifted`'s bits is `2^n` from `n as i32`, so `exp` gives the bits it
    /// always gave, at every 61st f32 from below −87 to above 88 (and the ends).
    #[test]
    fn exp_takes_two_to_n_from_the_bits_exactly() {
        fn exp_by_conversion(x: f32) -> f32 {
            let clamped = x.clamp(-87.0, 88.0);
            let n = (clamped * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
            let r = (clamped - n * 0.693_359_4) - n * -2.121_944_4e-4;
            let mut p = 1.987_569_1e-4;
            for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
                p = p * r + c;
            }
            let e_r = p * (r * r) + r + 1.0;
            let two_to_n = f32::from_bits(((n as i32 + 127) as u32) << 23);
            if x > 88.0 {
                f32::INFINITY
            } else if x < -87.0 {
                0.0
            } else {
                e_r * two_to_n
            }
        }
        let (lo, hi) = ((-90f32).to_bits(), 90f32.to_bits());
        let negatives = (0x8000_0000..=lo).step_by(61);
        let positives = (0..=hi).step_by(61);
        for x in negatives
            .chain(positives)
            .map(f32::from_bits)
            .chain([-87.0, 88.0, -126.0 * 0.693])
        {
            assert_eq!(exp(x).to_bits(), exp_by_conversion(x).to_bits(), "e^{x}");
        }
    }

    #[test]
    fn agree_with_the_reference_within_f32_rounding() {
        for i in -2000..=2000 {
            let x = i as f32 / 100.0;
            let (got, want) = (gelu_tanh(x), ops::gelu_tanh(x));
            // A few f32 roundings of `exp` and `y`: 2e-6 relative, 2e-9 absolute near zero.
            assert!(
                (got - want).abs() <= 2e-6 * want.abs().max(1e-3),
                "gelu({x}): {got} vs {want}"
            );
            let (got, want) = (silu(x), ops::silu(x));
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
                "silu({x}): {got} vs {want}"
            );
        }
        assert_eq!(gelu_tanh(-100.0), 0.0);
        assert_eq!(gelu_tanh(100.0), 100.0);
        assert_eq!(silu(-100.0), 0.0);
        assert_eq!(silu(100.0), 100.0);
        // Many rows (split over the pool, vector lanes) give each element's scalar result.
        let rows: Vec<f32> = (0..40 * 38).map(|i| (i % 13) as f32 * 0.7 - 4.0).collect();
        for act in [GluAct::Silu, GluAct::GeluTanh] {
            let f = match act {
                GluAct::Silu => silu,
                GluAct::GeluTanh => gelu_tanh,
            };
            let one_by_one: Vec<f32> = rows
                .chunks_exact(38)
                .flat_map(|r| {
                    r[..19]
                        .iter()
                        .zip(&r[19..])
                        .map(|(&g, &u)| f(g) * u)
                        .collect::<Vec<_>>()
                })
                .collect();
            let mut out = vec![f32::NAN; rows.len() / 2];
            glu(&rows, 38, act, &mut out);
            assert_eq!(out, one_by_one, "{act:?}");
        }
    }
}
