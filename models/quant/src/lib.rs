//! GGML tensor element formats, and the tensors bbc reads as them: what a model file stores,
//! what the compiler's INT8 head rows are (`int8_rows`), and what every backend reads
//! (`tensor`), in one place both the model reader and the runtime can use.
//!
//! One trait, [`BlockFormat`], describes a block-quantized format (block size in elements and
//! bytes, dequantization); one file per format implements it, after ggml's `ggml-quants.c`.
//! [`GgmlType`] is the run-time tag read from a GGUF tensor info and dispatches to the formats.
//! The CPU backend's integer kernels over these blocks live with it (`runtime::cpu::quant`).

pub mod fp4_blocks;
pub mod fp8_blocks;
pub mod int8_rows;
pub mod iq4;
pub mod mxfp4;
pub mod q2_k;
pub mod q3_k;
pub mod q4_0;
mod q4_1;
pub mod q4_k;
pub mod q5_0;
mod q5_1;
mod q5_k;
mod q6_k;
pub mod q8_0;
pub mod tensor;
pub mod u4_blocks;

pub use iq4::{IQ4NL, IQ4XS};
pub use mxfp4::MXFP4;
pub use q2_k::Q2K;
pub use q3_k::Q3K;
pub use q4_0::Q4_0;
pub use q4_1::Q4_1;
pub use q4_k::Q4K;
pub use q5_0::Q5_0;
pub use q5_1::Q5_1;
pub use q5_k::Q5K;
pub use q6_k::Q6K;
pub use q8_0::Q8_0;

use half::{bf16, f16};

/// A block-quantized format: `BLOCK_ELEMS` values stored in `BLOCK_BYTES` bytes.
pub trait BlockFormat {
    const BLOCK_ELEMS: usize;
    const BLOCK_BYTES: usize;
    /// Elements per scale group in [`BlockFormat::unpack_groups`].
    const GROUP: usize;

    /// Dequantize one block; `block.len() == BLOCK_BYTES`, `out.len() == BLOCK_ELEMS`.
    fn dequantize_block(block: &[u8], out: &mut [f32]);

    /// The block as small integers per group: element `i` of group `g` is
    /// `scale[g]·w[i] − min[g]`. This is what integer dot products (the CPU backend's) consume.
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]);

    /// Dot product of one block with `BLOCK_ELEMS` activations.
    fn dot_block(block: &[u8], x: &[f32]) -> f32 {
        let mut tmp = [0f32; 256];
        let tmp = &mut tmp[..Self::BLOCK_ELEMS];
        Self::dequantize_block(block, tmp);
        tmp.iter().zip(x).map(|(a, b)| a * b).sum()
    }
}

/// Element types of GGUF tensors that bbc reads (discriminants are ggml's type ids), and FP8
/// and integer checkpoints' weights as bbc holds them ([`GgmlType::F8E4M3B32`],
/// [`GgmlType::U4B32`], [`GgmlType::U4B128`], [`GgmlType::F4E2M1B32`], in no GGUF file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    IQ4NL = 20,
    IQ4XS = 23,
    BF16 = 30,
    /// OCP MXFP4 ([`mxfp4`]): FP4 E2M1 codes in blocks of 32 under a power-of-two scale.
    MXFP4 = 39,
    /// bbc's own ([`fp8_blocks`]): FP8 E4M3 codes in blocks of 32 with an f32 scale. Its id
    /// is none of ggml's, and no GGUF file is read as it.
    F8E4M3B32 = 1000,
    /// bbc's own ([`u4_blocks`]): 4-bit levels in blocks of 32 with an f32 scale and offset,
    /// as an integer checkpoint's 4-bit weights are held. In no GGUF file either.
    U4B32 = 1001,
    /// [`U4B32`](Self::U4B32)'s levels in blocks of 128 under one scale and offset, where a
    /// checkpoint's groups allow them.
    U4B128 = 1002,
    /// bbc's own ([`fp4_blocks`]): FP4 E2M1 codes in blocks of 32 with an f32 scale for each
    /// 16, as an NVFP4 checkpoint's weights are held.
    F4E2M1B32 = 1003,
    /// 32-bit signed integers (ggml's I32): indices bbc makes beside weights, such as the
    /// column order of a GPTQ act-order checkpoint's weights. No GGUF file is read as it.
    I32 = 26,
}

impl GgmlType {
    /// Every type bbc reads.
    pub const ALL: [Self; 16] = [
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q2K,
        Self::Q3K,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
        Self::IQ4NL,
        Self::IQ4XS,
        Self::MXFP4,
    ];

