//! Weight transforms that rewrites imply, computed at compile time: stacking rows
//! (`concat_rows`, a byte concatenation done where weights are laid out) and the INT8
//! quantization behind `int8_bound_top_k`, defined here.
//!
//! INT8 rows: every row is quantized in blocks of [`INT8_BLOCK`] with one scale per block,
//! `ŵ_b = s_b·q_b`, keeping per block `‖w_b − ŵ_b‖` and `‖ŵ_b‖` and per row `‖w‖`, every norm
//! rounded up: these are the terms of the head's error bound (see the runtime's `int8_head`).

/// Elements per quantization block.
pub const INT8_BLOCK: usize = 32;

/// Unit roundoff of f32.
pub const U: f64 = f32::EPSILON as f64 / 2.0;

#[derive(Debug, Clone, PartialEq)]
pub struct Int8Rows {
    pub rows: usize,
    pub cols: usize,
    pub q: Vec<i8>,
    /// Per row and block.
    pub scale: Vec<f32>,
    pub err_norm: Vec<f32>,
    pub quant_norm: Vec<f32>,
    /// Per row.
    pub norm: Vec<f32>,
}

impl Int8Rows {
    pub fn blocks_per_row(&self) -> usize {
        self.cols.div_ceil(INT8_BLOCK)
    }

    /// Quantize `rows` rows of `cols` values; `row(r, buf)` writes row `r` into `buf`.
    pub fn quantize(rows: usize, cols: usize, row: impl Fn(usize, &mut [f32])) -> Self {
        let blocks = cols.div_ceil(INT8_BLOCK);
        let mut out = Self {
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
            row(r, &mut buf);
            out.norm[r] = round_up(norm(&buf));
            for (b, x) in buf.chunks(INT8_BLOCK).enumerate() {
                let start = r * cols + b * INT8_BLOCK;
                let (s, e, n) = quantize_block(x, &mut out.q[start..start + x.len()]);
                let i = r * blocks + b;
                (out.scale[i], out.err_norm[i], out.quant_norm[i]) = (s, e, n);
            }
        }
        out
    }
}

/// `x` quantized with one scale: (scale, ‖x − scale·q‖, ‖scale·q‖), norms rounded up.
pub fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32, f32) {
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

/// ‖x‖ with a margin for its own rounding.
pub fn norm(x: &[f32]) -> f64 {
    x.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt() * (1.0 + 4.0 * U)
}

/// The smallest f32 not below `x` (bounds must never round down).
pub fn round_up(x: f64) -> f32 {
    let f = x as f32;
    if (f as f64) < x {
        f32::from_bits(f.to_bits() + 1)
    } else {
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_norms_bound_the_quantization_error() {
        let data: Vec<f32> = (0..3 * 70).map(|i| ((i * 7919 % 211) as f32 - 105.0) / 37.0).collect();
        let rows = Int8Rows::quantize(3, 70, |r, buf| buf.copy_from_slice(&data[r * 70..(r + 1) * 70]));
        assert_eq!(rows.blocks_per_row(), 3);
        for r in 0..3 {
            for b in 0..3 {
                let i = r * 3 + b;
                let range = r * 70 + b * 32..(r * 70 + (b + 1) * 32).min((r + 1) * 70);
                let err: f64 = range
                    .clone()
                    .map(|j| (data[j] as f64 - rows.scale[i] as f64 * rows.q[j] as f64).powi(2))
                    .sum::<f64>()
                    .sqrt();
                assert!(err <= rows.err_norm[i] as f64);
                assert!(rows.q[range].iter().all(|&q| q != i8::MIN));
            }
        }
    }
}
