//! The inner loops of the CPU backend, with the instruction set chosen at run time: AVX2+FMA
//! where the CPU has it, a portable loop elsewhere. Both are the same Rust body; the AVX2
//! variant is compiled with the features enabled so LLVM vectorises it to 256-bit FMAs.
//!
//! The forms over rows (`dots`, `axpys` and their many-vector forms: attention's scores and
//! weighted sums over KV cache rows) take rows of any [`KvElement`], widened as loaded, so a
//! narrow row gives the bits of the f32 row of its values.

use super::kv_element::KvElement;

/// Sixteen independent accumulators: enough to hide FMA latency on two 8-wide ports.
const LANES: usize = 16;
// `dots_many_avx2` holds a vector's `LANES` accumulators in two 8-wide registers.
const _: () = assert!(LANES == 16);

#[inline(always)]
fn dot_body<const FMA: bool, T: KvElement>(a: &[f32], b: &[T]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; LANES];
    let chunks = n / LANES;
    for c in 0..chunks {
        let (x, y) = (&a[c * LANES..c * LANES + LANES], &b[c * LANES..c * LANES + LANES]);
        for i in 0..LANES {
            acc[i] = if FMA {
                x[i].mul_add(y[i].widen(), acc[i])
            } else {
                acc[i] + x[i] * y[i].widen()
            };
        }
    }
    for i in chunks * LANES..n {
        acc[i % LANES] += a[i] * b[i].widen();
    }
    reduce(acc)
}

/// Pairwise reduction: a fixed order, so results are deterministic.
#[inline(always)]
pub(super) fn reduce(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0]
}

#[inline(always)]
fn dots_body<const FMA: bool, T: KvElement>(a: &[f32], rows: &[&[T]], out: &mut [f32]) {
    for (o, row) in out.iter_mut().zip(rows) {
        *o = dot_body::<FMA, T>(a, row);
    }
}

/// Elements of `y` held in registers while every row adds into them.
const AXPY_CHUNK: usize = 32;

/// [`axpy_body`] for each row in order, `y` kept in registers a chunk at a time across the
/// rows: every element sees the same operations in the same order as row-by-row `axpy`.
#[inline(always)]
fn axpys_body<const FMA: bool, T: KvElement>(alphas: &[f32], rows: &[&[T]], y: &mut [f32]) {
    if rows.iter().any(|row| row.len() < y.len()) {
        rows.iter()
            .zip(alphas)
            .for_each(|(row, &alpha)| axpy_body::<FMA, T>(alpha, row, y));
        return;
    }
    for (c, out) in y.chunks_mut(AXPY_CHUNK).enumerate() {
        let at = c * AXPY_CHUNK;
        match out.len() {
            AXPY_CHUNK => {
                let mut acc = [0f32; AXPY_CHUNK];
                acc.copy_from_slice(out);
                for (row, &alpha) in rows.iter().zip(alphas) {
                    axpy_body::<FMA, T>(alpha, &row[at..at + AXPY_CHUNK], &mut acc);
                }
                out.copy_from_slice(&acc);
            }
            len => {
                for (row, &alpha) in rows.iter().zip(alphas) {
                    axpy_body::<FMA, T>(alpha, &row[at..at + len], out);
                }
            }
        }
    }
}

