//! The INT8-bound head's scoring pass (`int8_head`): every vocabulary row's approximate score
//! `A_v` and error bound `B_v`, sixteen rows at a time.
//!
//! The head's rows are regrouped once, sixteen to a group as the int8 matmuls' rows are
//! (`crate::cpu::quant::interleaved`): per group and 32-column block, four neighbouring quants of
//! each of the sixteen rows side by side (stored as `q + 128`, so `vpdpbusd` multiplies them
//! unsigned by the query's signed quants), then the sixteen rows' block scale and norms. A
//! block's integer sums then come out as one vector, a row a lane, and the f64 arithmetic of
//! the bound runs a row a lane too, with no horizontal sums. Each lane does, in the same
//! order, the operations the one-row formula (`int8_head`'s doc) does, and integer sums are
//! exact, so every kernel gives the same bits.

use super::pool;
use crate::cpu::quant::int8::Int8Kernel;
use quant::int8_rows::{norm, quantize_block, round_up, Int8Rows, INT8_BLOCK, U};

/// Rows scored together: one 512-bit register of i32 sums.
pub const GROUP: usize = 16;

/// Groups of rows a parallel task scores: enough that claiming a task costs little beside it.
const GROUPS_A_TASK: usize = 64;

/// Query bytes in one `vpdpbusd` lane: four neighbouring columns.
const QUAD: usize = 4;

/// Quads in a block.
const QUADS: usize = INT8_BLOCK / QUAD;

/// An [`Int8Rows`] regrouped for scoring (see the module's doc).
pub struct ScoringRows {
    rows: usize,
    cols: usize,
    blocks: usize,
    /// `[group][block][quad][row of the group][4]`, `q + 128`; 128 (a zero quant) past the
    /// last row or column.
    quants: Vec<u8>,
    /// `[group][block][row of the group]`; zeros past the last row.
    scale: Vec<f32>,
    err_norm: Vec<f32>,
    quant_norm: Vec<f32>,
    /// `[row]`, padded with zeros to whole groups.
    norm: Vec<f32>,
}

