//! 4-bit levels in blocks of 32 or 128 with an f32 scale and an f32 offset: how bbc holds an
//! integer checkpoint's 4-bit weights (`models::int_checkpoint` repacks them: a block's
//! columns lie in one of the checkpoint's groups). Blocks of 128 where the groups allow them
//! (GPTQ's, AWQ's and compressed-tensors' default groups of 128, or a scale a row): 4.5 bits a
//! weight, where blocks of 32 take 6. Not GGUF types; no file stores them.
//!
//! Layout: scale: f32, offset: f32 (little-endian), then each run of 32 elements' levels in 16
//! bytes, GGUF Q4_1's nibble order within a run (low nibbles are its elements 0..16, high
//! 16..32); `x = level · scale + offset` in f32, a product and a sum each rounded (blocks are
//! made so that neither rounds: see [`exact`]). A block of 128 is a block of 32 with three more
//! runs after the first, so the same 16-byte run decoding serves both.

use crate::GgmlType;

/// Where a block's levels start.
pub const LEVELS_AT: usize = 8;
/// Elements whose levels share 16 bytes.
pub const RUN_ELEMS: usize = 32;
/// Bytes of a run's levels.
pub const RUN_BYTES: usize = 16;

/// A block's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Size {
    /// 32 weights (any group of a multiple of 32 columns), 24 bytes.
    Of32,
    /// 128 weights (groups of a multiple of 128 columns, or a row's), 72 bytes.
    Of128,
}

impl Size {
    pub const fn elems(self) -> usize {
        match self {
            Self::Of32 => 32,
            Self::Of128 => 128,
        }
    }

    pub const fn bytes(self) -> usize {
        LEVELS_AT + self.elems() / RUN_ELEMS * RUN_BYTES
    }

    /// The storage type of blocks of this size.
    pub const fn format(self) -> GgmlType {
        match self {
            Self::Of32 => GgmlType::U4B32,
            Self::Of128 => GgmlType::U4B128,
        }
    }

    /// The size of a 4-bit block format.
    pub fn of(format: GgmlType) -> Option<Self> {
        match format {
            GgmlType::U4B32 => Some(Self::Of32),
            GgmlType::U4B128 => Some(Self::Of128),
            _ => None,
        }
    }

    /// The widest blocks whose columns lie in one group, for rows of `cols` weights in groups
    /// of `group` columns (`None`: one group a row); `None` where no block size fits.
    pub fn widest(cols: usize, group: Option<usize>) -> Option<Self> {
        [Self::Of128, Self::Of32].into_iter().find(|size| {
            let n = size.elems();
            cols > 0 && cols.is_multiple_of(n) && group.is_none_or(|g| g > 0 && g.is_multiple_of(n))
        })
    }
}

/// The block's scale and offset.
pub fn scale_offset(block: &[u8]) -> (f32, f32) {
    let word = |at: usize| f32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
    (word(0), word(4))
}

/// Where the byte holding element `e`'s level lies in its block, and whether the level is that
/// byte's high nibble.
pub const fn level_at(e: usize) -> (usize, bool) {
    (LEVELS_AT + e / RUN_ELEMS * RUN_BYTES + e % 16, e % RUN_ELEMS >= 16)
}

/// Element `e`'s level (0..16).
pub fn level(block: &[u8], e: usize) -> u8 {
    let (at, high) = level_at(e);
    match high {
        true => block[at] >> 4,
        false => block[at] & 15,
    }
}

/// One block's weights (`out` as long as the block).
pub fn dequantize_block(block: &[u8], out: &mut [f32]) {
    let (scale, offset) = scale_offset(block);
    for (e, o) in out.iter_mut().enumerate() {
        *o = f32::from(level(block, e)) * scale + offset;
    }
}

/// Writes the block of `levels` (each below 16; 32 or 128 of them) with their scale and offset
/// into `out` (as long as the block).
pub fn write_block(scale: f32, offset: f32, levels: &[u8], out: &mut [u8]) {
    debug_assert_eq!(out.len(), LEVELS_AT + levels.len() / 2);
    out[..4].copy_from_slice(&scale.to_le_bytes());
    out[4..8].copy_from_slice(&offset.to_le_bytes());
    for (e, &level) in levels.iter().enumerate() {
        debug_assert!(level < 16);
        let (at, high) = level_at(e);
        match high {
            true => out[at] |= level << 4,
            false => out[at] = level,
        }
    }
}