#[inline(always)]
fn axpy_body<const FMA: bool, T: KvElement>(alpha: f32, x: &[T], y: &mut [f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        let xi = xi.widen();
        *yi = if FMA { xi.mul_add(alpha, *yi) } else { *yi + xi * alpha };
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_body::<true, f32>(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(alpha: f32, x: &[f32], y: &mut [f32]) {
    axpy_body::<true, f32>(alpha, x, y)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots_avx2<T: KvElement>(a: &[f32], rows: &[&[T]], out: &mut [f32]) {
    dots_body::<true, T>(a, rows, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpys_avx2<T: KvElement>(alphas: &[f32], rows: &[&[T]], y: &mut [f32]) {
    axpys_body::<true, T>(alphas, rows, y)
}

/// `dots` for `G` vectors, each 16-element chunk of a row loaded once for all of them. Written
/// with intrinsics (LLVM keeps `G` sets of [`dot_body`]'s accumulators on the stack otherwise):
/// lane `i` of a vector's two registers is `dot_body`'s `acc[i]`, the same FMA chain, then
/// `dot_body`'s tail and reduction.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots_many_avx2<const G: usize, T: KvElement>(a: &[&[f32]; G], rows: &[&[T]], out: &mut [&mut [f32]; G]) {
    use std::arch::x86_64::*;
    let len = a[0].len();
    assert!(a.iter().all(|v| v.len() == len), "vectors of one length");
    for (r, b) in rows.iter().enumerate() {
        let n = len.min(b.len());
        let chunks = n / LANES;
        let mut acc = [[_mm256_setzero_ps(); 2]; G];
        for c in 0..chunks {
            // SAFETY: (c + 1)·LANES ≤ n, within `b` and every vector.
            unsafe {
                let at = c * LANES;
                let y = [T::load8(b.as_ptr().add(at)), T::load8(b.as_ptr().add(at + 8))];
                for g in 0..G {
                    let x = a[g].as_ptr().add(at);
                    acc[g][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x), y[0], acc[g][0]);
                    acc[g][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(8)), y[1], acc[g][1]);
                }
            }
        }
        for g in 0..G {
            let mut lanes = [0f32; LANES];
            // SAFETY: `lanes` holds two registers' floats.
            unsafe {
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc[g][0]);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[g][1]);
            }
            for i in chunks * LANES..n {
                lanes[i % LANES] += a[g][i] * b[i].widen();
            }
            out[g][r] = reduce(lanes);
        }
    }
}

/// `axpys` for `G` outputs, each 16-element chunk of a row loaded once for all of them and
/// each output's chunk held in two registers across the rows: every element sees
/// [`axpy_body`]'s FMAs in row order (intrinsics for the reason `dots_many_avx2` gives).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpys_many_avx2<const G: usize, T: KvElement>(alphas: &[&[f32]; G], rows: &[&[T]], y: &mut [&mut [f32]; G]) {
    use std::arch::x86_64::*;
    let len = y[0].len();
    assert!(y.iter().all(|y| y.len() == len), "outputs of one length");
    assert!(alphas.iter().all(|a| a.len() >= rows.len()), "a weight per row");
    if rows.iter().any(|row| row.len() < len) {
        for (y, alphas) in y.iter_mut().zip(alphas) {
            axpys_body::<true, T>(alphas, rows, y);
        }
        return;
    }
    const CHUNK: usize = 16;
    let whole = len / CHUNK * CHUNK;
    for at in (0..whole).step_by(CHUNK) {
        // SAFETY: at + CHUNK ≤ len, within every output and (checked above) every row.
        unsafe {
            let mut acc: [[__m256; 2]; G] = std::array::from_fn(|g| {
                let p = y[g].as_ptr().add(at);
                [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
            });
            for (r, row) in rows.iter().enumerate() {
                let p = row.as_ptr().add(at);
                let x = [T::load8(p), T::load8(p.add(8))];
                for g in 0..G {
                    let alpha = _mm256_set1_ps(*alphas[g].get_unchecked(r));
                    acc[g][0] = _mm256_fmadd_ps(x[0], alpha, acc[g][0]);
                    acc[g][1] = _mm256_fmadd_ps(x[1], alpha, acc[g][1]);
                }
            }
            for g in 0..G {
                let p = y[g].as_mut_ptr().add(at);
                _mm256_storeu_ps(p, acc[g][0]);
                _mm256_storeu_ps(p.add(8), acc[g][1]);
            }
        }
    }
    axpys_many_tail(alphas, rows, y, whole);
}

/// The elements from `from` on of `axpys_many`'s outputs (past its last whole register chunk),
/// row by row. Nothing where there are none: the loop over every output and row, slicing
/// and checking bounds, cost as much as the FMAs before it even with nothing to add.
#[inline(always)]
fn axpys_many_tail<const G: usize, T: KvElement>(
    alphas: &[&[f32]; G],
    rows: &[&[T]],
    y: &mut [&mut [f32]; G],
    from: usize,
) {
    let len = y[0].len();
    if from == len {
        return;
    }
    for (y, alphas) in y.iter_mut().zip(alphas) {
        for (row, &alpha) in rows.iter().zip(alphas.iter()) {
            axpy_body::<true, T>(alpha, &row[from..len], &mut y[from..]);
        }
    }
}

/// The many-vector forms on 512-bit registers: a vector's sixteen lanes (`dot_body`'s `acc`)
/// in one register, so a tile of products and the vectors' chunks fit the 32 registers.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{axpys_many_tail, KvElement, LANES};
    use crate::cpu::quant::prefetch;
    use std::arch::x86_64::*;

    /// How many cache rows ahead the many-vector forms ask for rows.
    const ROWS_AHEAD: usize = 32;

    /// `dots_many_avx2`'s products for vectors whose length is a multiple of 16, rows at
    /// least as long and outputs with a place for every row: sixteen products at a time
    /// (`16 / G` rows × `G` vectors), their sums reduced together ([`reduce16`]) and each
    /// vector's stored at once, rather than each sum through memory.
    ///
    /// AVX-512VL lets LLVM zero accumulators above the sixteenth register (see
    /// `cpu::dense`'s `tile512`).
    #[target_feature(enable = "avx512f,avx512vl")]
    pub(super) unsafe fn dots_many<const G: usize, T: KvElement>(
        a: &[&[f32]; G],
        rows: &[&[T]],
        out: &mut [&mut [f32]; G],
    ) {
        let len = a[0].len();
        debug_assert!(len.is_multiple_of(LANES) && rows.iter().all(|r| r.len() >= len));
        let batch = 16 / G;
        for first in (0..rows.len()).step_by(batch) {
            let count = batch.min(rows.len() - first);
            // A short last batch repeats its first row; those products are dropped.
            let row: [*const T; 16] = std::array::from_fn(|b| rows[first + if b < count { b } else { 0 }].as_ptr());
            // The rows `ROWS_AHEAD` on (cache rows lie apart, a KV head's part of each
            // position's row), asked for as these are read (see `crate::cpu::quant::prefetch`),
            // where there are that many.
            let ahead = rows.get(first + ROWS_AHEAD..first + ROWS_AHEAD + batch);
            let mut acc = [_mm512_setzero_ps(); 16];
            for at in (0..len).step_by(LANES) {
                // SAFETY: at + 16 ≤ len, within every vector and row.
                unsafe {
                    let x: [__m512; G] = std::array::from_fn(|g| _mm512_loadu_ps(a[g].as_ptr().add(at)));
                    for (b, &row) in row.iter().enumerate().take(batch) {
                        if let Some(ahead) = ahead {
                            prefetch::line(ahead[b].as_ptr().wrapping_add(at).cast());
                        }
                        let y = T::load16(row.add(at));
                        for (g, &x) in x.iter().enumerate() {
                            acc[b * G + g] = _mm512_fmadd_ps(x, y, acc[b * G + g]);
                        }
                    }
                }
            }
            // `reduce16` leaves the sum of its register `L / 4 + 4·(L % 4)` in lane `L`: handing
            // it vector `g`'s product with row `b` there for `L = g·batch + b` puts each
            // vector's sums over the batch in consecutive lanes, stored at once.
            let sums = reduce16(std::array::from_fn(|s| {
                let lane = 4 * (s % 4) + s / 4;
                let (g, b) = (lane / batch, lane % batch);
                if g < G {
                    acc[b * G + g]
                } else {
                    _mm512_setzero_ps()
                }
            }));
            let rows_kept = u16::MAX >> (16 - count);
            for (g, out) in out.iter_mut().enumerate() {
                // Lanes `g·batch .. g·batch + count` to `out[first ..]`: the store's base lies
                // `g·batch` floats before that (never touched: its lanes are masked off).
                let base = out.as_mut_ptr().wrapping_add(first).wrapping_sub(g * batch);
                // SAFETY: the lanes stored land on `out[first .. first + count]`, inside `out`
                // (`dots_many` asserts a place for every row).
                unsafe { _mm512_mask_storeu_ps(base, rows_kept << (g * batch), sums) };
            }
        }
    }

    /// `super::reduce` of each of sixteen registers' lanes, all at once, into one register whose
    /// lane `4j + m` holds register `j + 4m`'s sum: each stage adds the lanes `reduce` adds (`i`
    /// and `i + width`, width 8, 4, 2, 1), shuffled so that two registers' halves meet in one
    /// addition.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce16(v: [__m512; 16]) -> __m512 {
        // Width 8: register k holds sums 2k (lanes 0–7) and 2k + 1 (lanes 8–15).
        let w: [__m512; 8] = std::array::from_fn(|k| {
            let (a, b) = (v[2 * k], v[2 * k + 1]);
            _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(a, b), _mm512_shuffle_f32x4::<0xEE>(a, b))
        });
        // Width 4: register k holds sums 4k … 4k + 3, four lanes each.
        let x: [__m512; 4] = std::array::from_fn(|k| {
            let (a, b) = (w[2 * k], w[2 * k + 1]);
            _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(a, b), _mm512_shuffle_f32x4::<0xDD>(a, b))
        });
        // Width 2: quarter j of register k holds sums 8k + j and 8k + 4 + j, two lanes each.
        let y: [__m512; 2] = std::array::from_fn(|k| {
            let (a, b) = (x[2 * k], x[2 * k + 1]);
            _mm512_add_ps(_mm512_shuffle_ps::<0x44>(a, b), _mm512_shuffle_ps::<0xEE>(a, b))
        });
        // Width 1: lane 4j + m holds sum j + 4m.
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(y[0], y[1]),
            _mm512_shuffle_ps::<0xDD>(y[0], y[1]),
        )
    }

    /// `axpys_many_avx2` with each output's 16-element chunk in one register, for rows at least
    /// as long as the outputs: spans of four chunks at a time, so that `4·G` chains of FMAs
    /// (each element's, in row order) hide the FMA's latency, then single chunks, then the
    /// tail past the last 16.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub(super) unsafe fn axpys_many<const G: usize, T: KvElement>(
        alphas: &[&[f32]; G],
        rows: &[&[T]],
        y: &mut [&mut [f32]; G],
    ) {
        let len = y[0].len();
        debug_assert!(rows.iter().all(|row| row.len() >= len));
        // Sixteen chains at most, so the accumulators stay in registers.
        let at = match G {
            // SAFETY: `spans` keeps its spans within the outputs; rows are as long.
            ..=4 => unsafe { spans::<G, 4, T>(alphas, rows, y, 0) },
            // SAFETY: as above.
            5..=8 => unsafe { spans::<G, 2, T>(alphas, rows, y, 0) },
            _ => 0,
        };
        // SAFETY: as above.
        let whole = unsafe { spans::<G, 1, T>(alphas, rows, y, at) };
        axpys_many_tail(alphas, rows, y, whole);
    }

    /// [`axpys_span`] over whole spans of `C` chunks from `from` while they fit the outputs;
    /// where they stopped.
    ///
    /// # Safety
    /// As `axpys_span`'s, for spans within `y[0].len()`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl")]
    unsafe fn spans<const G: usize, const C: usize, T: KvElement>(
        alphas: &[&[f32]; G],
        rows: &[&[T]],
        y: &mut [&mut [f32]; G],
        from: usize,
    ) -> usize {
        let span = C * LANES;
        let end = from + (y[0].len() - from) / span * span;
        for at in (from..end).step_by(span) {
            // SAFETY: at + span ≤ end ≤ len, within every output and (the caller's promise)
            // every row.
            unsafe { axpys_span::<G, C, T>(alphas, rows, y, at) };
        }
        end
    }

    /// Elements `at .. at + 16·C` of every output, held in `G·C` registers across the rows.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `at + 16·C` is within every output and row; every `alphas[g]` has
    /// a weight per row.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl")]
    unsafe fn axpys_span<const G: usize, const C: usize, T: KvElement>(
        alphas: &[&[f32]; G],
        rows: &[&[T]],
        y: &mut [&mut [f32]; G],
        at: usize,
    ) {
        // SAFETY: as the caller promises.
        unsafe {
            let mut acc: [[__m512; C]; G] =
                std::array::from_fn(|g| std::array::from_fn(|c| _mm512_loadu_ps(y[g].as_ptr().add(at + LANES * c))));
            for (r, row) in rows.iter().enumerate() {
                if let Some(ahead) = rows.get(r + ROWS_AHEAD) {
                    for c in 0..C {
                        prefetch::line(ahead.as_ptr().wrapping_add(at + LANES * c).cast());
                    }
                }
                let x: [__m512; C] = std::array::from_fn(|c| T::load16(row.as_ptr().add(at + LANES * c)));
                for (g, acc) in acc.iter_mut().enumerate() {
                    let alpha = _mm512_set1_ps(*alphas[g].get_unchecked(r));
                    for (acc, &x) in acc.iter_mut().zip(&x) {
                        *acc = _mm512_fmadd_ps(x, alpha, *acc);
                    }
                }
            }
            for (g, acc) in acc.iter().enumerate() {
                for (c, acc) in acc.iter().enumerate() {
                    _mm512_storeu_ps(y[g].as_mut_ptr().add(at + LANES * c), *acc);
                }
            }
        }
    }
}

