//! Integer dots of K-quant rows (Q4_K, Q5_K, Q6_K) with activations quantized per 256-element
//! super-block, as ggml's `vec_dot_q*_K_q8_K` do: a super-block's sub-block scales are small
//! integers, so with one activation scale per super-block its whole dot is one integer sum,
//! `Σ sc·Σ w·qx`, scaled once by `d·dx`, and its minimums one more, `dmin·dx·Σ m·Σ qx`.
//! (The per-32 activations of [`super::int8`] cost a float scale, an FMA and a minimum term
//! per 32 weights instead.)
//!
//! Results are defined by [`dot_portable`]: eight integer lanes per super-block (lane `l` sums
//! products `4l..4l+4` of each 32 weights, times their 16-weight group's scale), each widened
//! and FMA'd with `d·dx` into eight float lanes; eight more for the minimums (lane `l` the
//! groups `2l` and `2l+1`, FMA'd with `dmin·dx`); both summed in a fixed order at the end. The AVX2
//! and AVX-512 kernels compute exactly these integers and float operations, so a row's result
//! is the same bits on every CPU and whatever the number of activations sharing the pass.

use super::q4_k::scale_min_k4;
use super::{f16_at, BlockFormat, GgmlType, Q4K, Q5K, Q6K};

/// Elements per super-block (and per activation scale).
pub const SUPER: usize = 256;

/// An activation row quantized to int8 with one scale per 256 elements, and the sums of its
/// integers per 16 (what the minimums multiply).
#[derive(Debug, Clone, Default)]
pub struct Q8KRow {
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub sums16: Vec<i16>,
}

impl Q8KRow {
    /// Quantize `x` (`len` a multiple of 256): `d = max|x|/127`, `q = round(x/d)` (halves away
    /// from zero), as [`super::int8::Q8Row`] does per 32.
    pub fn quantize(x: &[f32]) -> Self {
        debug_assert_eq!(x.len() % SUPER, 0);
        let mut row = Self {
            q: vec![0; x.len()],
            ..Self::default()
        };
        for (xb, qb) in x.chunks_exact(SUPER).zip(row.q.chunks_exact_mut(SUPER)) {
            row.d.push(super::int8::quantize_span(xb, qb));
            row.sums16
                .extend(qb.chunks_exact(16).map(|g| g.iter().map(|&q| q as i16).sum::<i16>()));
        }
        row
    }

    fn supers(&self) -> usize {
        self.d.len()
    }
}

/// A K-quant super-block laid out for the kernels: weights as unsigned bytes, each 32-weight
/// chunk's pair of 16-weight group scales spread over 16 `i16` lanes (what `pmaddwd` takes),
/// per-16 minimum coefficients, and the two float factors.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub struct DecodedSuper {
    w: [u8; SUPER],
    /// `scales[j]`: lanes 0..8 the scale of chunk j's first 16 weights, lanes 8..16 its second.
    scales: [[i16; 16]; 8],
    /// The integer each 16-weight group's `Σ qx` is multiplied by in the minimum term.
    mins: [i16; 16],
    d: f32,
    dmin: f32,
}

impl Default for DecodedSuper {
    fn default() -> Self {
        Self {
            w: [0; SUPER],
            scales: [[0; 16]; 8],
            mins: [0; 16],
            d: 0.0,
            dmin: 0.0,
        }
    }
}

/// What a K-quant format adds to [`BlockFormat`] for the integer dot: its weights unsigned
/// and its scales as integers. The bit layouts are `unpack_groups`' (see each format's file);
/// here they are plain byte loops over fixed-size arrays, which the compiler vectorises.
trait SuperFormat: BlockFormat {
    /// The 256 weights as unsigned integers (Q6_K's without its −32).
    fn weights(block: &[u8], w: &mut [u8; SUPER]);
    /// `(d, dmin)`, and per 16-weight group the integer scale and minimum coefficient, so
    /// that an element is `d·scale·w − dmin·min` with `w` unsigned.
    fn integer_scales(block: &[u8], scales: &mut [i16; 16], mins: &mut [i16; 16]) -> (f32, f32);
}

/// Q4_K and Q5_K: eight 32-weight sub-blocks, 6-bit scales and minimums.
#[inline(always)]
fn six_bit_scales(block: &[u8], scales: &mut [i16; 16], mins: &mut [i16; 16]) -> (f32, f32) {
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &block[4..16]);
        scales[2 * j..2 * j + 2].fill(sc as i16);
        mins[2 * j..2 * j + 2].fill(m as i16);
    }
    (f16_at(block, 0), f16_at(block, 2))
}

