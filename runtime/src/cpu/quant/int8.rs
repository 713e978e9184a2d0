//! Integer dot products of GGML block rows with an int8-quantized activation row, as ggml's
//! `vec_dot_*_q8` kernels do: the activation is cut into 32-element blocks `x ≈ dx·qx`
//! (`qx` int8, `dx = max|x|/127`), the weights unpacked to their integer groups
//! (`y = scale·w − min`), and each group contributes `scale·dx·Σ w·qx − min·dx·Σ qx`.
//! Integer sums are exact; the only approximation is the activation's rounding.

use super::{BlockFormat, GgmlType, IQ4NL, IQ4XS, MXFP4, Q2K, Q3K, Q4K, Q4_0, Q4_1, Q5K, Q5_0, Q5_1, Q6K, Q8_0};

/// Elements per activation block.
pub const ACT_BLOCK: usize = 32;

/// An activation row quantized to int8 in blocks of 32, with per-16 sums of the integers
/// (so both 32- and 16-element weight groups find their `Σ qx`), and per block `Σ qx` and
/// `d · Σ qx` (what a weight block's bias and minimum multiply), worked out once where the row
/// is quantized, on whichever thread quantizes it, rather than again for every matmul.
#[derive(Debug, Clone, Default)]
pub struct Q8Row {
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub sum16: Vec<i32>,
    qsums: Vec<i32>,
    dsums: Vec<f32>,
}

impl Q8Row {
    /// Quantize `x` (`len` a multiple of 32).
    pub fn quantize(x: &[f32]) -> Self {
        let mut row = Self::default();
        row.quantize_into(x);
        row
    }

    /// [`quantize`](Self::quantize) into this row's buffers (no allocation once they have
    /// held a row as long).
    pub fn quantize_into(&mut self, x: &[f32]) {
        debug_assert_eq!(x.len() % ACT_BLOCK, 0);
        let blocks = x.len() / ACT_BLOCK;
        self.q.resize(x.len(), 0);
        self.d.clear();
        self.d.reserve(blocks);
        self.sum16.clear();
        self.sum16.reserve(2 * blocks);
        self.quantize_blocks(x);
        self.qsums.clear();
        self.qsums.extend(self.sum16.chunks_exact(2).map(|h| h[0] + h[1]));
        self.dsums.clear();
        self.dsums
            .extend(self.d.iter().zip(&self.qsums).map(|(&d, &qsum)| d * qsum as f32));
    }

    fn quantize_blocks(&mut self, x: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if wide_int8() {
            // SAFETY: the CPU has AVX-512 F/BW/VL (`wide_int8`).
            unsafe { quantize_blocks_avx512(x, &mut self.q, &mut self.d, &mut self.sum16) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            unsafe { quantize_blocks_avx2(x, &mut self.q, &mut self.d, &mut self.sum16) };
            return;
        }
        for (xb, qb) in whole_blocks(x, &mut self.q) {
            self.d.push(quantize_block(xb, qb));
            self.sum16.extend(half_sums(qb));
        }
    }

    /// Every block's `Σ qx`.
    pub fn qsums(&self) -> &[i32] {
        &self.qsums
    }

    /// Every block's `d · Σ qx`.
    pub fn dsums(&self) -> &[f32] {
        &self.dsums
    }
}

/// Elements per K-quant super-block (and per [`Q8KRow`] activation scale).
pub const SUPER: usize = 256;

/// An activation row quantized to int8 with one scale per 256 elements (ggml's `q8_K`), and
/// the sums of its integers per 16 (what K-quant minimums and zero points multiply).
#[derive(Debug, Clone, Default)]
pub struct Q8KRow {
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub sums16: Vec<i16>,
}

impl Q8KRow {
    /// Quantize `x` (`len` a multiple of 256): `d = max|x|/127`, `q = round(x/d)` (halves away
    /// from zero), as [`Q8Row`] does per 32.
    pub fn quantize(x: &[f32]) -> Self {
        let mut row = Self::default();
        row.quantize_into(x);
        row
    }