/// Whether the many-vector forms run on 512-bit registers for vectors of `len`, where up to
/// sixteen vectors' products fit the registers (with 256-bit ones, four).
pub fn wide_many(len: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return has_avx512() && len.is_multiple_of(LANES);
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Defines `$name` to run `$body` (an `#[inline(always)]` function of the same arguments)
/// compiled for the widest vector instructions the CPU has: AVX-512 (F and VL) where
/// [`has_avx512`] says so, else AVX2, else as written. The compiler vectorises the one source
/// for each width; loops written without fused multiply-adds give the same bits at every one.
macro_rules! widest_vectors {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? => $body:path) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if $crate::cpu::simd::has_avx512() {
                    // SAFETY: the CPU has AVX-512F and VL (checked above).
                    return unsafe { avx512($($arg),*) };
                }
                if std::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2 (checked above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use widest_vectors;

/// Whether the many-vector forms (and `dense`'s tiles) run on 512-bit registers: AVX-512F and
/// VL, unless `BBC_AVX512=0` (the same bits either way).
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        std::env::var("BBC_AVX512").map_or(true, |v| v != "0")
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vl")
            && has_avx2_fma()
    })
}

#[cfg(target_arch = "x86_64")]
pub(super) fn has_avx2_fma() -> bool {
    use std::sync::OnceLock;
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        // F16C (every AVX2 CPU has it) widens half cache rows.
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    })
}

