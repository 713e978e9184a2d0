//! Activations as the CPU backend computes them: in f32, in the forms that need no special
//! function beyond `exp` (SiLU is the reference's own). The IR reference computes GELU's tanh in f64 (the ground truth);
//! here `0.5·x·(1 + tanh(y)) = x·σ(2y)` gives the same value within f32 rounding at a fraction
//! of the cost (GeGLU was a tenth of Gemma 3's prefill), with no cancellation for negative x.

use super::rows;
use ir::reference::ops::silu;
use ir::GluAct;

/// PyTorch's `gelu(x, approximate="tanh")`, as `x / (1 + e^{-2y})`, `y = √(2/π)(x + 0.044715x³)`.
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let y = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    x / (1.0 + (-2.0 * y).exp())
}

/// `act(x[:, :n]) · x[:, n:]` for rows of `row_len = 2n`; a prefill chunk's rows spread over
/// the pool (each element is computed the same either way).
pub fn glu(x: &[f32], row_len: usize, act: GluAct) -> Vec<f32> {
    let n = row_len / 2;
    let f = match act {
        GluAct::Silu => silu,
        GluAct::GeluTanh => gelu_tanh,
    };
    let mut out = vec![0f32; x.len() / 2];
    rows::for_row_runs(&mut out, n, |first, run| {
        let inputs = x[first * row_len..].chunks_exact(row_len);
        for (o, r) in run.chunks_exact_mut(n).zip(inputs) {
            for ((o, &g), &u) in o.iter_mut().zip(&r[..n]).zip(&r[n..]) {
                *o = f(g) * u;
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::reference::ops;

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
        }
        assert_eq!(gelu_tanh(-100.0), 0.0);
        assert_eq!(gelu_tanh(100.0), 100.0);
        let x = [0.5f32, -1.0, 2.0, 3.0];
        assert_eq!(glu(&x, 4, GluAct::Silu), ops::glu(&x, 4, GluAct::Silu));
        // Many rows (split over the pool) give each row's one-row result.
        let rows: Vec<f32> = (0..40 * 6).map(|i| (i % 13) as f32 * 0.7 - 4.0).collect();
        let one_by_one: Vec<f32> = rows.chunks_exact(6).flat_map(|r| glu(r, 6, GluAct::GeluTanh)).collect();
        assert_eq!(glu(&rows, 6, GluAct::GeluTanh), one_by_one);
    }
}
