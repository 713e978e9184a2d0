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
    /// Per pair of blocks (an even one and the odd one after it, zeros past the end):
    /// `[d_even, d_odd, dsum_even, dsum_odd]`, what the packed tiles multiply a weight pair's
    /// `[scale_even, scale_odd, coef_even, coef_odd]` by, in one instruction. `dsum` is a
    /// block's `d · Σ qx`, what its offset term (its min, or the zero point of a signed
    /// format) multiplies ([`Q8Row::dsum`]).
    pub pair_factors: Vec<f32>,
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
        #[cfg(target_arch = "x86_64")]
        let avx2 = std::is_x86_feature_detected!("avx2");
        for (xb, qb) in x.chunks_exact(ACT_BLOCK).zip(self.q.chunks_exact_mut(ACT_BLOCK)) {
            let xb: &[f32; ACT_BLOCK] = xb.try_into().expect("whole blocks");
            let qb: &mut [i8; ACT_BLOCK] = qb.try_into().expect("whole blocks");
            // The vector path's scale, where it took the block.
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX2 where `avx2` is set.
            let vector = if avx2 {
                unsafe { quantize_block_avx2(xb, qb) }
            } else {
                None
            };
            #[cfg(not(target_arch = "x86_64"))]
            let vector: Option<f32> = None;
            let d = vector.unwrap_or_else(|| quantize_block(xb, qb));
            self.d.push(d);
            for half in qb.chunks_exact(16) {
                self.sum16.push(half.iter().map(|&q| q as i32).sum());
            }
        }
        self.pair_factors.clear();
        let blocks = self.d.len();
        let dsum = |b: usize| self.d[b] * (self.sum16[2 * b] + self.sum16[2 * b + 1]) as f32;
        for b in (0..blocks).step_by(2) {
            let (d_odd, dsum_odd) = match b + 1 < blocks {
                true => (self.d[b + 1], dsum(b + 1)),
                false => (0.0, 0.0),
            };
            self.pair_factors.extend([self.d[b], d_odd, dsum(b), dsum_odd]);
        }
    }

    /// Block `block`'s `d · Σ qx` (kept in [`Q8Row::pair_factors`]).
    pub fn dsum(&self, block: usize) -> f32 {
        self.pair_factors[4 * (block / 2) + 2 + block % 2]
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

fn round_scalar(x: &[f32], inv: f32, q: &mut [i8]) {
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * inv).round() as i8;
    }
}

/// [`quantize_block`] over a span of whole 32-element blocks with one scale for all of it
/// (the K-quant dots' 256-element activation blocks); the scale.
pub(crate) fn quantize_span(x: &[f32], q: &mut [i8]) -> f32 {
    let d = span_scale(x);
    let inv = inverse(d);
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::is_x86_feature_detected!("avx2");
    for (xb, qb) in x.chunks_exact(ACT_BLOCK).zip(q.chunks_exact_mut(ACT_BLOCK)) {
        let xb: &[f32; ACT_BLOCK] = xb.try_into().expect("whole blocks");
        let qb: &mut [i8; ACT_BLOCK] = qb.try_into().expect("whole blocks");
        // SAFETY: the CPU has AVX2 where `avx2` is set.
        #[cfg(target_arch = "x86_64")]
        if avx2 && unsafe { all_finite_avx2(xb) } {
            unsafe { round_block_avx2(xb, inv, qb) };
            continue;
        }
        round_scalar(xb, inv, qb);
    }
    d
}

/// [`quantize_block`] eight lanes at a time, bit for bit (halves rounded away from zero as
/// `f32::round` does, not to even as the vector unit would); the scale, or `None`, writing
/// nothing, for a block holding a NaN or an infinity, which the scalar code handles.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(xb: &[f32; ACT_BLOCK], qb: &mut [i8; ACT_BLOCK]) -> Option<f32> {
    // SAFETY: AVX2 is enabled for this function.
    unsafe {
        if !all_finite_avx2(xb) {
            return None;
        }
        let d = span_scale(xb);
        round_block_avx2(xb, inverse(d), qb);
        Some(d)
    }
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

/// [`round_scalar`] eight lanes at a time, bit for bit, for a block of finite values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn round_block_avx2(xb: &[f32; ACT_BLOCK], inv: f32, qb: &mut [i8; ACT_BLOCK]) {
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
    }
}

/// A weight group and its activation group, with the weight group's scale and min.
type GroupPair<'a> = ((&'a [i8], &'a [i8]), (&'a f32, &'a f32));

/// A weight row unpacked once (for many activation rows): integers, and per group scale/min.
/// The portable path, for CPUs the packed kernel ([`PackedDot`]) does not run on; K-quant
/// matmuls take [`super::int8_superblock`] instead.
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

    /// `out[t] = self.dot(&acts[t])` for every activation row.
    pub fn dot_many(&self, acts: &[Q8Row], out: &mut [f32]) {
        debug_assert_eq!(acts.len(), out.len());
        for (act, d) in acts.iter().zip(out) {
            *d = self.dot(act);
        }
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
        }
    }
}