    /// [`quantize`](Self::quantize) into this row's buffers (no allocation once they have
    /// held a row as long).
    pub fn quantize_into(&mut self, x: &[f32]) {
        debug_assert_eq!(x.len() % SUPER, 0);
        let spans = x.len() / SUPER;
        self.q.resize(x.len(), 0);
        self.d.clear();
        self.d.reserve(spans);
        self.sums16.clear();
        self.sums16.reserve(spans * SUPER / 16);
        for (xb, qb) in x.chunks_exact(SUPER).zip(self.q.chunks_exact_mut(SUPER)) {
            self.d.push(quantize_span(xb, qb, &mut self.sums16));
        }
    }
}

/// An activation row the int8 kernels read, quantized in place.
pub trait ActivationRow: Default + Send + Sync {
    fn quantize_into(&mut self, x: &[f32]);
}

impl ActivationRow for Q8Row {
    fn quantize_into(&mut self, x: &[f32]) {
        Q8Row::quantize_into(self, x)
    }
}

impl ActivationRow for Q8KRow {
    fn quantize_into(&mut self, x: &[f32]) {
        Q8KRow::quantize_into(self, x)
    }
}

/// A span's scale: `max|x| / 127` (NaNs ignored).
fn span_scale(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0
}

/// What multiplies `x` to give its integer: `1 / d`, or 0 for an all-zero span.
fn inverse(d: f32) -> f32 {
    if d > 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// `q = round(x / d)`, halves away from zero; the scale `d`.
fn quantize_block(xb: &[f32; ACT_BLOCK], qb: &mut [i8; ACT_BLOCK]) -> f32 {
    let d = span_scale(xb);
    round_scalar(xb, inverse(d), qb);
    d
}

/// `x` and `q` in pairs of whole 32-element blocks.
fn whole_blocks<'a>(
    x: &'a [f32],
    q: &'a mut [i8],
) -> impl Iterator<Item = (&'a [f32; ACT_BLOCK], &'a mut [i8; ACT_BLOCK])> {
    x.chunks_exact(ACT_BLOCK)
        .zip(q.chunks_exact_mut(ACT_BLOCK))
        .map(|(xb, qb)| {
            (
                xb.try_into().expect("whole blocks"),
                qb.try_into().expect("whole blocks"),
            )
        })
}

/// The sums of a block's two halves of 16 integers.
fn half_sums(qb: &[i8; ACT_BLOCK]) -> [i32; 2] {
    std::array::from_fn(|h| qb[16 * h..16 * (h + 1)].iter().map(|&q| q as i32).sum())
}

fn round_scalar(x: &[f32], inv: f32, q: &mut [i8]) {
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * inv).round() as i8;
    }
}

/// [`quantize_block`] over a span of whole 32-element blocks with one scale for all of it
/// (the K-quant dots' 256-element activation blocks); the scale. The sums of each 16
/// integers go on `sums16`.
fn quantize_span(x: &[f32], q: &mut [i8], sums16: &mut Vec<i16>) -> f32 {
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::is_x86_feature_detected!("avx2");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has AVX2 where `avx2` is set.
    let d = if avx2 {
        (unsafe { abs_max_avx2(x) }) / 127.0
    } else {
        span_scale(x)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let d = span_scale(x);
    let inv = inverse(d);
    // A block's halves sum to at most 16 · 127 in magnitude: an i16 holds them.
    let narrow = |sums: [i32; 2]| sums.map(|s| s as i16);
    for (xb, qb) in whole_blocks(x, q) {
        // SAFETY: the CPU has AVX2 where `avx2` is set.
        #[cfg(target_arch = "x86_64")]
        if avx2 && unsafe { all_finite_avx2(xb) } {
            sums16.extend(narrow(unsafe { round_block_avx2(xb, inv, qb) }));
            continue;
        }
        round_scalar(xb, inv, qb);
        sums16.extend(narrow(half_sums(qb)));
    }
    d
}

/// [`Q8Row::quantize_into`]'s blocks with AVX2: each block's scale on `d`, its halves' sums
/// on `sum16`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_blocks_avx2(x: &[f32], q: &mut [i8], d: &mut Vec<f32>, sum16: &mut Vec<i32>) {
    // SAFETY: AVX2 is enabled here, and in the closure, which inherits it.
    quantize_blocks_with(x, q, d, sum16, |xb, qb| unsafe { quantize_block_avx2(xb, qb) })
}

