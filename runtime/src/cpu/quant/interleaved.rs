//! Rows of a 32-weight block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4) regrouped for
//! matmuls, as llama.cpp's repacked CPU kernels do: [`GROUP`] rows interleaved so that one
//! 512-bit register holds four neighbouring weights of each of sixteen rows. A `vpdpbusd`
//! against four activation bytes broadcast to every lane then advances sixteen rows' dots at
//! once, and each lane ends a block holding its row's exact integer sum: the float work (a
//! scale product and an FMA) is paid once per block for sixteen rows, where a row-at-a-time
//! kernel pays it per row and lane.
//!
//! The arithmetic, per (row, token) and block `b` in order (ggml's `vec_dot_*_q8` scheme):
//! `isum = Σ w·qx` exactly in integers (`w` the format's integer weight, `d·w` or `d·w + m`
//! its value), then `main = fma(isum, d_w·d_x, main)`, and for formats with a minimum
//! `mins = fma(m, d_x·Σqx, mins)`; the result is `main` (`main + mins`). Every kernel here
//! (AVX-512 VNNI, AVX-VNNI, AVX2, portable) runs those operations lane by lane, so they all
//! give the same bits, whatever the number of tokens computed together: a token's logits do
//! not depend on its step's size, nor on the CPU.
//!
//! Layout, per group of sixteen rows and per block (rows past the matrix are zeros):
//! - weights, unsigned: the packed nibble bytes as `[chunk 0..4][row 0..16][byte 0..4]`,
//!   byte `k` of a row's chunk `c` being the block's packed byte `4c + k` (low nibble: weight
//!   `4c + k`, high nibble: weight `16 + 4c + k`); Q8_0's bytes as `[group 0..8][row][byte]`,
//!   `w + 128`;
//! - Q5's fifth bits: `[row][byte 0..4]`, bit `g` of byte `k` the fifth bit of weight `4g + k`;
//! - the sixteen rows' scales, f16 as stored (MXFP4's E8M0 scale as the f16 power of two ggml
//!   multiplies by, where that is exact); then (Q4_1, Q5_1) their minimums.
//!
//! So the stored integer is `u = w + bias` (8 for Q4_0, 16 for Q5_0, 128 for Q8_0, 0 with a
//! minimum), and a block's sum starts from `−bias·Σqx` before the unsigned products are added.
//! IQ4_NL and MXFP4 keep Q4_0's nibbles, which index a table of int8 values (IQ4's; MXFP4's E2M1
//! values doubled): the kernels look each up (`vpshufb`) as the value + 128 and sum it as
//! Q8_0's bytes, bias 128.

#[cfg(target_arch = "x86_64")]
mod amx_tiles;
#[cfg(target_arch = "x86_64")]
pub(super) use x86::fifth_bit;

use super::int8::{Int8Kernel, Q8Row, ACT_BLOCK};
use super::GgmlType;
use super::{iq4, mxfp4};
use std::ops::Range;

/// Rows interleaved together: one i32 lane each of a 512-bit register.
pub const GROUP: usize = 16;

/// How one block format sits in the interleaved layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    dtype: GgmlType,
    /// Low four bits as nibbles (Q4, Q5), else whole bytes (Q8_0).
    nibbles: bool,
    /// A fifth bit per weight (Q5).
    fifth_bits: bool,
    /// An f16 minimum per block (Q4_1, Q5_1).
    mins: bool,
    /// The table the nibbles index (IQ4_NL's, MXFP4's doubled E2M1 values), whose values the
    /// kernels look up; [`NO_TABLE`] where the nibbles are the weights.
    table: u8,
    /// What the stored unsigned integer exceeds the format's integer by.
    bias: i32,
    /// Where the packed nibbles (or Q8_0's bytes) start in a GGUF block.
    quants_at: usize,
    /// Bytes of one GGUF block.
    block_bytes: usize,
}

impl Layout {
    fn of(dtype: GgmlType) -> Option<Self> {
        let (nibbles, fifth_bits, mins, bias, quants_at, block_bytes) = match dtype {
            GgmlType::Q4_0 => (true, false, false, 8, 2, 18),
            GgmlType::Q4_1 => (true, false, true, 0, 4, 20),
            GgmlType::Q5_0 => (true, true, false, 16, 6, 22),
            GgmlType::Q5_1 => (true, true, true, 0, 8, 24),
            GgmlType::Q8_0 => (false, false, false, 128, 2, 34),
            GgmlType::IQ4NL => (true, false, false, 128, 2, 18),
            GgmlType::MXFP4 => (true, false, false, 128, 1, 17),
            _ => return None,
        };
        Some(Self {
            dtype,
            nibbles,
            fifth_bits,
            mins,
            table: match dtype {
                GgmlType::IQ4NL => IQ4_TABLE,
                GgmlType::MXFP4 => MXFP4_TABLE,
                _ => NO_TABLE,
            },
            bias,
            quants_at,
            block_bytes,
        })
    }

    /// Where the fifth bits start in a group's block: after the weights.
    fn fifth_bits_at(&self) -> usize {
        weight_bytes(self.nibbles)
    }

    fn scales_at(&self) -> usize {
        scales_at(self.nibbles, self.fifth_bits)
    }

    fn mins_at(&self) -> usize {
        self.scales_at() + 2 * GROUP
    }

    /// Bytes of one group's block.
    fn group_block_bytes(&self) -> usize {
        group_block_bytes(self.nibbles, self.fifth_bits, self.mins)
    }

    /// Where `qh` (the fifth bits, little-endian) sits in a GGUF block.
    fn qh_at(&self) -> usize {
        self.quants_at - 4
    }
}

/// The kernels' `TABLE` parameter: the nibbles are the weights.
const NO_TABLE: u8 = 0;
/// The nibbles index IQ4_NL's table.
const IQ4_TABLE: u8 = 1;
/// The nibbles index MXFP4's doubled E2M1 values.
const MXFP4_TABLE: u8 = 2;

/// The stored values (value + 128, for `vpdpbusd`) of table `table`.
const fn stored_table(table: u8) -> &'static [u8; 16] {
    match table {
        MXFP4_TABLE => &mxfp4::STORED,
        _ => &iq4::STORED,
    }
}

