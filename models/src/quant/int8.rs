//! Integer dot products of GGML block rows with an int8-quantized activation row, as ggml's
//! `vec_dot_*_q8` kernels do: the activation is cut into 32-element blocks `x ≈ dx·qx`
//! (`qx` int8, `dx = max|x|/127`), the weights unpacked to their integer groups
//! (`y = scale·w − min`), and each group contributes `scale·dx·Σ w·qx − min·dx·Σ qx`.
//! Integer sums are exact; the only approximation is the activation's rounding.

use super::{BlockFormat, GgmlType, Q4K, Q4_0, Q4_1, Q5K, Q5_0, Q5_1, Q6K, Q8_0};

/// Elements per activation block.
pub const ACT_BLOCK: usize = 32;

/// An activation row quantized to int8 in blocks of 32, with per-16 sums of the integers
/// (so both 32- and 16-element weight groups find their `Σ qx`).
#[derive(Debug, Clone, Default)]
pub struct Q8Row {
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub sum16: Vec<i32>,
}

impl Q8Row {
    /// Quantize `x` (`len` a multiple of 32).
    pub fn quantize(x: &[f32]) -> Self {
        let mut row = Self::default();
        row.quantize_into(x);
        row
    }

    pub fn quantize_into(&mut self, x: &[f32]) {
        debug_assert_eq!(x.len() % ACT_BLOCK, 0);
        self.q.resize(x.len(), 0);
        self.d.clear();
        self.sum16.clear();
        for (xb, qb) in x.chunks_exact(ACT_BLOCK).zip(self.q.chunks_exact_mut(ACT_BLOCK)) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            for (q, &v) in qb.iter_mut().zip(xb) {
                *q = (v * inv).round() as i8;
            }
            self.d.push(d);
            for half in qb.chunks_exact(16) {
                self.sum16.push(half.iter().map(|&q| q as i32).sum());
            }
        }
    }
}

/// A weight group and its activation group, with the weight group's scale and min.
type GroupPair<'a> = ((&'a [i8], &'a [i8]), (&'a f32, &'a f32));

/// A weight row unpacked once (for many activation rows): integers, and per group scale/min.
#[derive(Debug, Clone, Default)]
pub struct UnpackedRow {
    pub group: usize,
    pub w: Vec<i8>,
    pub scale: Vec<f32>,
    pub min: Vec<f32>,
}