/// The block of `levels` with their scale and offset.
pub fn block(scale: f32, offset: f32, levels: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; LEVELS_AT + levels.len() / 2];
    write_block(scale, offset, levels, &mut out);
    out
}

/// The weights `x` (32 or 128) rounded to nearest 4-bit levels over their range, as integer
/// checkpoints are made without calibration (a group of them a block), into `out`: the scale
/// the range over 15, rounded to f16 (so it is [`exact`]), the zero point the level of 0, each
/// level the weight over the scale plus the zero point, rounded and clamped to 0…15; the
/// offset `−zero · scale`. A block of zeros (or of NaNs) is levels of 0 under the least f16
/// scale.
pub fn quantize_block(x: &[f32], out: &mut [u8]) {
    let (low, high) = x.iter().fold((0f32, 0f32), |(l, h), &v| (l.min(v), h.max(v)));
    let least = half::f16::from_bits(1).to_f32();
    let scale = half::f16::from_f32(((high - low) / 15.0).clamp(least, half::f16::MAX.to_f32())).to_f32();
    let zero = (-low / scale).round().clamp(0.0, 15.0);
    let mut levels = [0u8; 128];
    let levels = &mut levels[..x.len()];
    for (level, &v) in levels.iter_mut().zip(x) {
        *level = (v / scale + zero).round().clamp(0.0, 15.0) as u8;
    }
    write_block(scale, -zero * scale, levels, out);
}

/// The float matrix `view` (f32, bf16 or f16, `[rows, cols]`, `cols` a multiple of the
/// block) as 4-bit blocks of `size` ([`quantize_block`]), row by row on the pool.
pub fn quantize_matrix(view: &crate::tensor::TensorView<'_>, size: Size) -> Vec<u8> {
    crate::tensor::quantize_blocks(view, size.elems(), size.bytes(), quantize_block)
}

/// Whether weights `(q − z) · scale` for levels `q` below 16 and zero points `z` up to 16 are
/// exactly `q · scale + (−z · scale)` with both operations exact: the scale is finite and its
/// significand has its four lowest bits clear (so a product by at most 16 needs no rounding,
/// and the sum, whose exact value is such a product, none either). Every f16 and bf16 scale
/// is.
pub fn exact(scale: f32) -> bool {
    scale.is_finite() && scale.to_bits() & 0xF == 0 && (scale * 16.0).is_finite()
}

/// A block's scale as an f16 and its zero point `z` (its weights `(q − z) · scale`, `z` from 0
/// to 16), where both are exact: `None` where the scale is not an f16 (an f32 checkpoint's,
/// say) or the offset is not an integer multiple of it. A block whose scale and offset are
/// both zero says 8 (every weight 0 whatever its zero point).
fn f16_zero_point(block: &[u8]) -> Option<(half::f16, u8)> {
    let (scale, offset) = scale_offset(block);
    let d = crate::exact_f16(scale)?;
    if scale == 0.0 {
        return (offset == 0.0).then_some((d, 8));
    }
    let zero = -offset / scale;
    let exact_zero = zero.fract() == 0.0 && (0.0..=16.0).contains(&zero) && -zero * scale == offset;
    exact_zero.then_some((d, zero as u8))
}