impl ScoringRows {
    pub fn new(w: &Int8Rows) -> Self {
        let (rows, cols, blocks) = (w.rows, w.cols, w.blocks_per_row());
        let groups = rows.div_ceil(GROUP);
        let mut quants = vec![128u8; groups * blocks * INT8_BLOCK * GROUP];
        let per_block = vec![0f32; groups * blocks * GROUP];
        let (mut scale, mut err_norm, mut quant_norm) = (per_block.clone(), per_block.clone(), per_block);
        let mut norm = vec![0f32; groups * GROUP];
        norm[..rows].copy_from_slice(&w.norm);
        for v in 0..rows {
            let (group, lane) = (v / GROUP, v % GROUP);
            for b in 0..blocks {
                let at = (group * blocks + b) * GROUP + lane;
                let i = v * blocks + b;
                (scale[at], err_norm[at], quant_norm[at]) = (w.scale[i], w.err_norm[i], w.quant_norm[i]);
                for c in b * INT8_BLOCK..((b + 1) * INT8_BLOCK).min(cols) {
                    let quad = (c % INT8_BLOCK) / QUAD;
                    let place = (((group * blocks + b) * QUADS + quad) * GROUP + lane) * QUAD + c % QUAD;
                    quants[place] = (w.q[v * cols + c] as i16 + 128) as u8;
                }
            }
        }
        Self {
            rows,
            cols,
            blocks,
            quants,
            scale,
            err_norm,
            quant_norm,
            norm,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// `(A_v, B_v)` for every row `v`, for the quantized query `query`.
    pub fn scores(&self, query: &Query, kernel: Int8Kernel) -> Vec<(f32, f32)> {
        assert_eq!(
            query.quants.len(),
            self.blocks * INT8_BLOCK,
            "a query of this head's width"
        );
        let mut out = vec![(0f32, 0f32); self.groups() * GROUP];
        pool::global().for_chunks_mut(
            &mut out,
            GROUPS_A_TASK * GROUP,
            || (),
            |_, run, out| {
                for (i, out) in out.chunks_exact_mut(GROUP).enumerate() {
                    let out: &mut [(f32, f32); GROUP] = out.try_into().expect("a group's rows");
                    self.score_group(run * GROUPS_A_TASK + i, query, kernel, out)
                }
            },
        );
        out.truncate(self.rows);
        out
    }

    fn score_group(&self, group: usize, query: &Query, kernel: Int8Kernel, out: &mut [(f32, f32); GROUP]) {
        let sums = match kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `kernel` is one this CPU runs (`Int8Kernel::detected`/`available`).
            Int8Kernel::Avx512 | Int8Kernel::Amx => unsafe { x86::sums_avx512(self, group, query) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Int8Kernel::Avx2 | Int8Kernel::AvxVnni => unsafe { x86::sums_avx2(self, group, query) },
            _ => sums_portable(self, group, query),
        };
        for (lane, out) in out.iter_mut().enumerate() {
            let (a, magnitude, quant_err) = (sums.a[lane], sums.magnitude[lane], sums.quant_err[lane]);
            let a = a as f32;
            let norm = self.norm[group * GROUP + lane] as f64;
            let b = quant_err + query.gamma_d * query.norm * norm + query.gamma_sum * magnitude + U * (a as f64).abs();
            *out = (a, round_up(b * (1.0 + 8.0 * U)));
        }
    }

    /// Block `b` of group `group`: the quants, then the rows' scale, error and quant norms.
    fn block(&self, group: usize, b: usize) -> (&[u8], [&[f32; GROUP]; 3]) {
        let at = group * self.blocks + b;
        let quants = &self.quants[at * INT8_BLOCK * GROUP..(at + 1) * INT8_BLOCK * GROUP];
        let lanes = [&self.scale, &self.err_norm, &self.quant_norm]
            .map(|v| <&[f32; GROUP]>::try_from(&v[at * GROUP..(at + 1) * GROUP]).expect("a group's lanes"));
        (quants, lanes)
    }
}

/// A query `h` as the scoring pass takes it: its quants (a block per [`INT8_BLOCK`] columns,
/// zero past the last column) and per block the scale, error and norm, and the constants of
/// the bound.
pub struct Query {
    quants: Vec<i8>,
    /// `128 · Σ q` per block: what the stored `q + 128` add to a block's integer sum.
    bias: Vec<i32>,
    /// Per block: (scale, ‖h_b − ĥ_b‖, ‖h_b‖).
    blocks: Vec<(f64, f64, f64)>,
    /// ‖h‖, and the rounding factors γ_d and γ_(B+3).
    norm: f64,
    gamma_d: f64,
    gamma_sum: f64,
}

impl Query {
    /// `h` quantized as the head's rows are, a block at a time, with what the bound needs of it.
    pub fn new(h: &[f32]) -> Self {
        let blocks = h.len().div_ceil(INT8_BLOCK);
        let mut quants = vec![0i8; blocks * INT8_BLOCK];
        let mut per_block = Vec::with_capacity(blocks);
        for (x, q) in h.chunks(INT8_BLOCK).zip(quants.chunks_exact_mut(INT8_BLOCK)) {
            let (s, e, _) = quantize_block(x, &mut q[..x.len()]);
            per_block.push((s as f64, e as f64, norm(x)));
        }
        let bias = quants
            .chunks_exact(INT8_BLOCK)
            .map(|q| 128 * q.iter().map(|&q| q as i32).sum::<i32>())
            .collect();
        let gamma = |n: usize| n as f64 * U / (1.0 - n as f64 * U);
        Self {
            quants,
            bias,
            blocks: per_block,
            norm: norm(h),
            gamma_d: gamma(h.len()),
            gamma_sum: gamma(blocks + 3),
        }
    }
}

/// A group's running sums, a row a lane: `A_v`, `Σ|terms|` and the quantization error bound.
struct GroupSums {
    a: [f64; GROUP],
    magnitude: [f64; GROUP],
    quant_err: [f64; GROUP],
}

impl GroupSums {
    fn new() -> Self {
        Self {
            a: [0.0; GROUP],
            magnitude: [0.0; GROUP],
            quant_err: [0.0; GROUP],
        }
    }

    /// Block `b`'s contribution, from its integer sums `isum` (one a row): the one-row
    /// formula's operations in its order, lane by lane.
    #[inline(always)]
    fn add_block(&mut self, rows: [&[f32; GROUP]; 3], isum: &[i32; GROUP], (sh, eh, hn): (f64, f64, f64)) {
        let [scale, err_norm, quant_norm] = rows;
        for lane in 0..GROUP {
            let term = scale[lane] as f64 * sh * isum[lane] as f64;
            self.a[lane] += term;
            self.magnitude[lane] += term.abs();
            self.quant_err[lane] += hn * err_norm[lane] as f64 + eh * quant_norm[lane] as f64;
        }
    }
}

/// Plain Rust, for CPUs without AVX2 (and other architectures).
fn sums_portable(rows: &ScoringRows, group: usize, query: &Query) -> GroupSums {
    let mut sums = GroupSums::new();
    for b in 0..rows.blocks {
        let (quants, lanes) = rows.block(group, b);
        let q = &query.quants[b * INT8_BLOCK..(b + 1) * INT8_BLOCK];
        let mut isum = [-query.bias[b]; GROUP];
        for (quad, bytes) in quants.chunks_exact(GROUP * QUAD).enumerate() {
            for (lane, u) in bytes.chunks_exact(QUAD).enumerate() {
                for (k, &u) in u.iter().enumerate() {
                    isum[lane] += u as i32 * q[quad * QUAD + k] as i32;
                }
            }
        }
        sums.add_block(lanes, &isum, query.blocks[b]);
    }
    sums
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{GroupSums, Query, ScoringRows, GROUP, INT8_BLOCK, QUAD};
    use crate::cpu::quant::prefetch;
    use std::arch::x86_64::*;

    /// A query quad (four neighbouring columns) in every i32 lane.
    #[inline(always)]
    fn quad(q: &[i8], at: usize) -> i32 {
        i32::from_le_bytes([q[at] as u8, q[at + 1] as u8, q[at + 2] as u8, q[at + 3] as u8])
    }

    /// Asks for the lanes of the block some [`prefetch::AHEAD_BYTES`] of quants after this one
    /// (blocks lie one after another, a group's then the next group's; `crate::cpu::quant::prefetch`
    /// says why); how many bytes after `quants` that block's quants lie, for the caller to ask
    /// for a chunk of them with each chunk it reads.
    #[inline(always)]
    fn prefetch_lanes_ahead(quants: &[u8], lanes: [&[f32; GROUP]; 3]) -> usize {
        let ahead = prefetch::ahead(quants.len());
        for lane in lanes {
            prefetch::line(lane.as_ptr().wrapping_add(ahead / quants.len() * GROUP).cast());
        }
        ahead
    }

    /// Sixteen rows' block sums by `vpdpbusd`, each quad's sixteen lanes one register.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn sums_avx512(rows: &ScoringRows, group: usize, query: &Query) -> GroupSums {
        let mut sums = GroupSums::new();
        for b in 0..rows.blocks {
            let (quants, lanes) = rows.block(group, b);
            let ahead = prefetch_lanes_ahead(quants, lanes);
            let q = &query.quants[b * INT8_BLOCK..(b + 1) * INT8_BLOCK];
            let mut acc = _mm512_set1_epi32(-query.bias[b]);
            for (i, u) in quants.chunks_exact(GROUP * QUAD).enumerate() {
                prefetch::line(u.as_ptr().wrapping_add(ahead));
                // SAFETY: the chunk holds 64 bytes.
                let u = unsafe { _mm512_loadu_si512(u.as_ptr().cast()) };
                acc = _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(quad(q, i * QUAD)));
            }
            let mut isum = [0i32; GROUP];
            // SAFETY: `isum` holds sixteen i32.
            unsafe { _mm512_storeu_si512(isum.as_mut_ptr().cast(), acc) };
            sums.add_block(lanes, &isum, query.blocks[b]);
        }
        sums
    }

