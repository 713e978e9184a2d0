//! FP4 E2M1 weights in blocks of 32 with an f32 scale for each 16: how bbc holds an NVFP4
//! checkpoint's weights natively (`models::fp4_checkpoint` repacks them: a scale for every 16
//! columns of a row, NVFP4's groups, folded with the tensor's global scale into one f32). Not
//! a GGUF type; no file stores it.
//!
//! Layout: scales: two f32s (little-endian; elements 0..16's, then 16..32's), codes: 16 bytes
//! in GGUF Q4_1's nibble order (low nibbles are elements 0..16, high 16..32), so a byte's low
//! nibble is under the first scale and its high nibble under the second; `x = e2m1(code) ·
//! scale` in f32, one product rounded. 6 bits a weight (NVFP4's own layout takes 4.5).

/// Elements of a block.
pub const BLOCK_ELEMS: usize = 32;
/// Bytes of a block.
pub const BLOCK_BYTES: usize = 24;
/// Where a block's codes start.
pub const CODES_AT: usize = 8;
/// Elements under one scale (NVFP4's group).
pub const GROUP_ELEMS: usize = 16;

/// The values of the 16 E2M1 codes: sign (bit 3), two exponent bits and one mantissa bit, no
/// infinities or NaNs: ±0, 0.5, 1, 1.5, 2, 3, 4, 6.
pub const CODE_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The block's two scales.
pub fn scales(block: &[u8]) -> [f32; 2] {
    let word = |at: usize| f32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
    [word(0), word(4)]
}

/// Element `e`'s code (0..16).
pub fn code(block: &[u8], e: usize) -> u8 {
    let byte = block[CODES_AT + e % 16];
    match e < 16 {
        true => byte & 15,
        false => byte >> 4,
    }
}

/// One block's 32 weights.
pub fn dequantize_block(block: &[u8], out: &mut [f32]) {
    let scales = scales(block);
    for (e, o) in out.iter_mut().enumerate().take(BLOCK_ELEMS) {
        *o = CODE_VALUES[usize::from(code(block, e))] * scales[e / GROUP_ELEMS];
    }
}

/// A block of 32 codes (each below 16) under two scales (elements 0..16's, 16..32's).
pub fn block(scales: [f32; 2], codes: &[u8; 32]) -> [u8; BLOCK_BYTES] {
    let mut out = [0u8; BLOCK_BYTES];
    out[..4].copy_from_slice(&scales[0].to_le_bytes());
    out[4..8].copy_from_slice(&scales[1].to_le_bytes());
    for j in 0..16 {
        debug_assert!(codes[j] < 16 && codes[j + 16] < 16);
        out[CODES_AT + j] = codes[j] | (codes[j + 16] << 4);
    }
    out
}

/// The E2M1 code nearest `x` (ties to the even code; beyond ±6 the largest magnitude; NaN to
/// 0).
pub fn nearest_code(x: f32) -> u8 {
    let magnitude = x.abs();
    let mut best = 0usize;
    for (code, &value) in CODE_VALUES[..8].iter().enumerate() {
        let (d, best_d) = ((magnitude - value).abs(), (magnitude - CODE_VALUES[best]).abs());
        if d < best_d || d == best_d && code % 2 == 0 {
            best = code;
        }
    }
    match x.is_sign_negative() && best != 0 {
        true => best as u8 | 8,
        false => best as u8,
    }
}

/// 32 weights quantized as an NVFP4 checkpoint of them with a global scale of 1 would be: each
/// group of 16's scale its largest magnitude over 6 rounded to E4M3 (at least E4M3's least,
/// 2⁻⁹), each code the weight over its scale rounded to the nearest E2M1 value.
pub fn quantize_block(x: &[f32]) -> [u8; BLOCK_BYTES] {
    debug_assert_eq!(x.len(), BLOCK_ELEMS);
    let scale = |group: &[f32]| {
        let amax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
        ir::F8E4M3::from_f32(amax / 6.0).to_f32().max(2f32.powi(-9))
    };
    let scales = [scale(&x[..16]), scale(&x[16..])];
    let codes = std::array::from_fn(|e| nearest_code(x[e] / scales[e / GROUP_ELEMS]));
    block(scales, &codes)
}