/// An MXFP4 block's scale as the layout keeps it, an f16 (`None` where that is not exactly the
/// block's weights' scale: the layout then cannot hold the block). Half the E8M0 scale, by
/// which ggml multiplies the doubled values, is a power of two, exact in f16 from 2⁻²⁴ to 2¹⁵;
/// a block of zero codes under exponent 0 keeps 0, which reads back as exponent 0.
fn mxfp4_f16_scale(block: &[u8]) -> Option<half::f16> {
    let e = block[0];
    let zeros = block[1..].iter().all(|&b| b & 0x77 == 0);
    match e {
        104..=143 => Some(half::f16::from_f32(mxfp4::half_scale(e))),
        0 if zeros => Some(half::f16::ZERO),
        _ => None,
    }
}

/// The E8M0 exponent of an MXFP4 scale kept as an f16 (the inverse of [`mxfp4_f16_scale`]).
fn mxfp4_exponent(scale: half::f16) -> u8 {
    match scale.to_f32() {
        0.0 => 0,
        // 2^(e − 128) has the f32 exponent field e − 1.
        s => ((s.to_bits() >> 23) + 1) as u8,
    }
}

/// A matrix of 32-weight block rows, interleaved by [`GROUP`] rows.
#[derive(Debug, Clone)]
pub struct InterleavedRows {
    layout: Layout,
    rows: usize,
    /// Blocks per row.
    blocks: usize,
    data: Vec<u8>,
}

impl InterleavedRows {
    /// `rows` rows of `row_bytes` GGUF bytes each, or `None` for a format without an
    /// interleaved layout (or bytes that are not whole blocks).
    pub fn new(dtype: GgmlType, bytes: &[u8], row_bytes: usize) -> Option<Self> {
        let layout = Layout::of(dtype)?;
        if row_bytes == 0 || !row_bytes.is_multiple_of(layout.block_bytes) || !bytes.len().is_multiple_of(row_bytes) {
            return None;
        }
        let (rows, blocks) = (bytes.len() / row_bytes, row_bytes / layout.block_bytes);
        if dtype == GgmlType::MXFP4
            && !bytes
                .chunks_exact(layout.block_bytes)
                .all(|b| mxfp4_f16_scale(b).is_some())
        {
            return None;
        }
        let per_block = layout.group_block_bytes();
        let mut data = vec![0u8; rows.div_ceil(GROUP) * blocks * per_block];
        for row in 0..rows {
            for b in 0..blocks {
                let at = row * row_bytes + b * layout.block_bytes;
                let block = &bytes[at..at + layout.block_bytes];
                let (group, lane) = (row / GROUP, row % GROUP);
                let place = (group * blocks + b) * per_block;
                interleave_block(&layout, block, lane, &mut data[place..place + per_block]);
            }
        }
        Some(Self {
            layout,
            rows,
            blocks,
            data,
        })
    }

    pub fn dtype(&self) -> GgmlType {
        self.layout.dtype
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Weights per row.
    pub fn cols(&self) -> usize {
        self.blocks * ACT_BLOCK
    }

    /// Bytes of one row in the GGUF layout.
    pub fn row_bytes(&self) -> usize {
        self.blocks * self.layout.block_bytes
    }

    /// Bytes held (padding rows included).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Groups of [`GROUP`] rows (the last may be part padding).
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// Row `row` as its GGUF blocks, exactly the bytes it was made from, into `out`
    /// ([`row_bytes`](Self::row_bytes) long).
    pub fn gguf_row(&self, row: usize, out: &mut [u8]) {
        let bytes = self.layout.block_bytes;
        assert!(row < self.rows && out.len() == self.row_bytes());
        for (b, block) in out.chunks_exact_mut(bytes).enumerate() {
            let place = self.place(row / GROUP, b);
            gguf_block(
                &self.layout,
                &self.data[place..place + self.layout.group_block_bytes()],
                row % GROUP,
                block,
            );
        }
    }

    /// Every row's GGUF bytes, in order (what [`new`](Self::new) was given).
    pub fn gguf_bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.rows * self.row_bytes()];
        for (row, dst) in out.chunks_exact_mut(self.row_bytes()).enumerate() {
            self.gguf_row(row, dst);
        }
        out
    }

    /// Row `row` dequantized into `out` (`cols` long), as the format's own dequantization
    /// gives it.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let mut block = [0u8; 34];
        let block = &mut block[..self.layout.block_bytes];
        for (b, dst) in out.chunks_exact_mut(ACT_BLOCK).enumerate().take(self.blocks) {
            let place = self.place(row / GROUP, b);
            gguf_block(
                &self.layout,
                &self.data[place..place + self.layout.group_block_bytes()],
                row % GROUP,
                block,
            );
            self.layout.dtype.dequantize(block, dst);
        }
    }

    fn place(&self, group: usize, block: usize) -> usize {
        (group * self.blocks + block) * self.layout.group_block_bytes()
    }

    /// The activations of one matmul as these rows' kernels read them; `None` where one does
    /// not cover a row.
    pub fn activations<'a>(&self, acts: &'a [Q8Row]) -> Option<Activations<'a>> {
        let blocks = self.blocks;
        let covers = |a: &Q8Row| {
            a.q.len() >= blocks * ACT_BLOCK
                && a.d.len() >= blocks
                && a.sum16.len() >= 2 * blocks
                && a.qsums().len() >= blocks
        };
        if !acts.iter().all(covers) {
            return None;
        }
        // Copies of the rows' sums, the bias folded in (this runs on the step's thread alone:
        // worked out here block by block, the sums took 3% of a prefill).
        let mut dsum = Vec::with_capacity(acts.len() * blocks);
        let mut bias_sum = Vec::with_capacity(acts.len() * blocks);
        let bias = self.layout.bias;
        for a in acts {
            dsum.extend_from_slice(&a.dsums()[..blocks]);
            bias_sum.extend(a.qsums()[..blocks].iter().map(|&qsum| -bias * qsum));
        }
        Some(Activations {
            acts,
            blocks,
            dsum,
            bias_sum,
            #[cfg(target_arch = "x86_64")]
            tiled: amx_tiles::TiledActivations::new(acts, blocks, self.layout.bias),
        })
    }

    /// `out[t·GROUP + i] = row (GROUP·group + i) · acts[t]` for every token (rows past the
    /// matrix give 0). `acts` came from [`activations`](Self::activations) of these rows;
    /// `kernel` is one this CPU runs ([`Int8Kernel::detected`]).
    pub fn group_products(&self, group: usize, acts: &Activations, out: &mut [f32], kernel: Int8Kernel) {
        assert!(group < self.groups(), "group {group} of {}", self.groups());
        assert_eq!(acts.blocks, self.blocks, "activations of other rows");
        assert_eq!(out.len(), acts.acts.len() * GROUP);
        let data = &self.data[self.place(group, 0)..self.place(group + 1, 0)];
        let l = self.layout;
        match (l.nibbles, l.fifth_bits, l.mins, l.table) {
            (true, false, false, IQ4_TABLE) => run::<true, false, false, IQ4_TABLE>(data, acts, out, kernel),
            (true, false, false, MXFP4_TABLE) => run::<true, false, false, MXFP4_TABLE>(data, acts, out, kernel),
            (true, false, false, _) => run::<true, false, false, NO_TABLE>(data, acts, out, kernel),
            (true, false, true, _) => run::<true, false, true, NO_TABLE>(data, acts, out, kernel),
            (true, true, false, _) => run::<true, true, false, NO_TABLE>(data, acts, out, kernel),
            (true, true, true, _) => run::<true, true, true, NO_TABLE>(data, acts, out, kernel),
            _ => run::<false, false, false, NO_TABLE>(data, acts, out, kernel),
        }
    }

    /// [`group_products`](Self::group_products) for the rows `rows` only: `write(t, i, values)`
    /// gives token `t`'s products with rows `rows.start + i ..` (a group's rows within `rows`).
    pub fn products(
        &self,
        rows: Range<usize>,
        acts: &Activations,
        kernel: Int8Kernel,
        scratch: &mut Vec<f32>,
        write: impl FnMut(usize, usize, &[f32]),
    ) {
        let group_products = |group, out: &mut [f32]| self.group_products(group, acts, out, kernel);
        by_group(rows, acts.tokens(), scratch, group_products, write)
    }
}