    /// ggml's name for a type id bbc does not read (so a refusal can say which it is).
    pub fn other_name(id: u32) -> Option<&'static str> {
        Some(match id {
            9 => "Q8_1",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            21 => "IQ3_S",
            22 => "IQ2_S",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            34 => "TQ1_0",
            35 => "TQ2_0",
            40 => "NVFP4",
            _ => return None,
        })
    }

    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            20 => Self::IQ4NL,
            23 => Self::IQ4XS,
            30 => Self::BF16,
            39 => Self::MXFP4,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q2K => "Q2_K",
            Self::Q3K => "Q3_K",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::IQ4NL => "IQ4_NL",
            Self::IQ4XS => "IQ4_XS",
            Self::MXFP4 => "MXFP4",
            Self::F8E4M3B32 => "F8_E4M3_B32",
            Self::U4B32 => "U4_B32",
            Self::U4B128 => "U4_B128",
            Self::F4E2M1B32 => "F4_E2M1_B32",
            Self::I32 => "I32",
        }
    }

    /// (elements, bytes) of one block; plain float types are blocks of one element.
    pub fn block_layout(self) -> (usize, usize) {
        match self {
            Self::F32 | Self::I32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_0 => (Q4_0::BLOCK_ELEMS, Q4_0::BLOCK_BYTES),
            Self::Q4_1 => (Q4_1::BLOCK_ELEMS, Q4_1::BLOCK_BYTES),
            Self::Q5_0 => (Q5_0::BLOCK_ELEMS, Q5_0::BLOCK_BYTES),
            Self::Q5_1 => (Q5_1::BLOCK_ELEMS, Q5_1::BLOCK_BYTES),
            Self::Q8_0 => (Q8_0::BLOCK_ELEMS, Q8_0::BLOCK_BYTES),
            Self::Q4K => (Q4K::BLOCK_ELEMS, Q4K::BLOCK_BYTES),
            Self::Q5K => (Q5K::BLOCK_ELEMS, Q5K::BLOCK_BYTES),
            Self::Q6K => (Q6K::BLOCK_ELEMS, Q6K::BLOCK_BYTES),
            Self::Q2K => (Q2K::BLOCK_ELEMS, Q2K::BLOCK_BYTES),
            Self::Q3K => (Q3K::BLOCK_ELEMS, Q3K::BLOCK_BYTES),
            Self::IQ4NL => (IQ4NL::BLOCK_ELEMS, IQ4NL::BLOCK_BYTES),
            Self::IQ4XS => (IQ4XS::BLOCK_ELEMS, IQ4XS::BLOCK_BYTES),
            Self::MXFP4 => (MXFP4::BLOCK_ELEMS, MXFP4::BLOCK_BYTES),
            Self::F8E4M3B32 => (fp8_blocks::BLOCK_ELEMS, fp8_blocks::BLOCK_BYTES),
            Self::F4E2M1B32 => (fp4_blocks::BLOCK_ELEMS, fp4_blocks::BLOCK_BYTES),
            Self::U4B32 | Self::U4B128 => {
                let size = u4_blocks::Size::of(self).expect("a 4-bit block format");
                (size.elems(), size.bytes())
            }
        }
    }

    /// bbc's own block formats, in which FP8, integer and NVFP4 checkpoints' weights are held
    /// as they are (no GGUF file has them): such weights stay in them whatever type a model
    /// computes in.
    pub const CHECKPOINT_BLOCKS: [Self; 4] = [Self::F8E4M3B32, Self::U4B32, Self::U4B128, Self::F4E2M1B32];

    /// The block formats bbc makes from floats (`tensor::quantize_matrix`) where no file gave
    /// them: its checkpoint blocks, GGUF's MXFP4 and Q8_0 (the form 8-bit integer checkpoints
    /// are held in; random weights are timed in each).
    pub const MADE_FROM_FLOATS: [Self; 6] = [
        Self::F8E4M3B32,
        Self::U4B32,
        Self::U4B128,
        Self::F4E2M1B32,
        Self::MXFP4,
        Self::Q8_0,
    ];

    /// Whether this is one of [`Self::CHECKPOINT_BLOCKS`].
    pub fn is_checkpoint_blocks(self) -> bool {
        Self::CHECKPOINT_BLOCKS.contains(&self)
    }

    /// Bytes taken by `elems` elements, or `None` when `elems` is not a whole number of blocks.
    pub fn bytes_for(self, elems: usize) -> Option<usize> {
        let (be, bb) = self.block_layout();
        elems
            .is_multiple_of(be)
            .then(|| elems / be)
            .and_then(|b| b.checked_mul(bb))
    }

    /// Dequantize `data` (a whole number of blocks) into `out`.
    pub fn dequantize(self, data: &[u8], out: &mut [f32]) {
        match self {
            Self::F32 => {
                for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            // Indices, each exactly an f32 below 2^24.
            Self::I32 => {
                for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                    *o = i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32;
                }
            }
            Self::F16 => {
                // A slice at a time: `half` converts slices with the CPU's vector conversion
                // instructions where it has them, single values one by one.
                use half::slice::HalfFloatSliceExt;
                const AT_ONCE: usize = 512;
                let mut halves = [f16::ZERO; AT_ONCE];
                for (out, data) in out.chunks_mut(AT_ONCE).zip(data.chunks(2 * AT_ONCE)) {
                    let halves = &mut halves[..out.len()];
                    for (h, c) in halves.iter_mut().zip(data.chunks_exact(2)) {
                        *h = f16::from_le_bytes([c[0], c[1]]);
                    }
                    halves.convert_to_f32_slice(out);
                }
            }
            Self::BF16 => {
                for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            Self::Q4_0 => dequantize_blocks::<Q4_0>(data, out),
            Self::Q4_1 => dequantize_blocks::<Q4_1>(data, out),
            Self::Q5_0 => dequantize_blocks::<Q5_0>(data, out),
            Self::Q5_1 => dequantize_blocks::<Q5_1>(data, out),
            Self::Q8_0 => dequantize_blocks::<Q8_0>(data, out),
            Self::Q4K => dequantize_blocks::<Q4K>(data, out),
            Self::Q5K => dequantize_blocks::<Q5K>(data, out),
            Self::Q6K => dequantize_blocks::<Q6K>(data, out),
            Self::Q2K => dequantize_blocks::<Q2K>(data, out),
            Self::Q3K => dequantize_blocks::<Q3K>(data, out),
            Self::IQ4NL => dequantize_blocks::<IQ4NL>(data, out),
            Self::IQ4XS => dequantize_blocks::<IQ4XS>(data, out),
            Self::MXFP4 => dequantize_blocks::<MXFP4>(data, out),
            Self::F8E4M3B32 => {
                for (block, out) in data
                    .chunks_exact(fp8_blocks::BLOCK_BYTES)
                    .zip(out.chunks_exact_mut(fp8_blocks::BLOCK_ELEMS))
                {
                    fp8_blocks::dequantize_block(block, out);
                }
            }
            Self::F4E2M1B32 => {
                for (block, out) in data
                    .chunks_exact(fp4_blocks::BLOCK_BYTES)
                    .zip(out.chunks_exact_mut(fp4_blocks::BLOCK_ELEMS))
                {
                    fp4_blocks::dequantize_block(block, out);
                }
            }
            Self::U4B32 | Self::U4B128 => {
                let (elems, bytes) = self.block_layout();
                for (block, out) in data.chunks_exact(bytes).zip(out.chunks_exact_mut(elems)) {
                    u4_blocks::dequantize_block(block, out);
                }
            }
        }
    }

    /// Dot product of a row stored in this format with `x` (`x.len()` elements).
    pub fn dot(self, data: &[u8], x: &[f32]) -> f32 {
        match self {
            Self::Q4_0 => dot_blocks::<Q4_0>(data, x),
            Self::Q4_1 => dot_blocks::<Q4_1>(data, x),
            Self::Q5_0 => dot_blocks::<Q5_0>(data, x),
            Self::Q5_1 => dot_blocks::<Q5_1>(data, x),
            Self::Q8_0 => dot_blocks::<Q8_0>(data, x),
            Self::Q4K => dot_blocks::<Q4K>(data, x),
            Self::Q5K => dot_blocks::<Q5K>(data, x),
            Self::Q6K => dot_blocks::<Q6K>(data, x),
            Self::Q2K => dot_blocks::<Q2K>(data, x),
            Self::Q3K => dot_blocks::<Q3K>(data, x),
            Self::IQ4NL => dot_blocks::<IQ4NL>(data, x),
            Self::IQ4XS => dot_blocks::<IQ4XS>(data, x),
            Self::MXFP4 => dot_blocks::<MXFP4>(data, x),
            Self::F32
            | Self::F16
            | Self::BF16
            | Self::I32
            | Self::F8E4M3B32
            | Self::F4E2M1B32
            | Self::U4B32
            | Self::U4B128 => {
                let mut row = vec![0f32; x.len()];
                self.dequantize(data, &mut row);
                row.iter().zip(x).map(|(a, b)| a * b).sum()
            }
        }
    }
}

