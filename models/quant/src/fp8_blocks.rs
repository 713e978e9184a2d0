//! FP8 E4M3 weights in blocks of 32 with an f32 scale: how bbc holds an FP8 checkpoint's
//! weights natively (`models::fp8_checkpoint` repacks them: every 32 columns of a row lie
//! under one of the checkpoint's scales). Not a GGUF type; no file stores it.
//! Layout: scale: f32 (little-endian), codes: [u8; 32]; `x = e4m3(code) · scale` in f32.
//! [`quantize_matrix`] makes them from floats, as a checkpoint of floats is quantized as it
//! loads.

use crate::tensor::TensorView;
use ir::F8E4M3;

pub const BLOCK_ELEMS: usize = 32;
pub const BLOCK_BYTES: usize = 36;

/// Every code's value, exactly (NaN for the two NaN codes), made once.
pub fn code_values() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|code| F8E4M3(code as u8).to_f32()))
}

/// The block's scale.
pub fn scale(block: &[u8]) -> f32 {
    f32::from_le_bytes([block[0], block[1], block[2], block[3]])
}

/// One block's 32 weights.
pub fn dequantize_block(block: &[u8], out: &mut [f32]) {
    let (table, d) = (code_values(), scale(block));
    for (o, &code) in out.iter_mut().zip(&block[4..BLOCK_BYTES]) {
        *o = table[usize::from(code)] * d;
    }
}

/// A block of 32 weights given as codes and their scale.
pub fn block(scale: f32, codes: &[u8; 32]) -> [u8; BLOCK_BYTES] {
    let mut out = [0u8; BLOCK_BYTES];
    out[..4].copy_from_slice(&scale.to_le_bytes());
    out[4..].copy_from_slice(codes);
    out
}

/// The least block magnitude a scale is made from: a block of zeros keeps a positive scale
/// (as FP8 checkpoints' makers clamp it) and codes of zero.
const LEAST_MAGNITUDE: f32 = 1e-12;

/// 32 weights quantized: the scale is their largest magnitude over 448 (in f32), each code the
/// weight over the scale rounded to nearest even E4M3, as FP8 checkpoints are made
/// (`(w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`). A NaN weight is a NaN code.
pub fn quantize_block(x: &[f32]) -> [u8; BLOCK_BYTES] {
    debug_assert_eq!(x.len(), BLOCK_ELEMS);
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs())).max(LEAST_MAGNITUDE);
    let scale = amax / F8E4M3::MAX;
    let codes = std::array::from_fn(|i| F8E4M3::from_f32(x[i] / scale).0);
    block(scale, &codes)
}

/// A row of floats (a multiple of 32 of them) as its blocks, into `out`
/// (`row.len() / 32 · 36` bytes).
pub fn quantize_row(row: &[f32], out: &mut [u8]) {
    debug_assert_eq!(row.len() % BLOCK_ELEMS, 0);
    debug_assert_eq!(out.len(), row.len() / BLOCK_ELEMS * BLOCK_BYTES);
    for (x, o) in row.chunks_exact(BLOCK_ELEMS).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        o.copy_from_slice(&quantize_block(x));
    }
}