/// The rows `rows` of a matrix interleaved by [`GROUP`], a group at a time:
/// `group_products(group, scratch)` fills `scratch` (`[tokens, GROUP]`) with a group's products,
/// and `write(t, i, values)` gets token `t`'s products with rows `rows.start + i ..` (the group's
/// rows within `rows`).
pub(crate) fn by_group(
    rows: Range<usize>,
    tokens: usize,
    scratch: &mut Vec<f32>,
    mut group_products: impl FnMut(usize, &mut [f32]),
    mut write: impl FnMut(usize, usize, &[f32]),
) {
    scratch.resize(tokens * GROUP, 0.0);
    for group in rows.start / GROUP..rows.end.div_ceil(GROUP) {
        group_products(group, scratch);
        let first = (group * GROUP).max(rows.start);
        let end = ((group + 1) * GROUP).min(rows.end);
        for t in 0..tokens {
            let lanes = t * GROUP + first - group * GROUP..t * GROUP + end - group * GROUP;
            write(t, first - rows.start, &scratch[lanes]);
        }
    }
}

/// Put one row's GGUF block into lane `lane` of its group's block `out`.
fn interleave_block(layout: &Layout, block: &[u8], lane: usize, out: &mut [u8]) {
    let quants = &block[layout.quants_at..];
    if layout.nibbles {
        for chunk in 0..4 {
            let at = chunk * 64 + lane * 4;
            out[at..at + 4].copy_from_slice(&quants[4 * chunk..4 * chunk + 4]);
        }
    } else {
        for group in 0..8 {
            for k in 0..4 {
                out[group * 64 + lane * 4 + k] = quants[4 * group + k] ^ 0x80;
            }
        }
    }
    if layout.fifth_bits {
        let qh = u32::from_le_bytes(block[layout.qh_at()..layout.qh_at() + 4].try_into().expect("4 bytes"));
        for k in 0..4 {
            let bits = (0..8).fold(0u8, |byte, g| byte | ((((qh >> (4 * g + k)) & 1) as u8) << g));
            out[layout.fifth_bits_at() + lane * 4 + k] = bits;
        }
    }
    let scale = layout.scales_at() + 2 * lane;
    match layout.dtype {
        GgmlType::MXFP4 => {
            let f16 = mxfp4_f16_scale(block).expect("the rows' scales were checked");
            out[scale..scale + 2].copy_from_slice(&f16.to_le_bytes());
        }
        _ => out[scale..scale + 2].copy_from_slice(&block[0..2]),
    }
    if layout.mins {
        let min = layout.mins_at() + 2 * lane;
        out[min..min + 2].copy_from_slice(&block[2..4]);
    }
}

/// Lane `lane` of a group's block back as its GGUF block (the inverse of [`interleave_block`]).
fn gguf_block(layout: &Layout, group_block: &[u8], lane: usize, block: &mut [u8]) {
    let scale = layout.scales_at() + 2 * lane;
    match layout.dtype {
        GgmlType::MXFP4 => {
            let f16 = half::f16::from_le_bytes([group_block[scale], group_block[scale + 1]]);
            block[0] = mxfp4_exponent(f16);
        }
        _ => block[0..2].copy_from_slice(&group_block[scale..scale + 2]),
    }
    if layout.mins {
        let min = layout.mins_at() + 2 * lane;
        block[2..4].copy_from_slice(&group_block[min..min + 2]);
    }
    if layout.fifth_bits {
        let mut qh = 0u32;
        for k in 0..4 {
            let bits = group_block[layout.fifth_bits_at() + lane * 4 + k];
            for g in 0..8 {
                qh |= (((bits >> g) & 1) as u32) << (4 * g + k);
            }
        }
        block[layout.qh_at()..layout.qh_at() + 4].copy_from_slice(&qh.to_le_bytes());
    }
    let quants = &mut block[layout.quants_at..];
    if layout.nibbles {
        for chunk in 0..4 {
            let at = chunk * 64 + lane * 4;
            quants[4 * chunk..4 * chunk + 4].copy_from_slice(&group_block[at..at + 4]);
        }
    } else {
        for group in 0..8 {
            for k in 0..4 {
                quants[4 * group + k] = group_block[group * 64 + lane * 4 + k] ^ 0x80;
            }
        }
    }
}