/// The float matrix `view` (f32, bf16 or f16, `[rows, cols]`, `cols` a multiple of 32) as FP4
/// blocks ([`quantize_block`]), row by row on the pool.
pub fn quantize_matrix(view: &crate::tensor::TensorView<'_>) -> Vec<u8> {
    crate::tensor::quantize_blocks_of_32(view, quantize_block)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code under either scale is its value times that scale, read back from the layout.
    #[test]
    fn a_weight_is_its_codes_value_times_its_groups_scale() {
        let codes: [u8; 32] = std::array::from_fn(|e| ((e * 7 + e / 16) % 16) as u8);
        for scales_ in [[0.37f32, -2.5e-3], [1.0, 448.0], [f32::from_bits(0x30), 6.0e35]] {
            let bytes = block(scales_, &codes);
            assert_eq!(scales(&bytes), scales_);
            let mut out = [0f32; 32];
            dequantize_block(&bytes, &mut out);
            for (e, &got) in out.iter().enumerate() {
                assert_eq!(code(&bytes, e), codes[e]);
                let want = CODE_VALUES[usize::from(codes[e])] * scales_[e / 16];
                assert_eq!(got.to_bits(), want.to_bits(), "element {e}");
            }
        }
    }

    /// Rounding to the nearest code, ties to even codes, saturating past 6.
    #[test]
    fn nearest_codes_round_to_nearest_ties_to_even() {
        for (x, want) in [
            (0.0, 0u8),
            (0.25, 0),
            (0.26, 1),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (5.1, 7),
            (100.0, 7),
            (-1.5, 11),
            (-0.1, 0),
        ] {
            assert_eq!(nearest_code(x), want, "{x}");
        }
        assert_eq!(nearest_code(f32::NAN), 0);
    }

    /// Quantized blocks: each group's scale an E4M3 value, every weight within half a step of
    /// its code's value where the step is the gap between the codes around it, zeros zero.
    #[test]
    fn quantized_blocks_hold_the_nearest_codes() {
        for b in 0..100usize {
            let x: [f32; 32] = std::array::from_fn(|i| {
                let v = (((b * 32 + i) * 2654435761usize) >> 7) % 2001;
                (v as f32 - 1000.0) * 1e-3 * (1 + (b + i / 16) % 7) as f32
            });
            let bytes = quantize_block(&x);
            let mut got = [0f32; 32];
            dequantize_block(&bytes, &mut got);
            for (e, (&g, &w)) in got.iter().zip(&x).enumerate() {
                let scale = scales(&bytes)[e / 16];
                assert_eq!(ir::F8E4M3::from_f32(scale).to_f32(), scale);
                // E2M1's widest gap is 2 (between 4 and 6); past 6 the code saturates.
                assert!(
                    (g - w).abs() <= scale * 1.0 + 1e-6,
                    "block {b} element {e}: {g} for {w}"
                );
                assert_eq!(code(&bytes, e), nearest_code(w / scale));
            }
        }
        let mut zeros = [1f32; 32];
        dequantize_block(&quantize_block(&[0.0; 32]), &mut zeros);
        assert_eq!(zeros, [0.0; 32]);
    }

    /// The table is E2M1's: sign, exponent (bias 1) and mantissa bits decoded.
    #[test]
    fn code_values_are_e2m1() {
        for (code, &value) in CODE_VALUES.iter().enumerate() {
            let (sign, exponent, mantissa) = (code >> 3, (code >> 1) & 3, code & 1);
            let magnitude = match exponent {
                0 => 0.5 * mantissa as f32,
                e => (1.0 + 0.5 * mantissa as f32) * 2f32.powi(e as i32 - 1),
            };
            assert_eq!(
                value.to_bits(),
                if sign == 1 { -magnitude } else { magnitude }.to_bits()
            );
        }
    }
}
