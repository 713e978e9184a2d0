//! FP8 E4M3 weights in blocks of 32 with an f32 scale: how bbc holds an FP8 checkpoint's
//! weights natively (`models::fp8_checkpoint` repacks them: every 32 columns of a row lie
//! under one of the checkpoint's scales). Not a GGUF type; no file stores it.
//! Layout: scale: f32 (little-endian), codes: [u8; 32]; `x = e4m3(code) · scale` in f32.

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
}