fn dequantize_blocks<F: BlockFormat>(data: &[u8], out: &mut [f32]) {
    for (block, out) in data
        .chunks_exact(F::BLOCK_BYTES)
        .zip(out.chunks_exact_mut(F::BLOCK_ELEMS))
    {
        F::dequantize_block(block, out);
    }
}

/// A block of a format whose weights are `scale·w − min` per group, dequantized as ggml does:
/// `scale·w − min` in f32 (exact for the formats without a minimum, whose `min` is 0).
fn dequantize_groups<F: BlockFormat>(block: &[u8], out: &mut [f32]) {
    let mut w = [0i8; 256];
    let (mut scale, mut min) = ([0f32; 16], [0f32; 16]);
    let groups = F::BLOCK_ELEMS / F::GROUP;
    F::unpack_groups(
        block,
        &mut w[..F::BLOCK_ELEMS],
        &mut scale[..groups],
        &mut min[..groups],
    );
    for (g, out) in out[..F::BLOCK_ELEMS].chunks_exact_mut(F::GROUP).enumerate() {
        for (o, &q) in out.iter_mut().zip(&w[g * F::GROUP..]) {
            *o = scale[g] * q as f32 - min[g];
        }
    }
}

fn dot_blocks<F: BlockFormat>(data: &[u8], x: &[f32]) -> f32 {
    data.chunks_exact(F::BLOCK_BYTES)
        .zip(x.chunks_exact(F::BLOCK_ELEMS))
        .map(|(block, x)| F::dot_block(block, x))
        .sum()
}