/// One matmul's activations, with what the kernels need per token and block besides the
/// quants: `d·Σqx` (what a minimum multiplies) and `−bias·Σqx` (where a block's integer sum
/// starts).
pub struct Activations<'a> {
    acts: &'a [Q8Row],
    blocks: usize,
    dsum: Vec<f32>,
    bias_sum: Vec<i32>,
    /// The quants and scales again, as AMX tiles load them, where [`Int8Kernel::Amx`] can
    /// take whole tiles of these tokens.
    #[cfg(target_arch = "x86_64")]
    tiled: Option<amx_tiles::TiledActivations>,
}

impl Activations<'_> {
    pub fn tokens(&self) -> usize {
        self.acts.len()
    }

    /// Token `t`'s pointers for the kernels.
    fn token(&self, t: usize) -> Token {
        let a = &self.acts[t];
        Token {
            q: a.q.as_ptr(),
            d: a.d.as_ptr(),
            dsum: self.dsum[t * self.blocks..].as_ptr(),
            bias_sum: self.bias_sum[t * self.blocks..].as_ptr(),
        }
    }
}

/// A token's activation as a kernel reads it, unchecked: each pointer covers the blocks of the
/// rows its [`Activations`] were made for.
#[derive(Clone, Copy)]
struct Token {
    q: *const i8,
    d: *const f32,
    dsum: *const f32,
    bias_sum: *const i32,
}

/// Tokens per pass over a group's weights.
const TILE: usize = 4;

fn run<const NIBBLES: bool, const FIFTH: bool, const MINS: bool, const TABLE: u8>(
    data: &[u8],
    acts: &Activations,
    out: &mut [f32],
    kernel: Int8Kernel,
) {
    let blocks = acts.blocks;
    let tokens = acts.tokens();
    // AMX takes the whole 16-token tiles, the other kernels the rest.
    #[cfg(target_arch = "x86_64")]
    let mut t0 = match kernel {
        Int8Kernel::Amx => amx_tiles::products::<NIBBLES, FIFTH, MINS, TABLE>(data, acts, out),
        _ => 0,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let mut t0 = 0;
    while t0 < tokens {
        let n = (tokens - t0).min(TILE);
        let dst = &mut out[t0 * GROUP..(t0 + n) * GROUP];
        match n {
            1 => tile::<NIBBLES, FIFTH, MINS, TABLE, 1>(data, blocks, acts, t0, dst, kernel),
            2 => tile::<NIBBLES, FIFTH, MINS, TABLE, 2>(data, blocks, acts, t0, dst, kernel),
            3 => tile::<NIBBLES, FIFTH, MINS, TABLE, 3>(data, blocks, acts, t0, dst, kernel),
            _ => tile::<NIBBLES, FIFTH, MINS, TABLE, TILE>(data, blocks, acts, t0, dst, kernel),
        }
        t0 += n;
    }
}

fn tile<const NIBBLES: bool, const FIFTH: bool, const MINS: bool, const TABLE: u8, const T: usize>(
    data: &[u8],
    blocks: usize,
    acts: &Activations,
    t0: usize,
    out: &mut [f32],
    kernel: Int8Kernel,
) {
    let tokens: [Token; T] = std::array::from_fn(|t| acts.token(t0 + t));
    let out: &mut [[f32; GROUP]; T] = out.as_chunks_mut().0.try_into().expect("a tile's outputs");
    // SAFETY: `data` is one group's blocks (`group_products` sliced it), every token covers
    // `blocks` blocks (`activations` checked), and `kernel` is one the CPU runs.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        match kernel {
            Int8Kernel::Avx512 | Int8Kernel::Amx => {
                return x86::tile_avx512::<NIBBLES, FIFTH, MINS, TABLE, T>(data.as_ptr(), blocks, tokens, out)
            }
            Int8Kernel::AvxVnni => {
                return x86::tile_avx_vnni::<NIBBLES, FIFTH, MINS, TABLE, T>(data.as_ptr(), blocks, tokens, out)
            }
            Int8Kernel::Avx2 => {
                return x86::tile_avx2::<NIBBLES, FIFTH, MINS, TABLE, T>(data.as_ptr(), blocks, tokens, out)
            }
            Int8Kernel::Portable => {}
        }
    }
    let _ = kernel;
    // SAFETY: as above.
    unsafe { tile_portable::<NIBBLES, FIFTH, MINS, TABLE, T>(data.as_ptr(), blocks, tokens, out) }
}

/// Bytes of a group's weights for one block: 4 chunks of packed nibbles, or Q8_0's 8 of bytes.
const fn weight_bytes(nibbles: bool) -> usize {
    if nibbles {
        4 * 64
    } else {
        8 * 64
    }
}

/// Where a group's block keeps its scales: after the weights and any fifth bits.
const fn scales_at(nibbles: bool, fifth: bool) -> usize {
    weight_bytes(nibbles) + if fifth { 64 } else { 0 }
}

/// Bytes of a group's block for these parameters (see [`Layout`]): the scales, then any
/// minimums.
const fn group_block_bytes(nibbles: bool, fifth: bool, mins: bool) -> usize {
    scales_at(nibbles, fifth) + 2 * GROUP + if mins { 2 * GROUP } else { 0 }
}

/// Weight `j` (0..32) of lane `lane` in a group's block, as stored (`w + bias`; IQ4_NL's
/// table value + 128).
///
/// # Safety
/// `block` holds a group's block of this layout.
#[inline(always)]
unsafe fn stored_weight<const NIBBLES: bool, const FIFTH: bool, const TABLE: u8>(
    block: *const u8,
    lane: usize,
    j: usize,
) -> i32 {
    let (g, k) = (j / 4, j % 4);
    // SAFETY: every offset lies inside the group's block.
    unsafe {
        if !NIBBLES {
            return *block.add(g * 64 + lane * 4 + k) as i32;
        }
        let byte = *block.add((g % 4) * 64 + lane * 4 + k);
        let low = if g < 4 { byte & 0x0F } else { byte >> 4 };
        if TABLE != NO_TABLE {
            return stored_table(TABLE)[low as usize] as i32;
        }
        let fifth = match FIFTH {
            true => ((*block.add(256 + lane * 4 + k) >> g) & 1) << 4,
            false => 0,
        };
        (low | fifth) as i32
    }
}