/// [`quantize_blocks_avx2`] with AVX-512, a half block a register: a prefill quantizes every
/// matmul's input rows, and eight lanes at a time that was 4% of a 128-token step.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn quantize_blocks_avx512(x: &[f32], q: &mut [i8], d: &mut Vec<f32>, sum16: &mut Vec<i32>) {
    // SAFETY: AVX-512 F/BW/VL are enabled here, and in the closure, which inherits them.
    quantize_blocks_with(x, q, d, sum16, |xb, qb| unsafe { quantize_block_avx512(xb, qb) })
}

/// Each block through `vector` (its scale and its halves' sums, or `None` for a block only the
/// scalar code takes: one holding a NaN or an infinity), scales on `d`, sums on `sum16`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn quantize_blocks_with(
    x: &[f32],
    q: &mut [i8],
    d: &mut Vec<f32>,
    sum16: &mut Vec<i32>,
    vector: impl Fn(&[f32; ACT_BLOCK], &mut [i8; ACT_BLOCK]) -> Option<(f32, [i32; 2])>,
) {
    for (xb, qb) in whole_blocks(x, q) {
        match vector(xb, qb) {
            Some((scale, sums)) => {
                d.push(scale);
                sum16.extend(sums);
            }
            None => {
                d.push(quantize_block(xb, qb));
                sum16.extend(half_sums(qb));
            }
        }
    }
}

/// [`quantize_block_avx2`] sixteen lanes at a time: the same operations lane by lane (the
/// maximum is exact in any order, the rounding steps away from zero as `f32::round` does), so
/// the same bytes; `None`, writing nothing, for a block holding a NaN or an infinity.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn quantize_block_avx512(xb: &[f32; ACT_BLOCK], qb: &mut [i8; ACT_BLOCK]) -> Option<(f32, [i32; 2])> {
    use std::arch::x86_64::*;
    // SAFETY: the block holds 32 f32 and `qb` 32 bytes; AVX-512 F/BW/VL are enabled.
    unsafe {
        let halves = [_mm512_loadu_ps(xb.as_ptr()), _mm512_loadu_ps(xb.as_ptr().add(16))];
        // An infinity or NaN anywhere: x − x is NaN exactly there.
        let unordered = |x: __m512| {
            let zero_if_finite = _mm512_sub_ps(x, x);
            _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(zero_if_finite, zero_if_finite)
        };
        if unordered(halves[0]) | unordered(halves[1]) != 0 {
            return None;
        }
        let d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(halves[0]), _mm512_abs_ps(halves[1]))) / 127.0;
        let inv = _mm512_set1_ps(inverse(d));
        let (sign, one) = (_mm512_set1_epi32(i32::MIN), _mm512_castps_si512(_mm512_set1_ps(1.0)));
        let sums = std::array::from_fn(|h| {
            let y = _mm512_mul_ps(halves[h], inv);
            let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
            // |y − trunc(y)| ≥ ½: one more step away from zero (the difference is exact).
            let away = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_abs_ps(_mm512_sub_ps(y, t)), _mm512_set1_ps(0.5));
            let step = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(y), sign), one));
            let q = _mm512_cvtps_epi32(_mm512_mask_add_ps(t, away, t, step));
            _mm_storeu_si128(qb.as_mut_ptr().add(16 * h) as *mut __m128i, _mm512_cvtsepi32_epi8(q));
            _mm512_reduce_add_epi32(q)
        });
        Some((d, sums))
    }
}

