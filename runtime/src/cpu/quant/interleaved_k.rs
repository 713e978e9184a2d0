//! K-quant rows (Q2_K to Q6_K, and IQ4_XS) regrouped for matmuls as
//! [`super::interleaved`] regroups the 32-weight formats: [`GROUP`] rows interleaved so that a
//! `vpdpbusd` against four broadcast activation bytes advances sixteen rows' sub-block sums at
//! once, each lane ending a sub-block with its row's exact integer sum.
//!
//! The arithmetic, per (row, token) and super-block in order, with activations quantized per
//! 256 ([`Q8KRow`], ggml's `q8_K`), `u` the stored unsigned weights:
//! - Q4_K and Q5_K: `total = Σ_j sc_j·Σ_{i∈j} u_i·qx_i` and `mins = Σ_j m_j·Σ_{i∈j} qx_i` exactly in
//!   integers (`j` the eight 32-weight sub-blocks, `sc`/`m` their 6-bit scale and minimum), then
//!   `main = fma(total, d·dx, main)` and `low = fma(mins, dmin·dx, low)` (each integer rounded
//!   to f32 once); the result `main − low`.
//! - Q2_K: Q4_K's, over its sixteen 16-weight groups and their 4-bit scales and minimums.
//! - Q3_K: Q6_K's, with `u_i − 4` (a weight's three bits, ggml's `q + 4`) and `sc − 32` as
//!   the int8 scale.
//! - Q6_K: `total = Σ_g sc_g·Σ_{i∈g} (u_i − 32)·qx_i` exactly (`g` the sixteen 16-weight
//!   sub-blocks, `sc` their int8 scale), then `main = fma(total, d·dx, main)`; the result `main`.
//! - IQ4_XS: the same with `u_i − 128` (each weight's table value looked up + 128) and each
//!   32-weight run's `ls − 32` as the scale of both its halves: ggml's `Σ_r (ls_r − 32)·Σ v·qx`.
//!
//! Every kernel runs those operations lane by lane: the same bits on every CPU, whatever the
//! number of tokens computed together.
//!
//! Layout, per group of sixteen rows and per super-block (rows past the matrix are zeros):
//! - Q4_K: the nibbles as `[chunk 0..32][row][byte 0..4]` (byte `k` of a row's chunk `c` is
//!   the block's `qs[4c + k]`: low nibble weight `64·(c/8) + 4·(c%8) + k` of sub-block
//!   `2·(c/8)`, high nibble the same place 32 weights on, in sub-block `2·(c/8) + 1`); the
//!   scales and the minimums as `[sub-block][row]` bytes; the rows' `d` and `dmin` (f16, as
//!   stored); the rows' twelve packed scale bytes as stored, so the block comes back exactly.
//!   Q5_K adds its fifth bits: the rows' `qh` as `[quad 0..8][row][byte 0..4]` (byte `k` of
//!   quad `c` is `qh[4c + k]`, whose bit `2p` is the fifth bit of nibble chunk `8p + c`'s low
//!   nibble, bit `2p + 1` of its high one).
//! - Q6_K: the six-bit weights as bytes, `[quad 0..64][row][byte 0..4]` (weight `4·quad + k`);
//!   the scales as `[sub-block][row]` int8; the rows' `d` (f16). `ql`/`qh` come back from the
//!   weights exactly.
//! - Q2_K: the 2-bit weights as `[group 0..16][row][byte 0..4]`, bits `2p..2p + 2` of byte
//!   `k` being weight `4p + k` of the group (so shifting a group's 64 bytes by `2p` and masking
//!   gives weights `4p..4p + 4` of every row); the `scales` bytes as `[group][row]` (scale in
//!   the low nibble, minimum in the high one, as stored); the rows' `d`, then their `dmin`.
//!   The same bytes as the GGUF blocks.
//! - Q3_K: the low two bits as Q2_K's; the third bits as `[byte 0..8][row][byte k 0..4]`, bit
//!   `b` of byte `j` being that of weight `4p + k` of group `g` where `4g + p = 8j + b`; the
//!   scales `sc − 32` as `[group][row]` int8; the rows' `d`. GGUF's size and 4% more.
//! - IQ4_XS: the 4-bit table indices as `[group][half 0..2][row][byte k 0..4]`, the low nibble
//!   of byte `k` in half `h` indexing weight `8h + k` of the group, the high one weight
//!   `8h + 4 + k` (so a mask or a shift and a `vpshufb` give a quad of every row); the runs'
//!   scales `ls − 32`, each for both its groups, as `[group][row]` int8; the rows' `d`. 7% over
//!   GGUF's size.

#[cfg(target_arch = "x86_64")]
mod amx_tiles;

use super::int8::{Int8Kernel, Q8KRow, SUPER};
use super::interleaved::f16_at;
use super::q2_k::two_bit_group;
use super::q3_k::high_bit_group;
use super::q4_k::scale_min_k4;
use super::GgmlType;
use std::ops::Range;

pub use super::interleaved::GROUP;

/// Where each part of a Q4_K group's super-block starts, and its size.
mod q4k {
    use super::GROUP;
    pub const BLOCK_BYTES: usize = 144;
    pub const SCALES_AT: usize = 32 * 64;
    pub const MINS_AT: usize = SCALES_AT + 8 * GROUP;
    pub const D_AT: usize = MINS_AT + 8 * GROUP;
    pub const DMIN_AT: usize = D_AT + 2 * GROUP;
    pub const PACKED_SCALES_AT: usize = DMIN_AT + 2 * GROUP;
    pub const GROUP_BLOCK: usize = PACKED_SCALES_AT + 12 * GROUP;
    /// Q5_K's fifth bits, after the rest of a Q4_K group's super-block.
    pub const Q5_BLOCK_BYTES: usize = 176;
    pub const FIFTH_AT: usize = GROUP_BLOCK;
    pub const Q5_GROUP_BLOCK: usize = FIFTH_AT + 32 * GROUP;
}

/// Where each part of a Q6_K group's super-block starts, and its size.
mod q6k {
    use super::GROUP;
    pub const BLOCK_BYTES: usize = 210;
    pub const SCALES_AT: usize = 64 * 64;
    pub const D_AT: usize = SCALES_AT + 16 * GROUP;
    pub const GROUP_BLOCK: usize = D_AT + 2 * GROUP;
}

/// Where each part of a Q2_K group's super-block starts, and its size.
mod q2k {
    use super::GROUP;
    pub const BLOCK_BYTES: usize = 84;
    pub const SCALES_AT: usize = 16 * 64;
    pub const D_AT: usize = SCALES_AT + 16 * GROUP;
    pub const DMIN_AT: usize = D_AT + 2 * GROUP;
    pub const GROUP_BLOCK: usize = DMIN_AT + 2 * GROUP;
}

/// Where each part of a Q3_K group's super-block starts, and its size.
mod q3k {
    use super::GROUP;
    pub const BLOCK_BYTES: usize = 110;
    pub const HIGH_AT: usize = 16 * 64;
    pub const SCALES_AT: usize = HIGH_AT + 8 * 64;
    pub const D_AT: usize = SCALES_AT + 16 * GROUP;
    pub const GROUP_BLOCK: usize = D_AT + 2 * GROUP;
}

/// IQ4_XS's GGUF block (d: f16, scales_h: u16, scales_l: [u8; 4], qs: [u8; 128]), and where
/// each part of its group's super-block starts.
mod iq4xs {
    use super::GROUP;
    pub const BLOCK_BYTES: usize = 136;
    pub const SCALES_AT: usize = 16 * 128;
    pub const D_AT: usize = SCALES_AT + 16 * GROUP;
    pub const GROUP_BLOCK: usize = D_AT + 2 * GROUP;
    /// What a weight's table value is stored above (in a Q6_K-layout byte).
    pub const BIAS: i32 = 128;
}

/// The K-quant formats with an interleaved layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    IQ4XS,
}

impl Format {
    fn of(dtype: GgmlType) -> Option<Self> {
        match dtype {
            GgmlType::Q2K => Some(Self::Q2K),
            GgmlType::Q3K => Some(Self::Q3K),
            GgmlType::Q4K => Some(Self::Q4K),
            GgmlType::Q5K => Some(Self::Q5K),
            GgmlType::Q6K => Some(Self::Q6K),
            GgmlType::IQ4XS => Some(Self::IQ4XS),
            _ => None,
        }
    }

    fn dtype(self) -> GgmlType {
        match self {
            Self::Q2K => GgmlType::Q2K,
            Self::Q3K => GgmlType::Q3K,
            Self::Q4K => GgmlType::Q4K,
            Self::Q5K => GgmlType::Q5K,
            Self::Q6K => GgmlType::Q6K,
            Self::IQ4XS => GgmlType::IQ4XS,
        }
    }

    fn block_bytes(self) -> usize {
        match self {
            Self::Q2K => q2k::BLOCK_BYTES,
            Self::Q3K => q3k::BLOCK_BYTES,
            Self::Q4K => q4k::BLOCK_BYTES,
            Self::Q5K => q4k::Q5_BLOCK_BYTES,
            Self::Q6K => q6k::BLOCK_BYTES,
            Self::IQ4XS => iq4xs::BLOCK_BYTES,
        }
    }

    fn group_block(self) -> usize {
        match self {
            Self::Q2K => q2k::GROUP_BLOCK,
            Self::Q3K => q3k::GROUP_BLOCK,
            Self::Q4K => q4k::GROUP_BLOCK,
            Self::Q5K => q4k::Q5_GROUP_BLOCK,
            Self::Q6K => q6k::GROUP_BLOCK,
            Self::IQ4XS => iq4xs::GROUP_BLOCK,
        }
    }

    fn interleave(self, block: &[u8], lane: usize, out: &mut [u8]) {
        match self {
            Self::Q2K => interleave_q2k(block, lane, out),
            Self::Q3K => interleave_q3k(block, lane, out),
            Self::Q4K => interleave_q4k(block, lane, out, 16),
            Self::Q5K => {
                interleave_q4k(block, lane, out, 48);
                interleave_fifth_bits(&block[16..48], lane, out);
            }
            Self::Q6K => interleave_q6k(block, lane, out),
            Self::IQ4XS => interleave_iq4xs(block, lane, out),
        }
    }