impl UnpackedRow {
    /// Unpack a row of `dtype` blocks; `None` for plain float types.
    pub fn unpack(&mut self, dtype: GgmlType, row: &[u8]) -> Option<()> {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { self.unpack_avx2(dtype, row) };
        }
        self.unpack_body(dtype, row)
    }

    /// The same body compiled with AVX2 enabled, so the nibble shuffling vectorises.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn unpack_avx2(&mut self, dtype: GgmlType, row: &[u8]) -> Option<()> {
        self.unpack_body(dtype, row)
    }

    #[inline(always)]
    fn unpack_body(&mut self, dtype: GgmlType, row: &[u8]) -> Option<()> {
        match dtype {
            GgmlType::Q4_0 => self.unpack_with::<Q4_0>(row),
            GgmlType::Q4_1 => self.unpack_with::<Q4_1>(row),
            GgmlType::Q5_0 => self.unpack_with::<Q5_0>(row),
            GgmlType::Q5_1 => self.unpack_with::<Q5_1>(row),
            GgmlType::Q8_0 => self.unpack_with::<Q8_0>(row),
            GgmlType::Q4K => self.unpack_with::<Q4K>(row),
            GgmlType::Q5K => self.unpack_with::<Q5K>(row),
            GgmlType::Q6K => self.unpack_with::<Q6K>(row),
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => return None,
        }
        Some(())
    }

    #[inline(always)]
    fn unpack_with<F: BlockFormat>(&mut self, row: &[u8]) {
        let blocks = row.len() / F::BLOCK_BYTES;
        let groups_per_block = F::BLOCK_ELEMS / F::GROUP;
        self.group = F::GROUP;
        self.w.resize(blocks * F::BLOCK_ELEMS, 0);
        self.scale.resize(blocks * groups_per_block, 0.0);
        self.min.resize(blocks * groups_per_block, 0.0);
        for (b, block) in row.chunks_exact(F::BLOCK_BYTES).enumerate() {
            F::unpack_groups(
                block,
                &mut self.w[b * F::BLOCK_ELEMS..(b + 1) * F::BLOCK_ELEMS],
                &mut self.scale[b * groups_per_block..(b + 1) * groups_per_block],
                &mut self.min[b * groups_per_block..(b + 1) * groups_per_block],
            );
        }
    }

    /// `Σ y·x` with the activation quantized as `act`.
    pub fn dot(&self, act: &Q8Row) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            return unsafe { self.dot_avx2(act) };
        }
        self.dot_portable(act)
    }

    /// The definition: per group, exact integer sum, then scaled.
    fn dot_portable(&self, act: &Q8Row) -> f32 {
        let g = self.group;
        let mut acc = 0f32;
        for (i, ((w, q), (&scale, &min))) in self.groups(act).enumerate() {
            let dx = act.d[i * g / ACT_BLOCK];
            let isum: i32 = w.iter().zip(q).map(|(&a, &b)| a as i32 * b as i32).sum();
            acc += dx * (scale * isum as f32 - min * self.qsum(act, i) as f32);
        }
        acc
    }

    fn groups<'a>(&'a self, act: &'a Q8Row) -> impl Iterator<Item = GroupPair<'a>> {
        self.w
            .chunks_exact(self.group)
            .zip(act.q.chunks_exact(self.group))
            .zip(self.scale.iter().zip(&self.min))
    }

    #[inline(always)]
    fn qsum(&self, act: &Q8Row, group: usize) -> i32 {
        if self.group == 16 {
            act.sum16[group]
        } else {
            act.sum16[2 * group] + act.sum16[2 * group + 1]
        }
    }

    /// AVX2: 16 int8 pairs → `pmaddwd` → 8 i32 partial sums → f32, FMA'd with `scale·dx`
    /// into eight float lanes summed once at the end (no horizontal sum per group).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_avx2(&self, act: &Q8Row) -> f32 {
        // SAFETY (both calls): the caller checked AVX2/FMA; lengths are checked inside.
        if self.group == 16 {
            unsafe { self.dot_avx2_groups::<16>(act) }
        } else {
            unsafe { self.dot_avx2_groups::<32>(act) }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_avx2_groups<const G: usize>(&self, act: &Q8Row) -> f32 {
        use std::arch::x86_64::*;
        let groups = self.scale.len();
        // Every unchecked read below stays inside these bounds.
        assert!(self.min.len() == groups && self.w.len() >= groups * G && act.q.len() >= groups * G);
        assert!(act.d.len() * ACT_BLOCK >= groups * G && act.sum16.len() * 16 >= groups * G);
        let (w, q) = (self.w.as_ptr(), act.q.as_ptr());
        let mut acc = _mm256_setzero_ps();
        let mut offset = 0f32;
        for i in 0..groups {
            // SAFETY: i < groups, so group i's G bytes, its act block and its sums are in bounds.
            unsafe {
                let dx = *act.d.get_unchecked(i * G / ACT_BLOCK);
                let mut isum = _mm256_setzero_si256();
                for c in 0..G / 16 {
                    let at = i * G + 16 * c;
                    let wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(w.add(at) as *const __m128i));
                    let qv = _mm256_cvtepi8_epi16(_mm_loadu_si128(q.add(at) as *const __m128i));
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(wv, qv));
                }
                acc = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(isum),
                    _mm256_set1_ps(*self.scale.get_unchecked(i) * dx),
                    acc,
                );
                let qsum = if G == 16 {
                    *act.sum16.get_unchecked(i)
                } else {
                    *act.sum16.get_unchecked(2 * i) + *act.sum16.get_unchecked(2 * i + 1)
                };
                offset += *self.min.get_unchecked(i) * dx * qsum as f32;
            }
        }
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds eight f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        let total = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
        total - offset
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random-looking but valid blocks: scales are small finite f16s.
    fn blocks(dtype: GgmlType, count: usize) -> Vec<u8> {
        let (_, bytes) = dtype.block_layout();
        let mut data: Vec<u8> = (0..count * bytes).map(|i| ((i * 2654435761usize) >> 7) as u8).collect();
        let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
        for b in data.chunks_exact_mut(bytes) {
            match dtype {
                GgmlType::Q6K => b[208..210].copy_from_slice(&f16(0.01)),
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => {
                    b[0..2].copy_from_slice(&f16(0.02));
                    b[2..4].copy_from_slice(&f16(0.01));
                }
                _ => b[0..2].copy_from_slice(&f16(0.03)),
            }
        }
        data
    }

    #[test]
    fn int8_dot_approximates_the_float_dot_for_every_format() {
        use GgmlType::*;
        for dtype in [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4K, Q5K, Q6K] {
            let n = 512;
            let data = blocks(dtype, n / dtype.block_layout().0);
            let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 19) as f32 - 9.0) / 5.0).collect();
            let mut w = vec![0f32; n];
            dtype.dequantize(&data, &mut w);
            let exact: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            let magnitude: f64 = w.iter().zip(&x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            let mut row = UnpackedRow::default();
            row.unpack(dtype, &data).unwrap();
            // Unpacking is exact: scale·w − min reproduces the dequantized weights.
            for (i, &v) in w.iter().enumerate() {
                let g = i / row.group;
                let y = row.scale[g] * row.w[i] as f32 - row.min[g];
                assert!((y - v).abs() <= 1e-6 * v.abs().max(1e-3), "{dtype:?}[{i}]: {y} vs {v}");
            }
            let act = Q8Row::quantize(&x);
            let got = row.dot(&act) as f64;
            assert!((got - exact).abs() <= 0.01 * magnitude, "{dtype:?}: {got} vs {exact}");
            // The SIMD path computes the same integer sums as the definition.
            let portable = row.dot_portable(&act) as f64;
            assert!(
                (got - portable).abs() <= 1e-5 * magnitude,
                "{dtype:?}: {got} vs portable {portable}"
            );
        }
    }
}