/// `Σ a[i]·b[i]` over the shorter length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { dot_avx2(a, b) };
    }
    dot_body::<false, f32>(a, b)
}

/// `y += alpha·x`.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: as in `dot`.
        return unsafe { axpy_avx2(alpha, x, y) };
    }
    axpy_body::<false, f32>(alpha, x, y)
}

/// `out[r] = dot(a, rows[r])`, bit for bit (rows widened), in one call (one feature check
/// for all rows).
#[inline]
pub fn dots<T: KvElement>(a: &[f32], rows: &[&[T]], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
        return unsafe { dots_avx2(a, rows, out) };
    }
    dots_body::<false, T>(a, rows, out)
}

/// `axpy(alphas[r], rows[r], y)` for each row in order, bit for bit (rows widened), `y` held
/// in registers.
#[inline]
pub fn axpys<T: KvElement>(alphas: &[f32], rows: &[&[T]], y: &mut [f32]) {
    // Sixteen lanes a register where AVX-512 runs: `axpys_many`'s one-vector form, the same
    // FMA for every element in the same row order (attention's rows outside a shared span of
    // positions took 2.5% of a SmolLM2 prefill on eight lanes).
    #[cfg(target_arch = "x86_64")]
    if has_avx512() && alphas.len() >= rows.len() && rows.iter().all(|row| row.len() >= y.len()) {
        // SAFETY: the CPU has AVX-512F and VL (checked above); lengths as it wants them.
        return unsafe { avx512::axpys_many::<1, T>(&[alphas], rows, &mut [y]) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: as in `dots`.
        return unsafe { axpys_avx2(alphas, rows, y) };
    }
    axpys_body::<false, T>(alphas, rows, y)
}

/// The most vectors the many-vector forms take in one call: their accumulators then fill half
/// the 16 vector registers.
pub const MANY: usize = 4;

/// `out[g][r] = dot(a[g], rows[r])`, bit for bit, for `G` vectors of one length (the query
/// heads sharing a KV head), each cache row read once for all of them.
#[inline]
pub fn dots_many<const G: usize, T: KvElement>(a: &[&[f32]; G], rows: &[&[T]], out: &mut [&mut [f32]; G]) {
    let len = a[0].len();
    assert!(a.iter().all(|v| v.len() == len), "vectors of one length");
    assert!(out.iter().all(|o| o.len() >= rows.len()), "a place for every row's dot");
    #[cfg(target_arch = "x86_64")]
    if has_avx512() && len.is_multiple_of(LANES) && rows.iter().all(|r| r.len() >= len) {
        // SAFETY: the CPU has AVX-512F and VL (checked above); lengths as it wants them.
        return unsafe { avx512::dots_many::<G, T>(a, rows, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: as in `dot`.
        return unsafe { dots_many_avx2::<G, T>(a, rows, out) };
    }
    for (a, out) in a.iter().zip(out.iter_mut()) {
        dots_body::<false, T>(a, rows, out);
    }
}

/// `axpys(alphas[g], rows, y[g])` for each `g`, bit for bit, each row read once for all.
#[inline]
pub fn axpys_many<const G: usize, T: KvElement>(alphas: &[&[f32]; G], rows: &[&[T]], y: &mut [&mut [f32]; G]) {
    let len = y[0].len();
    assert!(y.iter().all(|y| y.len() == len), "outputs of one length");
    assert!(alphas.iter().all(|a| a.len() >= rows.len()), "a weight per row");
    #[cfg(target_arch = "x86_64")]
    if has_avx512() && rows.iter().all(|row| row.len() >= len) {
        // SAFETY: the CPU has AVX-512F and VL (checked above); lengths as it wants them.
        return unsafe { avx512::axpys_many::<G, T>(alphas, rows, y) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: as in `dot`.
        return unsafe { axpys_many_avx2::<G, T>(alphas, rows, y) };
    }
    for (alphas, y) in alphas.iter().zip(y.iter_mut()) {
        axpys_body::<false, T>(alphas, rows, y);
    }
}

/// Which instruction set the kernels use here, for reports.
pub fn isa() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        return if crate::cpu::quant::int8::wide_int8() {
            "avx2+fma, avx512-vnni int8 dots"
        } else {
            "avx2+fma"
        };
    }
    "portable"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_f64_sum_at_ragged_lengths() {
        for n in [0, 1, 7, 16, 17, 100, 577] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.25).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.5).collect();
            let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-4, "n = {n}");
            assert!(
                (dot_body::<false, f32>(&a, &b) as f64 - want).abs() < 1e-4,
                "portable, n = {n}"
            );
        }
    }

    /// The batched forms give exactly what the one-row forms give, at ragged lengths and row
    /// counts (a partial group of four, a partial register chunk).
    #[test]
    fn dots_and_axpys_equal_their_one_row_forms_bit_for_bit() {
        for (n, count) in [(64, 9), (256, 4), (17, 3), (100, 6), (1, 1)] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.137).collect();
            let rows: Vec<Vec<f32>> = (0..count)
                .map(|r| (0..n).map(|i| ((i * 13 + r * 7) % 23) as f32 * 0.071 - 0.8).collect())
                .collect();
            let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
            let mut got = vec![0f32; count];
            dots(&a, &refs, &mut got);
            let want: Vec<f32> = refs.iter().map(|r| dot(&a, r)).collect();
            assert_eq!(bits(&got), bits(&want), "dots, n = {n}");
            let alphas: Vec<f32> = (0..count).map(|r| 0.3 + r as f32 * 0.11).collect();
            let (mut got, mut want) = (a.clone(), a.clone());
            axpys(&alphas, &refs, &mut got);
            refs.iter()
                .zip(&alphas)
                .for_each(|(r, &alpha)| axpy(alpha, r, &mut want));
            assert_eq!(bits(&got), bits(&want), "axpys, n = {n}");
        }
    }

    /// The many-vector forms give each vector exactly its `dots` / `axpys` result, for one to
    /// four vectors and for attention's tiles' eight and twelve, at ragged lengths (a partial register chunk, a tail past the last 16) and
    /// row counts (several of the 512-bit form's batches, a short last one).
    #[test]
    fn many_vector_forms_equal_the_one_vector_forms_bit_for_bit() {
        many_vector_forms_agree::<1>();
        many_vector_forms_agree::<2>();
        many_vector_forms_agree::<3>();
        many_vector_forms_agree::<4>();
        // Attention's tiles of four rows: the weighted sums in spans of two chunks, and of one.
        many_vector_forms_agree::<8>();
        many_vector_forms_agree::<12>();
    }

    fn many_vector_forms_agree<const G: usize>() {
        for (n, count) in [
            (64, 9),
            (256, 4),
            (17, 3),
            (100, 6),
            (1, 1),
            (40, 0),
            (32, 37),
            (128, 16),
        ] {
            let vector =
                |g: usize| -> Vec<f32> { (0..n).map(|i| ((i * 37 + g * 5) % 11) as f32 * 0.137 - 0.6).collect() };
            let a: [Vec<f32>; G] = std::array::from_fn(vector);
            let a: [&[f32]; G] = std::array::from_fn(|g| a[g].as_slice());
            let rows: Vec<Vec<f32>> = (0..count)
                .map(|r| (0..n).map(|i| ((i * 13 + r * 7) % 23) as f32 * 0.071 - 0.8).collect())
                .collect();
            let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
            // Each output sits between sixteen sentinels on either side, which the 512-bit
            // form's masked stores must leave as they were.
            const PAD: usize = 16;
            let mut padded: [Vec<f32>; G] = std::array::from_fn(|_| vec![-7.0; PAD + count + PAD]);
            let mut outs = padded.each_mut().map(|p| &mut p[PAD..PAD + count]);
            dots_many(&a, &refs, &mut outs);
            for (g, padded) in padded.iter().enumerate() {
                let (before, rest) = padded.split_at(PAD);
                let (got, after) = rest.split_at(count);
                assert!(
                    before.iter().chain(after).all(|&x| x == -7.0),
                    "dots_many::<{G}> wrote outside its outputs, {count} rows"
                );
                let mut want = vec![0f32; count];
                dots(a[g], &refs, &mut want);
                assert_eq!(
                    bits(got),
                    bits(&want),
                    "dots_many::<{G}>, n = {n}, {count} rows, vector {g}"
                );
            }
            let alphas: [Vec<f32>; G] =
                std::array::from_fn(|g| (0..count).map(|r| 0.3 + (r + g) as f32 * 0.11).collect());
            let alphas: [&[f32]; G] = std::array::from_fn(|g| alphas[g].as_slice());
            let mut got: [Vec<f32>; G] = std::array::from_fn(|g| vector(G + g));
            let want: Vec<Vec<f32>> = got
                .iter()
                .zip(alphas)
                .map(|(y, alphas)| {
                    let mut y = y.clone();
                    axpys(alphas, &refs, &mut y);
                    y
                })
                .collect();
            let mut outs = got.each_mut().map(Vec::as_mut_slice);
            axpys_many(&alphas, &refs, &mut outs);
            for g in 0..G {
                assert_eq!(bits(&got[g]), bits(&want[g]), "axpys_many::<{G}>, n = {n}, vector {g}");
            }
        }
    }

    /// Rows stored narrow give, in every form, the bits their widened f32 rows give.
    #[test]
    fn narrow_rows_give_the_bits_of_their_widened_rows() {
        narrow_rows_agree::<half::bf16>();
        narrow_rows_agree::<half::f16>();
    }

    fn narrow_rows_agree<T: KvElement>() {
        for (n, count) in [(64, 9), (128, 16), (17, 3), (100, 6), (32, 37)] {
            let vector =
                |g: usize| -> Vec<f32> { (0..n).map(|i| ((i * 37 + g * 5) % 11) as f32 * 0.137 - 0.6).collect() };
            let narrow: Vec<Vec<T>> = (0..count)
                .map(|r| {
                    (0..n)
                        .map(|i| T::narrow(((i * 13 + r * 7) % 23) as f32 * 0.071 - 0.8))
                        .collect()
                })
                .collect();
            let wide: Vec<Vec<f32>> = narrow.iter().map(|r| r.iter().map(|x| x.widen()).collect()).collect();
            let narrow: Vec<&[T]> = narrow.iter().map(Vec::as_slice).collect();
            let wide: Vec<&[f32]> = wide.iter().map(Vec::as_slice).collect();
            let a: [Vec<f32>; 3] = std::array::from_fn(vector);
            let a: [&[f32]; 3] = std::array::from_fn(|g| a[g].as_slice());
            let (mut got, mut want) = (
                [vec![0f32; count], vec![0f32; count], vec![0f32; count]],
                [vec![0f32; count], vec![0f32; count], vec![0f32; count]],
            );
            dots_many(&a, &narrow, &mut got.each_mut().map(Vec::as_mut_slice));
            dots_many(&a, &wide, &mut want.each_mut().map(Vec::as_mut_slice));
            assert_eq!(got.map(|v| bits(&v)), want.map(|v| bits(&v)), "dots_many, n = {n}");
            let (mut got, mut want) = (vec![0f32; count], vec![0f32; count]);
            dots(a[0], &narrow, &mut got);
            dots(a[0], &wide, &mut want);
            assert_eq!(bits(&got), bits(&want), "dots, n = {n}");
            let alphas: [Vec<f32>; 3] =
                std::array::from_fn(|g| (0..count).map(|r| 0.3 + (r + g) as f32 * 0.11).collect());
            let alphas: [&[f32]; 3] = std::array::from_fn(|g| alphas[g].as_slice());
            let (mut got, mut want): ([Vec<f32>; 3], [Vec<f32>; 3]) =
                (std::array::from_fn(vector), std::array::from_fn(vector));
            axpys_many(&alphas, &narrow, &mut got.each_mut().map(Vec::as_mut_slice));
            axpys_many(&alphas, &wide, &mut want.each_mut().map(Vec::as_mut_slice));
            assert_eq!(got.map(|v| bits(&v)), want.map(|v| bits(&v)), "axpys_many, n = {n}");
            let (mut got, mut want) = (vector(0), vector(0));
            axpys(alphas[0], &narrow, &mut got);
            axpys(alphas[0], &wide, &mut want);
            assert_eq!(bits(&got), bits(&want), "axpys, n = {n}");
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn axpy_adds_scaled() {
        let mut y = vec![1.0f32; 19];
        let x: Vec<f32> = (0..19).map(|i| i as f32).collect();
        axpy(2.0, &x, &mut y);
        assert!(y.iter().enumerate().all(|(i, &v)| v == 1.0 + 2.0 * i as f32));
    }
}