    fn gguf_block(self, group_block: &[u8], lane: usize, block: &mut [u8]) {
        match self {
            Self::Q2K => gguf_block_q2k(group_block, lane, block),
            Self::Q3K => gguf_block_q3k(group_block, lane, block),
            Self::Q4K => gguf_block_q4k(group_block, lane, block, 16),
            Self::Q5K => {
                gguf_block_q4k(group_block, lane, block, 48);
                gguf_fifth_bits(group_block, lane, &mut block[16..48]);
            }
            Self::Q6K => gguf_block_q6k(group_block, lane, block),
            Self::IQ4XS => gguf_block_iq4xs(group_block, lane, block),
        }
    }
}

/// A K-quant matrix, interleaved by [`GROUP`] rows.
#[derive(Debug, Clone)]
pub struct InterleavedSuperRows {
    format: Format,
    rows: usize,
    /// Super-blocks per row.
    supers: usize,
    data: Vec<u8>,
}

impl InterleavedSuperRows {
    /// Rows of `row_bytes` GGUF bytes each; `None` for a format without an interleaved layout
    /// or bytes that are not whole super-blocks.
    pub fn new(dtype: GgmlType, bytes: &[u8], row_bytes: usize) -> Option<Self> {
        let format = Format::of(dtype)?;
        let block_bytes = format.block_bytes();
        if row_bytes == 0 || !row_bytes.is_multiple_of(block_bytes) || !bytes.len().is_multiple_of(row_bytes) {
            return None;
        }
        let (rows, supers) = (bytes.len() / row_bytes, row_bytes / block_bytes);
        let group_block = format.group_block();
        let mut data = vec![0u8; rows.div_ceil(GROUP) * supers * group_block];
        for row in 0..rows {
            for s in 0..supers {
                let at = row * row_bytes + s * block_bytes;
                let place = ((row / GROUP) * supers + s) * group_block;
                format.interleave(
                    &bytes[at..at + block_bytes],
                    row % GROUP,
                    &mut data[place..place + group_block],
                );
            }
        }
        Some(Self {
            format,
            rows,
            supers,
            data,
        })
    }

    pub fn dtype(&self) -> GgmlType {
        self.format.dtype()
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.supers * SUPER
    }

    pub fn row_bytes(&self) -> usize {
        self.supers * self.format.block_bytes()
    }

    /// Bytes held (padding rows included).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    fn group_block(&self, group: usize, s: usize) -> &[u8] {
        let size = self.format.group_block();
        let at = (group * self.supers + s) * size;
        &self.data[at..at + size]
    }

    /// Row `row` as its GGUF bytes, exactly those it was made from.
    pub fn gguf_row(&self, row: usize, out: &mut [u8]) {
        assert!(row < self.rows && out.len() == self.row_bytes());
        for (s, block) in out.chunks_exact_mut(self.format.block_bytes()).enumerate() {
            self.format
                .gguf_block(self.group_block(row / GROUP, s), row % GROUP, block);
        }
    }

    /// Every row's GGUF bytes, in order.
    pub fn gguf_bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.rows * self.row_bytes()];
        for (row, dst) in out.chunks_exact_mut(self.row_bytes()).enumerate() {
            self.gguf_row(row, dst);
        }
        out
    }

    /// Row `row` dequantized as the format's own dequantization gives it.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let mut block = [0u8; q6k::BLOCK_BYTES];
        let block = &mut block[..self.format.block_bytes()];
        for (s, dst) in out.chunks_exact_mut(SUPER).enumerate().take(self.supers) {
            self.format
                .gguf_block(self.group_block(row / GROUP, s), row % GROUP, block);
            self.format.dtype().dequantize(block, dst);
        }
    }

    /// The activations of one matmul as the kernels read them; `None` where one does not cover
    /// a row.
    pub fn activations<'a>(&self, acts: &'a [Q8KRow]) -> Option<SuperActivations<'a>> {
        let supers = self.supers;
        let covers = |a: &Q8KRow| a.q.len() >= supers * SUPER && a.d.len() >= supers && a.sums16.len() >= 16 * supers;
        if !acts.iter().all(covers) {
            return None;
        }
        // Q4_K: each 32-weight sub-block's Σqx (what its minimum multiplies), Q2_K each
        // 16-weight group's; Q6_K: each
        // 16-weight sub-block's −32·Σqx (where its sum starts, the weights being stored + 32),
        // Q3_K's −4·Σqx, IQ4_XS's −128·Σqx.
        let sums = match self.format {
            Format::Q2K => acts
                .iter()
                .flat_map(|a| a.sums16[..16 * supers].iter().map(|&s| s as i32))
                .collect(),
            Format::Q4K | Format::Q5K => acts
                .iter()
                .flat_map(|a| (0..8 * supers).map(|j| a.sums16[2 * j] as i32 + a.sums16[2 * j + 1] as i32))
                .collect(),
            Format::Q3K | Format::Q6K | Format::IQ4XS => {
                let bias = match self.format {
                    Format::Q3K => 4,
                    Format::Q6K => 32,
                    _ => iq4xs::BIAS,
                };
                acts.iter()
                    .flat_map(|a| a.sums16[..16 * supers].iter().map(move |&s| -bias * s as i32))
                    .collect()
            }
        };
        Some(SuperActivations {
            acts,
            supers,
            sums_per_token: sums_per_super(self.format) * supers,
            sums,
            #[cfg(target_arch = "x86_64")]
            tiled: amx_tiles::TiledActivations::new(self.format, acts, supers),
        })
    }

    /// `out[t·GROUP + i] = row (GROUP·group + i) · acts[t]` for every token (rows past the
    /// matrix give 0); `kernel` one this CPU runs.
    pub fn group_products(&self, group: usize, acts: &SuperActivations, out: &mut [f32], kernel: Int8Kernel) {
        assert!(group < self.groups(), "group {group} of {}", self.groups());
        assert_eq!(acts.supers, self.supers, "activations of other rows");
        assert_eq!(acts.sums_per_token, sums_per_super(self.format) * self.supers);
        assert_eq!(out.len(), acts.acts.len() * GROUP);
        let size = self.supers * self.format.group_block();
        let data = &self.data[group * size..(group + 1) * size];
        // AMX takes the whole 16-token tiles, the other kernels the rest.
        #[cfg(target_arch = "x86_64")]
        let mut t0 = match kernel {
            Int8Kernel::Amx => amx_tiles::products(self.format, data, acts, out),
            _ => 0,
        };
        #[cfg(not(target_arch = "x86_64"))]
        let mut t0 = 0;
        while t0 < acts.acts.len() {
            let n = (acts.acts.len() - t0).min(TILE);
            let dst = &mut out[t0 * GROUP..(t0 + n) * GROUP];
            match n {
                1 => tile::<1>(self.format, data, self.supers, acts, t0, dst, kernel),
                2 => tile::<2>(self.format, data, self.supers, acts, t0, dst, kernel),
                3 => tile::<3>(self.format, data, self.supers, acts, t0, dst, kernel),
                _ => tile::<TILE>(self.format, data, self.supers, acts, t0, dst, kernel),
            }
            t0 += n;
        }
    }

    /// [`group_products`](Self::group_products) for the rows `rows` only: `write(t, i, values)`
    /// gives token `t`'s products with rows `rows.start + i ..` (a group's rows within `rows`).
    pub fn products(
        &self,
        rows: Range<usize>,
        acts: &SuperActivations,
        kernel: Int8Kernel,
        scratch: &mut Vec<f32>,
        write: impl FnMut(usize, usize, &[f32]),
    ) {
        let group_products = |group, out: &mut [f32]| self.group_products(group, acts, out, kernel);
        super::interleaved::by_group(rows, acts.acts.len(), scratch, group_products, write)
    }
}

/// Activation sums a kernel reads per super-block: one per sub-block.
fn sums_per_super(format: Format) -> usize {
    match format {
        Format::Q4K | Format::Q5K => 8,
        Format::Q2K | Format::Q3K | Format::Q6K | Format::IQ4XS => 16,
    }
}

/// Put one row's Q4_K block (or Q5_K's, but its fifth bits), whose nibbles start at `qs`, into
/// lane `lane` of its group's super-block `out`.
fn interleave_q4k(block: &[u8], lane: usize, out: &mut [u8], qs: usize) {
    use q4k::*;
    let scales = &block[4..16];
    for chunk in 0..32 {
        let at = chunk * 64 + lane * 4;
        out[at..at + 4].copy_from_slice(&block[qs + 4 * chunk..qs + 4 * chunk + 4]);
    }
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, scales);
        out[SCALES_AT + j * GROUP + lane] = sc;
        out[MINS_AT + j * GROUP + lane] = m;
    }
    out[D_AT + 2 * lane..D_AT + 2 * lane + 2].copy_from_slice(&block[0..2]);
    out[DMIN_AT + 2 * lane..DMIN_AT + 2 * lane + 2].copy_from_slice(&block[2..4]);
    out[PACKED_SCALES_AT + 12 * lane..PACKED_SCALES_AT + 12 * lane + 12].copy_from_slice(scales);
}

/// Put one row's Q5_K `qh` into lane `lane` of its group's super-block `out`.
fn interleave_fifth_bits(qh: &[u8], lane: usize, out: &mut [u8]) {
    for quad in 0..8 {
        let at = q4k::FIFTH_AT + quad * 64 + lane * 4;
        out[at..at + 4].copy_from_slice(&qh[4 * quad..4 * quad + 4]);
    }
}

/// Lane `lane`'s Q5_K `qh` back from its group's super-block.
fn gguf_fifth_bits(group_block: &[u8], lane: usize, qh: &mut [u8]) {
    for quad in 0..8 {
        let at = q4k::FIFTH_AT + quad * 64 + lane * 4;
        qh[4 * quad..4 * quad + 4].copy_from_slice(&group_block[at..at + 4]);
    }
}