/// `Σ y·x` straight from a row of 32-element blocks (Q4_0, Q4_1, Q8_0) without unpacking it:
/// llama.cpp's `vec_dot_q4_1_q8_1` scheme with AVX2 (`pmaddubsw` on the packed nibbles).
/// `None` for other formats or CPUs without AVX2, where the unpacked path applies.
pub fn dot_packed(dtype: GgmlType, row: &[u8], act: &Q8Row) -> Option<f32> {
    let kernel = PackedDot::new(dtype, row.len(), std::slice::from_ref(act))?;
    let mut out = [0f32];
    kernel.run(row, std::slice::from_ref(act), &mut out);
    Some(out[0])
}

/// The packed dot for one matmul, its preconditions (format, CPU features, activation
/// lengths) checked once rather than per row. Each result is bit for bit what [`dot_packed`]
/// gives for that activation alone, however many are computed together, so a token's logits
/// do not depend on its step's size.
#[derive(Debug, Clone, Copy)]
pub struct PackedDot {
    dtype: GgmlType,
}

impl PackedDot {
    /// For rows of `row_bytes` against `acts`; `None` where the unpacked path must be used.
    pub fn new(dtype: GgmlType, row_bytes: usize, acts: &[Q8Row]) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if matches!(dtype, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
        {
            let blocks = row_bytes / dtype.block_layout().1;
            let fits =
                |a: &Q8Row| a.q.len() >= blocks * ACT_BLOCK && a.d.len() >= blocks && a.sum16.len() >= 2 * blocks;
            return acts.iter().all(fits).then_some(Self { dtype });
        }
        let _ = (dtype, row_bytes, acts);
        None
    }