/// `Σ y·x` straight from a row of 32-element blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) without
/// unpacking it:
/// llama.cpp's `vec_dot_q4_1_q8_1` scheme with AVX2 (`pmaddubsw` on the packed nibbles).
/// `None` for other formats or CPUs without AVX2, where the unpacked path applies.
pub fn dot_packed(dtype: GgmlType, row: &[u8], act: &Q8Row) -> Option<f32> {
    let kernel = PackedDot::new(dtype, row.len(), std::slice::from_ref(act))?;
    let mut out = [0f32];
    kernel.run(row, std::slice::from_ref(act), &mut out);
    Some(out[0])
}

/// Whether the packed dot runs its AVX-512 kernel (`vpdpbusd` on 512-bit registers, two
/// blocks an instruction): where the CPU has AVX-512 F/BW/VL/VNNI, unless `BBC_AVX512=0`. Its
/// results are bit for bit the AVX2 kernel's, so the switch only changes the speed.
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

/// Whether the AVX2 kernel sums its products with AVX-VNNI (`vpdpbusd` on 256-bit registers,
/// one instruction where `pmaddubsw` then `pmaddwd` take two): where the CPU has it (Intel
/// since Alder Lake, AMD since Zen 5), unless `BBC_AVX_VNNI=0`. The same integers, so the
/// same bits; for CPUs without AVX-512, which runs the wide kernel instead.
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

/// Which kernel a packed dot runs: all give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Kernel {
    /// Plain Rust, for CPUs without AVX2, FMA and F16C (and other architectures).
    Portable,
    Avx2,
    /// The AVX2 kernel with AVX-VNNI's dot ([`vnni_int8`]).
    AvxVnni,
    /// Two blocks a 512-bit register ([`wide_int8`]).
    Avx512,
}

impl Int8Kernel {
    /// The fastest this CPU runs (as the switches allow).
    pub fn detected() -> Self {
        if !avx2_fma_f16c() {
            return Self::Portable;
        }
        match (wide_int8(), vnni_int8()) {
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
            }
        }
        kernels
    }
}

/// The packed dot for one matmul, its preconditions (format, CPU features, activation
/// lengths) checked once rather than per row. Each result is bit for bit what [`dot_packed`]
/// gives for that activation alone, however many are computed together (one kernel computes
/// every lane the same way), so a token's logits do not depend on its step's size.
#[derive(Debug, Clone, Copy)]
pub struct PackedDot {
    dtype: GgmlType,
    /// Bytes a row holds, whose blocks every activation covers.
    row_bytes: usize,
    kernel: Int8Kernel,
}

impl PackedDot {
    /// For rows of `row_bytes` against `acts`; `None` where the unpacked path must be used.
    pub fn new(dtype: GgmlType, row_bytes: usize, acts: &[Q8Row]) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if matches!(
            dtype,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0
        ) && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
        {
            let blocks = row_bytes / dtype.block_layout().1;
            let fits = |a: &Q8Row| {
                a.q.len() >= blocks * ACT_BLOCK && a.d.len() >= blocks && a.pair_factors.len() >= 4 * blocks.div_ceil(2)
            };
            return acts.iter().all(fits).then_some(Self {
                dtype,
                row_bytes,
                kernel: Int8Kernel::detected(),
            });
        }
        let _ = (dtype, row_bytes, acts);
        None
    }

    /// The same dot on `kernel`, which the caller has checked the CPU runs (to check one
    /// against another).
    #[cfg(test)]
    fn on(self, kernel: Int8Kernel) -> Self {
        Self { kernel, ..self }
    }

    /// `out[t] = row · acts[t]` for a row of the length given to `new`.
    pub fn run(&self, row: &[u8], acts: &[Q8Row], out: &mut [f32]) {
        self.run_with(row, acts, out, &mut Vec::new())
    }

    /// As [`run`](Self::run); `scratch` holds the row's decoded blocks when enough activations
    /// share it (reuse it across rows to spare the allocation).
    pub fn run_with(&self, row: &[u8], acts: &[Q8Row], out: &mut [f32], scratch: &mut Vec<u8>) {
        // The kernels read each activation unchecked up to the row's length.
        assert!(row.len() <= self.row_bytes, "a row longer than `new` was told");
        #[cfg(target_arch = "x86_64")]
        {
            use packed_x86::{run, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
            let kernel = self.kernel;
            match self.dtype {
                GgmlType::Q4_0 => run::<Q4_0>(row, acts, out, scratch, kernel),
                GgmlType::Q4_1 => run::<Q4_1>(row, acts, out, scratch, kernel),
                GgmlType::Q5_0 => run::<Q5_0>(row, acts, out, scratch, kernel),
                GgmlType::Q5_1 => run::<Q5_1>(row, acts, out, scratch, kernel),
                _ => run::<Q8_0>(row, acts, out, scratch, kernel),
            }
        }
        // Elsewhere `new` gives no kernel, so nothing gets here.
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (self.dtype, self.kernel, row, acts, out, scratch);
    }
}

/// The AVX2 kernel: per weight block, its 32 weights decoded once into a register, then
/// multiplied into up to [`TILE`] activation rows whose accumulators stay in registers. The
/// format is a type parameter, so each instance's inner loop has no branch on it.
#[cfg(target_arch = "x86_64")]
mod packed_x86 {
    use super::{Int8Kernel, Q8Row, ACT_BLOCK};
    use std::arch::x86_64::*;

    /// Activation rows per pass over a weight row: 4 rows × 2 accumulators fill 8 of the 16
    /// vector registers.
    const TILE: usize = 4;