/// [`quantize_block`] eight lanes at a time, bit for bit (halves rounded away from zero as
/// `f32::round` does, not to even as the vector unit would); the scale and the halves' sums,
/// or `None`, writing nothing, for a block holding a NaN or an infinity, which the scalar code
/// handles.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(xb: &[f32; ACT_BLOCK], qb: &mut [i8; ACT_BLOCK]) -> Option<(f32, [i32; 2])> {
    // SAFETY: AVX2 is enabled for this function.
    unsafe {
        if !all_finite_avx2(xb) {
            return None;
        }
        let d = abs_max_avx2(xb) / 127.0;
        Some((d, round_block_avx2(xb, inverse(d), qb)))
    }
}

/// [`span_scale`]'s `max|x|` eight lanes at a time, for `x` of whole 8-element chunks: a
/// maximum is exact, so any order gives the same number, and `vmaxps` returns its second
/// operand where the first is a NaN, so NaNs are passed over as `f32::max` passes them.
/// (The scalar fold is a chain of dependent `max`es, 256 of them over a K-quant span.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn abs_max_avx2(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    debug_assert!(x.len().is_multiple_of(8));
    let sign = _mm256_set1_ps(-0.0);
    let mut max = _mm256_setzero_ps();
    for chunk in x.chunks_exact(8) {
        // SAFETY: the chunk holds eight floats.
        let v = unsafe { _mm256_loadu_ps(chunk.as_ptr()) };
        max = _mm256_max_ps(_mm256_andnot_ps(sign, v), max);
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(max), _mm256_extractf128_ps(max, 1));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)))
}

/// Whether a block holds neither an infinity nor a NaN.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn all_finite_avx2(xb: &[f32; ACT_BLOCK]) -> bool {
    use std::arch::x86_64::*;
    // SAFETY: the block holds 32 f32; AVX2 is enabled for this function.
    unsafe {
        // An infinity or NaN anywhere: x − x is NaN exactly there.
        let mut bad = _mm256_setzero_ps();
        for i in 0..4 {
            let x = _mm256_loadu_ps(xb.as_ptr().add(8 * i));
            let zero_if_finite = _mm256_sub_ps(x, x);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(zero_if_finite, zero_if_finite, _CMP_UNORD_Q));
        }
        _mm256_movemask_ps(bad) == 0
    }
}

/// [`round_scalar`] eight lanes at a time, bit for bit, for a block of finite values; the
/// sums of its halves' integers ([`half_sums`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn round_block_avx2(xb: &[f32; ACT_BLOCK], inv: f32, qb: &mut [i8; ACT_BLOCK]) -> [i32; 2] {
    use std::arch::x86_64::*;
    // SAFETY: the block holds 32 f32 and `qb` 32 bytes; AVX2 is enabled for this function.
    unsafe {
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xb.as_ptr().add(8 * i)));
        let sign = _mm256_set1_ps(-0.0);
        let inv = _mm256_set1_ps(inv);
        let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            let y = _mm256_mul_ps(v[i], inv);
            let t = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            // |y − trunc(y)| ≥ ½: one more step away from zero (the difference is exact).
            let away = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(y, t)), half, _CMP_GE_OQ);
            let step = _mm256_or_ps(_mm256_and_ps(y, sign), one);
            _mm256_cvtps_epi32(_mm256_add_ps(t, _mm256_and_ps(away, step)))
        });
        // i32 → i16 → i8 saturating packs work within 128-bit lanes; put the lanes back in
        // element order.
        let packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        let ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(qb.as_mut_ptr() as *mut __m256i, ordered);
        // `vpsadbw` sums unsigned bytes eight at a time: q + 128 (the sign bit flipped), less
        // 16 · 128 a half after.
        let biased = _mm256_xor_si256(ordered, _mm256_set1_epi8(i8::MIN));
        let eights = _mm256_sad_epu8(biased, _mm256_setzero_si256());
        let (low, high) = (_mm256_castsi256_si128(eights), _mm256_extracti128_si256(eights, 1));
        let half = |v: __m128i| _mm_cvtsi128_si32(_mm_add_epi64(v, _mm_unpackhi_epi64(v, v))) - 16 * 128;
        [half(low), half(high)]
    }
}