/// Lane `lane` of a group's super-block back as its Q4_K block (Q5_K's but its fifth bits,
/// its nibbles from `qs` on).
fn gguf_block_q4k(group_block: &[u8], lane: usize, block: &mut [u8], qs: usize) {
    use q4k::*;
    block[0..2].copy_from_slice(&group_block[D_AT + 2 * lane..D_AT + 2 * lane + 2]);
    block[2..4].copy_from_slice(&group_block[DMIN_AT + 2 * lane..DMIN_AT + 2 * lane + 2]);
    block[4..16].copy_from_slice(&group_block[PACKED_SCALES_AT + 12 * lane..PACKED_SCALES_AT + 12 * lane + 12]);
    for chunk in 0..32 {
        let at = chunk * 64 + lane * 4;
        block[qs + 4 * chunk..qs + 4 * chunk + 4].copy_from_slice(&group_block[at..at + 4]);
    }
}

/// A Q6_K block's 256 six-bit weights (ggml's `ql`/`qh` order undone: element order).
fn q6k_weights(block: &[u8]) -> [u8; SUPER] {
    let mut u = [0u8; SUPER];
    for half in 0..2 {
        let (ql, qh) = (
            &block[64 * half..64 * half + 64],
            &block[128 + 32 * half..128 + 32 * half + 32],
        );
        let u = &mut u[128 * half..128 * half + 128];
        for l in 0..32 {
            u[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
            u[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
            u[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            u[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    u
}

/// Put one row's Q6_K block into lane `lane` of its group's super-block `out`.
fn interleave_q6k(block: &[u8], lane: usize, out: &mut [u8]) {
    use q6k::*;
    let u = q6k_weights(block);
    for quad in 0..64 {
        let at = quad * 64 + lane * 4;
        out[at..at + 4].copy_from_slice(&u[4 * quad..4 * quad + 4]);
    }
    for g in 0..16 {
        out[SCALES_AT + g * GROUP + lane] = block[192 + g];
    }
    out[D_AT + 2 * lane..D_AT + 2 * lane + 2].copy_from_slice(&block[208..210]);
}

/// Lane `lane` of a group's super-block back as its Q6_K block.
fn gguf_block_q6k(group_block: &[u8], lane: usize, block: &mut [u8]) {
    use q6k::*;
    let mut u = [0u8; SUPER];
    for quad in 0..64 {
        let at = quad * 64 + lane * 4;
        u[4 * quad..4 * quad + 4].copy_from_slice(&group_block[at..at + 4]);
    }
    for half in 0..2 {
        let u = &u[128 * half..128 * half + 128];
        for l in 0..32 {
            block[64 * half + l] = (u[l] & 0x0F) | ((u[l + 64] & 0x0F) << 4);
            block[64 * half + l + 32] = (u[l + 32] & 0x0F) | ((u[l + 96] & 0x0F) << 4);
            block[128 + 32 * half + l] =
                (u[l] >> 4) | ((u[l + 32] >> 4) << 2) | ((u[l + 64] >> 4) << 4) | ((u[l + 96] >> 4) << 6);
        }
    }
    for g in 0..16 {
        block[192 + g] = group_block[SCALES_AT + g * GROUP + lane];
    }
    block[208..210].copy_from_slice(&group_block[D_AT + 2 * lane..D_AT + 2 * lane + 2]);
}

/// Put one row's Q2_K block into lane `lane` of its group's super-block `out`.
fn interleave_q2k(block: &[u8], lane: usize, out: &mut [u8]) {
    use q2k::*;
    for g in 0..16 {
        let (offset, shift) = two_bit_group(g);
        let qs = &block[16 + offset..][..16];
        for k in 0..4 {
            out[g * 64 + lane * 4 + k] = (0..4).fold(0, |byte, p| byte | (((qs[4 * p + k] >> shift) & 3) << (2 * p)));
        }
        out[SCALES_AT + g * GROUP + lane] = block[g];
    }
    out[D_AT + 2 * lane..D_AT + 2 * lane + 2].copy_from_slice(&block[80..82]);
    out[DMIN_AT + 2 * lane..DMIN_AT + 2 * lane + 2].copy_from_slice(&block[82..84]);
}

/// Lane `lane` of a group's super-block back as its Q2_K block.
fn gguf_block_q2k(group_block: &[u8], lane: usize, block: &mut [u8]) {
    use q2k::*;
    block[16..80].fill(0);
    for g in 0..16 {
        let (offset, shift) = two_bit_group(g);
        for l in 0..16 {
            let q = (group_block[g * 64 + lane * 4 + l % 4] >> (2 * (l / 4))) & 3;
            block[16 + offset + l] |= q << shift;
        }
        block[g] = group_block[SCALES_AT + g * GROUP + lane];
    }
    block[80..82].copy_from_slice(&group_block[D_AT + 2 * lane..D_AT + 2 * lane + 2]);
    block[82..84].copy_from_slice(&group_block[DMIN_AT + 2 * lane..DMIN_AT + 2 * lane + 2]);
}

/// Put one row's Q3_K block into lane `lane` of its group's super-block `out` (each weight as
/// ggml's `q + 4`, 0..8).
fn interleave_q3k(block: &[u8], lane: usize, out: &mut [u8]) {
    use q3k::*;
    let (mut w, mut scale, mut min) = ([0i8; SUPER], [0f32; 16], [0f32; 16]);
    <super::Q3K as super::BlockFormat>::unpack_groups(block, &mut w, &mut scale, &mut min);
    for (i, &w) in w.iter().enumerate() {
        let ((low_at, shift), (high_at, bit)) = q3k_bits_at(lane, i);
        let weight = (w + 4) as u8;
        out[low_at] |= (weight & 3) << shift;
        out[high_at] |= (weight >> 2) << bit;
    }
    for (g, sc) in super::q3_k::scales(&block[96..108]).into_iter().enumerate() {
        out[SCALES_AT + g * GROUP + lane] = (sc as i8 - 32) as u8;
    }
    out[D_AT + 2 * lane..D_AT + 2 * lane + 2].copy_from_slice(&block[108..110]);
}

/// Lane `lane` of a group's super-block back as its Q3_K block.
fn gguf_block_q3k(group_block: &[u8], lane: usize, block: &mut [u8]) {
    use q3k::*;
    block[..108].fill(0);
    for g in 0..16 {
        let ((offset, shift), (high_offset, bit)) = (two_bit_group(g), high_bit_group(g));
        for l in 0..16 {
            let ((low_at, low_shift), (high_at, high_bit)) = q3k_bits_at(lane, 16 * g + l);
            let low = (group_block[low_at] >> low_shift) & 3;
            let high = (group_block[high_at] >> high_bit) & 1;
            block[32 + offset + l] |= low << shift;
            block[high_offset + l] |= high << bit;
        }
    }
    let scales: [u8; 16] = std::array::from_fn(|g| (group_block[SCALES_AT + g * GROUP + lane] as i8 as i32 + 32) as u8);
    super::q3_k::pack_scales(&scales, &mut block[96..108]);
    block[108..110].copy_from_slice(&group_block[D_AT + 2 * lane..D_AT + 2 * lane + 2]);
}

/// Put one row's IQ4_XS block into lane `lane` of its group's super-block `out`.
fn interleave_iq4xs(block: &[u8], lane: usize, out: &mut [u8]) {
    use iq4xs::*;
    for i in 0..SUPER {
        let ((from, from_shift), (to, to_shift)) = (iq4xs_gguf_index_at(i), iq4xs_index_at(lane, i));
        out[to] |= ((block[from] >> from_shift) & 0x0F) << to_shift;
    }
    for (run, ls) in super::iq4::run_scales(block).into_iter().enumerate() {
        for g in [2 * run, 2 * run + 1] {
            out[SCALES_AT + g * GROUP + lane] = (ls as i8 - 32) as u8;
        }
    }
    out[D_AT + 2 * lane..D_AT + 2 * lane + 2].copy_from_slice(&block[0..2]);
}

/// Lane `lane` of a group's super-block back as its IQ4_XS block.
fn gguf_block_iq4xs(group_block: &[u8], lane: usize, block: &mut [u8]) {
    use iq4xs::*;
    block[2..].fill(0);
    block[0..2].copy_from_slice(&group_block[D_AT + 2 * lane..D_AT + 2 * lane + 2]);
    let mut scales_h = 0u16;
    for run in 0..8 {
        let ls = (group_block[SCALES_AT + 2 * run * GROUP + lane] as i8 as i32 + 32) as u8;
        block[4 + run / 2] |= (ls & 0x0F) << (4 * (run % 2));
        scales_h |= ((ls >> 4) as u16 & 3) << (2 * run);
    }
    block[2..4].copy_from_slice(&scales_h.to_le_bytes());
    for i in 0..SUPER {
        let ((to, to_shift), (from, from_shift)) = (iq4xs_gguf_index_at(i), iq4xs_index_at(lane, i));
        block[to] |= ((group_block[from] >> from_shift) & 0x0F) << to_shift;
    }
}

/// Where weight `i` (0..256) of lane `lane` keeps its bits in a Q3_K group's super-block: its
/// low two as (byte, shift), its third as (byte, bit).
fn q3k_bits_at(lane: usize, i: usize) -> ((usize, usize), (usize, usize)) {
    let (g, p, k) = (i / 16, (i % 16) / 4, i % 4);
    let (j, b) = ((4 * g + p) / 8, (4 * g + p) % 8);
    (
        (g * 64 + lane * 4 + k, 2 * p),
        (q3k::HIGH_AT + j * 64 + lane * 4 + k, b),
    )
}

/// Where weight `i` of lane `lane` keeps its table index in an IQ4_XS group's super-block:
/// (byte, shift).
fn iq4xs_index_at(lane: usize, i: usize) -> (usize, usize) {
    let (g, j) = (i / 16, i % 16);
    (g * 128 + (j / 8) * 64 + lane * 4 + j % 4, if j % 8 < 4 { 0 } else { 4 })
}

/// Where weight `i` keeps its table index in an IQ4_XS GGUF block: run `i / 32`, byte
/// `i % 16` of its 16, the low nibble for the run's first 16 weights.
fn iq4xs_gguf_index_at(i: usize) -> (usize, usize) {
    (8 + 16 * (i / 32) + i % 16, if i % 32 < 16 { 0 } else { 4 })
}

/// One matmul's activations, with per token the sums the format's kernel reads (see
/// [`InterleavedSuperRows::activations`]).
pub struct SuperActivations<'a> {
    acts: &'a [Q8KRow],
    supers: usize,
    sums_per_token: usize,
    sums: Vec<i32>,
    /// The quants again, as AMX tiles load them, where [`Int8Kernel::Amx`] can take whole
    /// tiles of these tokens (Q4_K, Q5_K, Q6_K).
    #[cfg(target_arch = "x86_64")]
    tiled: Option<amx_tiles::TiledActivations>,
}

/// A token as a kernel reads it, unchecked: each pointer covers the rows' super-blocks.
#[derive(Clone, Copy)]
struct Token {
    q: *const i8,
    d: *const f32,
    sums: *const i32,
}

impl SuperActivations<'_> {
    fn token(&self, t: usize) -> Token {
        let a = &self.acts[t];
        Token {
            q: a.q.as_ptr(),
            d: a.d.as_ptr(),
            sums: self.sums[t * self.sums_per_token..].as_ptr(),
        }
    }
}

/// Tokens per pass over a group's weights.
const TILE: usize = 4;

fn tile<const T: usize>(
    format: Format,
    data: &[u8],
    supers: usize,
    acts: &SuperActivations,
    t0: usize,
    out: &mut [f32],
    kernel: Int8Kernel,
) {
    let tokens: [Token; T] = std::array::from_fn(|t| acts.token(t0 + t));
    let out: &mut [[f32; GROUP]; T] = out.as_chunks_mut().0.try_into().expect("a tile's outputs");
    let data = data.as_ptr();
    // SAFETY: `data` is one group's super-blocks of `format`, every token covers `supers`
    // super-blocks (`activations` checked), and `kernel` is one the CPU runs.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        match (kernel, format) {
            (Int8Kernel::Avx512 | Int8Kernel::Amx, Format::Q3K) => {
                return x86::scaled_groups_avx512::<x86::ThreeBitPlanes, T>(data, supers, tokens, out)
            }
            (Int8Kernel::Avx2 | Int8Kernel::AvxVnni, Format::Q3K) => {
                return x86::scaled_groups_avx2::<x86::ThreeBitPlanes, T, false>(data, supers, tokens, out)
            }
            (Int8Kernel::Avx512 | Int8Kernel::Amx, Format::Q2K) => {
                return x86::q2k_avx512::<T>(data, supers, tokens, out)
            }
            (Int8Kernel::Avx2 | Int8Kernel::AvxVnni, Format::Q2K) => {
                return x86::q2k_avx2::<T>(data, supers, tokens, out)
            }
            (Int8Kernel::Avx512 | Int8Kernel::Amx, Format::Q4K) => {
                return x86::q4k_avx512::<T, false>(data, supers, tokens, out)
            }
            (Int8Kernel::Avx512 | Int8Kernel::Amx, Format::Q5K) => {
                return x86::q4k_avx512::<T, true>(data, supers, tokens, out)
            }
            (Int8Kernel::Avx512 | Int8Kernel::Amx, Format::Q6K) => {
                return x86::scaled_groups_avx512::<x86::WeightBytes, T>(data, supers, tokens, out)
            }
            (Int8Kernel::Avx512 | Int8Kernel::Amx, Format::IQ4XS) => {
                return x86::scaled_groups_avx512::<x86::TableNibbles, T>(data, supers, tokens, out)
            }
            (Int8Kernel::Avx2 | Int8Kernel::AvxVnni, Format::Q4K) => {
                return x86::q4k_avx2::<T, false>(data, supers, tokens, out)
            }
            (Int8Kernel::Avx2 | Int8Kernel::AvxVnni, Format::Q5K) => {
                return x86::q4k_avx2::<T, true>(data, supers, tokens, out)
            }
            (Int8Kernel::Avx2 | Int8Kernel::AvxVnni, Format::Q6K) => {
                return x86::scaled_groups_avx2::<x86::WeightBytes, T, false>(data, supers, tokens, out)
            }
            (Int8Kernel::Avx2 | Int8Kernel::AvxVnni, Format::IQ4XS) => {
                return x86::scaled_groups_avx2::<x86::TableNibbles, T, true>(data, supers, tokens, out)
            }
            (Int8Kernel::Portable, _) => {}
        }
    }
    let _ = kernel;
    // SAFETY: as above.
    unsafe {
        match format {
            Format::Q2K => q2k_portable::<T>(data, supers, tokens, out),
            Format::Q3K => scaled_groups_portable::<T>(
                q3k_weight,
                (q3k::GROUP_BLOCK, q3k::SCALES_AT, q3k::D_AT),
                data,
                supers,
                tokens,
                out,
            ),
            Format::Q4K => q4k_portable::<T, false>(data, supers, tokens, out),
            Format::Q5K => q4k_portable::<T, true>(data, supers, tokens, out),
            Format::Q6K => scaled_groups_portable::<T>(
                q6k_weight,
                (q6k::GROUP_BLOCK, q6k::SCALES_AT, q6k::D_AT),
                data,
                supers,
                tokens,
                out,
            ),
            Format::IQ4XS => scaled_groups_portable::<T>(
                iq4xs_weight,
                (iq4xs::GROUP_BLOCK, iq4xs::SCALES_AT, iq4xs::D_AT),
                data,
                supers,
                tokens,
                out,
            ),
        }
    }
}

/// The portable Q4_K kernel (Q5_K's where `FIFTH`): every lane's operations one by one, as the
/// vector kernels run them.
///
/// # Safety
/// As [`tile`]'s callers promise.
unsafe fn q4k_portable<const T: usize, const FIFTH: bool>(
    data: *const u8,
    supers: usize,
    tokens: [Token; T],
    out: &mut [[f32; GROUP]; T],
) {
    use q4k::*;
    for (token, out) in tokens.iter().zip(out.iter_mut()) {
        for (lane, result) in out.iter_mut().enumerate() {
            let (mut main, mut low) = (0f32, 0f32);
            for s in 0..supers {
                // SAFETY: super-block `s` of the group and the token's super-block `s` are
                // readable.
                unsafe {
                    let block = data.add(s * if FIFTH { Q5_GROUP_BLOCK } else { GROUP_BLOCK });
                    let q = token.q.add(s * SUPER);
                    let (mut total, mut mins) = (0i32, 0i32);
                    for j in 0..8 {
                        let mut isum = 0i32;
                        for l in 0..32 {
                            let chunk = 8 * (j / 2) + l / 4;
                            let byte = *block.add(chunk * 64 + lane * 4 + l % 4);
                            let mut u = if j % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                            if FIFTH {
                                let bits = *block.add(FIFTH_AT + (l / 4) * 64 + lane * 4 + l % 4);
                                u |= ((bits >> j) & 1) << 4;
                            }
                            isum += u as i32 * *q.add(32 * j + l) as i32;
                        }
                        total += *block.add(SCALES_AT + j * GROUP + lane) as i32 * isum;
                        mins += *block.add(MINS_AT + j * GROUP + lane) as i32 * *token.sums.add(8 * s + j);
                    }
                    let dx = *token.d.add(s);
                    main = (total as f32).mul_add(f16_at(block.add(D_AT + 2 * lane)) * dx, main);
                    low = (mins as f32).mul_add(f16_at(block.add(DMIN_AT + 2 * lane)) * dx, low);
                }
            }
            *result = main - low;
        }
    }
}

/// The portable Q2_K kernel.
///
/// # Safety
/// As [`tile`]'s callers promise.
unsafe fn q2k_portable<const T: usize>(
    data: *const u8,
    supers: usize,
    tokens: [Token; T],
    out: &mut [[f32; GROUP]; T],
) {
    use q2k::*;
    for (token, out) in tokens.iter().zip(out.iter_mut()) {
        for (lane, result) in out.iter_mut().enumerate() {
            let (mut main, mut low) = (0f32, 0f32);
            for s in 0..supers {
                // SAFETY: as in `q4k_portable`.
                unsafe {
                    let block = data.add(s * GROUP_BLOCK);
                    let q = token.q.add(s * SUPER);
                    let (mut total, mut mins) = (0i32, 0i32);
                    for g in 0..16 {
                        let mut isum = 0i32;
                        for i in 0..16 {
                            let u = (*block.add(g * 64 + lane * 4 + i % 4) >> (2 * (i / 4))) & 3;
                            isum += u as i32 * *q.add(16 * g + i) as i32;
                        }
                        let scale_min = *block.add(SCALES_AT + g * GROUP + lane);
                        total += (scale_min & 0x0F) as i32 * isum;
                        mins += (scale_min >> 4) as i32 * *token.sums.add(16 * s + g);
                    }
                    let dx = *token.d.add(s);
                    main = (total as f32).mul_add(f16_at(block.add(D_AT + 2 * lane)) * dx, main);
                    low = (mins as f32).mul_add(f16_at(block.add(DMIN_AT + 2 * lane)) * dx, low);
                }
            }
            *result = main - low;
        }
    }
}

/// Stored weight `i` (0..256, plus the layout's bias) of lane `lane` in a Q3_K group block.
///
/// # Safety
/// `block` holds a Q3_K group's super-block.
unsafe fn q3k_weight(block: *const u8, lane: usize, i: usize) -> i32 {
    let ((low_at, shift), (high_at, bit)) = q3k_bits_at(lane, i);
    // SAFETY: both offsets lie in the group block.
    let (low, high) = unsafe { (*block.add(low_at), *block.add(high_at)) };
    (((low >> shift) & 3) | (((high >> bit) & 1) << 2)) as i32
}

/// The same for a Q6_K group block.
///
/// # Safety
/// `block` holds a Q6_K group's super-block.
unsafe fn q6k_weight(block: *const u8, lane: usize, i: usize) -> i32 {
    // SAFETY: the offset lies in the group block.
    unsafe { *block.add((i / 4) * 64 + lane * 4 + i % 4) as i32 }
}

/// The same for an IQ4_XS group block: the index's table value + 128.
///
/// # Safety
/// `block` holds an IQ4_XS group's super-block.
unsafe fn iq4xs_weight(block: *const u8, lane: usize, i: usize) -> i32 {
    let (at, shift) = iq4xs_index_at(lane, i);
    // SAFETY: the offset lies in the group block.
    let index = (unsafe { *block.add(at) } >> shift) & 0x0F;
    super::iq4::STORED[index as usize] as i32
}

/// The portable kernel of the sixteen int8-scaled 16-weight groups (Q3_K, Q6_K, IQ4_XS), the
/// stored weights read by `weight`: every lane's operations one by one, as the vector kernels
/// run them.
///
/// # Safety
/// As [`tile`]'s callers promise, `weight` and the layout's (group block size, scales' and
/// `d`'s offsets) being the format's.
unsafe fn scaled_groups_portable<const T: usize>(
    weight: unsafe fn(*const u8, usize, usize) -> i32,
    (group_block, scales_at, d_at): (usize, usize, usize),
    data: *const u8,
    supers: usize,
    tokens: [Token; T],
    out: &mut [[f32; GROUP]; T],
) {
    for (token, out) in tokens.iter().zip(out.iter_mut()) {
        for (lane, result) in out.iter_mut().enumerate() {
            let mut main = 0f32;
            for s in 0..supers {
                // SAFETY: as in `q4k_portable`.
                unsafe {
                    let block = data.add(s * group_block);
                    let q = token.q.add(s * SUPER);
                    let mut total = 0i32;
                    for g in 0..16 {
                        let mut isum = *token.sums.add(16 * s + g);
                        for i in 16 * g..16 * g + 16 {
                            isum += weight(block, lane, i) * *q.add(i) as i32;
                        }
                        total += *block.add(scales_at + g * GROUP + lane) as i8 as i32 * isum;
                    }
                    main = (total as f32).mul_add(f16_at(block.add(d_at + 2 * lane)) * *token.d.add(s), main);
                }
            }
            *result = main;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{iq4xs, q2k, q3k, q4k, q6k, Token, GROUP, SUPER};
    use crate::cpu::quant::interleaved::quad;
    use crate::cpu::quant::iq4::STORED as IQ4_STORED;
    use crate::cpu::quant::prefetch;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn q4k_avx512<const T: usize, const FIFTH: bool>(
        data: *const u8,
        supers: usize,
        tokens: [Token; T],
        out: &mut [[f32; GROUP]; T],
    ) {
        use q4k::*;
        let mut main = [_mm512_setzero_ps(); T];
        let mut low = [_mm512_setzero_ps(); T];
        for s in 0..supers {
            // SAFETY: super-block `s` of the group and each token's super-block `s` are
            // readable (the caller's promise).
            unsafe {
                let group_block = if FIFTH { Q5_GROUP_BLOCK } else { GROUP_BLOCK };
                let block = data.add(s * group_block);
                let q0 = s * SUPER;
                let mut total = [_mm512_setzero_si512(); T];
                for pair in 0..4 {
                    let mut even = [_mm512_setzero_si512(); T];
                    let mut odd = [_mm512_setzero_si512(); T];
                    for c in 0..8 {
                        prefetch::block_ahead(block, group_block, 8 * pair + c, 32);
                        let [lo, hi] = q4k_chunk::<FIFTH>(block, pair, c);
                        for t in 0..T {
                            let at = q0 + 64 * pair + 4 * c;
                            even[t] = _mm512_dpbusd_epi32(even[t], lo, _mm512_set1_epi32(quad(tokens[t].q, at)));
                            odd[t] = _mm512_dpbusd_epi32(odd[t], hi, _mm512_set1_epi32(quad(tokens[t].q, at + 32)));
                        }
                    }
                    let scale = |j: usize| {
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(block.add(SCALES_AT + j * GROUP) as *const __m128i))
                    };
                    let (sc_even, sc_odd) = (scale(2 * pair), scale(2 * pair + 1));
                    for t in 0..T {
                        let scaled =
                            _mm512_add_epi32(_mm512_mullo_epi32(even[t], sc_even), _mm512_mullo_epi32(odd[t], sc_odd));
                        total[t] = _mm512_add_epi32(total[t], scaled);
                    }
                }
                let mins = q4k_mins_512(block, &tokens, s);
                let (d, dmin) = (block.add(D_AT), block.add(DMIN_AT));
                scale_super_512(d, dmin, &tokens, s, (&total, &mins), (&mut main, &mut low));
            }
        }
        for t in 0..T {
            // SAFETY: token t's sixteen outputs.
            unsafe { _mm512_storeu_ps(out[t].as_mut_ptr(), _mm512_sub_ps(main[t], low[t])) };
        }
    }

    /// Quad `c` (0..8) of sub-blocks `2·pair` and `2·pair + 1` of a Q4_K (Q5_K: `FIFTH`) group's
    /// super-block, a byte a weight, four of every row's in each i32 lane: `[lo, hi]`, weights
    /// `4c..4c + 4` of each sub-block (Q5_K's fifth bits set in).
    ///
    /// # Safety
    /// `block` holds a group's super-block of this layout; AVX-512 F/BW are enabled where this
    /// inlines.
    #[inline(always)]
    pub(super) unsafe fn q4k_chunk<const FIFTH: bool>(block: *const u8, pair: usize, c: usize) -> [__m512i; 2] {
        use crate::cpu::quant::interleaved::fifth_bit;
        use q4k::FIFTH_AT;
        let low4 = _mm512_set1_epi8(0x0F);
        // SAFETY: the quad's bytes and (Q5_K) its fifth bits lie in the super-block.
        unsafe {
            let raw = _mm512_loadu_si512(block.add(64 * (8 * pair + c)) as *const _);
            let mut lo = _mm512_and_si512(raw, low4);
            let mut hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            if FIFTH {
                let bits = _mm512_loadu_si512(block.add(FIFTH_AT + 64 * c) as *const _);
                lo = _mm512_or_si512(lo, fifth_bit(bits, 2 * pair as i32));
                hi = _mm512_or_si512(hi, fifth_bit(bits, 2 * pair as i32 + 1));
            }
            [lo, hi]
        }
    }

    /// Each token's `Σ_j m_j·Σ_{i∈j} qx_i` over Q4_K/Q5_K super-block `s` (`block`, the group's),
    /// exactly, a lane a row.
    ///
    /// # Safety
    /// `block` holds a group's super-block of this layout, and each token's sums cover `s`;
    /// AVX-512 F is enabled where this inlines.
    #[inline(always)]
    pub(super) unsafe fn q4k_mins_512<const T: usize>(block: *const u8, tokens: &[Token; T], s: usize) -> [__m512i; T] {
        use q4k::MINS_AT;
        let mut mins = [_mm512_setzero_si512(); T];
        for j in 0..8 {
            // SAFETY: as the caller promises.
            unsafe {
                let m = _mm512_cvtepu8_epi32(_mm_loadu_si128(block.add(MINS_AT + j * GROUP) as *const __m128i));
                for t in 0..T {
                    let sums = _mm512_set1_epi32(*tokens[t].sums.add(8 * s + j));
                    mins[t] = _mm512_add_epi32(mins[t], _mm512_mullo_epi32(m, sums));
                }
            }
        }
        mins
    }

    /// The end of a super-block with minimums (Q2_K, Q4_K, Q5_K), the rows' f16 `d` and
    /// `dmin` at `d` and `dmin`: `main = fma(total, d·dx, main)`, `low = fma(mins, dmin·dx, low)`
    /// for each token.
    #[inline(always)]
    pub(super) unsafe fn scale_super_512<const T: usize>(
        d: *const u8,
        dmin: *const u8,
        tokens: &[Token; T],
        s: usize,
        (total, mins): (&[__m512i; T], &[__m512i; T]),
        (main, low): (&mut [__m512; T], &mut [__m512; T]),
    ) {
        // SAFETY: the caller's group block holds sixteen f16s at each, and token t's scales
        // cover super-block s.
        unsafe {
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(d as *const __m256i));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(dmin as *const __m256i));
            for t in 0..T {
                let dx = _mm512_set1_ps(*tokens[t].d.add(s));
                main[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[t]), _mm512_mul_ps(d, dx), main[t]);
                low[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins[t]), _mm512_mul_ps(dmin, dx), low[t]);
            }
        }
    }

    /// [`scale_super_512`] for eight rows.
    #[inline(always)]
    unsafe fn scale_super_256<const T: usize>(
        d: *const u8,
        dmin: *const u8,
        tokens: &[Token; T],
        s: usize,
        (total, mins): (&[__m256i; T], &[__m256i; T]),
        (main, low): (&mut [__m256; T], &mut [__m256; T]),
    ) {
        // SAFETY: as in `scale_super_512`, eight f16s at each.
        unsafe {
            let d = _mm256_cvtph_ps(_mm_loadu_si128(d as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(dmin as *const __m128i));
            for t in 0..T {
                let dx = _mm256_set1_ps(*tokens[t].d.add(s));
                main[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[t]), _mm256_mul_ps(d, dx), main[t]);
                low[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[t]), _mm256_mul_ps(dmin, dx), low[t]);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn q2k_avx512<const T: usize>(
        data: *const u8,
        supers: usize,
        tokens: [Token; T],
        out: &mut [[f32; GROUP]; T],
    ) {
        use q2k::*;
        let (two_bits, nibble) = (_mm512_set1_epi8(3), _mm512_set1_epi32(0x0F));
        let mut main = [_mm512_setzero_ps(); T];
        let mut low = [_mm512_setzero_ps(); T];
        for s in 0..supers {
            // SAFETY: as in `q4k_avx512`.
            unsafe {
                let block = data.add(s * GROUP_BLOCK);
                let q0 = s * SUPER;
                let mut total = [_mm512_setzero_si512(); T];
                let mut mins = [_mm512_setzero_si512(); T];
                for g in 0..16 {
                    prefetch::block_ahead(block, GROUP_BLOCK, g, 16);
                    let raw = _mm512_loadu_si512(block.add(64 * g) as *const _);
                    let mut isum = [_mm512_setzero_si512(); T];
                    for p in 0..4 {
                        let u = _mm512_and_si512(_mm512_srl_epi16(raw, _mm_cvtsi32_si128(2 * p as i32)), two_bits);
                        for t in 0..T {
                            let qx = _mm512_set1_epi32(quad(tokens[t].q, q0 + 16 * g + 4 * p));
                            isum[t] = _mm512_dpbusd_epi32(isum[t], u, qx);
                        }
                    }
                    let scale_min =
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(block.add(SCALES_AT + g * GROUP) as *const __m128i));
                    let (sc, m) = (_mm512_and_si512(scale_min, nibble), _mm512_srli_epi32(scale_min, 4));
                    for t in 0..T {
                        total[t] = _mm512_add_epi32(total[t], _mm512_mullo_epi32(isum[t], sc));
                        let sums = _mm512_set1_epi32(*tokens[t].sums.add(16 * s + g));
                        mins[t] = _mm512_add_epi32(mins[t], _mm512_mullo_epi32(m, sums));
                    }
                }
                let (d, dmin) = (block.add(D_AT), block.add(DMIN_AT));
                scale_super_512(d, dmin, &tokens, s, (&total, &mins), (&mut main, &mut low));
            }
        }
        for t in 0..T {
            // SAFETY: token t's sixteen outputs.
            unsafe { _mm512_storeu_ps(out[t].as_mut_ptr(), _mm512_sub_ps(main[t], low[t])) };
        }
    }

    /// `acc + Σ u·qx` over each lane's four bytes: `pmaddubsw` then `pmaddwd` by ones, exact
    /// for `u` below 64 (a pair is at most 2·63·127).
    #[inline(always)]
    unsafe fn dot4(acc: __m256i, u: __m256i, qx: __m256i) -> __m256i {
        _mm256_add_epi32(
            acc,
            _mm256_madd_epi16(_mm256_maddubs_epi16(u, qx), _mm256_set1_epi16(1)),
        )
    }

    /// AVX2: the group as two halves of eight rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q4k_avx2<const T: usize, const FIFTH: bool>(
        data: *const u8,
        supers: usize,
        tokens: [Token; T],
        out: &mut [[f32; GROUP]; T],
    ) {
        for half in 0..2 {
            // SAFETY: as the caller promises.
            unsafe { q4k_half::<T, FIFTH>(data, supers, &tokens, out, half) }
        }
    }

    /// `dot4` for any byte `u` (IQ4_XS's reach 241, where a `pmaddubsw` pair could saturate):
    /// the low and high nibbles' sums apart, the high one times 16, the same integers.
    #[inline(always)]
    unsafe fn dot4_wide(acc: __m256i, u: __m256i, qx: __m256i) -> __m256i {
        let nibble = _mm256_set1_epi8(0x0F);
        let low = _mm256_and_si256(u, nibble);
        let high = _mm256_and_si256(_mm256_srli_epi16(u, 4), nibble);
        let ones = _mm256_set1_epi16(1);
        let low_sum = _mm256_madd_epi16(_mm256_maddubs_epi16(low, qx), ones);
        let high_sum = _mm256_madd_epi16(_mm256_maddubs_epi16(high, qx), ones);
        _mm256_add_epi32(acc, _mm256_add_epi32(low_sum, _mm256_slli_epi32(high_sum, 4)))
    }

    /// AVX2: the group as two halves of eight rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q2k_avx2<const T: usize>(
        data: *const u8,
        supers: usize,
        tokens: [Token; T],
        out: &mut [[f32; GROUP]; T],
    ) {
        for half in 0..2 {
            // SAFETY: as the caller promises.
            unsafe { q2k_half::<T>(data, supers, &tokens, out, half) }
        }
    }

    #[inline(always)]
    unsafe fn q2k_half<const T: usize>(
        data: *const u8,
        supers: usize,
        tokens: &[Token; T],
        out: &mut [[f32; GROUP]; T],
        half: usize,
    ) {
        use q2k::*;
        let (lanes, rows) = (32 * half, 8 * half);
        let (two_bits, nibble) = (_mm256_set1_epi8(3), _mm256_set1_epi32(0x0F));
        let mut main = [_mm256_setzero_ps(); T];
        let mut low = [_mm256_setzero_ps(); T];
        for s in 0..supers {
            // SAFETY: as in `q4k_avx512`, for this half's bytes.
            unsafe {
                let block = data.add(s * GROUP_BLOCK);
                let q0 = s * SUPER;
                let mut total = [_mm256_setzero_si256(); T];
                let mut mins = [_mm256_setzero_si256(); T];
                for g in 0..16 {
                    if half == 0 {
                        prefetch::block_ahead(block, GROUP_BLOCK, g, 16);
                    }
                    let raw = _mm256_loadu_si256(block.add(64 * g + lanes) as *const __m256i);
                    let mut isum = [_mm256_setzero_si256(); T];
                    for p in 0..4 {
                        let u = _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(2 * p as i32)), two_bits);
                        for t in 0..T {
                            isum[t] = dot4(isum[t], u, _mm256_set1_epi32(quad(tokens[t].q, q0 + 16 * g + 4 * p)));
                        }
                    }
                    let at = block.add(SCALES_AT + g * GROUP + rows);
                    let scale_min = _mm256_cvtepu8_epi32(_mm_loadl_epi64(at as *const __m128i));
                    let (sc, m) = (_mm256_and_si256(scale_min, nibble), _mm256_srli_epi32(scale_min, 4));
                    for t in 0..T {
                        total[t] = _mm256_add_epi32(total[t], _mm256_mullo_epi32(isum[t], sc));
                        let sums = _mm256_set1_epi32(*tokens[t].sums.add(16 * s + g));
                        mins[t] = _mm256_add_epi32(mins[t], _mm256_mullo_epi32(m, sums));
                    }
                }
                let (d, dmin) = (block.add(D_AT + 2 * rows), block.add(DMIN_AT + 2 * rows));
                scale_super_256(d, dmin, tokens, s, (&total, &mins), (&mut main, &mut low));
            }
        }
        for t in 0..T {
            // SAFETY: token t's eight outputs of this half.
            unsafe { _mm256_storeu_ps(out[t].as_mut_ptr().add(rows), _mm256_sub_ps(main[t], low[t])) };
        }
    }

    #[inline(always)]
    unsafe fn q4k_half<const T: usize, const FIFTH: bool>(
        data: *const u8,
        supers: usize,
        tokens: &[Token; T],
        out: &mut [[f32; GROUP]; T],
        half: usize,
    ) {
        use q4k::*;
        let (lanes, rows) = (32 * half, 8 * half);
        let low4 = _mm256_set1_epi8(0x0F);
        let bit4 = _mm256_set1_epi8(0x10);
        let fifth = |bits: __m256i, b: i32| match b <= 4 {
            true => _mm256_and_si256(_mm256_sll_epi16(bits, _mm_cvtsi32_si128(4 - b)), bit4),
            false => _mm256_and_si256(_mm256_srl_epi16(bits, _mm_cvtsi32_si128(b - 4)), bit4),
        };
        let mut main = [_mm256_setzero_ps(); T];
        let mut low = [_mm256_setzero_ps(); T];
        for s in 0..supers {
            // SAFETY: as in `q4k_avx512`, for this half's bytes.
            unsafe {
                let group_block = if FIFTH { Q5_GROUP_BLOCK } else { GROUP_BLOCK };
                let block = data.add(s * group_block);
                let q0 = s * SUPER;
                let mut total = [_mm256_setzero_si256(); T];
                for pair in 0..4 {
                    let mut even = [_mm256_setzero_si256(); T];
                    let mut odd = [_mm256_setzero_si256(); T];
                    for c in 0..8 {
                        // The second half reads what the first brought in.
                        if half == 0 {
                            prefetch::block_ahead(block, group_block, 8 * pair + c, 32);
                        }
                        let raw = _mm256_loadu_si256(block.add(64 * (8 * pair + c) + lanes) as *const __m256i);
                        let mut lo = _mm256_and_si256(raw, low4);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                        if FIFTH {
                            let bits = _mm256_loadu_si256(block.add(FIFTH_AT + 64 * c + lanes) as *const __m256i);
                            lo = _mm256_or_si256(lo, fifth(bits, 2 * pair as i32));
                            hi = _mm256_or_si256(hi, fifth(bits, 2 * pair as i32 + 1));
                        }
                        for t in 0..T {
                            let at = q0 + 64 * pair + 4 * c;
                            even[t] = dot4(even[t], lo, _mm256_set1_epi32(quad(tokens[t].q, at)));
                            odd[t] = dot4(odd[t], hi, _mm256_set1_epi32(quad(tokens[t].q, at + 32)));
                        }
                    }
                    let scale = |j: usize| {
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                            block.add(SCALES_AT + j * GROUP + rows) as *const __m128i
                        ))
                    };
                    let (sc_even, sc_odd) = (scale(2 * pair), scale(2 * pair + 1));
                    for t in 0..T {
                        let scaled =
                            _mm256_add_epi32(_mm256_mullo_epi32(even[t], sc_even), _mm256_mullo_epi32(odd[t], sc_odd));
                        total[t] = _mm256_add_epi32(total[t], scaled);
                    }
                }
                let mut mins = [_mm256_setzero_si256(); T];
                for j in 0..8 {
                    let at = block.add(MINS_AT + j * GROUP + rows);
                    let m = _mm256_cvtepu8_epi32(_mm_loadl_epi64(at as *const __m128i));
                    for t in 0..T {
                        let sums = _mm256_set1_epi32(*tokens[t].sums.add(8 * s + j));
                        mins[t] = _mm256_add_epi32(mins[t], _mm256_mullo_epi32(m, sums));
                    }
                }
                let (d, dmin) = (block.add(D_AT + 2 * rows), block.add(DMIN_AT + 2 * rows));
                scale_super_256(d, dmin, tokens, s, (&total, &mins), (&mut main, &mut low));
            }
        }
        for t in 0..T {
            // SAFETY: token t's eight outputs of this half.
            unsafe { _mm256_storeu_ps(out[t].as_mut_ptr().add(rows), _mm256_sub_ps(main[t], low[t])) };
        }
    }

    /// A layout of sixteen 16-weight groups with int8 scales (Q6_K's and IQ4_XS's weight
    /// bytes, Q3_K's bit planes): where its parts are, and how a group's weights are read.
    /// The kernels below are the same for each.
    pub trait ScaledGroups {
        const GROUP_BLOCK: usize;
        const SCALES_AT: usize;
        const D_AT: usize;
        /// Group `g`'s weights `4j..4j + 4` of the sixteen rows (`[row][byte]`), `j` in 0..4.
        unsafe fn quads512(block: *const u8, g: usize) -> [__m512i; 4];
        /// The same for eight rows, from byte `lanes` of each 64.
        unsafe fn quads256(block: *const u8, g: usize, lanes: usize) -> [__m256i; 4];
    }

    /// Q6_K's layout: a group's weights as whole bytes, a quad's 64 after another.
    pub struct WeightBytes;

    impl ScaledGroups for WeightBytes {
        const GROUP_BLOCK: usize = q6k::GROUP_BLOCK;
        const SCALES_AT: usize = q6k::SCALES_AT;
        const D_AT: usize = q6k::D_AT;
        #[inline(always)]
        unsafe fn quads512(block: *const u8, g: usize) -> [__m512i; 4] {
            // SAFETY: the group block holds sixteen groups of four 64-byte quads.
            std::array::from_fn(|j| unsafe { _mm512_loadu_si512(block.add(64 * (4 * g + j)) as *const _) })
        }
        #[inline(always)]
        unsafe fn quads256(block: *const u8, g: usize, lanes: usize) -> [__m256i; 4] {
            // SAFETY: as in `quads512`, half of each quad.
            std::array::from_fn(|j| unsafe {
                _mm256_loadu_si256(block.add(64 * (4 * g + j) + lanes) as *const __m256i)
            })
        }
    }

    /// IQ4_XS's layout: a group's table indices as two 64-byte nibble planes (quads 2h and
    /// 2h + 1 in plane h's low and high nibbles), each looked up (`vpshufb`) as value + 128.
    pub struct TableNibbles;

    impl ScaledGroups for TableNibbles {
        const GROUP_BLOCK: usize = iq4xs::GROUP_BLOCK;
        const SCALES_AT: usize = iq4xs::SCALES_AT;
        const D_AT: usize = iq4xs::D_AT;
        #[inline(always)]
        unsafe fn quads512(block: *const u8, g: usize) -> [__m512i; 4] {
            // SAFETY: the table is 16 bytes; group g's two planes lie in the group block.
            let (table, planes) = unsafe {
                let table = _mm512_broadcast_i32x4(_mm_loadu_si128(IQ4_STORED.as_ptr() as *const __m128i));
                let plane = |h: usize| _mm512_loadu_si512(block.add(128 * g + 64 * h) as *const _);
                (table, [plane(0), plane(1)])
            };
            let low4 = _mm512_set1_epi8(0x0F);
            std::array::from_fn(|p| {
                let plane = planes[p / 2];
                let index = match p % 2 {
                    0 => _mm512_and_si512(plane, low4),
                    _ => _mm512_and_si512(_mm512_srli_epi16(plane, 4), low4),
                };
                _mm512_shuffle_epi8(table, index)
            })
        }
        #[inline(always)]
        unsafe fn quads256(block: *const u8, g: usize, lanes: usize) -> [__m256i; 4] {
            // SAFETY: as in `quads512`, half of each plane.
            let (table, planes) = unsafe {
                let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_STORED.as_ptr() as *const __m128i));
                let plane = |h: usize| _mm256_loadu_si256(block.add(128 * g + 64 * h + lanes) as *const __m256i);
                (table, [plane(0), plane(1)])
            };
            let low4 = _mm256_set1_epi8(0x0F);
            std::array::from_fn(|p| {
                let plane = planes[p / 2];
                let index = match p % 2 {
                    0 => _mm256_and_si256(plane, low4),
                    _ => _mm256_and_si256(_mm256_srli_epi16(plane, 4), low4),
                };
                _mm256_shuffle_epi8(table, index)
            })
        }
    }

    /// Q3_K's layout: a group's low two bits in one 64-byte plane (quad `p` at bits `2p`), the
    /// third bits in a plane shared by two groups (quad `p` of group `g` at bit `(4g + p) % 8`).
    pub struct ThreeBitPlanes;

    impl ScaledGroups for ThreeBitPlanes {
        const GROUP_BLOCK: usize = q3k::GROUP_BLOCK;
        const SCALES_AT: usize = q3k::SCALES_AT;
        const D_AT: usize = q3k::D_AT;
        #[inline(always)]
        unsafe fn quads512(block: *const u8, g: usize) -> [__m512i; 4] {
            // SAFETY: group g's plane and its third-bit plane lie in the group block.
            let (low, high) = unsafe {
                (
                    _mm512_loadu_si512(block.add(64 * g) as *const _),
                    _mm512_loadu_si512(block.add(q3k::HIGH_AT + 64 * (g / 2)) as *const _),
                )
            };
            let (two_bits, one) = (_mm512_set1_epi8(3), _mm512_set1_epi8(1));
            std::array::from_fn(|p| {
                let low_bits = _mm512_and_si512(_mm512_srl_epi16(low, _mm_cvtsi32_si128(2 * p as i32)), two_bits);
                let b = ((4 * g + p) % 8) as i32;
                let third = _mm512_and_si512(_mm512_srl_epi16(high, _mm_cvtsi32_si128(b)), one);
                _mm512_or_si512(low_bits, _mm512_slli_epi16(third, 2))
            })
        }
        #[inline(always)]
        unsafe fn quads256(block: *const u8, g: usize, lanes: usize) -> [__m256i; 4] {
            // SAFETY: as in `quads512`, half of each plane.
            let (low, high) = unsafe {
                (
                    _mm256_loadu_si256(block.add(64 * g + lanes) as *const __m256i),
                    _mm256_loadu_si256(block.add(q3k::HIGH_AT + 64 * (g / 2) + lanes) as *const __m256i),
                )
            };
            let (two_bits, one) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1));
            std::array::from_fn(|p| {
                let low_bits = _mm256_and_si256(_mm256_srl_epi16(low, _mm_cvtsi32_si128(2 * p as i32)), two_bits);
                let b = ((4 * g + p) % 8) as i32;
                let third = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(b)), one);
                _mm256_or_si256(low_bits, _mm256_slli_epi16(third, 2))
            })
        }
    }

    /// Sixteen 16-weight groups with int8 scales (layout `L`): each group's sum started at
    /// `−bias·Σqx` (the activations' sums; the weights are stored + bias), its products added,
    /// times its scale; one FMA for `d·dx` per super-block.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn scaled_groups_avx512<L: ScaledGroups, const T: usize>(
        data: *const u8,
        supers: usize,
        tokens: [Token; T],
        out: &mut [[f32; GROUP]; T],
    ) {
        let mut main = [_mm512_setzero_ps(); T];
        for s in 0..supers {
            // SAFETY: as in `q4k_avx512`.
            unsafe {
                let block = data.add(s * L::GROUP_BLOCK);
                let q0 = s * SUPER;
                let mut total = [_mm512_setzero_si512(); T];
                for g in 0..16 {
                    prefetch::block_ahead(block, L::GROUP_BLOCK, g, 16);
                    let mut isum: [__m512i; T] =
                        std::array::from_fn(|t| _mm512_set1_epi32(*tokens[t].sums.add(16 * s + g)));
                    for (j, w) in L::quads512(block, g).into_iter().enumerate() {
                        for t in 0..T {
                            let qx = _mm512_set1_epi32(quad(tokens[t].q, q0 + 16 * g + 4 * j));
                            isum[t] = _mm512_dpbusd_epi32(isum[t], w, qx);
                        }
                    }
                    let sc =
                        _mm512_cvtepi8_epi32(_mm_loadu_si128(block.add(L::SCALES_AT + g * GROUP) as *const __m128i));
                    for t in 0..T {
                        total[t] = _mm512_add_epi32(total[t], _mm512_mullo_epi32(isum[t], sc));
                    }
                }
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(block.add(L::D_AT) as *const __m256i));
                for t in 0..T {
                    let dx = _mm512_set1_ps(*tokens[t].d.add(s));
                    main[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[t]), _mm512_mul_ps(d, dx), main[t]);
                }
            }
        }
        for t in 0..T {
            // SAFETY: token t's sixteen outputs.
            unsafe { _mm512_storeu_ps(out[t].as_mut_ptr(), main[t]) };
        }
    }

    /// [`scaled_groups_avx512`] on 256-bit registers, the group as two halves of eight rows;
    /// `WIDE` for weight bytes past 63 (IQ4_XS).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scaled_groups_avx2<L: ScaledGroups, const T: usize, const WIDE: bool>(
        data: *const u8,
        supers: usize,
        tokens: [Token; T],
        out: &mut [[f32; GROUP]; T],
    ) {
        for half in 0..2 {
            // SAFETY: as the caller promises.
            unsafe { scaled_groups_half::<L, T, WIDE>(data, supers, &tokens, out, half) }
        }
    }

    #[inline(always)]
    unsafe fn scaled_groups_half<L: ScaledGroups, const T: usize, const WIDE: bool>(
        data: *const u8,
        supers: usize,
        tokens: &[Token; T],
        out: &mut [[f32; GROUP]; T],
        half: usize,
    ) {
        let (lanes, rows) = (32 * half, 8 * half);
        let mut main = [_mm256_setzero_ps(); T];
        for s in 0..supers {
            // SAFETY: as in `q4k_avx512`, for this half's bytes.
            unsafe {
                let block = data.add(s * L::GROUP_BLOCK);
                let q0 = s * SUPER;
                let mut total = [_mm256_setzero_si256(); T];
                for g in 0..16 {
                    if half == 0 {
                        prefetch::block_ahead(block, L::GROUP_BLOCK, g, 16);
                    }
                    let mut isum: [__m256i; T] =
                        std::array::from_fn(|t| _mm256_set1_epi32(*tokens[t].sums.add(16 * s + g)));
                    for (j, w) in L::quads256(block, g, lanes).into_iter().enumerate() {
                        for t in 0..T {
                            let qx = _mm256_set1_epi32(quad(tokens[t].q, q0 + 16 * g + 4 * j));
                            isum[t] = if WIDE {
                                dot4_wide(isum[t], w, qx)
                            } else {
                                dot4(isum[t], w, qx)
                            };
                        }
                    }
                    let at = block.add(L::SCALES_AT + g * GROUP + rows);
                    let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(at as *const __m128i));
                    for t in 0..T {
                        total[t] = _mm256_add_epi32(total[t], _mm256_mullo_epi32(isum[t], sc));
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(block.add(L::D_AT + 2 * rows) as *const __m128i));
                for t in 0..T {
                    let dx = _mm256_set1_ps(*tokens[t].d.add(s));
                    main[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[t]), _mm256_mul_ps(d, dx), main[t]);
                }
            }
        }
        for t in 0..T {
            // SAFETY: token t's eight outputs of this half.
            unsafe { _mm256_storeu_ps(out[t].as_mut_ptr().add(rows), main[t]) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMATS: [GgmlType; 6] = [
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::IQ4XS,
    ];

    /// `rows` rows of `supers` valid blocks: random quants and scale bytes (every 6-bit
    /// scale and minimum, every int8 scale), finite f16 factors differing from block to block.
    fn matrix(dtype: GgmlType, rows: usize, supers: usize, seed: usize) -> Vec<u8> {
        let bytes = dtype.block_layout().1;
        let mut data: Vec<u8> = (0..rows * supers * bytes)
            .map(|i| (((i + seed) * 2654435761usize) >> 11) as u8)
            .collect();
        let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
        for (i, b) in data.chunks_exact_mut(bytes).enumerate() {
            let d = f16(0.001 * (1 + (i * 7 + seed) % 11) as f32);
            match dtype {
                GgmlType::Q4K | GgmlType::Q5K => {
                    b[0..2].copy_from_slice(&d);
                    b[2..4].copy_from_slice(&f16(0.002 * (1 + (i * 5) % 7) as f32));
                }
                GgmlType::IQ4XS => b[0..2].copy_from_slice(&d),
                GgmlType::Q3K => b[108..110].copy_from_slice(&d),
                GgmlType::Q2K => {
                    b[80..82].copy_from_slice(&d);
                    b[82..84].copy_from_slice(&f16(0.002 * (1 + (i * 5) % 7) as f32));
                }
                _ => b[208..210].copy_from_slice(&d),
            }
        }
        data
    }

    fn activations(tokens: usize, cols: usize) -> Vec<Q8KRow> {
        (0..tokens)
            .map(|t| {
                let x: Vec<f32> = (0..cols)
                    .map(|i| (((i * 31 + t * 977) % 41) as f32 - 20.0) / (3.0 + t as f32))
                    .collect();
                Q8KRow::quantize(&x)
            })
            .collect()
    }

    /// The module's arithmetic written from the GGUF block itself (ggml's bit layouts), not
    /// from the interleaved layout.
    fn reference(dtype: GgmlType, row: &[u8], act: &Q8KRow) -> f32 {
        let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let (mut main, mut low) = (0f32, 0f32);
        for (s, block) in row.chunks_exact(dtype.block_layout().1).enumerate() {
            let q = &act.q[s * SUPER..(s + 1) * SUPER];
            if dtype == GgmlType::Q6K {
                let u = q6k_weights(block);
                let total: i32 = (0..16)
                    .map(|g| {
                        let sum: i32 = (16 * g..16 * g + 16).map(|i| (u[i] as i32 - 32) * q[i] as i32).sum();
                        block[192 + g] as i8 as i32 * sum
                    })
                    .sum();
                main = (total as f32).mul_add(f16(&block[208..210]) * act.d[s], main);
                continue;
            }
            if dtype == GgmlType::Q2K {
                // ggml's `vec_dot_q2_K_q8_K`: per 16-weight group `Σ q·qx` times the scale,
                // `Σ qx` times the minimum.
                let (mut total, mut mins) = (0i32, 0i32);
                for g in 0..16 {
                    let (offset, shift) = two_bit_group(g);
                    let qs = &block[16 + offset..][..16];
                    let q = &q[16 * g..16 * g + 16];
                    let isum: i32 = (0..16).map(|l| ((qs[l] >> shift) & 3) as i32 * q[l] as i32).sum();
                    total += (block[g] & 0x0F) as i32 * isum;
                    mins += (block[g] >> 4) as i32 * q.iter().map(|&x| x as i32).sum::<i32>();
                }
                main = (total as f32).mul_add(f16(&block[80..82]) * act.d[s], main);
                low = (mins as f32).mul_add(f16(&block[82..84]) * act.d[s], low);
                continue;
            }
            if dtype == GgmlType::Q3K {
                // ggml's `vec_dot_q3_K_q8_K`: per 16-weight group `Σ q·qx` times `sc − 32`.
                let (mut w, mut scale, mut min) = ([0i8; SUPER], [0f32; 16], [0f32; 16]);
                <crate::cpu::quant::Q3K as crate::cpu::quant::BlockFormat>::unpack_groups(
                    block, &mut w, &mut scale, &mut min,
                );
                let scales = crate::cpu::quant::q3_k::scales(&block[96..108]);
                let total: i32 = (0..16)
                    .map(|g| {
                        let sum: i32 = (16 * g..16 * g + 16).map(|i| w[i] as i32 * q[i] as i32).sum();
                        (scales[g] as i32 - 32) * sum
                    })
                    .sum();
                main = (total as f32).mul_add(f16(&block[108..110]) * act.d[s], main);
                continue;
            }
            if dtype == GgmlType::IQ4XS {
                // ggml's `vec_dot_iq4_xs_q8_K`: each run's table-value sum times `ls − 32`.
                let scales = crate::cpu::quant::iq4::run_scales(block);
                let total: i32 = (0..8)
                    .map(|r| {
                        let qs = &block[8 + 16 * r..8 + 16 * r + 16];
                        let q = &q[32 * r..32 * r + 32];
                        let sum: i32 = (0..16)
                            .map(|j| {
                                let v = |i: u8| crate::cpu::quant::iq4::KVALUES[i as usize] as i32;
                                v(qs[j] & 0x0F) * q[j] as i32 + v(qs[j] >> 4) * q[j + 16] as i32
                            })
                            .sum();
                        (scales[r] as i32 - 32) * sum
                    })
                    .sum();
                main = (total as f32).mul_add(f16(&block[0..2]) * act.d[s], main);
                continue;
            }
            let (mut total, mut mins) = (0i32, 0i32);
            // Q5_K: ggml's `qh`, bit 2c (and 2c + 1) of byte l the fifth bit of weight l (l + 32)
            // of 64-weight chunk c.
            let (qs_at, qh) = match dtype {
                GgmlType::Q5K => (48, Some(&block[16..48])),
                _ => (16, None),
            };
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, &block[4..16]);
                let qs = &block[qs_at + 32 * (j / 2)..qs_at + 32 * (j / 2) + 32];
                let q = &q[32 * j..32 * j + 32];
                let isum: i32 = (0..32)
                    .map(|l| {
                        let nibble = if j % 2 == 0 { qs[l] & 0x0F } else { qs[l] >> 4 };
                        let high = qh.map_or(0, |qh| ((qh[l] >> j) & 1) << 4);
                        (nibble | high) as i32 * q[l] as i32
                    })
                    .sum();
                total += sc as i32 * isum;
                mins += m as i32 * q.iter().map(|&x| x as i32).sum::<i32>();
            }
            main = (total as f32).mul_add(f16(&block[0..2]) * act.d[s], main);
            low = (mins as f32).mul_add(f16(&block[2..4]) * act.d[s], low);
        }
        if matches!(dtype, GgmlType::Q3K | GgmlType::Q6K | GgmlType::IQ4XS) {
            main
        } else {
            main - low
        }
    }

    /// The layout keeps everything: the GGUF bytes come back as given, and rows dequantize as
    /// the format does.
    #[test]
    fn interleaving_loses_nothing() {
        for dtype in FORMATS {
            let (rows, supers) = (19, 2);
            let bytes = matrix(dtype, rows, supers, 1);
            let row_bytes = bytes.len() / rows;
            let m = InterleavedSuperRows::new(dtype, &bytes, row_bytes).unwrap();
            assert_eq!((m.rows(), m.cols(), m.groups(), m.dtype()), (rows, 512, 2, dtype));
            assert_eq!(m.gguf_bytes(), bytes, "{dtype:?}");
            let (mut got, mut want) = (vec![0f32; 512], vec![0f32; 512]);
            for r in [0, 15, 18] {
                m.dequantize_row(r, &mut got);
                dtype.dequantize(&bytes[r * row_bytes..(r + 1) * row_bytes], &mut want);
                assert_eq!(got, want, "{dtype:?} row {r}");
            }
        }
        assert!(
            InterleavedSuperRows::new(GgmlType::Q4K, &[0; 150], 150).is_none(),
            "not whole super-blocks"
        );
        assert!(
            InterleavedSuperRows::new(GgmlType::Q8_0, &[0; 34], 34).is_none(),
            "no super-block layout"
        );
    }

    /// Every kernel this CPU runs gives the reference's bits for every (row, token), whatever
    /// the tokens sharing a pass, and 0 for padding rows.
    #[test]
    fn every_kernel_gives_the_reference_bits() {
        for dtype in FORMATS {
            let (rows, supers) = (21, 3);
            let bytes = matrix(dtype, rows, supers, 3);
            let row_bytes = bytes.len() / rows;
            let m = InterleavedSuperRows::new(dtype, &bytes, row_bytes).unwrap();
            for tokens in [1, 2, 3, 4, 5, 9, 32, 83] {
                let acts = activations(tokens, m.cols());
                let prepared = m.activations(&acts).unwrap();
                for kernel in Int8Kernel::available() {
                    let mut out = vec![f32::NAN; tokens * GROUP];
                    for group in 0..m.groups() {
                        m.group_products(group, &prepared, &mut out, kernel);
                        let want =
                            |row: usize, t| reference(dtype, &bytes[row * row_bytes..(row + 1) * row_bytes], &acts[t]);
                        let case = format!("{dtype:?} {kernel:?}");
                        crate::cpu::quant::interleaved::assert_group_bits(&out, group, rows, want, &case);
                    }
                }
            }
            assert!(
                m.activations(&activations(1, 256)).is_none(),
                "activations shorter than the rows"
            );
        }
    }
}