    /// The same with 256-bit registers, eight rows a register: the stored `q + 128` turned back
    /// into `q`, whose magnitude meets the query's quant carrying `q`'s sign (`pmaddubsw`'s
    /// pairs then stay below 2·127·127, inside i16), so no bias is added or taken away.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn sums_avx2(rows: &ScoringRows, group: usize, query: &Query) -> GroupSums {
        let mut sums = GroupSums::new();
        let ones = _mm256_set1_epi16(1);
        for b in 0..rows.blocks {
            let (quants, lanes) = rows.block(group, b);
            let ahead = prefetch_lanes_ahead(quants, lanes);
            let q = &query.quants[b * INT8_BLOCK..(b + 1) * INT8_BLOCK];
            let mut acc = [_mm256_setzero_si256(); 2];
            for (i, u) in quants.chunks_exact(GROUP * QUAD).enumerate() {
                prefetch::line(u.as_ptr().wrapping_add(ahead));
                let x = _mm256_set1_epi32(quad(q, i * QUAD));
                for (half, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: the chunk holds 64 bytes, two registers.
                    let u = unsafe { _mm256_loadu_si256(u.as_ptr().add(32 * half).cast()) };
                    let w = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
                    let products = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
                    *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(products, ones));
                }
            }
            let mut isum = [0i32; GROUP];
            // SAFETY: `isum` holds sixteen i32, two registers.
            unsafe {
                _mm256_storeu_si256(isum.as_mut_ptr().cast(), acc[0]);
                _mm256_storeu_si256(isum.as_mut_ptr().add(8).cast(), acc[1]);
            }
            sums.add_block(lanes, &isum, query.blocks[b]);
        }
        sums
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-row formula over the row-major rows: each block's integer sum, then the f64
    /// sums in block order.
    fn one_row_scores(w: &Int8Rows, query: &Query) -> Vec<(f32, f32)> {
        let (d, blocks) = (w.cols, w.blocks_per_row());
        (0..w.rows)
            .map(|v| {
                let (mut a, mut magnitude, mut quant_err) = (0f64, 0f64, 0f64);
                for (b, &(sh, eh, hn)) in query.blocks.iter().enumerate() {
                    let cols = b * INT8_BLOCK..((b + 1) * INT8_BLOCK).min(d);
                    let isum: i32 = cols.map(|c| w.q[v * d + c] as i32 * query.quants[c] as i32).sum();
                    let i = v * blocks + b;
                    let term = w.scale[i] as f64 * sh * isum as f64;
                    a += term;
                    magnitude += term.abs();
                    quant_err += hn * w.err_norm[i] as f64 + eh * w.quant_norm[i] as f64;
                }
                let a = a as f32;
                let b = quant_err
                    + query.gamma_d * query.norm * w.norm[v] as f64
                    + query.gamma_sum * magnitude
                    + U * (a as f64).abs();
                (a, round_up(b * (1.0 + 8.0 * U)))
            })
            .collect()
    }

    /// Every kernel gives the one-row formula's bits, for ragged groups and blocks, with
    /// quants at ±127 (the largest products the 256-bit kernel's i16 pairs hold).
    #[test]
    fn every_kernel_scores_as_the_one_row_formula() {
        for (rows, cols) in [(37, 70), (16, 64), (5, 32)] {
            let data: Vec<f32> = (0..rows * cols)
                .map(|i| match i % 11 {
                    0 => 3.0,
                    1 => -3.0,
                    _ => (((i * 2654435761) >> 9) % 1000) as f32 / 500.0 - 1.0,
                })
                .collect();
            let w = Int8Rows::quantize(rows, cols, |r, buf| {
                buf.copy_from_slice(&data[r * cols..(r + 1) * cols])
            });
            assert!(w.q.contains(&127) && w.q.contains(&-127));
            let scoring = ScoringRows::new(&w);
            for query_row in [0, rows / 2, rows - 1] {
                let mut h = data[query_row * cols..(query_row + 1) * cols].to_vec();
                h[0] = -4.0;
                let query = Query::new(&h);
                let want = one_row_scores(&w, &query);
                for kernel in Int8Kernel::available() {
                    let got = scoring.scores(&query, kernel);
                    let bits = |s: &[(f32, f32)]| -> Vec<(u32, u32)> {
                        s.iter().map(|(a, b)| (a.to_bits(), b.to_bits())).collect()
                    };
                    assert_eq!(bits(&got), bits(&want), "{kernel:?}, {rows}×{cols}, query {query_row}");
                }
            }
        }
    }
}