/// The portable kernel: every lane's operations one by one, as the vector kernels run them.
///
/// # Safety
/// As [`tile`]'s callers promise.
unsafe fn tile_portable<const NIBBLES: bool, const FIFTH: bool, const MINS: bool, const TABLE: u8, const T: usize>(
    data: *const u8,
    blocks: usize,
    tokens: [Token; T],
    out: &mut [[f32; GROUP]; T],
) {
    let bytes = group_block_bytes(NIBBLES, FIFTH, MINS);
    let scales = scales_at(NIBBLES, FIFTH);
    for (token, out) in tokens.iter().zip(out.iter_mut()) {
        for (lane, result) in out.iter_mut().enumerate() {
            let (mut main, mut mins) = (0f32, 0f32);
            for b in 0..blocks {
                // SAFETY: block `b` of the group, and the token's block `b`, are readable.
                unsafe {
                    let block = data.add(b * bytes);
                    let mut isum = *token.bias_sum.add(b);
                    for j in 0..ACT_BLOCK {
                        isum += stored_weight::<NIBBLES, FIFTH, TABLE>(block, lane, j)
                            * *token.q.add(b * ACT_BLOCK + j) as i32;
                    }
                    let scale = f16_at(block.add(scales + 2 * lane)) * *token.d.add(b);
                    main = (isum as f32).mul_add(scale, main);
                    if MINS {
                        let min = f16_at(block.add(scales + 2 * GROUP + 2 * lane));
                        mins = min.mul_add(*token.dsum.add(b), mins);
                    }
                }
            }
            *result = if MINS { main + mins } else { main };
        }
    }
}

/// Bytes `at..at + 2` as an f16, widened.
///
/// # Safety
/// Two bytes are readable at `at`.
#[inline(always)]
pub(super) unsafe fn f16_at(at: *const u8) -> f32 {
    // SAFETY: as the caller promises.
    half::f16::from_bits(unsafe { std::ptr::read_unaligned(at as *const u16) }).to_f32()
}

/// Four activation bytes (`q[at..at + 4]`) as one i32, to broadcast to every row's lane.
///
/// # Safety
/// The four bytes are readable.
#[inline(always)]
pub(super) unsafe fn quad(q: *const i8, at: usize) -> i32 {
    // SAFETY: as the caller promises.
    unsafe { std::ptr::read_unaligned(q.add(at) as *const i32) }
}

