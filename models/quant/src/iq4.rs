//! IQ4_NL and IQ4_XS: 4-bit indices into a fixed non-uniform table of int8 values
//! ([`KVALUES`], ggml's `kvalues_iq4nl`), scaled per 32 weights; `x = d·v` (IQ4_NL) or
//! `x = d·(ls − 32)·v` (IQ4_XS). In a 32-weight run the index of weight `j < 16` is the low
//! nibble of byte `j`, of weight `j + 16` its high nibble.
//! Layouts: `block_iq4_nl`: d: f16, qs: [u8; 16]. `block_iq4_xs` (256 weights): d: f16,
//! scales_h: u16 (two high bits of each 32-weight run's 6-bit scale), scales_l: [u8; 4] (their
//! low nibbles, run `2i` in the low nibble of byte `i`), qs: [u8; 128] (16 bytes a run).

use super::{f16_at, BlockFormat};

/// The values a 4-bit index stands for.
pub const KVALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// The table's values + 128 (0..242): what an index stands for as the CPU kernels store it,
/// unsigned for `vpdpbusd` (their sums start at −128·Σqx).
pub const STORED: [u8; 16] = super::stored_table(&KVALUES);

/// One 32-weight run's table values from its 16 bytes of indices.
#[inline(always)]
pub(crate) fn run_values(qs: &[u8], w: &mut [i8]) {
    for (j, &q) in qs[..16].iter().enumerate() {
        w[j] = KVALUES[(q & 0x0F) as usize];
        w[j + 16] = KVALUES[(q >> 4) as usize];
    }
}

/// An IQ4_XS block's eight 6-bit run scales `ls` (before the −32): low nibbles from
/// `scales_l`, two high bits each from `scales_h`.
pub fn run_scales(block: &[u8]) -> [u8; 8] {
    let scales_h = u16::from_le_bytes([block[2], block[3]]);
    std::array::from_fn(|run| {
        let low = (block[4 + run / 2] >> (4 * (run % 2))) & 0x0F;
        low | ((((scales_h >> (2 * run)) & 3) as u8) << 4)
    })
}

pub struct IQ4NL;

impl BlockFormat for IQ4NL {
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 18;

    const GROUP: usize = 32;

    #[inline(always)]
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]) {
        run_values(&block[2..18], w);
        scale[0] = f16_at(block, 0);
        min[0] = 0.0;
    }

    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        super::dequantize_groups::<Self>(block, out);
    }
}

pub struct IQ4XS;

impl BlockFormat for IQ4XS {
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 136;

    const GROUP: usize = 32;

    #[inline(always)]
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]) {
        let d = f16_at(block, 0);
        for (run, ls) in run_scales(block).into_iter().enumerate() {
            scale[run] = d * (ls as i32 - 32) as f32;
            run_values(&block[8 + 16 * run..], &mut w[32 * run..32 * run + 32]);
        }
        min.fill(0.0);
    }

    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        super::dequantize_groups::<Self>(block, out);
    }
}