/// A 4-bit table's int8 values + 128, as the CPU's int8 kernels store what an index stands
/// for (unsigned, for `vpdpbusd`).
const fn stored_table(values: &[i8; 16]) -> [u8; 16] {
    let mut stored = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        stored[i] = (values[i] as i32 + 128) as u8;
        i += 1;
    }
    stored
}

/// `x` as an f16 where that is exactly `x` (a scale GGUF's blocks can keep), else `None`.
pub fn exact_f16(x: f32) -> Option<f16> {
    let h = f16::from_f32(x);
    (h.to_f32() == x).then_some(h)
}

/// Little-endian f16 at `offset` of a block, as f32.
#[inline(always)]
pub fn f16_at(block: &[u8], offset: usize) -> f32 {
    f16::from_le_bytes([block[offset], block[offset + 1]]).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f16 (NaNs, infinities, subnormals, both zeros) decodes to its exact f32, across
    /// slices of whole and partial conversion batches.
    #[test]
    fn f16_rows_decode_every_value_exactly() {
        let all: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
        for len in [65_536, 1_000, 3] {
            let mut out = vec![0f32; len];
            GgmlType::F16.dequantize(&all[..2 * len], &mut out);
            for (i, got) in out.iter().enumerate() {
                let want = f16::from_bits(i as u16).to_f32();
                assert!(
                    got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan(),
                    "{i:#06x}"
                );
            }
        }
    }

    #[test]
    fn ids_round_trip_and_unknown_ids_are_rejected() {
        for id in 0..64 {
            if let Some(t) = GgmlType::from_id(id) {
                assert_eq!(t as u32, id);
            }
        }
        assert_eq!(GgmlType::from_id(9), None, "Q8_1 is not a storage format we read");
        assert_eq!(GgmlType::from_id(1000), None);
    }

    #[test]
    fn every_type_read_has_its_id_and_no_other_name() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t as u32), Some(t));
            assert_eq!(GgmlType::other_name(t as u32), None, "{}", t.name());
        }
        let read = (0..64).filter(|&id| GgmlType::from_id(id).is_some()).count();
        assert_eq!(read, GgmlType::ALL.len());
        // ggml's NVFP4 is refused by name (bbc reads NVFP4 from HF checkpoints).
        assert_eq!(GgmlType::other_name(40), Some("NVFP4"));
    }

    #[test]
    fn bytes_for_requires_whole_blocks() {
        assert_eq!(GgmlType::Q4K.bytes_for(512), Some(288));
        assert_eq!(GgmlType::Q4K.bytes_for(100), None);
        assert_eq!(GgmlType::F16.bytes_for(3), Some(6));
    }
}