    /// `out[t] = row · acts[t]` for a row of the length given to `new`.
    pub fn run(&self, row: &[u8], acts: &[Q8Row], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        for (acts, out) in acts.chunks(PACKED_TILE).zip(out.chunks_mut(PACKED_TILE)) {
            // SAFETY: `new` checked the format, AVX2/FMA and that every activation covers the
            // row's blocks. The tile width is a constant so the accumulators stay in registers.
            unsafe {
                match acts.len() {
                    1 => out[0] = dot_packed_single_avx2(self.dtype, row, &acts[0]),
                    2 => dot_packed_avx2::<2>(self.dtype, row, acts, out),
                    3 => dot_packed_avx2::<3>(self.dtype, row, acts, out),
                    4 => dot_packed_avx2::<4>(self.dtype, row, acts, out),
                    5 => dot_packed_avx2::<5>(self.dtype, row, acts, out),
                    6 => dot_packed_avx2::<6>(self.dtype, row, acts, out),
                    7 => dot_packed_avx2::<7>(self.dtype, row, acts, out),
                    _ => dot_packed_avx2::<8>(self.dtype, row, acts, out),
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (row, acts, out);
    }
}

/// One activation row: the same operations, in the same order, as one lane of
/// [`dot_packed_avx2`] (the tests check the bits), in a form the compiler keeps in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_packed_single_avx2(dtype: GgmlType, row: &[u8], act: &Q8Row) -> f32 {
    use super::f16_at;
    use std::arch::x86_64::*;
    let (_, bytes) = dtype.block_layout();
    let ones = _mm256_set1_epi16(1);
    let low_nibbles = _mm_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    let mut offset = 0f32;
    for (b, block) in row.chunks_exact(bytes).enumerate() {
        let scale = f16_at(block, 0);
        let dx = act.d[b];
        let qsum = (act.sum16[2 * b] + act.sum16[2 * b + 1]) as f32;
        // SAFETY: the caller checked the activation holds block `b`; the block loads stay
        // inside `block` (see `dot_packed_avx2`).
        let qx = unsafe { _mm256_loadu_si256(act.q.as_ptr().add(b * ACT_BLOCK) as *const __m256i) };
        let products = match dtype {
            GgmlType::Q8_0 => {
                // SAFETY: a Q8_0 block is 2 + 32 bytes.
                let q = unsafe { _mm256_loadu_si256(block.as_ptr().add(2) as *const __m256i) };
                _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(qx, q))
            }
            _ => {
                let start = if dtype == GgmlType::Q4_1 { 4 } else { 2 };
                // SAFETY: a Q4 block holds 16 bytes of nibbles after its scales.
                let packed = unsafe { _mm_loadu_si128(block.as_ptr().add(start) as *const __m128i) };
                let lo = _mm_and_si128(packed, low_nibbles);
                let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles);
                _mm256_maddubs_epi16(_mm256_set_m128i(hi, lo), qx)
            }
        };
        let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(products, ones));
        acc = _mm256_fmadd_ps(sums, _mm256_set1_ps(scale * dx), acc);
        offset += match dtype {
            GgmlType::Q4_0 => -8.0 * scale * dx * qsum,
            GgmlType::Q4_1 => f16_at(block, 2) * dx * qsum,
            _ => 0.0,
        };
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds eight f32.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    let total = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    total + offset
}