/// Q4_K/Q5_K's nibbles: each 64 weights take 32 bytes, low nibbles first; `high` gives each
/// weight's fifth bit (Q5_K) as 0 or 16.
#[inline(always)]
fn nibble_chunks(qs: &[u8], w: &mut [u8; SUPER], high: impl Fn(usize, usize) -> u8) {
    for (c, (q, w)) in qs.chunks_exact(32).zip(w.chunks_exact_mut(64)).enumerate() {
        let (low_w, high_w) = w.split_at_mut(32);
        for l in 0..32 {
            low_w[l] = (q[l] & 0x0F) | high(2 * c, l);
            high_w[l] = (q[l] >> 4) | high(2 * c + 1, l);
        }
    }
}

impl SuperFormat for Q4K {
    #[inline(always)]
    fn weights(block: &[u8], w: &mut [u8; SUPER]) {
        nibble_chunks(&block[16..144], w, |_, _| 0);
    }
    #[inline(always)]
    fn integer_scales(block: &[u8], scales: &mut [i16; 16], mins: &mut [i16; 16]) -> (f32, f32) {
        six_bit_scales(block, scales, mins)
    }
}

impl SuperFormat for Q5K {
    #[inline(always)]
    fn weights(block: &[u8], w: &mut [u8; SUPER]) {
        let qh: &[u8; 32] = block[16..48].try_into().expect("a Q5_K block");
        nibble_chunks(&block[48..176], w, |bit, l| ((qh[l] >> bit) & 1) << 4);
    }
    #[inline(always)]
    fn integer_scales(block: &[u8], scales: &mut [i16; 16], mins: &mut [i16; 16]) -> (f32, f32) {
        six_bit_scales(block, scales, mins)
    }
}