/// `out` (one group's products, `[tokens, GROUP]`) against `want(row, token)` bit for bit, and
/// 0 for the group's rows past `rows`; `case` names the case in a failure.
#[cfg(test)]
pub(super) fn assert_group_bits(
    out: &[f32],
    group: usize,
    rows: usize,
    want: impl Fn(usize, usize) -> f32,
    case: &dyn std::fmt::Display,
) {
    for (t, products) in out.chunks_exact(GROUP).enumerate() {
        for (lane, &got) in products.iter().enumerate() {
            let row = group * GROUP + lane;
            let want = if row < rows { want(row, t) } else { 0.0 };
            let tokens = out.len() / GROUP;
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{case}: row {row}, token {t} of {tokens}: {got} vs {want}"
            );
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{group_block_bytes, quad, scales_at, Token, GROUP};
    use super::{stored_table, NO_TABLE};
    use crate::cpu::quant::int8::ACT_BLOCK;
    use crate::cpu::quant::prefetch;
    use std::arch::x86_64::*;

    /// AVX-512: the sixteen rows in one register a token.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn tile_avx512<
        const NIBBLES: bool,
        const FIFTH: bool,
        const MINS: bool,
        const TABLE: u8,
        const T: usize,
    >(
        data: *const u8,
        blocks: usize,
        tokens: [Token; T],
        out: &mut [[f32; GROUP]; T],
    ) {
        let bytes = group_block_bytes(NIBBLES, FIFTH, MINS);
        let scales_at = scales_at(NIBBLES, FIFTH);
        let table = table_vector::<TABLE>();
        let mut main = [_mm512_setzero_ps(); T];
        let mut mins = [_mm512_setzero_ps(); T];
        for b in 0..blocks {
            // SAFETY: block `b` of the group and each token's block `b` are readable (the
            // caller's promise); AVX-512 F/BW/VNNI and F16C are enabled.
            unsafe {
                let block = data.add(b * bytes);
                let q0 = b * ACT_BLOCK;
                let mut isum: [__m512i; T] = std::array::from_fn(|t| _mm512_set1_epi32(*tokens[t].bias_sum.add(b)));
                if NIBBLES {
                    for chunk in 0..4 {
                        prefetch::block_ahead(block, bytes, chunk, 4);
                        let [low, high] = nibble_chunk::<FIFTH, TABLE>(block, chunk, table);
                        for t in 0..T {
                            let qa = _mm512_set1_epi32(quad(tokens[t].q, q0 + 4 * chunk));
                            let qb = _mm512_set1_epi32(quad(tokens[t].q, q0 + 16 + 4 * chunk));
                            isum[t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[t], low, qa), high, qb);
                        }
                    }
                } else {
                    for g in 0..8 {
                        prefetch::block_ahead(block, bytes, g, 8);
                        let w = _mm512_loadu_si512(block.add(64 * g) as *const _);
                        for t in 0..T {
                            let qx = _mm512_set1_epi32(quad(tokens[t].q, q0 + 4 * g));
                            isum[t] = _mm512_dpbusd_epi32(isum[t], w, qx);
                        }
                    }
                }
                let scales = _mm512_cvtph_ps(_mm256_loadu_si256(block.add(scales_at) as *const __m256i));
                for t in 0..T {
                    let scale = _mm512_mul_ps(scales, _mm512_set1_ps(*tokens[t].d.add(b)));
                    main[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), scale, main[t]);
                }
                if MINS {
                    let m = _mm512_cvtph_ps(_mm256_loadu_si256(block.add(scales_at + 2 * GROUP) as *const __m256i));
                    for t in 0..T {
                        mins[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(*tokens[t].dsum.add(b)), mins[t]);
                    }
                }
            }
        }
        for t in 0..T {
            let sum = if MINS { _mm512_add_ps(main[t], mins[t]) } else { main[t] };
            // SAFETY: token t's sixteen outputs lie in `out`.
            unsafe { _mm512_storeu_ps(out[t].as_mut_ptr(), sum) };
        }
    }

    /// Table `TABLE`'s stored values in every 128-bit lane, for [`nibble_chunk`].
    #[inline(always)]
    pub(super) unsafe fn table_vector<const TABLE: u8>() -> __m512i {
        // SAFETY: the table is 16 bytes; AVX-512 F is enabled where this inlines.
        unsafe { _mm512_broadcast_i32x4(_mm_loadu_si128(stored_table(TABLE).as_ptr() as *const __m128i)) }
    }

    /// The stored weights of chunk `chunk` (0..4) of a nibble format's group block, one byte
    /// each, four of every row's in each i32 lane: `[low, high]`, the weights `4·chunk + k` and
    /// `16 + 4·chunk + k` (`k` < 4). Q5's fifth bits are set in, and IQ4_NL's and MXFP4's
    /// nibbles looked up in `table` ([`table_vector`]).
    ///
    /// # Safety
    /// `block` holds a group's block of this layout; AVX-512 F/BW are enabled where this
    /// inlines.
    #[inline(always)]
    pub(super) unsafe fn nibble_chunk<const FIFTH: bool, const TABLE: u8>(
        block: *const u8,
        chunk: usize,
        table: __m512i,
    ) -> [__m512i; 2] {
        let low4 = _mm512_set1_epi8(0x0F);
        // SAFETY: the chunk's bytes and (Q5) the fifth bits lie in the block.
        unsafe {
            let raw = _mm512_loadu_si512(block.add(64 * chunk) as *const _);
            let mut low = _mm512_and_si512(raw, low4);
            let mut high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            if FIFTH {
                let fifth = _mm512_loadu_si512(block.add(256) as *const _);
                low = _mm512_or_si512(low, fifth_bit(fifth, chunk as i32));
                high = _mm512_or_si512(high, fifth_bit(fifth, chunk as i32 + 4));
            }
            if TABLE != NO_TABLE {
                low = _mm512_shuffle_epi8(table, low);
                high = _mm512_shuffle_epi8(table, high);
            }
            [low, high]
        }
    }

    /// Bit `g` of each byte of `fifth` moved to bit 4 (16-bit shifts: no bit crosses into the
    /// neighbouring byte's bit 4): a Q5 weight's fifth bit, here and in Q5_K's kernels.
    ///
    /// # Safety
    /// AVX-512 F/BW are enabled where this inlines.
    #[inline(always)]
    pub(in crate::cpu::quant) unsafe fn fifth_bit(fifth: __m512i, g: i32) -> __m512i {
        let bit4 = _mm512_set1_epi8(0x10);
        // SAFETY: AVX-512 F/BW are enabled where this inlines.
        unsafe {
            match g <= 4 {
                true => _mm512_and_si512(_mm512_sll_epi16(fifth, _mm_cvtsi32_si128(4 - g)), bit4),
                false => _mm512_and_si512(_mm512_srl_epi16(fifth, _mm_cvtsi32_si128(g - 4)), bit4),
            }
        }
    }

    /// How the 256-bit kernels add four neighbouring `u·qx` products into each i32 lane.
    trait Dot {
        /// `acc + Σ u·qx` per lane, for unsigned `u` below 32.
        unsafe fn small(acc: __m256i, u: __m256i, qx: __m256i) -> __m256i;
        /// The same for Q8_0's stored `u = w + 128`, given `acc` without its `−128·Σqx`
        /// where `ADDS_BIAS` is false (the sum then comes from the signed weights directly).
        unsafe fn bytes(acc: __m256i, u: __m256i, qx: __m256i) -> __m256i;
        /// Whether `bytes` wants the block's sum started at `−128·Σqx`.
        const ADDS_BIAS: bool;
    }

    /// AVX2: `pmaddubsw` then `pmaddwd` by ones (exact: the pairs' sums fit in i16).
    struct Avx2;

    impl Dot for Avx2 {
        #[inline(always)]
        unsafe fn small(acc: __m256i, u: __m256i, qx: __m256i) -> __m256i {
            _mm256_add_epi32(
                acc,
                _mm256_madd_epi16(_mm256_maddubs_epi16(u, qx), _mm256_set1_epi16(1)),
            )
        }
        /// `u` up to 255 could saturate `pmaddubsw`'s i16 pairs, so the signed weight's
        /// magnitude meets the activation carrying its sign: |w|·|qx| ≤ 128·127, and a pair
        /// of them fits.
        #[inline(always)]
        unsafe fn bytes(acc: __m256i, u: __m256i, qx: __m256i) -> __m256i {
            let w = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
            let products = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(qx, w));
            _mm256_add_epi32(acc, _mm256_madd_epi16(products, _mm256_set1_epi16(1)))
        }
        const ADDS_BIAS: bool = false;
    }

    /// AVX-VNNI: one 256-bit `vpdpbusd` (no intermediate i16, so no saturation).
    struct AvxVnni;

    impl Dot for AvxVnni {
        #[inline(always)]
        unsafe fn small(acc: __m256i, u: __m256i, qx: __m256i) -> __m256i {
            _mm256_dpbusd_avx_epi32(acc, u, qx)
        }
        #[inline(always)]
        unsafe fn bytes(acc: __m256i, u: __m256i, qx: __m256i) -> __m256i {
            _mm256_dpbusd_avx_epi32(acc, u, qx)
        }
        const ADDS_BIAS: bool = true;
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile_avx2<
        const NIBBLES: bool,
        const FIFTH: bool,
        const MINS: bool,
        const TABLE: u8,
        const T: usize,
    >(
        data: *const u8,
        blocks: usize,
        tokens: [Token; T],
        out: &mut [[f32; GROUP]; T],
    ) {
        for half in 0..2 {
            // SAFETY: as the caller promises.
            unsafe { half_tile::<Avx2, NIBBLES, FIFTH, MINS, TABLE, T>(data, blocks, &tokens, out, half) }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    pub unsafe fn tile_avx_vnni<
        const NIBBLES: bool,
        const FIFTH: bool,
        const MINS: bool,
        const TABLE: u8,
        const T: usize,
    >(
        data: *const u8,
        blocks: usize,
        tokens: [Token; T],
        out: &mut [[f32; GROUP]; T],
    ) {
        for half in 0..2 {
            // SAFETY: as the caller promises.
            unsafe { half_tile::<AvxVnni, NIBBLES, FIFTH, MINS, TABLE, T>(data, blocks, &tokens, out, half) }
        }
    }

    /// Eight of the group's rows (`half` 0: lanes 0..8, 1: lanes 8..16), a 256-bit register a
    /// token; inlined into the kernels above, whose features it takes.
    #[inline(always)]
    unsafe fn half_tile<
        D: Dot,
        const NIBBLES: bool,
        const FIFTH: bool,
        const MINS: bool,
        const TABLE: u8,
        const T: usize,
    >(
        data: *const u8,
        blocks: usize,
        tokens: &[Token; T],
        out: &mut [[f32; GROUP]; T],
        half: usize,
    ) {
        let bytes = group_block_bytes(NIBBLES, FIFTH, MINS);
        let scales_at = scales_at(NIBBLES, FIFTH);
        let lanes = 32 * half;
        let low4 = _mm256_set1_epi8(0x0F);
        let bit4 = _mm256_set1_epi8(0x10);
        // SAFETY: the table is 16 bytes.
        let table =
            _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(stored_table(TABLE).as_ptr() as *const __m128i) });
        let mut main = [_mm256_setzero_ps(); T];
        let mut mins = [_mm256_setzero_ps(); T];
        for b in 0..blocks {
            // SAFETY: as in `tile_avx512`, for this half's bytes of each 64-byte row set.
            unsafe {
                let block = data.add(b * bytes);
                let q0 = b * ACT_BLOCK;
                // Looked-up table values are whole bytes, summed as Q8_0's are.
                let starts = (NIBBLES && TABLE == NO_TABLE) || D::ADDS_BIAS;
                let mut isum: [__m256i; T] = std::array::from_fn(|t| match starts {
                    true => _mm256_set1_epi32(*tokens[t].bias_sum.add(b)),
                    false => _mm256_setzero_si256(),
                });
                if NIBBLES {
                    let fifth = match FIFTH {
                        true => _mm256_loadu_si256(block.add(256 + lanes) as *const __m256i),
                        false => _mm256_setzero_si256(),
                    };
                    let fifth_of = |g: i32| match g <= 4 {
                        true => _mm256_and_si256(_mm256_sll_epi16(fifth, _mm_cvtsi32_si128(4 - g)), bit4),
                        false => _mm256_and_si256(_mm256_srl_epi16(fifth, _mm_cvtsi32_si128(g - 4)), bit4),
                    };
                    for chunk in 0..4 {
                        // The second half reads what the first brought in.
                        if half == 0 {
                            prefetch::block_ahead(block, bytes, chunk, 4);
                        }
                        let raw = _mm256_loadu_si256(block.add(64 * chunk + lanes) as *const __m256i);
                        let mut low = _mm256_and_si256(raw, low4);
                        let mut high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                        if FIFTH {
                            low = _mm256_or_si256(low, fifth_of(chunk as i32));
                            high = _mm256_or_si256(high, fifth_of(chunk as i32 + 4));
                        }
                        if TABLE != NO_TABLE {
                            low = _mm256_shuffle_epi8(table, low);
                            high = _mm256_shuffle_epi8(table, high);
                        }
                        for t in 0..T {
                            let qa = _mm256_set1_epi32(quad(tokens[t].q, q0 + 4 * chunk));
                            let qb = _mm256_set1_epi32(quad(tokens[t].q, q0 + 16 + 4 * chunk));
                            isum[t] = match TABLE != NO_TABLE {
                                true => D::bytes(D::bytes(isum[t], low, qa), high, qb),
                                false => D::small(D::small(isum[t], low, qa), high, qb),
                            };
                        }
                    }
                } else {
                    for g in 0..8 {
                        if half == 0 {
                            prefetch::block_ahead(block, bytes, g, 8);
                        }
                        let w = _mm256_loadu_si256(block.add(64 * g + lanes) as *const __m256i);
                        for t in 0..T {
                            let qx = _mm256_set1_epi32(quad(tokens[t].q, q0 + 4 * g));
                            isum[t] = D::bytes(isum[t], w, qx);
                        }
                    }
                }
                let scales = _mm256_cvtph_ps(_mm_loadu_si128(block.add(scales_at + lanes / 2) as *const __m128i));
                for t in 0..T {
                    let scale = _mm256_mul_ps(scales, _mm256_set1_ps(*tokens[t].d.add(b)));
                    main[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), scale, main[t]);
                }
                if MINS {
                    let at = block.add(scales_at + 2 * GROUP + lanes / 2);
                    let m = _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i));
                    for t in 0..T {
                        mins[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(*tokens[t].dsum.add(b)), mins[t]);
                    }
                }
            }
        }
        for t in 0..T {
            let sum = if MINS { _mm256_add_ps(main[t], mins[t]) } else { main[t] };
            // SAFETY: token t's eight outputs of this half lie in `out`.
            unsafe { _mm256_storeu_ps(out[t].as_mut_ptr().add(8 * half), sum) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::quant::int8::UnpackedRow;

    const FORMATS: [GgmlType; 7] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::IQ4NL,
        GgmlType::MXFP4,
    ];

    /// `rows` rows of `blocks` valid blocks: random quants (every byte value, so Q8_0 meets
    /// −128 and 127), finite scales and minimums that differ from block to block and row to
    /// row (a lane mix-up changes the result); MXFP4's exponents across those the layout
    /// holds (104 to 143), and every 13th block zeros (codes ±0) under exponent 0.
    fn matrix(dtype: GgmlType, rows: usize, blocks: usize, seed: usize) -> Vec<u8> {
        let (_, bytes) = dtype.block_layout();
        let mut data: Vec<u8> = (0..rows * blocks * bytes)
            .map(|i| (((i + seed) * 2654435761usize) >> 11) as u8)
            .collect();
        let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
        for (i, b) in data.chunks_exact_mut(bytes).enumerate() {
            if dtype == GgmlType::MXFP4 {
                b[0] = 104 + ((i * 7 + seed) % 40) as u8;
                if i % 13 == 0 {
                    b[0] = 0;
                    b[1..].iter_mut().for_each(|q| *q &= 0x88);
                }
                continue;
            }
            b[0..2].copy_from_slice(&f16(0.004 * (1 + (i * 7 + seed) % 11) as f32));
            if matches!(dtype, GgmlType::Q4_1 | GgmlType::Q5_1) {
                b[2..4].copy_from_slice(&f16(-0.03 * (1 + (i * 5) % 7) as f32));
            }
        }
        data
    }

    fn activations(tokens: usize, cols: usize) -> Vec<Q8Row> {
        (0..tokens)
            .map(|t| {
                let x: Vec<f32> = (0..cols)
                    .map(|i| (((i * 31 + t * 977) % 41) as f32 - 20.0) / (3.0 + t as f32))
                    .collect();
                Q8Row::quantize(&x)
            })
            .collect()
    }

    /// The module's arithmetic written from the GGUF row's integers (`UnpackedRow`), not from
    /// the interleaved layout.
    fn reference(dtype: GgmlType, row: &[u8], act: &Q8Row) -> f32 {
        let mut unpacked = UnpackedRow::default();
        unpacked.unpack(dtype, row).unwrap();
        let has_min = matches!(dtype, GgmlType::Q4_1 | GgmlType::Q5_1);
        let (mut main, mut mins) = (0f32, 0f32);
        for b in 0..unpacked.scale.len() {
            let span = b * ACT_BLOCK..(b + 1) * ACT_BLOCK;
            let isum: i32 = unpacked.w[span.clone()]
                .iter()
                .zip(&act.q[span])
                .map(|(&w, &q)| w as i32 * q as i32)
                .sum();
            main = (isum as f32).mul_add(unpacked.scale[b] * act.d[b], main);
            let qsum: i32 = act.q[b * ACT_BLOCK..(b + 1) * ACT_BLOCK]
                .iter()
                .map(|&q| q as i32)
                .sum();
            mins = (-unpacked.min[b]).mul_add(act.d[b] * qsum as f32, mins);
        }
        if has_min {
            main + mins
        } else {
            main
        }
    }

    /// The layout keeps everything: the GGUF bytes come back as given, and rows dequantize as
    /// the format does.
    #[test]
    fn interleaving_loses_nothing() {
        for dtype in FORMATS {
            let (rows, blocks) = (37, 3);
            let bytes = matrix(dtype, rows, blocks, 1);
            let row_bytes = bytes.len() / rows;
            let m = InterleavedRows::new(dtype, &bytes, row_bytes).unwrap();
            assert_eq!((m.rows(), m.cols(), m.groups()), (rows, blocks * 32, 3));
            assert_eq!(m.gguf_bytes(), bytes, "{dtype:?}");
            let (mut got, mut want) = (vec![0f32; m.cols()], vec![0f32; m.cols()]);
            for r in [0, 15, 16, 36] {
                m.dequantize_row(r, &mut got);
                dtype.dequantize(&bytes[r * row_bytes..(r + 1) * row_bytes], &mut want);
                assert_eq!(got, want, "{dtype:?} row {r}");
            }
        }
        assert!(InterleavedRows::new(GgmlType::Q4K, &[0; 144], 144).is_none());
        // MXFP4 scales beyond f16's exact powers of two, or nonzero codes under exponent 0.
        for (e, code) in [(103, 0x21), (144, 0x21), (0, 0x01), (0, 0x10), (255, 0)] {
            let mut block = [code; 17];
            block[0] = e;
            assert!(
                InterleavedRows::new(GgmlType::MXFP4, &block, 17).is_none(),
                "exponent {e}, codes {code:#x}"
            );
        }
        assert!(
            InterleavedRows::new(GgmlType::Q4_0, &[0; 20], 19).is_none(),
            "not whole blocks"
        );
    }

    /// Every kernel this CPU runs gives the reference's bits for every (row, token), however
    /// many tokens share a pass (1 to 9: whole tiles and ragged ones; 32 and 83: AMX's whole
    /// tiles, and its tiles with the rest), and 0 for padding rows.
    #[test]
    fn every_kernel_gives_the_reference_bits() {
        for dtype in FORMATS {
            let (rows, blocks) = (21, 5);
            let bytes = matrix(dtype, rows, blocks, 3);
            let row_bytes = bytes.len() / rows;
            let m = InterleavedRows::new(dtype, &bytes, row_bytes).unwrap();
            for tokens in [1, 2, 3, 4, 5, 9, 32, 83] {
                let acts = activations(tokens, m.cols());
                let prepared = m.activations(&acts).unwrap();
                for kernel in Int8Kernel::available() {
                    let mut out = vec![f32::NAN; tokens * GROUP];
                    for group in 0..m.groups() {
                        m.group_products(group, &prepared, &mut out, kernel);
                        let want =
                            |row: usize, t| reference(dtype, &bytes[row * row_bytes..(row + 1) * row_bytes], &acts[t]);
                        assert_group_bits(&out, group, rows, want, &format!("{dtype:?} {kernel:?}"));
                    }
                }
            }
        }
    }

    /// `products` over a row range that starts and ends inside groups writes exactly those
    /// rows, each at its place.
    #[test]
    fn products_write_the_rows_asked_for() {
        let dtype = GgmlType::Q4_1;
        let (rows, blocks) = (40, 2);
        let bytes = matrix(dtype, rows, blocks, 5);
        let row_bytes = bytes.len() / rows;
        let m = InterleavedRows::new(dtype, &bytes, row_bytes).unwrap();
        let acts = activations(3, m.cols());
        let prepared = m.activations(&acts).unwrap();
        let range = 5..35;
        let mut out = vec![f32::NAN; 3 * range.len()];
        let kernel = Int8Kernel::detected();
        m.products(range.clone(), &prepared, kernel, &mut Vec::new(), |t, r, values| {
            let at = t * range.len() + r;
            out[at..at + values.len()].copy_from_slice(values)
        });
        for (t, act) in acts.iter().enumerate() {
            for (i, row) in range.clone().enumerate() {
                let want = reference(dtype, &bytes[row * row_bytes..(row + 1) * row_bytes], act);
                assert_eq!(
                    out[t * range.len() + i].to_bits(),
                    want.to_bits(),
                    "row {row} token {t}"
                );
            }
        }
        let short = activations(1, 32);
        assert!(m.activations(&short).is_none(), "activations shorter than the rows");
    }
}