/// 4-bit blocks of `size` as GGUF blocks of 32 that hold exactly the same weights, so that the
/// CPU's int8 kernels can take them: Q4_0 (`(q − 8) · d`, 4.5 bits a weight) where every
/// block's zero point is 8 (symmetric GPTQ's and compressed-tensors'), else Q5_0
/// (`(u − 16) · d` with `u = q − z + 16`, 5.5 bits, any zero point up to 16: AWQ's and
/// asymmetric GPTQ's); `None` where a block's scale is no f16 or its offset is no integer
/// multiple of it ([`f16_zero_point`]). Each block of 128 becomes four under its scale.
pub fn to_gguf_blocks(bytes: &[u8], size: Size) -> Option<(GgmlType, Vec<u8>)> {
    let points = bytes
        .chunks_exact(size.bytes())
        .map(f16_zero_point)
        .collect::<Option<Vec<_>>>()?;
    let format = match points.iter().all(|&(_, zero)| zero == 8) {
        true => GgmlType::Q4_0,
        false => GgmlType::Q5_0,
    };
    let (_, gguf_bytes) = format.block_layout();
    let runs = size.elems() / RUN_ELEMS;
    let mut out = vec![0u8; points.len() * runs * gguf_bytes];
    let gguf_blocks = out.chunks_exact_mut(gguf_bytes);
    let runs_of = bytes
        .chunks_exact(size.bytes())
        .zip(&points)
        .flat_map(|(block, &point)| {
            (0..runs).map(move |run| (&block[LEVELS_AT + run * RUN_BYTES..][..RUN_BYTES], point))
        });
    for (gguf, (levels, (d, zero))) in gguf_blocks.zip(runs_of) {
        match format {
            GgmlType::Q4_0 => {
                gguf[..2].copy_from_slice(&d.to_le_bytes());
                gguf[2..].copy_from_slice(levels);
            }
            _ => crate::q5_0::write_levels_block(d, levels, zero, gguf),
        }
    }
    Some((format, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZES: [Size; 2] = [Size::Of32, Size::Of128];

    /// Levels and zero points of every value over short scales give `(q − z) · s` exactly,
    /// from either block size's layout; f16 and bf16 scales are all short.
    #[test]
    fn blocks_hold_levels_less_zero_points_times_the_scale_exactly() {
        let short = [
            1.0f32,
            0.013_671_875,
            half::f16::from_f32(3.0e-5).to_f32(),
            -0.25,
            f32::from_bits(0x30),
        ];
        for size in SIZES {
            for scale in short {
                assert!(exact(scale), "{scale}");
                for zero in 0..=16u8 {
                    let levels: Vec<u8> = (0..size.elems()).map(|e| (e as u8 * 7 + zero) % 16).collect();
                    let offset = -f32::from(zero) * scale;
                    let bytes = block(scale, offset, &levels);
                    assert_eq!(bytes.len(), size.bytes());
                    let mut out = vec![0f32; size.elems()];
                    dequantize_block(&bytes, &mut out);
                    for (e, &got) in out.iter().enumerate() {
                        assert_eq!(level(&bytes, e), levels[e]);
                        let want = ((f64::from(levels[e]) - f64::from(zero)) * f64::from(scale)) as f32;
                        // Equal as numbers: a zero weight may be either zero.
                        assert_eq!(got, want, "{size:?} scale {scale} zero {zero} element {e}");
                    }
                }
            }
        }
        assert!((0..=u16::MAX).all(|b| {
            let (h, bf) = (half::f16::from_bits(b).to_f32(), half::bf16::from_bits(b).to_f32());
            (!h.is_finite() || exact(h)) && (!bf.is_finite() || bf.abs() > 1e37 || exact(bf))
        }));
        assert!(!exact(1.0 + f32::EPSILON) && !exact(f32::NAN) && !exact(f32::MAX));
    }

    /// A block of 128 is four runs of 32 under one scale: its first run's bytes are the block
    /// of 32 those levels make, and each later run's 16 bytes follow.
    #[test]
    fn a_block_of_128_is_four_runs_of_32_levels() {
        let levels: Vec<u8> = (0..128).map(|e| ((e * 5 + e / 7) % 16) as u8).collect();
        let wide = block(0.5, -2.0, &levels);
        for run in 0..4 {
            let narrow = block(0.5, -2.0, &levels[run * 32..run * 32 + 32]);
            let at = LEVELS_AT + run * RUN_BYTES;
            assert_eq!(wide[at..at + RUN_BYTES], narrow[LEVELS_AT..], "run {run}");
        }
        assert_eq!(wide[..LEVELS_AT], block(0.5, -2.0, &levels[..32])[..LEVELS_AT]);
    }

    /// Rounded to nearest: every weight within half a step (and the clamped ends within one)
    /// of its level's value, the scale exact, zero blocks all zero; for either size.
    #[test]
    fn quantized_blocks_are_within_half_a_step() {
        for size in SIZES {
            for b in 0..200usize {
                let x: Vec<f32> = (0..size.elems())
                    .map(|i| {
                        let v = (((b * 128 + i) * 2654435761usize) >> 7) % 2001;
                        (v as f32 - 1000.0 + 300.0 * (b % 3) as f32) * 1e-3 * (1 + b % 7) as f32
                    })
                    .collect();
                let mut bytes = vec![0u8; size.bytes()];
                quantize_block(&x, &mut bytes);
                let (scale, _) = scale_offset(&bytes);
                assert!(exact(scale) && scale > 0.0);
                let mut got = vec![0f32; size.elems()];
                dequantize_block(&bytes, &mut got);
                for (e, (g, w)) in got.iter().zip(&x).enumerate() {
                    let clamped = matches!(level(&bytes, e), 0 | 15);
                    let steps = if clamped { 1.0 } else { 0.5 };
                    assert!(
                        (g - w).abs() <= scale * steps + scale * 2e-3,
                        "{size:?} block {b}: {g} for {w}, step {scale}"
                    );
                }
            }
            let mut zeros = vec![1f32; size.elems()];
            let mut bytes = vec![0u8; size.bytes()];
            quantize_block(&vec![0.0; size.elems()], &mut bytes);
            dequantize_block(&bytes, &mut zeros);
            assert!(zeros.iter().all(|&z| z == 0.0));
        }
    }

    /// The widest size whose blocks lie in one group: 128 where rows and groups are multiples
    /// of it, else 32, else none.
    #[test]
    fn the_widest_blocks_lie_in_one_group() {
        assert_eq!(Size::widest(4096, Some(128)), Some(Size::Of128));
        assert_eq!(Size::widest(4096, Some(256)), Some(Size::Of128));
        assert_eq!(Size::widest(4096, None), Some(Size::Of128));
        assert_eq!(Size::widest(4096, Some(64)), Some(Size::Of32));
        assert_eq!(Size::widest(160, None), Some(Size::Of32));
        assert_eq!(Size::widest(160, Some(32)), Some(Size::Of32));
        assert_eq!(Size::widest(160, Some(48)), None);
        assert_eq!(Size::widest(100, None), None);
        assert_eq!(Size::widest(0, None), None);
        for size in SIZES {
            assert_eq!(Size::of(size.format()), Some(size));
            assert_eq!(size.format().block_layout(), (size.elems(), size.bytes()));
        }
    }

    /// Blocks of every zero point over f16 and bf16 scales (and zero blocks), of either size,
    /// as GGUF blocks: Q4_0 where every zero point is 8, else Q5_0, each weight the same number
    /// as the 4-bit block's; every level, and zero points 0 and 16, appear.
    #[test]
    fn blocks_with_f16_scales_are_the_same_weights_as_gguf_blocks() {
        let scales = [0.013_671_875f32, half::f16::from_f32(3.0e-5).to_f32(), -0.25, 1.5, 0.0];
        for size in SIZES {
            let make = |zero_of: &dyn Fn(usize) -> u8| {
                let mut bytes = Vec::new();
                for (b, &scale) in scales.iter().cycle().take(3 * scales.len()).enumerate() {
                    let levels: Vec<u8> = (0..size.elems()).map(|e| ((e * 7 + b * 3) % 16) as u8).collect();
                    let zero = if scale == 0.0 { 0 } else { zero_of(b) };
                    bytes.extend(block(scale, -f32::from(zero) * scale, &levels));
                }
                bytes
            };
            for (bytes, want) in [
                (make(&|_| 8), GgmlType::Q4_0),
                (make(&|b| (b * 5 % 17) as u8), GgmlType::Q5_0),
                (make(&|b| if b == 3 { 16 } else { 8 }), GgmlType::Q5_0),
            ] {
                let (format, gguf) = to_gguf_blocks(&bytes, size).expect("f16 scales, integer zero points");
                assert_eq!(format, want, "{size:?}");
                let elems = bytes.len() / size.bytes() * size.elems();
                assert_eq!(Some(gguf.len()), format.bytes_for(elems));
                let (mut got, mut held) = (vec![0f32; elems], vec![0f32; elems]);
                format.dequantize(&gguf, &mut got);
                size.format().dequantize(&bytes, &mut held);
                for (e, (g, h)) in got.iter().zip(&held).enumerate() {
                    assert_eq!(g, h, "{size:?} as {}: element {e}", format.name());
                }
            }
        }
    }

    /// Blocks the GGUF formats cannot hold exactly stay as they are: a scale that is no f16
    /// (too precise, or too small), an offset that is no whole multiple of the scale or past
    /// 16 of them, an offset under a zero scale. One such block is enough.
    #[test]
    fn blocks_without_an_exact_f16_form_are_refused() {
        let levels = [3u8; 32];
        let good = block(0.5, -3.0, &levels);
        for (scale, offset) in [
            (0.1f32, -0.8f32),
            (f32::from_bits(0x30), 0.0),
            (0.5, -1.25),
            (0.5, 0.5),
            (0.5, -8.5),
            (0.0, 1.0),
            (f32::NAN, 0.0),
        ] {
            let mut bytes = good.clone();
            bytes.extend(block(scale, offset, &levels));
            assert_eq!(
                to_gguf_blocks(&bytes, Size::Of32),
                None,
                "scale {scale}, offset {offset}"
            );
        }
        assert_eq!(to_gguf_blocks(&good, Size::Of32).map(|(f, _)| f), Some(GgmlType::Q5_0));
    }
}