/// The float matrix `view` (f32, bf16 or f16, `[rows, cols]`, `cols` a multiple of 32) as
/// FP8 blocks ([`quantize_block`]), row by row on the pool.
pub fn quantize_matrix(view: &TensorView<'_>) -> Vec<u8> {
    crate::tensor::quantize_blocks_of_32(view, quantize_block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_weight_is_its_code_times_its_scale() {
        let codes: [u8; 32] = std::array::from_fn(|i| (i as u8).wrapping_mul(53) & 0xfe);
        let bytes = block(0.37, &codes);
        let mut out = [0f32; 32];
        dequantize_block(&bytes, &mut out);
        for (o, &c) in out.iter().zip(&codes) {
            assert_eq!(o.to_bits(), (F8E4M3(c).to_f32() * 0.37).to_bits());
        }
        // 0x38 is 1.0, 0x7e the largest, 448.
        let mut one = [0u8; 32];
        (one[0], one[1]) = (0x38, 0x7e);
        dequantize_block(&block(2.0, &one), &mut out);
        assert_eq!(&out[..3], &[2.0, 896.0, 0.0]);
    }

    /// Each weight comes back within half a step of its block's grid (the step at its
    /// magnitude), the largest as ±448, and the scale is the largest magnitude over 448.
    #[test]
    fn quantized_blocks_hold_each_weight_to_within_half_a_step() {
        let mut seed = 0x2545_F491u32;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed as f32 / u32::MAX as f32 - 0.5) * 0.2
        };
        for row in 0..64 {
            let mut x: Vec<f32> = (0..64).map(|_| next()).collect();
            x[row % 64] *= 30.0;
            let mut bytes = vec![0u8; 2 * BLOCK_BYTES];
            quantize_row(&x, &mut bytes);
            for (xs, b) in x.chunks(32).zip(bytes.chunks(BLOCK_BYTES)) {
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert_eq!(scale(b), amax / 448.0);
                let mut out = [0f32; 32];
                dequantize_block(b, &mut out);
                for ((&w, &q), &code) in xs.iter().zip(&out).zip(&b[4..]) {
                    // E4M3 keeps 3 mantissa bits: half a step is 2⁻⁴ of the value's power
                    // of two; below 2⁻⁶ (subnormal codes) steps are 2⁻⁹ of the scale.
                    let step = (w.abs() / scale(b)).max(2f32.powi(-6)).log2().floor().exp2() / 8.0;
                    assert!((w - q).abs() <= step / 2.0 * scale(b) * 1.000_001, "{w} → {q}");
                    if w.abs() == amax {
                        assert_eq!(code & 0x7f, 0x7e, "the largest weight is ±448 × scale");
                    }
                }
            }
        }
    }

    /// A block of zeros keeps a positive scale and zero codes; NaN stays NaN, alone.
    #[test]
    fn zero_and_nan_blocks() {
        let zeros = quantize_block(&[0.0; 32]);
        assert!(scale(&zeros) > 0.0);
        assert!(zeros[4..].iter().all(|&c| c == 0));
        let mut x = [0.5f32; 32];
        x[3] = f32::NAN;
        let b = quantize_block(&x);
        assert_eq!(scale(&b), 0.5 / 448.0);
        assert_eq!(b[4 + 3] & 0x7f, 0x7f);
        assert!(b[4..].iter().enumerate().all(|(i, &c)| i == 3 || c == 0x7e));
    }

    /// Each row's blocks are `quantize_row` of its values, whatever the stored float type.
    #[test]
    fn a_matrix_is_its_rows_quantized() {
        use crate::GgmlType;
        let (rows, cols) = (5, 96);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let stored: [(GgmlType, Vec<u8>); 3] = [
            (GgmlType::F32, values.iter().flat_map(|v| v.to_le_bytes()).collect()),
            (
                GgmlType::BF16,
                values
                    .iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect(),
            ),
            (
                GgmlType::F16,
                values
                    .iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                    .collect(),
            ),
        ];
        for (dtype, bytes) in stored {
            let shape = [rows, cols];
            let out = quantize_matrix(&TensorView {
                shape: &shape,
                dtype,
                bytes: &bytes,
            });
            let row_bytes = bytes.len() / rows;
            for (r, blocks) in out.chunks(cols / 32 * BLOCK_BYTES).enumerate() {
                let mut row = vec![0f32; cols];
                dtype.dequantize(&bytes[r * row_bytes..][..row_bytes], &mut row);
                let mut want = vec![0u8; blocks.len()];
                quantize_row(&row, &mut want);
                assert_eq!(blocks, &want[..], "{dtype:?} row {r}");
            }
        }
    }
}