    /// A 32-element block format: `y = d·w + offset` per element.
    pub trait Format {
        const BYTES: usize;
        /// The block's scale `d` (an f16 in its first two bytes).
        #[inline(always)]
        unsafe fn scale(block: *const u8) -> f32 {
            unsafe { f16_at(block, 0) }
        }
        /// The 32 weights in element order: unsigned nibbles for Q4, signed bytes for Q8_0.
        unsafe fn weights(block: *const u8) -> __m256i;
        /// Pairwise `w·qx` sums as i16 (`pmaddubsw` wants its first operand unsigned, as the
        /// 4- and 5-bit formats' weights are).
        #[inline(always)]
        unsafe fn products(w: __m256i, qx: __m256i) -> __m256i {
            _mm256_maddubs_epi16(w, qx)
        }
        /// The same sums as `pmaddwd(products, 1)`, by AVX-VNNI: each i32 lane the four
        /// neighbouring products (weights unsigned), exactly.
        #[inline(always)]
        unsafe fn dots_vnni(w: __m256i, qx: __m256i) -> __m256i {
            _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, qx)
        }
        /// What multiplies `dx·Σqx` in the block's contribution, given its scale `d`.
        unsafe fn offset(block: *const u8, d: f32) -> f32;
        /// The wide kernel's products: two blocks' weights against their 64 activations, each
        /// i32 lane the sum of four neighbouring products (`vpdpbusd`, weights unsigned), the
        /// same integers `pmaddubsw` then `pmaddwd` give.
        #[inline(always)]
        unsafe fn dots_wide(w: __m512i, qx: __m512i) -> __m512i {
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, qx)
        }
    }

    /// What the AVX-512 tile reads: a row as pairs of blocks (an even block and the odd one
    /// after it), and where the count is odd, its last block alone.
    pub trait PairFormat {
        /// Bytes from one pair to the next.
        const PAIR_BYTES: usize;
        /// The bytes a row of `blocks` blocks takes.
        fn row_bytes(blocks: usize) -> usize;
        /// The pair at `at`: both blocks' weights (the even block's in the low half), and
        /// `[scale_even, scale_odd, coef_even, coef_odd]` (their scales and offset
        /// coefficients).
        unsafe fn pair(at: *const u8) -> (__m512i, __m128);
        /// The lone last block at `at`: its weights in the low half (the high half anything),
        /// its scale and its offset coefficient.
        unsafe fn lone(at: *const u8) -> (__m512i, f32, f32);
        /// As [`Format::dots_wide`].
        unsafe fn dots_wide(w: __m512i, qx: __m512i) -> __m512i;
    }

    /// Straight off the packed blocks.
    impl<F: Format> PairFormat for F {
        const PAIR_BYTES: usize = 2 * F::BYTES;
        fn row_bytes(blocks: usize) -> usize {
            blocks * F::BYTES
        }
        #[inline(always)]
        unsafe fn pair(at: *const u8) -> (__m512i, __m128) {
            unsafe {
                let (w, even_scale, even_coef) = Self::lone(at);
                let odd = at.add(F::BYTES);
                let odd_scale = F::scale(odd);
                let odd_coef = F::offset(odd, odd_scale);
                (
                    _mm512_inserti64x4(w, F::weights(odd), 1),
                    _mm_setr_ps(even_scale, odd_scale, even_coef, odd_coef),
                )
            }
        }
        #[inline(always)]
        unsafe fn lone(at: *const u8) -> (__m512i, f32, f32) {
            unsafe {
                let scale = F::scale(at);
                (_mm512_castsi256_si512(F::weights(at)), scale, F::offset(at, scale))
            }
        }
        #[inline(always)]
        unsafe fn dots_wide(w: __m512i, qx: __m512i) -> __m512i {
            unsafe { F::dots_wide(w, qx) }
        }
    }

    pub struct Q4_0;
    pub struct Q4_1;
    pub struct Q5_0;
    pub struct Q5_1;
    pub struct Q8_0;

    /// Bytes `at..at+2` of a block as an f16, widened.
    #[inline(always)]
    unsafe fn f16_at(block: *const u8, at: usize) -> f32 {
        // SAFETY (caller): the block holds the two bytes; F16C is enabled where this inlines.
        let bits = unsafe { std::ptr::read_unaligned(block.add(at) as *const u16) };
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// 16 bytes of nibbles as 32 bytes: the low nibbles (elements 0..16), then the high ones.
    #[inline(always)]
    unsafe fn nibbles(at: *const u8) -> __m256i {
        // SAFETY (caller): 16 bytes are readable at `at`.
        let packed = unsafe { _mm_loadu_si128(at as *const __m128i) };
        let low = _mm_set1_epi8(0x0F);
        _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16(packed, 4), low),
            _mm_and_si128(packed, low),
        )
    }

    impl Format for Q4_0 {
        const BYTES: usize = 18;
        #[inline(always)]
        unsafe fn weights(block: *const u8) -> __m256i {
            unsafe { nibbles(block.add(2)) }
        }
        /// Q4_0 stores w + 8: Σ(w − 8)·x = Σw·x − 8·Σx.
        #[inline(always)]
        unsafe fn offset(_: *const u8, d: f32) -> f32 {
            -8.0 * d
        }
    }

    impl Format for Q4_1 {
        const BYTES: usize = 20;
        #[inline(always)]
        unsafe fn weights(block: *const u8) -> __m256i {
            unsafe { nibbles(block.add(4)) }
        }
        /// Q4_1: y = d·w + m.
        #[inline(always)]
        unsafe fn offset(block: *const u8, _: f32) -> f32 {
            unsafe { f16_at(block, 2) }
        }
    }

    /// 16 bytes of nibbles and the 32 high bits before them (`qh`, little-endian, bit `i` for
    /// element `i`) as 32 five-bit values in element order (ggml's `bytes_from_bits_32`).
    #[inline(always)]
    unsafe fn five_bits(qh: *const u8, qs: *const u8) -> __m256i {
        // SAFETY (caller): 4 bytes at `qh` and 16 at `qs` are readable.
        let bits = unsafe { std::ptr::read_unaligned(qh as *const u32) };
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits as i32),
            _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0),
        );
        // Byte i keeps bit (i % 8) of its source byte: all ones where that bit is set.
        let set = _mm256_cmpeq_epi8(
            _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
            _mm256_set1_epi64x(-1),
        );
        _mm256_or_si256(unsafe { nibbles(qs) }, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
    }

    impl Format for Q5_0 {
        const BYTES: usize = 22;
        #[inline(always)]
        unsafe fn weights(block: *const u8) -> __m256i {
            unsafe { five_bits(block.add(2), block.add(6)) }
        }
        /// Q5_0 stores w + 16.
        #[inline(always)]
        unsafe fn offset(_: *const u8, d: f32) -> f32 {
            -16.0 * d
        }
    }

    impl Format for Q5_1 {
        const BYTES: usize = 24;
        #[inline(always)]
        unsafe fn weights(block: *const u8) -> __m256i {
            unsafe { five_bits(block.add(4), block.add(8)) }
        }
        /// Q5_1: y = d·w + m.
        #[inline(always)]
        unsafe fn offset(block: *const u8, _: f32) -> f32 {
            unsafe { f16_at(block, 2) }
        }
    }

    impl Format for Q8_0 {
        const BYTES: usize = 34;
        #[inline(always)]
        unsafe fn weights(block: *const u8) -> __m256i {
            unsafe { _mm256_loadu_si256(block.add(2) as *const __m256i) }
        }
        /// |w| against qx carrying w's sign.
        #[inline(always)]
        unsafe fn products(w: __m256i, qx: __m256i) -> __m256i {
            _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(qx, w))
        }
        #[inline(always)]
        unsafe fn dots_vnni(w: __m256i, qx: __m256i) -> __m256i {
            _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(qx, w))
        }
        #[inline(always)]
        unsafe fn offset(_: *const u8, _: f32) -> f32 {
            0.0
        }
        /// |w| against qx negated where w is negative (AVX-512 has no `vpsignb`; where w is 0
        /// the product is 0 either way). |−128| stays 0x80, read unsigned as 128, as before.
        #[inline(always)]
        unsafe fn dots_wide(w: __m512i, qx: __m512i) -> __m512i {
            let zero = _mm512_setzero_si512();
            let signed = _mm512_mask_sub_epi8(qx, _mm512_movepi8_mask(w), zero, qx);
            _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(w), signed)
        }
    }

    /// From this many activations, a row's blocks are decoded once (into `scratch`) rather
    /// than once per tile.
    const DECODE_ONCE_FROM: usize = 2 * TILE;

    /// `kernel`: one the caller has checked the CPU runs.
    pub fn run<F: Format>(row: &[u8], acts: &[Q8Row], out: &mut [f32], scratch: &mut Vec<u8>, kernel: Int8Kernel) {
        let blocks = row.len() / F::BYTES;
        let decode_once = acts.len() >= DECODE_ONCE_FROM;
        let vnni = kernel == Int8Kernel::AvxVnni;
        // SAFETY (decoding): as for `tile`: `PackedDot::new` checked the CPU's features.
        match (kernel == Int8Kernel::Avx512, decode_once) {
            (false, false) => tiles::<F>(row, acts, out, vnni),
            (false, true) => {
                unsafe { decode_row::<F>(row, scratch) };
                tiles::<Decoded<F>>(scratch, acts, out, vnni)
            }
            (true, false) => tiles_wide::<F>(row, blocks, acts, out),
            (true, true) => {
                unsafe { decode_pairs::<F>(row, scratch) };
                tiles_wide::<DecodedPairs<F>>(scratch, blocks, acts, out)
            }
        }
    }

    /// `vnni`: sum the products with AVX-VNNI, which the caller has checked the CPU has.
    fn tiles<F: Format>(row: &[u8], acts: &[Q8Row], out: &mut [f32], vnni: bool) {
        for (acts, out) in acts.chunks(TILE).zip(out.chunks_mut(TILE)) {
            // SAFETY: `PackedDot::new` checked AVX2/FMA/F16C (and `vnni_int8` AVX-VNNI) and
            // that every activation covers the row's blocks; the tile width is a constant so
            // the accumulators stay in registers.
            unsafe {
                match (vnni, acts.len()) {
                    (false, 1) => tile::<F, 1>(row, acts, out),
                    (false, 2) => tile::<F, 2>(row, acts, out),
                    (false, 3) => tile::<F, 3>(row, acts, out),
                    (false, _) => tile::<F, TILE>(row, acts, out),
                    (true, 1) => tile_vnni::<F, 1>(row, acts, out),
                    (true, 2) => tile_vnni::<F, 2>(row, acts, out),
                    (true, 3) => tile_vnni::<F, 3>(row, acts, out),
                    (true, _) => tile_vnni::<F, TILE>(row, acts, out),
                }
            }
        }
    }

    fn tiles_wide<P: PairFormat>(row: &[u8], blocks: usize, acts: &[Q8Row], out: &mut [f32]) {
        // Every unchecked read of `tile_wide` stays inside this.
        assert!(row.len() >= P::row_bytes(blocks));
        for (acts, out) in acts.chunks(TILE).zip(out.chunks_mut(TILE)) {
            // SAFETY: as in `tiles`, and `wide_int8` checked the AVX-512 features.
            unsafe {
                match acts.len() {
                    1 => tile_wide::<P, 1>(row, blocks, acts, out),
                    2 => tile_wide::<P, 2>(row, blocks, acts, out),
                    3 => tile_wide::<P, 3>(row, blocks, acts, out),
                    _ => tile_wide::<P, TILE>(row, blocks, acts, out),
                }
            }
        }
    }

    /// A block of format `F` decoded: its 32 weights as `F::weights` gives them, then its
    /// scale and its offset coefficient as f32. The tile reads exactly the values it would
    /// compute from the packed block, so results are bit for bit the same.
    pub struct Decoded<F>(std::marker::PhantomData<F>);

    const DECODED_BYTES: usize = 32 + 4 + 4;

    impl<F: Format> Format for Decoded<F> {
        const BYTES: usize = DECODED_BYTES;
        #[inline(always)]
        unsafe fn scale(block: *const u8) -> f32 {
            unsafe { std::ptr::read_unaligned(block.add(32) as *const f32) }
        }
        #[inline(always)]
        unsafe fn weights(block: *const u8) -> __m256i {
            unsafe { _mm256_loadu_si256(block as *const __m256i) }
        }
        #[inline(always)]
        unsafe fn products(w: __m256i, qx: __m256i) -> __m256i {
            unsafe { F::products(w, qx) }
        }
        #[inline(always)]
        unsafe fn dots_vnni(w: __m256i, qx: __m256i) -> __m256i {
            unsafe { F::dots_vnni(w, qx) }
        }
        #[inline(always)]
        unsafe fn offset(block: *const u8, _: f32) -> f32 {
            unsafe { std::ptr::read_unaligned(block.add(36) as *const f32) }
        }
        #[inline(always)]
        unsafe fn dots_wide(w: __m512i, qx: __m512i) -> __m512i {
            unsafe { F::dots_wide(w, qx) }
        }
    }

    /// A pair of blocks of format `F` decoded for the AVX-512 tile: both blocks' 64 weights
    /// (one load), then `[even scale, odd scale, even coefficient, odd coefficient]` as f32
    /// (one more). A lone last block's odd half is left as it was: `lone` reads only the even
    /// half's factors, and its weights' high half meets zeroed activations.
    pub struct DecodedPairs<F>(std::marker::PhantomData<F>);

    const DECODED_PAIR_BYTES: usize = 64 + 4 * 4;

    impl<F: Format> PairFormat for DecodedPairs<F> {
        const PAIR_BYTES: usize = DECODED_PAIR_BYTES;
        fn row_bytes(blocks: usize) -> usize {
            blocks.div_ceil(2) * DECODED_PAIR_BYTES
        }
        #[inline(always)]
        unsafe fn pair(at: *const u8) -> (__m512i, __m128) {
            unsafe {
                (
                    _mm512_loadu_si512(at as *const _),
                    _mm_loadu_ps(at.add(64) as *const f32),
                )
            }
        }
        #[inline(always)]
        unsafe fn lone(at: *const u8) -> (__m512i, f32, f32) {
            unsafe {
                let read = |i: usize| std::ptr::read_unaligned(at.add(64 + 4 * i) as *const f32);
                (_mm512_loadu_si512(at as *const _), read(0), read(2))
            }
        }
        #[inline(always)]
        unsafe fn dots_wide(w: __m512i, qx: __m512i) -> __m512i {
            unsafe { F::dots_wide(w, qx) }
        }
    }

    /// Decode every pair of blocks of `row` into `out` (`DecodedPairs<F>`'s layout).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode_pairs<F: Format>(row: &[u8], out: &mut Vec<u8>) {
        let blocks = row.len() / F::BYTES;
        out.resize(blocks.div_ceil(2) * DECODED_PAIR_BYTES, 0);
        for b in 0..blocks {
            // SAFETY: block `b` lies within `row` and its decoded place within `out`.
            unsafe {
                let block = row.as_ptr().add(b * F::BYTES);
                let at = out.as_mut_ptr().add(b / 2 * DECODED_PAIR_BYTES);
                let (half, scale) = (b % 2, F::scale(block));
                _mm256_storeu_si256(at.add(32 * half) as *mut __m256i, F::weights(block));
                std::ptr::write_unaligned(at.add(64 + 4 * half) as *mut f32, scale);
                std::ptr::write_unaligned(at.add(72 + 4 * half) as *mut f32, F::offset(block, scale));
            }
        }
    }

    /// Decode every block of `row` into `out` (`Decoded<F>`'s layout).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode_row<F: Format>(row: &[u8], out: &mut Vec<u8>) {
        let blocks = row.len() / F::BYTES;
        out.resize(blocks * DECODED_BYTES, 0);
        for b in 0..blocks {
            // SAFETY: block `b` lies within `row` and its decoded place within `out`.
            unsafe {
                let block = row.as_ptr().add(b * F::BYTES);
                let at = out.as_mut_ptr().add(b * DECODED_BYTES);
                let scale = F::scale(block);
                _mm256_storeu_si256(at as *mut __m256i, F::weights(block));
                std::ptr::write_unaligned(at.add(32) as *mut f32, scale);
                std::ptr::write_unaligned(at.add(36) as *mut f32, F::offset(block, scale));
            }
        }
    }

    /// `out[t] = row · acts[t]` for `N` activations. Every lane runs the same operations in the
    /// same order, so a lane's result does not depend on `N` or on its neighbours.
    ///
    /// Two accumulators per row, for even and odd blocks: two independent FMA chains, so a
    /// one-row tile (decode) is not bound by the FMA latency; every tile width keeps the same
    /// two, so a row's result never depends on the width. Blocks go in pairs: one multiply of
    /// the pair's `[scale, scale, coef, coef]` by the activation's `pair_factors` gives both
    /// blocks' `scale·dx` and both offset terms (lanes 2 and 3 of `offset`, each a multiply
    /// then an add, as a scalar would round them).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<F: Format, const N: usize>(row: &[u8], acts: &[Q8Row], out: &mut [f32]) {
        unsafe { tile_with::<F, N, false>(row, acts, out) }
    }

    /// [`tile`] summing its products with AVX-VNNI: the same integers, so the same bits.
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn tile_vnni<F: Format, const N: usize>(row: &[u8], acts: &[Q8Row], out: &mut [f32]) {
        unsafe { tile_with::<F, N, true>(row, acts, out) }
    }

    /// The body of [`tile`] and [`tile_vnni`], inlined into each (whose target features it
    /// then has).
    #[inline(always)]
    unsafe fn tile_with<F: Format, const N: usize, const VNNI: bool>(row: &[u8], acts: &[Q8Row], out: &mut [f32]) {
        let ones = _mm256_set1_epi16(1);
        let dots = |w: __m256i, qx: __m256i| match VNNI {
            // SAFETY: the callers enable AVX2, and AVX-VNNI where `VNNI`.
            true => unsafe { F::dots_vnni(w, qx) },
            false => unsafe { _mm256_madd_epi16(F::products(w, qx), ones) },
        };
        // Loop-invariant pointers into each activation, hoisted out of the block loop.
        let q: [*const i8; N] = std::array::from_fn(|t| acts[t].q.as_ptr());
        let d: [*const f32; N] = std::array::from_fn(|t| acts[t].d.as_ptr());
        let pair_factors: [*const f32; N] = std::array::from_fn(|t| acts[t].pair_factors.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); N]; 2];
        let mut offset = [_mm_setzero_ps(); N];
        let blocks = row.len() / F::BYTES;
        let pairs = blocks / 2;
        for p in 0..pairs {
            // SAFETY: blocks 2p and 2p + 1 lie within `row`; the caller checked every
            // activation holds them (their quants and pair factors).
            unsafe {
                let even = row.as_ptr().add(2 * p * F::BYTES);
                let odd = even.add(F::BYTES);
                let (even_scale, odd_scale) = (F::scale(even), F::scale(odd));
                let factors = _mm_setr_ps(
                    even_scale,
                    odd_scale,
                    F::offset(even, even_scale),
                    F::offset(odd, odd_scale),
                );
                let w = [F::weights(even), F::weights(odd)];
                for t in 0..N {
                    let products = _mm_mul_ps(factors, _mm_loadu_ps(pair_factors[t].add(4 * p)));
                    let scaled = [
                        _mm256_broadcastss_ps(products),
                        _mm256_broadcastss_ps(_mm_movehdup_ps(products)),
                    ];
                    for parity in 0..2 {
                        let at = q[t].add((2 * p + parity) * ACT_BLOCK);
                        let qx = _mm256_loadu_si256(at as *const __m256i);
                        let sums = _mm256_cvtepi32_ps(dots(w[parity], qx));
                        acc[parity][t] = _mm256_fmadd_ps(sums, scaled[parity], acc[parity][t]);
                    }
                    offset[t] = _mm_add_ps(offset[t], products);
                }
            }
        }
        if blocks % 2 == 1 {
            let b = blocks - 1;
            // SAFETY: as above, for the lone last block.
            unsafe {
                let block = row.as_ptr().add(b * F::BYTES);
                let scale = F::scale(block);
                let coef = F::offset(block, scale);
                let w = F::weights(block);
                for t in 0..N {
                    let qx = _mm256_loadu_si256(q[t].add(b * ACT_BLOCK) as *const __m256i);
                    let sums = _mm256_cvtepi32_ps(dots(w, qx));
                    acc[0][t] = _mm256_fmadd_ps(sums, _mm256_set1_ps(scale * *d[t].add(b)), acc[0][t]);
                    // Lane 2 alone: adding 0 elsewhere could turn a −0 odd offset into +0.
                    let added = _mm_add_ps(offset[t], _mm_set1_ps(coef * acts[t].dsum(b)));
                    offset[t] = _mm_blend_ps(offset[t], added, 0b0100);
                }
            }
        }
        for t in 0..N {
            // SAFETY: `__m128` is four f32.
            let [_, _, even, odd] = unsafe { std::mem::transmute::<__m128, [f32; 4]>(offset[t]) };
            out[t] = finish(_mm256_add_ps(acc[0][t], acc[1][t]), even + odd);
        }
    }

    /// A row's result from its eight lane sums (even and odd blocks added) and its offset
    /// terms, in the one order both kernels use.
    #[inline(always)]
    fn finish(sums: __m256, offset: f32) -> f32 {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds eight f32; the callers enable AVX.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sums) };
        let total = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
        total + offset
    }

    /// Lanes 8..16 (with AVX-512F alone: `vextractf32x8` wants DQ).
    #[inline(always)]
    fn high_half(v: __m512) -> __m256 {
        // SAFETY: the callers enable AVX-512F.
        unsafe { _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)) }
    }

    /// [`tile`] with AVX-512, bit for bit: an even block and the odd one after it share one
    /// 512-bit register, so the accumulator's low half is `tile`'s even-block accumulator and
    /// its high half the odd one, each lane's products, scales and FMAs the same values in
    /// the same order (`vpdpbusd` sums the four products `pmaddubsw` + `pmaddwd` do, exactly).
    /// Half the vector instructions a block, and the same tokens on every x86 CPU.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile_wide<P: PairFormat, const N: usize>(row: &[u8], blocks: usize, acts: &[Q8Row], out: &mut [f32]) {
        let q: [*const i8; N] = std::array::from_fn(|t| acts[t].q.as_ptr());
        let d: [*const f32; N] = std::array::from_fn(|t| acts[t].d.as_ptr());
        let pair_factors: [*const f32; N] = std::array::from_fn(|t| acts[t].pair_factors.as_ptr());
        let mut acc = [_mm512_setzero_ps(); N];
        // Lanes 2 and 3: `tile`'s even- and odd-block offsets (each lane a multiply, then an
        // add, as the scalar code rounds); lanes 0 and 1 add up scale products nobody reads.
        let mut offset = [_mm_setzero_ps(); N];
        // Lane i of a block pair's scales goes to accumulator lanes 8i..8i+8.
        let halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let pairs = blocks / 2;
        for p in 0..pairs {
            let b = 2 * p;
            // SAFETY: pair p lies within `row` (`tiles_wide` checked its length); the caller
            // checked every activation holds every block (32 quants, its scale and its d·Σq)
            // and the CPU's features.
            unsafe {
                let (w, factors) = P::pair(row.as_ptr().add(p * P::PAIR_BYTES));
                for t in 0..N {
                    let qx = _mm512_loadu_si512(q[t].add(b * ACT_BLOCK) as *const _);
                    let sums = _mm512_cvtepi32_ps(P::dots_wide(w, qx));
                    // [scale·dx, scale·dx, coef·dsum, coef·dsum] for the even and odd block.
                    let products = _mm_mul_ps(factors, _mm_loadu_ps(pair_factors[t].add(4 * p)));
                    let scaled = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(products));
                    acc[t] = _mm512_fmadd_ps(sums, scaled, acc[t]);
                    offset[t] = _mm_add_ps(offset[t], products);
                }
            }
        }
        if blocks % 2 == 1 {
            // The last, even block alone: the accumulator's high half (odd blocks) must keep
            // its value, so the FMA is masked to the low half.
            let b = blocks - 1;
            // SAFETY: as above, for the lone block after the pairs.
            unsafe {
                let (w, scale, coef) = P::lone(row.as_ptr().add(pairs * P::PAIR_BYTES));
                for t in 0..N {
                    let qx = _mm512_maskz_loadu_epi8(u32::MAX as u64, q[t].add(b * ACT_BLOCK));
                    let sums = _mm512_cvtepi32_ps(P::dots_wide(w, qx));
                    let scaled = _mm512_set1_ps(scale * *d[t].add(b));
                    acc[t] = _mm512_mask3_fmadd_ps(sums, scaled, acc[t], 0x00FF);
                    // Lane 2 alone: adding 0 elsewhere could turn a −0 odd offset into +0.
                    let term = _mm_set1_ps(coef * acts[t].dsum(b));
                    offset[t] = _mm_mask_add_ps(offset[t], 0b0100, offset[t], term);
                }
            }
        }
        for t in 0..N {
            let sums = _mm256_add_ps(_mm512_castps512_ps256(acc[t]), high_half(acc[t]));
            let [_, _, even, odd] = std::mem::transmute::<__m128, [f32; 4]>(offset[t]);
            out[t] = finish(sums, even + odd);
        }
    }
}