/// A weight group and its activation group, with the weight group's scale and min.
type GroupPair<'a> = ((&'a [i8], &'a [i8]), (&'a f32, &'a f32));

/// A weight row unpacked: integers, and per group scale/min, straight from the GGUF blocks.
/// No kernel runs on it (the 32-weight formats run over [`super::interleaved`] rows, the
/// K-quants and IQ4_XS over [`super::interleaved_k`] rows): it is the arithmetic those
/// kernels are checked against.
#[derive(Debug, Clone, Default)]
pub struct UnpackedRow {
    pub group: usize,
    pub w: Vec<i8>,
    pub scale: Vec<f32>,
    pub min: Vec<f32>,
}

impl UnpackedRow {
    /// Unpack a row of `dtype` blocks; `None` for float types (FP8 blocks among them: their
    /// weights are no integers under a scale).
    pub fn unpack(&mut self, dtype: GgmlType, row: &[u8]) -> Option<()> {
        match dtype {
            GgmlType::Q4_0 => self.unpack_with::<Q4_0>(row),
            GgmlType::Q4_1 => self.unpack_with::<Q4_1>(row),
            GgmlType::Q5_0 => self.unpack_with::<Q5_0>(row),
            GgmlType::Q5_1 => self.unpack_with::<Q5_1>(row),
            GgmlType::Q8_0 => self.unpack_with::<Q8_0>(row),
            GgmlType::Q4K => self.unpack_with::<Q4K>(row),
            GgmlType::Q5K => self.unpack_with::<Q5K>(row),
            GgmlType::Q6K => self.unpack_with::<Q6K>(row),
            GgmlType::Q2K => self.unpack_with::<Q2K>(row),
            GgmlType::Q3K => self.unpack_with::<Q3K>(row),
            GgmlType::IQ4NL => self.unpack_with::<IQ4NL>(row),
            GgmlType::IQ4XS => self.unpack_with::<IQ4XS>(row),
            GgmlType::MXFP4 => self.unpack_with::<MXFP4>(row),
            GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::I32
            | GgmlType::F8E4M3B32
            | GgmlType::U4B32
            | GgmlType::U4B128
            | GgmlType::F4E2M1B32 => return None,
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

    /// `Σ y·x` with the activation quantized as `act`: per group, the exact integer sum,
    /// then scaled.
    pub fn dot(&self, act: &Q8Row) -> f32 {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector quantizer gives the scalar one's bytes for random rows, rows whose scaled
    /// values sit exactly on halves (where rounding to even would differ), zeros, and blocks
    /// with NaNs and infinities.
    #[test]
    fn vector_quantization_equals_the_scalar_rounding() {
        let mut rows: Vec<Vec<f32>> = (0..50)
            .map(|r| {
                (0..128)
                    .map(|i| (((i * 7919 + r * 104729) % 2001) as f32 - 1000.0) * 0.0137 * (1 + r % 5) as f32)
                    .collect()
            })
            .collect();
        // max |x| = 127, so d = 1 and x / d = x: every value a tie.
        let mut ties: Vec<f32> = (0..32).map(|i| i as f32 - 15.5).collect();
        ties[31] = 127.0;
        ties[30] = -126.5;
        rows.push(ties.repeat(2));
        rows.push(vec![0.0; 64]);
        let mut odd = rows[0].clone();
        odd[3] = f32::NAN;
        odd[40] = f32::INFINITY;
        odd[70] = f32::NEG_INFINITY;
        rows.push(odd);
        for x in &rows {
            let got = Q8Row::quantize(x);
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                // The narrower kernel too, where the dispatch took the wider one.
                let mut avx2 = Q8Row {
                    q: vec![0; x.len()],
                    ..Default::default()
                };
                // SAFETY: the CPU has AVX2.
                unsafe { quantize_blocks_avx2(x, &mut avx2.q, &mut avx2.d, &mut avx2.sum16) };
                assert_eq!((&avx2.q, &avx2.d, &avx2.sum16), (&got.q, &got.d, &got.sum16));
            }
            let mut want = Q8Row {
                q: vec![0; x.len()],
                ..Default::default()
            };
            for (xb, qb) in x.chunks_exact(ACT_BLOCK).zip(want.q.chunks_exact_mut(ACT_BLOCK)) {
                want.d
                    .push(quantize_block(xb.try_into().unwrap(), qb.try_into().unwrap()));
            }
            assert_eq!(got.q, want.q);
            assert_eq!(
                got.d.iter().map(|d| d.to_bits()).collect::<Vec<_>>(),
                want.d.iter().map(|d| d.to_bits()).collect::<Vec<_>>()
            );
            let sums: Vec<i32> = want
                .q
                .chunks_exact(16)
                .map(|h| h.iter().map(|&q| q as i32).sum())
                .collect();
            assert_eq!(got.sum16, sums);
            let qsums: Vec<i32> = sums.chunks_exact(2).map(|h| h[0] + h[1]).collect();
            assert_eq!(got.qsums(), qsums);
            let dsums = want.d.iter().zip(&qsums).map(|(&d, &q)| (d * q as f32).to_bits());
            assert!(got.dsums().iter().map(|v| v.to_bits()).eq(dsums));
            // A row's buffers reused for another row give what a fresh row gives.
            let mut reused = Q8Row::quantize(&rows[0][..64]);
            reused.quantize_into(x);
            assert_eq!((&reused.q, &reused.d, &reused.sum16), (&got.q, &got.d, &got.sum16));
            assert_eq!(reused.qsums(), got.qsums());
            assert!(reused
                .dsums()
                .iter()
                .map(|v| v.to_bits())
                .eq(got.dsums().iter().map(|v| v.to_bits())));
        }
        // K-quant spans (256 values a scale) get the scalar scale too, NaNs passed over.
        for span in rows[..50].concat().chunks_exact(SUPER) {
            let d = quantize_span(span, &mut [0i8; SUPER], &mut Vec::new());
            assert_eq!(d.to_bits(), span_scale(span).to_bits());
        }
        let mut spans = rows[0].repeat(4);
        spans[5] = f32::NAN;
        spans[255] = f32::NAN;
        spans[300] = f32::NAN;
        spans[301] = f32::INFINITY;
        for span in spans.chunks_exact(SUPER) {
            let d = quantize_span(span, &mut [0i8; SUPER], &mut Vec::new());
            assert_eq!(
                d.to_bits(),
                span_scale(span).to_bits(),
                "a span with a NaN or an infinity"
            );
        }
        // K-quant rows' sums of 16, vector blocks and scalar ones (the NaN spans).
        for x in [rows[..50].concat(), spans] {
            let row = Q8KRow::quantize(&x);
            let sums: Vec<i16> = row
                .q
                .chunks_exact(16)
                .map(|h| h.iter().map(|&q| q as i16).sum())
                .collect();
            assert_eq!(row.sums16, sums);
        }
        // The ties went away from zero: -15.5 → -16, 0.5 → 1, -126.5 → -127.
        let tied = Q8Row::quantize(&rows[50]);
        assert_eq!((tied.q[0], tied.q[16], tied.q[30]), (-16, 1, -127));
    }

    /// Random-looking but valid blocks: scales are small finite f16s.
    fn blocks(dtype: GgmlType, count: usize) -> Vec<u8> {
        let (_, bytes) = dtype.block_layout();
        let mut data: Vec<u8> = (0..count * bytes).map(|i| ((i * 2654435761usize) >> 7) as u8).collect();
        let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
        for b in data.chunks_exact_mut(bytes) {
            match dtype {
                GgmlType::Q6K => b[208..210].copy_from_slice(&f16(0.01)),
                GgmlType::Q3K => b[108..110].copy_from_slice(&f16(0.01)),
                GgmlType::Q2K => {
                    b[80..82].copy_from_slice(&f16(0.02));
                    b[82..84].copy_from_slice(&f16(0.01));
                }
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
        for dtype in [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K, IQ4NL, IQ4XS] {
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
        }
    }
}

/// Whether the int8 dots run their AVX-512 kernels (`vpdpbusd` on 512-bit registers): where the
/// CPU has AVX-512 F/BW/VL/VNNI, unless `BBC_AVX512=0`. Their results are bit for bit the AVX2
/// kernels', so the switch only changes the speed.
pub fn wide_int8() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *WIDE.get_or_init(|| {
            std::env::var("BBC_AVX512").map_or(true, |v| v != "0")
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512vnni")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the AVX-512 kernels over the 32-weight formats, Q4_K, Q5_K and Q6_K take AMX tiles
/// for steps of many tokens (prefill chunks, large batches): where [`wide_int8`] holds and AMX
/// is usable ([`amx::usable`](super::amx::usable); `BBC_AMX=0` turns it off). The tiles compute
/// the same exact integer sums, and the float work after them is the AVX-512 kernel's, so the
/// bits are the same.
pub fn amx_int8() -> bool {
    wide_int8() && super::amx::usable()
}

/// Whether the 256-bit kernels sum their products with AVX-VNNI (`vpdpbusd` on 256-bit
/// registers, one instruction where `pmaddubsw` then `pmaddwd` take two): where the CPU has it
/// (Intel since Alder Lake, AMD since Zen 5), unless `BBC_AVX_VNNI=0`. The same integers, so
/// the same bits; for CPUs without AVX-512, which run the wide kernels instead.
pub fn vnni_int8() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *VNNI.get_or_init(|| {
            std::env::var("BBC_AVX_VNNI").map_or(true, |v| v != "0") && std::arch::is_x86_feature_detected!("avxvnni")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the CPU has AVX2, FMA and F16C, which every x86 kernel here needs.
fn avx2_fma_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Which kernel an int8 matmul over interleaved rows runs: all give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Kernel {
    /// Plain Rust, for CPUs without AVX2, FMA and F16C (and other architectures).
    Portable,
    Avx2,
    /// The AVX2 kernel with AVX-VNNI's dot ([`vnni_int8`]).
    AvxVnni,
    /// 512-bit registers ([`wide_int8`]).
    Avx512,
    /// The AVX-512 kernels, with AMX tiles ([`amx_int8`]) computing whole 16-token tiles of
    /// the 32-weight formats' and Q4_K's to Q6_K's products (`interleaved`, `interleaved_k`);
    /// the same bits.
    Amx,
}

impl Int8Kernel {
    /// The fastest this CPU runs (as the switches allow).
    pub fn detected() -> Self {
        if !avx2_fma_f16c() {
            return Self::Portable;
        }
        match (wide_int8(), vnni_int8()) {
            (true, _) if amx_int8() => Self::Amx,
            (true, _) => Self::Avx512,
            (false, true) => Self::AvxVnni,
            (false, false) => Self::Avx2,
        }
    }

    /// Every kernel this CPU runs, switches aside (to check them against each other).
    pub fn available() -> Vec<Self> {
        let mut kernels = vec![Self::Portable];
        #[cfg(target_arch = "x86_64")]
        if avx2_fma_f16c() {
            kernels.push(Self::Avx2);
            if std::arch::is_x86_feature_detected!("avxvnni") {
                kernels.push(Self::AvxVnni);
            }
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512vnni")
            {
                kernels.push(Self::Avx512);
                if super::amx::usable() {
                    kernels.push(Self::Amx);
                }
            }
        }
        kernels
    }
}
