//! Q8_0: 32 weights as int8 with one f16 scale; `x = q·d`.
//! Layout (`block_q8_0`): d: f16, qs: [i8; 32].

use super::{f16_at, BlockFormat};

pub struct Q8_0;

impl BlockFormat for Q8_0 {
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 34;

    const GROUP: usize = 32;

    #[inline(always)]
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]) {
        for (o, &q) in w.iter_mut().zip(&block[2..34]) {
            *o = q as i8;
        }
        scale[0] = f16_at(block, 0);
        min[0] = 0.0;
    }

    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        for (o, &q) in out.iter_mut().zip(&block[2..34]) {
            *o = (q as i8) as f32 * d;
        }
    }
}

/// One block of 32 weights as ggml's reference quantizer (`quantize_row_q8_0_ref`) makes it:
/// `d = max|x| / 127` (stored as an f16), each `q` the weight times `1/d` (of the f32 `d`)
/// rounded half away from zero; a block of zeros is zeros under a zero scale.
pub fn quantize_block(x: &[f32]) -> [u8; 34] {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut out = [0u8; 34];
    out[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
    for (q, &v) in out[2..].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
    out
}

/// The float matrix `view` (f32, bf16 or f16, `[rows, cols]`, `cols` a multiple of 32) as Q8_0
/// blocks ([`quantize_block`]), row by row on the pool.
pub fn quantize_matrix(view: &crate::tensor::TensorView<'_>) -> Vec<u8> {
    crate::tensor::quantize_blocks_of_32(view, quantize_block)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GgmlType;

    fn fixture(name: &str) -> Vec<u8> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/gguf-blocks/");
        std::fs::read(format!("{path}{name}")).unwrap()
    }

    /// The Q8_0 blocks llama.cpp wrote for SmolLM2's embedding (`gguf-blocks/Q8_0.bin`) are
    /// what this quantizer makes of their own weights again: each block's largest weight is
    /// ±127 steps, so the scale comes back and every level with it.
    #[test]
    fn gguf_py_blocks_quantize_back_to_themselves() {
        let blocks = fixture("Q8_0.bin");
        let mut weights = vec![0f32; blocks.len() / 34 * 32];
        GgmlType::Q8_0.dequantize(&blocks, &mut weights);
        assert!(blocks.len() >= 34 * 8);
        for (b, (block, x)) in blocks.chunks_exact(34).zip(weights.chunks_exact(32)).enumerate() {
            assert_eq!(quantize_block(x)[..], block[..], "block {b}");
        }
    }

    /// Every weight within half a step of its level's value (plus the f16 scale's rounding);
    /// ties round away from zero; zeros stay zeros.
    #[test]
    fn weights_are_rounded_to_the_nearest_level() {
        for b in 0..64usize {
            let x: Vec<f32> = (0..32)
                .map(|i| ((((b * 32 + i) * 2654435761usize) >> 9) % 2001) as f32 - 1000.0)
                .map(|v| v * 1e-4 * (1 + b % 5) as f32)
                .collect();
            let block = quantize_block(&x);
            let mut got = [0f32; 32];
            GgmlType::Q8_0.dequantize(&block, &mut got);
            let d = f32::from(half::f16::from_le_bytes([block[0], block[1]]));
            for (g, w) in got.iter().zip(&x) {
                assert!((g - w).abs() <= 0.5 * d + 127.0 * d * 1e-3, "block {b}: {g} for {w}");
            }
        }
        let mut half_step = [0f32; 32];
        (half_step[0], half_step[1]) = (127.0, 2.5);
        assert_eq!(quantize_block(&half_step)[3] as i8, 3);
        assert!(quantize_block(&[0.0; 32]).iter().all(|&b| b == 0));
    }
}