/// Q6_K: `d·sc·(q − 32)` is `d·sc·q − d·(32·sc)`: a minimum of `32·sc` with `dmin = d`.
impl SuperFormat for Q6K {
    #[inline(always)]
    fn weights(block: &[u8], w: &mut [u8; SUPER]) {
        for (half, w) in w.chunks_exact_mut(128).enumerate() {
            let ql = &block[64 * half..64 * half + 64];
            let qh = &block[128 + 32 * half..128 + 32 * half + 32];
            for l in 0..32 {
                w[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
                w[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
                w[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                w[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
        }
    }
    #[inline(always)]
    fn integer_scales(block: &[u8], scales: &mut [i16; 16], mins: &mut [i16; 16]) -> (f32, f32) {
        for g in 0..16 {
            let sc = block[192 + g] as i8 as i16;
            scales[g] = sc;
            mins[g] = 32 * sc;
        }
        let d = f16_at(block, 208);
        (d, d)
    }
}

#[inline(always)]
fn decode_super<F: SuperFormat>(block: &[u8], out: &mut DecodedSuper) {
    F::weights(block, &mut out.w);
    let mut scales = [0i16; 16];
    (out.d, out.dmin) = F::integer_scales(block, &mut scales, &mut out.mins);
    for (j, chunk) in out.scales.iter_mut().enumerate() {
        chunk[..8].fill(scales[2 * j]);
        chunk[8..].fill(scales[2 * j + 1]);
    }
}

/// The integer dot of one matmul's K-quant rows with its activations, the format and lengths
/// checked once.
#[derive(Debug, Clone, Copy)]
pub struct SuperblockDot {
    dtype: GgmlType,
    /// Super-blocks a row holds, which every activation covers.
    supers: usize,
    kernel: Kernel,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Wide,
}

impl SuperblockDot {
    /// For rows of `row_bytes` of `dtype` against `acts`; `None` for other formats, or
    /// activations that do not cover a row.
    pub fn new(dtype: GgmlType, row_bytes: usize, acts: &[Q8KRow]) -> Option<Self> {
        if !matches!(dtype, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K) {
            return None;
        }
        let supers = row_bytes / dtype.block_layout().1;
        if acts
            .iter()
            .any(|a| a.supers() < supers || a.q.len() < supers * SUPER || a.sums16.len() < supers * 16)
        {
            return None;
        }
        Some(Self {
            dtype,
            supers,
            kernel: best_kernel(),
        })
    }

    /// `out[t] = row · acts[t]` for `acts` of those given to `new`; `scratch` holds the decoded
    /// row (reuse it across rows).
    pub fn run_with(&self, row: &[u8], acts: &[Q8KRow], out: &mut [f32], scratch: &mut Vec<DecodedSuper>) {
        // The kernels read each activation unchecked up to the row's length.
        assert!(
            row.len() / self.dtype.block_layout().1 <= self.supers,
            "a row longer than `new` was told"
        );
        match self.dtype {
            GgmlType::Q4K => decode_row::<Q4K>(row, scratch),
            GgmlType::Q5K => decode_row::<Q5K>(row, scratch),
            _ => decode_row::<Q6K>(row, scratch),
        }
        for (acts, out) in acts.chunks(TILE).zip(out.chunks_mut(TILE)) {
            match acts.len() {
                1 => self.tile::<1>(scratch, acts, out),
                2 => self.tile::<2>(scratch, acts, out),
                3 => self.tile::<3>(scratch, acts, out),
                _ => self.tile::<TILE>(scratch, acts, out),
            }
        }
    }

    fn tile<const N: usize>(&self, row: &[DecodedSuper], acts: &[Q8KRow], out: &mut [f32]) {
        let acts: [&Q8KRow; N] = std::array::from_fn(|t| &acts[t]);
        let got = match self.kernel {
            Kernel::Portable => acts.map(|a| dot_portable(row, a)),
            // SAFETY: `best_kernel` chose these only where the CPU has their features; `new`
            // checked every activation covers the row's super-blocks.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { x86::tile_avx2(row, acts) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Wide => unsafe { x86::tile_wide(row, acts) },
        };
        out.copy_from_slice(&got);
    }

    /// The same dot on another kernel (to check them against each other); the caller makes
    /// sure the CPU runs it.
    #[cfg(test)]
    fn on(self, kernel: Kernel) -> Self {
        Self { kernel, ..self }
    }
}

/// Activation rows per pass over a decoded row.
const TILE: usize = 4;

fn best_kernel() -> Kernel {
    #[cfg(target_arch = "x86_64")]
    {
        if super::int8::wide_int8() {
            return Kernel::Wide;
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return Kernel::Avx2;
        }
    }
    Kernel::Portable
}

/// Decode every super-block of `row` into `out`: with AVX2 where the CPU has it, so the byte
/// loops run 32 lanes wide.
fn decode_row<F: SuperFormat>(row: &[u8], out: &mut Vec<DecodedSuper>) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { decode_row_avx2::<F>(row, out) };
    }
    decode_row_body::<F>(row, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn decode_row_avx2<F: SuperFormat>(row: &[u8], out: &mut Vec<DecodedSuper>) {
    decode_row_body::<F>(row, out)
}

#[inline(always)]
fn decode_row_body<F: SuperFormat>(row: &[u8], out: &mut Vec<DecodedSuper>) {
    let supers = row.len() / F::BLOCK_BYTES;
    out.resize(supers, DecodedSuper::default());
    for (block, decoded) in row.chunks_exact(F::BLOCK_BYTES).zip(out.iter_mut()) {
        decode_super::<F>(block, decoded);
    }
}

/// The definition every kernel computes bit for bit (see the module's documentation).
pub fn dot_portable(row: &[DecodedSuper], act: &Q8KRow) -> f32 {
    let mut acc = [0f32; 8];
    let mut min_acc = [0f32; 8];
    for (s, sb) in row.iter().enumerate() {
        let q = &act.q[s * SUPER..(s + 1) * SUPER];
        let mut lanes = [0i32; 8];
        for (j, scales) in sb.scales.iter().enumerate() {
            for (l, lane) in lanes.iter_mut().enumerate() {
                let e = 32 * j + 4 * l;
                let products: i32 = (e..e + 4).map(|i| sb.w[i] as i32 * q[i] as i32).sum();
                *lane += scales[2 * l] as i32 * products;
            }
        }
        let dx = act.d[s];
        for (a, &lane) in acc.iter_mut().zip(&lanes) {
            *a = (lane as f32).mul_add(sb.d * dx, *a);
        }
        // Exact: |min| ≤ 4096 and |Σqx| ≤ 2032 per group.
        let sums = &act.sums16[16 * s..16 * s + 16];
        for (l, a) in min_acc.iter_mut().enumerate() {
            let lane: i32 = (2 * l..2 * l + 2).map(|g| sb.mins[g] as i32 * sums[g] as i32).sum();
            *a = (lane as f32).mul_add(sb.dmin * dx, *a);
        }
    }
    lane_sum(acc) - lane_sum(min_acc)
}

/// Eight lanes added in the one order every kernel uses.
fn lane_sum(l: [f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{lane_sum, DecodedSuper, Q8KRow, SUPER};
    use std::arch::x86_64::*;

    /// A row's two accumulators: the weights' eight float lanes and the minimums'.
    type Accumulators = (__m256, __m256);

    /// The float part of a super-block, shared by both kernels: its eight integer lanes
    /// widened and FMA'd with `d·dx`, and its minimum lanes (`pmaddwd` of the group minimums
    /// and the activation's group sums) with `dmin·dx`.
    #[inline(always)]
    unsafe fn accumulate(sb: &DecodedSuper, s: usize, lanes: __m256i, act: &Q8KRow, acc: &mut Accumulators) {
        // SAFETY (caller): `s` is one of the activation's super-blocks; AVX2 and FMA are
        // enabled.
        unsafe {
            let dx = *act.d.get_unchecked(s);
            acc.0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(sb.d * dx), acc.0);
            let mins = _mm256_loadu_si256(sb.mins.as_ptr() as *const __m256i);
            let sums = _mm256_loadu_si256(act.sums16.as_ptr().add(16 * s) as *const __m256i);
            let min_lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, sums));
            acc.1 = _mm256_fmadd_ps(min_lanes, _mm256_set1_ps(sb.dmin * dx), acc.1);
        }
    }

    #[inline(always)]
    fn finish(acc: Accumulators) -> f32 {
        let (mut lanes, mut min_lanes) = ([0f32; 8], [0f32; 8]);
        // SAFETY: each array holds eight f32; the callers enable AVX.
        unsafe {
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc.0);
            _mm256_storeu_ps(min_lanes.as_mut_ptr(), acc.1);
        }
        lane_sum(lanes) - lane_sum(min_lanes)
    }

    /// Per 32 weights: `pmaddubsw` (unsigned weights ≤ 63 against int8: pairs ≤ 16 002, no
    /// saturation), `pmaddwd` with the chunk's group scales, added to the lanes.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile_avx2<const N: usize>(row: &[DecodedSuper], acts: [&Q8KRow; N]) -> [f32; N] {
        let mut acc = [(_mm256_setzero_ps(), _mm256_setzero_ps()); N];
        for (s, sb) in row.iter().enumerate() {
            let mut lanes = [_mm256_setzero_si256(); N];
            for j in 0..8 {
                // SAFETY: chunk j of the decoded block, and of each activation's super-block
                // `s` (`SuperblockDot::new` checked their lengths).
                unsafe {
                    let w = _mm256_loadu_si256(sb.w.as_ptr().add(32 * j) as *const __m256i);
                    let scales = _mm256_loadu_si256(sb.scales[j].as_ptr() as *const __m256i);
                    for t in 0..N {
                        let q = _mm256_loadu_si256(acts[t].q.as_ptr().add(s * SUPER + 32 * j) as *const __m256i);
                        let scaled = _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), scales);
                        lanes[t] = _mm256_add_epi32(lanes[t], scaled);
                    }
                }
            }
            for t in 0..N {
                // SAFETY: as above.
                unsafe { accumulate(sb, s, lanes[t], acts[t], &mut acc[t]) };
            }
        }
        std::array::from_fn(|t| finish(acc[t]))
    }

    /// [`tile_avx2`] 64 weights an instruction: the lanes of even and odd chunks apart in the
    /// two halves, added at the end of the super-block (integers: the same sums exactly).
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
    pub unsafe fn tile_wide<const N: usize>(row: &[DecodedSuper], acts: [&Q8KRow; N]) -> [f32; N] {
        let mut acc = [(_mm256_setzero_ps(), _mm256_setzero_ps()); N];
        for (s, sb) in row.iter().enumerate() {
            let mut lanes = [_mm512_setzero_si512(); N];
            for j in (0..8).step_by(2) {
                // SAFETY: chunks j and j + 1 of the decoded block (its scales are contiguous),
                // and of each activation's super-block `s`.
                unsafe {
                    let w = _mm512_loadu_si512(sb.w.as_ptr().add(32 * j) as *const _);
                    let scales = _mm512_loadu_si512(sb.scales[j].as_ptr() as *const _);
                    for t in 0..N {
                        let q = _mm512_loadu_si512(acts[t].q.as_ptr().add(s * SUPER + 32 * j) as *const _);
                        let scaled = _mm512_madd_epi16(_mm512_maddubs_epi16(w, q), scales);
                        lanes[t] = _mm512_add_epi32(lanes[t], scaled);
                    }
                }
            }
            for t in 0..N {
                let low = _mm512_castsi512_si256(lanes[t]);
                let high = _mm512_extracti64x4_epi64(lanes[t], 1);
                // SAFETY: as above.
                unsafe { accumulate(sb, s, _mm256_add_epi32(low, high), acts[t], &mut acc[t]) };
            }
        }
        std::array::from_fn(|t| finish(acc[t]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Valid random-looking super-blocks of `dtype` (small finite f16 factors).
    fn blocks(dtype: GgmlType, count: usize, seed: usize) -> Vec<u8> {
        let bytes = dtype.block_layout().1;
        let mut data: Vec<u8> = (0..count * bytes)
            .map(|i| (((i + seed) * 2654435761usize) >> 9) as u8)
            .collect();
        let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
        for b in data.chunks_exact_mut(bytes) {
            if dtype == GgmlType::Q6K {
                b[208..210].copy_from_slice(&f16(0.004));
            } else {
                b[0..2].copy_from_slice(&f16(0.01));
                b[2..4].copy_from_slice(&f16(0.02));
            }
        }
        data
    }

    fn activation(n: usize, s: usize) -> Vec<f32> {
        let mut x: Vec<f32> = (0..n)
            .map(|i| (((i * (s + 7)) % 53) as f32 - 26.0) * (0.5 + s as f32 * 0.25))
            .collect();
        x[s % n] = 90.0 * (s as f32 - 3.0);
        x
    }

    /// Decoding is exact: `d·scale·w − dmin·min` is the dequantized weight.
    #[test]
    fn decoded_super_blocks_reproduce_the_dequantized_weights() {
        for dtype in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
            let data = blocks(dtype, 3, 1);
            let mut want = vec![0f32; 3 * SUPER];
            dtype.dequantize(&data, &mut want);
            let mut row = Vec::new();
            match dtype {
                GgmlType::Q4K => decode_row::<Q4K>(&data, &mut row),
                GgmlType::Q5K => decode_row::<Q5K>(&data, &mut row),
                _ => decode_row::<Q6K>(&data, &mut row),
            }
            for (i, &v) in want.iter().enumerate() {
                let sb = &row[i / SUPER];
                let e = i % SUPER;
                let (scale, min) = (sb.scales[e / 32][8 * (e % 32 / 16)], sb.mins[e / 16]);
                let got = sb.d * (scale as f32 * sb.w[e] as f32) - sb.dmin * min as f32;
                assert!(
                    (got - v).abs() <= 1e-5 * v.abs().max(1e-2),
                    "{dtype:?}[{i}]: {got} vs {v}"
                );
            }
        }
    }

    /// The dot is the float dot up to the activation's rounding, and every kernel gives the
    /// portable definition's bits for every activation, however many share the pass.
    #[test]
    fn every_kernel_gives_the_definitions_bits_and_approximates_the_float_dot() {
        for dtype in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
            let supers = 3;
            let n = supers * SUPER;
            let data = blocks(dtype, supers, 5);
            let mut w = vec![0f32; n];
            dtype.dequantize(&data, &mut w);
            let xs: Vec<Vec<f32>> = (0..9).map(|s| activation(n, s)).collect();
            let acts: Vec<Q8KRow> = xs.iter().map(|x| Q8KRow::quantize(x)).collect();
            let kernel = SuperblockDot::new(dtype, data.len(), &acts).unwrap();
            let mut scratch = Vec::new();
            let mut want = vec![0f32; acts.len()];
            kernel
                .on(Kernel::Portable)
                .run_with(&data, &acts, &mut want, &mut scratch);
            for on in available_kernels() {
                for count in 1..=acts.len() {
                    let mut got = vec![0f32; count];
                    kernel.on(on).run_with(&data, &acts[..count], &mut got, &mut scratch);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want[..count]), "{dtype:?}, {on:?}, {count} rows");
                }
            }
            for (x, got) in xs.iter().zip(&want) {
                let exact: f64 = w.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum();
                let magnitude: f64 = w.iter().zip(x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                assert!(
                    (*got as f64 - exact).abs() <= 0.01 * magnitude,
                    "{dtype:?}: {got} vs {exact}"
                );
            }
        }
    }

    /// The kernels this CPU runs, the portable one first; on x86 with AVX2 and FMA, at least
    /// the AVX2 kernel, and the wide one wherever `best_kernel` would pick it.
    fn available_kernels() -> Vec<Kernel> {
        #[allow(unused_mut)]
        let mut kernels = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                kernels.push(Kernel::Avx2);
            }
            if super::super::int8::wide_int8() {
                kernels.push(Kernel::Wide);
            }
            assert_eq!(kernels.last(), Some(&best_kernel()));
        }
        kernels
    }

    #[test]
    fn other_formats_and_short_activations_have_no_kernel() {
        let acts = [Q8KRow::quantize(&activation(SUPER, 0))];
        assert!(SuperblockDot::new(GgmlType::Q8_0, 34, &acts).is_none());
        assert!(SuperblockDot::new(GgmlType::Q4K, 2 * 144, &acts).is_none());
        assert!(SuperblockDot::new(GgmlType::Q4K, 144, &acts).is_some());
    }
}