/// Activation rows per pass over a weight row (accumulators held in registers).
const PACKED_TILE: usize = 8;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_packed_avx2<const N: usize>(dtype: GgmlType, row: &[u8], acts: &[Q8Row], out: &mut [f32]) {
    use super::f16_at;
    use std::arch::x86_64::*;
    let (_, bytes) = dtype.block_layout();
    let ones = _mm256_set1_epi16(1);
    let low_nibbles = _mm_set1_epi8(0x0F);
    let acts = &acts[..N];
    let mut acc = [_mm256_setzero_ps(); N];
    let mut offset = [0f32; N];
    for (b, block) in row.chunks_exact(bytes).enumerate() {
        let scale = f16_at(block, 0);
        // The block's weights as 32 bytes in element order, decoded once for every row.
        let q = match dtype {
            // SAFETY: a Q8_0 block is 2 + 32 bytes.
            GgmlType::Q8_0 => unsafe { _mm256_loadu_si256(block.as_ptr().add(2) as *const __m256i) },
            _ => {
                let start = if dtype == GgmlType::Q4_1 { 4 } else { 2 };
                // SAFETY: a Q4 block holds 16 bytes of nibbles after its scales.
                let packed = unsafe { _mm_loadu_si128(block.as_ptr().add(start) as *const __m128i) };
                let lo = _mm_and_si128(packed, low_nibbles);
                let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles);
                _mm256_set_m128i(hi, lo)
            }
        };
        let q_abs = _mm256_sign_epi8(q, q);
        // A constant trip count: unrolled, the accumulators live in registers.
        #[allow(clippy::needless_range_loop)]
        for t in 0..N {
            let act = &acts[t];
            let dx = act.d[b];
            let qsum = (act.sum16[2 * b] + act.sum16[2 * b + 1]) as f32;
            // SAFETY: the caller checked the activation holds block `b`.
            let qx = unsafe { _mm256_loadu_si256(act.q.as_ptr().add(b * ACT_BLOCK) as *const __m256i) };
            let products = match dtype {
                // u8 × i8 multiply: |q| against qx carrying q's sign.
                GgmlType::Q8_0 => _mm256_maddubs_epi16(q_abs, _mm256_sign_epi8(qx, q)),
                _ => _mm256_maddubs_epi16(q, qx),
            };
            let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(products, ones));
            acc[t] = _mm256_fmadd_ps(sums, _mm256_set1_ps(scale * dx), acc[t]);
            offset[t] += match dtype {
                // Q4_0 stores q + 8: Σ(q − 8)·x = Σq·x − 8·Σx.
                GgmlType::Q4_0 => -8.0 * scale * dx * qsum,
                // Q4_1: y = d·q + m.
                GgmlType::Q4_1 => f16_at(block, 2) * dx * qsum,
                _ => 0.0,
            };
        }
    }
    for (t, o) in out.iter_mut().enumerate().take(N) {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds eight f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[t]) };
        let total = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
        *o = total + offset[t];
    }
}

#[cfg(test)]
mod packed_tests {
    use super::*;

    #[test]
    fn packed_dot_equals_the_unpacked_dot() {
        for dtype in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let (_, bytes) = dtype.block_layout();
            let blocks = 18;
            let mut data: Vec<u8> = (0..blocks * bytes)
                .map(|i| ((i * 2654435761usize) >> 9) as u8)
                .collect();
            for b in data.chunks_exact_mut(bytes) {
                b[0..2].copy_from_slice(&half::f16::from_f32(0.02).to_le_bytes());
                if dtype == GgmlType::Q4_1 {
                    b[2..4].copy_from_slice(&half::f16::from_f32(-0.1).to_le_bytes());
                }
            }
            let x: Vec<f32> = (0..blocks * 32).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
            let act = Q8Row::quantize(&x);
            let mut row = UnpackedRow::default();
            row.unpack(dtype, &data).unwrap();
            let want = row.dot(&act);
            if let Some(got) = dot_packed(dtype, &data, &act) {
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{dtype:?}: {got} vs {want}"
                );
            }
        }
    }
}

#[cfg(test)]
mod packed_many_tests {
    use super::*;

    #[test]
    fn many_rows_at_once_give_each_rows_single_result_exactly() {
        for dtype in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let (_, bytes) = dtype.block_layout();
            let mut data: Vec<u8> = (0..7 * bytes).map(|i| ((i * 2654435761usize) >> 11) as u8).collect();
            for b in data.chunks_exact_mut(bytes) {
                b[0..2].copy_from_slice(&half::f16::from_f32(0.03).to_le_bytes());
                if dtype == GgmlType::Q4_1 {
                    b[2..4].copy_from_slice(&half::f16::from_f32(0.05).to_le_bytes());
                }
            }
            let acts: Vec<Q8Row> = (0..6)
                .map(|s| {
                    Q8Row::quantize(
                        &(0..7 * 32)
                            .map(|i| ((i * (s + 3)) % 29) as f32 - 14.0)
                            .collect::<Vec<_>>(),
                    )
                })
                .collect();
            let Some(kernel) = PackedDot::new(dtype, data.len(), &acts) else {
                return;
            };
            let mut many = vec![0f32; acts.len()];
            kernel.run(&data, &acts, &mut many);
            for (a, m) in acts.iter().zip(&many) {
                assert_eq!(m.to_bits(), dot_packed(dtype, &data, a).unwrap().to_bits(), "{dtype:?}");
            }
        }
    }
}