#[cfg(test)]
mod packed_tests {
    use super::*;

    /// The formats the packed kernel reads.
    pub(super) const PACKED: [GgmlType; 5] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
    ];

    #[test]
    fn packed_dot_equals_the_unpacked_dot() {
        for dtype in PACKED {
            let (elements, bytes) = dtype.block_layout();
            let blocks = 18;
            let mut data: Vec<u8> = (0..blocks * bytes)
                .map(|i| ((i * 2654435761usize) >> 9) as u8)
                .collect();
            for b in data.chunks_exact_mut(bytes) {
                b[0..2].copy_from_slice(&half::f16::from_f32(0.02).to_le_bytes());
                if matches!(dtype, GgmlType::Q4_1 | GgmlType::Q5_1) {
                    b[2..4].copy_from_slice(&half::f16::from_f32(-0.1).to_le_bytes());
                }
            }
            let x: Vec<f32> = (0..blocks * elements)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
                .collect();
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

    /// Up to 7 activations tile straight off the packed blocks, from 8 on the row is decoded
    /// once first: both give each activation exactly its one-at-a-time result.
    #[test]
    fn many_rows_at_once_give_each_rows_single_result_exactly() {
        for dtype in super::packed_tests::PACKED {
            let (elements, bytes) = dtype.block_layout();
            let mut data: Vec<u8> = (0..7 * bytes).map(|i| ((i * 2654435761usize) >> 11) as u8).collect();
            for b in data.chunks_exact_mut(bytes) {
                b[0..2].copy_from_slice(&half::f16::from_f32(0.03).to_le_bytes());
                if matches!(dtype, GgmlType::Q4_1 | GgmlType::Q5_1) {
                    b[2..4].copy_from_slice(&half::f16::from_f32(0.05).to_le_bytes());
                }
            }
            let acts: Vec<Q8Row> = (0..13)
                .map(|s| {
                    Q8Row::quantize(
                        &(0..7 * elements)
                            .map(|i| ((i * (s + 3)) % 29) as f32 - 14.0)
                            .collect::<Vec<_>>(),
                    )
                })
                .collect();
            let Some(kernel) = PackedDot::new(dtype, data.len(), &acts) else {
                // Only CPUs without AVX2/FMA/F16C have no packed kernel: `return` here once
                // let every later format go unchecked.
                #[cfg(target_arch = "x86_64")]
                assert!(!std::is_x86_feature_detected!("avx2"), "{dtype:?} has no packed kernel");
                continue;
            };
            for count in [6, 13] {
                let mut many = vec![0f32; count];
                kernel.run(&data, &acts[..count], &mut many);
                for (a, m) in acts.iter().zip(&many) {
                    assert_eq!(m.to_bits(), dot_packed(dtype, &data, a).unwrap().to_bits(), "{dtype:?}");
                }
            }
        }
    }

    /// The AVX-512 kernel and the AVX-VNNI one give the AVX2 kernel's bits: every format, rows
    /// of an odd and an even number of blocks (the odd one's last block alone), every tile
    /// width, packed and decoded rows, and activations with extreme values (|q| = 127 against
    /// Q8_0's −128). Each where the CPU has it (and its switch is not off).
    #[test]
    fn the_wide_and_vnni_kernels_give_the_avx2_kernels_bits() {
        #[cfg(target_arch = "x86_64")]
        assert!(
            wide_int8()
                || !std::is_x86_feature_detected!("avx512vnni")
                || std::env::var("BBC_AVX512").is_ok_and(|v| v == "0"),
            "the CPU has AVX-512 VNNI but the wide kernel is off"
        );
        let kernels = [(wide_int8(), Int8Kernel::Avx512), (vnni_int8(), Int8Kernel::AvxVnni)];
        for kernel in kernels.into_iter().filter(|(runs, _)| *runs).map(|(_, k)| k) {
            gives_the_avx2_kernels_bits(kernel);
        }
    }

    fn gives_the_avx2_kernels_bits(kernel: Int8Kernel) {
        for dtype in super::packed_tests::PACKED {
            let (elements, bytes) = dtype.block_layout();
            for blocks in [1, 6, 7] {
                let mut data: Vec<u8> = (0..blocks * bytes)
                    .map(|i| ((i * 2654435761usize) >> 13) as u8)
                    .collect();
                for (k, b) in data.chunks_exact_mut(bytes).enumerate() {
                    b[0..2].copy_from_slice(&half::f16::from_f32(0.01 + 0.003 * k as f32).to_le_bytes());
                    if matches!(dtype, GgmlType::Q4_1 | GgmlType::Q5_1) {
                        b[2..4].copy_from_slice(&half::f16::from_f32(-0.04).to_le_bytes());
                    }
                }
                if dtype == GgmlType::Q8_0 {
                    data[2] = 0x80;
                    data[3] = 0x7f;
                }
                let acts: Vec<Q8Row> = (0..11)
                    .map(|s| {
                        let mut x: Vec<f32> = (0..blocks * elements)
                            .map(|i| (((i * (s + 5)) % 31) as f32 - 15.0) * (1.0 + s as f32) / 9.0)
                            .collect();
                        x[0] = -40.0;
                        Q8Row::quantize(&x)
                    })
                    .collect();
                let dot = PackedDot::new(dtype, data.len(), &acts).expect("a packed kernel");
                for count in 1..=acts.len() {
                    let (mut got, mut avx2) = (vec![0f32; count], vec![0f32; count]);
                    dot.on(kernel).run(&data, &acts[..count], &mut got);
                    dot.on(Int8Kernel::Avx2).run(&data, &acts[..count], &mut avx2);
                    assert_eq!(
                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        avx2.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{kernel:?}: {dtype:?}, {blocks} blocks, {count} rows"
                    );
                }
            }
        }
    }
}
