//! Intel AMX (Advanced Matrix Extensions, Sapphire Rapids and later Xeons): eight tile
//! registers of up to 16 rows × 64 bytes, and `tdpbssd`, which adds a 16×K signed-byte tile
//! times a K×16 signed-byte tile into a 16×16 tile of i32 sums in one instruction. Where the
//! int8 kernels' `vpdpbusd` advances one token's dot with sixteen rows by four weights, one
//! `tdpbssd` advances sixteen tokens' dots with sixteen rows by 32 or 64 weights: the integer
//! products of a prefill step come from the tiles, and the float work stays on AVX-512.
//!
//! Stable Rust has neither AMX intrinsics nor their feature detection, so this module asks
//! CPUID itself, asks Linux for the permission a process needs before it may touch the tile
//! data (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and issues the instructions in `asm!` blocks
//! naming the tile registers outright. The compiler never allocates those registers, so what
//! one block leaves in a tile is there for the next; `asm!` blocks (none `pure`) keep their
//! order; and a kernel holds the tiles only between its `configure` and its `release`, on
//! its own thread.

/// Whether AMX's int8 tiles are usable here: the CPU has AMX-TILE and AMX-INT8, Linux granted
/// this process the tile data, and `BBC_AMX` is not `0`. Asked once.
pub fn usable() -> bool {
    static USABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USABLE.get_or_init(|| std::env::var("BBC_AMX").map_or(true, |v| v != "0") && detect())
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
    let (tile, int8) = (leaf7.edx >> 24 & 1 == 1, leaf7.edx >> 25 & 1 == 1);
    // SAFETY: arch_prctl with this request only changes what the process may use; a kernel
    // without AMX support answers an error.
    tile && int8 && unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) } == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// What every tile kernel here shares: sixteen tokens a tile, sixteen weight rows (a group of
/// the interleaved layouts) a sum tile.
#[cfg(target_arch = "x86_64")]
pub mod tiles {
    use std::arch::asm;

    /// Rows of the activation and sum tiles: tokens a tile.
    pub const TOKENS: usize = 16;
    /// Steps of fewer tokens than this keep to the AVX-512 kernels: a kernel on tiles unpacks
    /// a group's weights once a call, which a single tile of tokens does not repay (SmolLM2's
    /// decode step at 16 sequences: no faster; at 32, 5% faster; at 64, 10%).
    pub const MIN_TOKENS: usize = 2 * TOKENS;

    /// Whether a step of `tokens` tokens takes the tiles: AMX runs here ([`amx_int8`]) and
    /// the step has at least [`MIN_TOKENS`].
    ///
    /// [`amx_int8`]: crate::cpu::quant::int8::amx_int8
    pub fn pay_for(tokens: usize) -> bool {
        tokens >= MIN_TOKENS && crate::cpu::quant::int8::amx_int8()
    }

    /// Room for a kernel's unpacked weight tiles, aligned to a line and left unwritten: each
    /// kernel writes its tiles before it loads them, and zeroing the 8 KiB once for every group
    /// of sixteen rows was 2% of a 128-token prefill's `perf` samples.
    #[repr(C, align(64))]
    pub struct WeightTiles<const BYTES: usize>(std::mem::MaybeUninit<[u8; BYTES]>);

    impl<const BYTES: usize> WeightTiles<BYTES> {
        pub fn unwritten() -> Self {
            Self(std::mem::MaybeUninit::uninit())
        }

        pub fn as_ptr(&self) -> *const u8 {
            self.0.as_ptr().cast()
        }

        pub fn as_mut_ptr(&mut self) -> *mut u8 {
            self.0.as_mut_ptr().cast()
        }
    }

    /// One tile's i32 sums (`[token][row]`), where a kernel stores them, aligned for the
    /// vector loads that read them back.
    #[repr(C, align(64))]
    pub struct Sums(pub [i32; TOKENS * 16]);

    impl Sums {
        pub fn new() -> Self {
            Self([0; TOKENS * 16])
        }

        pub fn as_mut_ptr(&mut self) -> *mut i32 {
            self.0.as_mut_ptr()
        }

        /// Token `t`'s sixteen sums.
        pub fn token(&self, t: usize) -> *const i32 {
            self.0[t * 16..].as_ptr()
        }
    }

    impl Default for Sums {
        fn default() -> Self {
            Self::new()
        }
    }

    /// Every row's first `len` values one after another: a step's quantized activations as
    /// the activation tiles load them (`stride` = `len`).
    pub fn rows_together<'a, T: Copy + 'a>(rows: impl ExactSizeIterator<Item = &'a [T]>, len: usize) -> Vec<T> {
        let mut all = Vec::with_capacity(rows.len() * len);
        for row in rows {
            all.extend_from_slice(&row[..len]);
        }
        all
    }

    /// `ldtilecfg`'s 64 bytes for palette 1 and tiles of `(tile, rows, bytes a row)`.
    #[repr(C, align(64))]
    pub struct Config([u8; 64]);

    impl Config {
        pub const fn new(shapes: &[(usize, u8, u8)]) -> Self {
            let mut c = [0u8; 64];
            c[0] = 1;
            // colsb at 16 + 2·tile (u16), rows at 48 + tile.
            let mut i = 0;
            while i < shapes.len() {
                let (tile, rows, bytes) = shapes[i];
                c[16 + 2 * tile] = bytes;
                c[48 + tile] = rows;
                i += 1;
            }
            Self(c)
        }

        /// Configures this thread's tiles so (and zeroes them).
        ///
        /// # Safety
        /// [`super::usable`] said yes.
        pub unsafe fn load(&self) {
            // SAFETY: a valid palette-1 configuration; AMX is usable (the caller).
            unsafe { asm!("ldtilecfg [{0}]", in(reg) self.0.as_ptr(), options(nostack, readonly)) };
        }
    }

    /// Returns this thread's tiles to their initial state, so a context switch need not save
    /// them.
    ///
    /// # Safety
    /// [`super::usable`] said yes.
    pub unsafe fn release() {
        // SAFETY: AMX is usable (the caller).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// The tile shapes of the 32-weight block kernels: tokens' quantized activations of one
/// block (16 rows × 32 signed bytes), a group's signed weights of one block in the layout
/// `tdpbssd` reads (8 rows of 4 k × 16 weight rows), and the 16×16 sums.
#[cfg(target_arch = "x86_64")]
pub mod block32 {
    use super::tiles::Config;
    use std::arch::asm;

    /// Bytes of one token's activation row in a tile: one block.
    pub const BLOCK: usize = 32;
    /// Bytes of the weight tile: 8 rows of 64.
    pub const WEIGHT_BYTES: usize = 512;

    /// tmm0 activations (16 × 32 bytes), tmm1 weights (8 × 64), tmm2 sums (16 × 64).
    static CONFIG: Config = Config::new(&[(0, 16, 32), (1, 8, 64), (2, 16, 64)]);

    /// Configures this thread's tiles for the functions below (and zeroes them).
    ///
    /// # Safety
    /// [`super::usable`] said yes.
    pub unsafe fn configure() {
        // SAFETY: as the caller promises.
        unsafe { CONFIG.load() }
    }

    /// Loads a block's weight tile (8 rows of 64 bytes, 64 apart) for the products that follow.
    ///
    /// # Safety
    /// Tiles configured ([`configure`]); `weights` points to [`WEIGHT_BYTES`] readable bytes.
    pub unsafe fn load_weights(weights: *const u8) {
        // SAFETY: the caller's promise.
        unsafe {
            asm!("tileloadd tmm1, [{w} + {stride}*1]", w = in(reg) weights, stride = in(reg) 64usize,
                options(nostack, readonly))
        };
    }

    /// `sums[t][r] = Σ_k acts[t·stride + k]·w[k][r]` over the block (k < 32) for the 16 tokens
    /// `t` and the 16 weight rows `r` of the loaded weight tile; the i32 sums are exact.
    ///
    /// # Safety
    /// Weights loaded ([`load_weights`]); `acts` points to 16 rows of 32 readable bytes,
    /// `stride` apart; `sums` to 256 writable i32.
    pub unsafe fn products(acts: *const i8, stride: usize, sums: *mut i32) {
        // SAFETY: the caller's promise.
        unsafe {
            asm!(
                "tileloadd tmm0, [{a} + {stride}*1]",
                "tilezero tmm2",
                "tdpbssd tmm2, tmm0, tmm1",
                "tilestored [{s} + {row}*1], tmm2",
                a = in(reg) acts, stride = in(reg) stride, s = in(reg) sums, row = in(reg) 64usize,
                options(nostack)
            );
        }
    }

    #[cfg(test)]
    mod tests {
        use super::super::tiles::{release, TOKENS};
        use super::*;

        /// The tiles compute what the integers say, rows and columns where the layout puts
        /// them (a swapped operand or a wrong config gives other sums).
        #[test]
        fn products_are_the_integer_dots() {
            if !crate::cpu::quant::amx::usable() {
                eprintln!("skipped: no AMX here");
                return;
            }
            let stride = 48;
            let acts: Vec<i8> = (0..TOKENS * stride).map(|i| (i * 37 % 251) as u8 as i8).collect();
            let weights: Vec<u8> = (0..WEIGHT_BYTES).map(|i| (i * 91 % 253) as u8).collect();
            // Both operands signed: byte 200 is −56.
            // Weight row r's k-th value: row k / 4 of the tile, byte 4·r + k % 4.
            let w = |k: usize, r: usize| weights[(k / 4) * 64 + 4 * r + k % 4] as i8 as i32;
            let mut tile = [[0i32; 16]; 16];
            // SAFETY: AMX usable (checked); the buffers are as long as the calls read and write.
            unsafe {
                configure();
                load_weights(weights.as_ptr());
                products(acts.as_ptr(), stride, tile.as_mut_ptr().cast());
                release();
            }
            for (t, row) in tile.iter().enumerate() {
                for (r, &got) in row.iter().enumerate() {
                    let want: i32 = (0..BLOCK).map(|k| acts[t * stride + k] as i32 * w(k, r)).sum();
                    assert_eq!(got, want, "token {t} row {r}");
                }
            }
        }
    }
}

/// The tile shapes of the K-quant kernels with their sub-block scales folded into the weights:
/// a super-block's 256 quants of sixteen tokens as four activation tiles of 64 bytes a row,
/// each against two weight tiles of sixteen rows of 64 (Q4_K: `sc·u` split as `8·hi + lo`, the
/// weights times `hi` and times `lo`) or four (Q6_K: the scale's four base-4 digits), summed
/// over the super-block into as many sum tiles.
#[cfg(target_arch = "x86_64")]
pub mod super256 {
    use super::tiles::Config;
    use std::arch::asm;

    /// Bytes of one token's activation row in a tile: a quarter super-block.
    pub const SPAN: usize = 64;
    /// Bytes of a weight tile: 16 rows of 64.
    pub const WEIGHT_BYTES: usize = 1024;

    /// tmm0 activations (16 × 64 bytes), tmm1 weights (16 × 64), tmm2 to tmm5 the sums with
    /// each set of weights (16 × 64).
    static CONFIG: Config = Config::new(&[
        (0, 16, 64),
        (1, 16, 64),
        (2, 16, 64),
        (3, 16, 64),
        (4, 16, 64),
        (5, 16, 64),
    ]);

    /// Configures this thread's tiles for the functions below (and zeroes them).
    ///
    /// # Safety
    /// [`super::usable`] said yes.
    pub unsafe fn configure() {
        // SAFETY: as the caller promises.
        unsafe { CONFIG.load() }
    }

    /// Starts a super-block's sums at zero.
    ///
    /// # Safety
    /// Tiles configured ([`configure`]).
    pub unsafe fn start() {
        // SAFETY: the caller's promise.
        unsafe {
            asm!(
                "tilezero tmm2",
                "tilezero tmm3",
                "tilezero tmm4",
                "tilezero tmm5",
                options(nostack, nomem)
            )
        };
    }

    /// Adds one quarter of the super-block: `hi[t][r] += Σ_k acts[t·stride + k]·w_hi[k][r]`
    /// and the same into `lo` with `w_lo` (k < 64), exactly in i32.
    ///
    /// # Safety
    /// Tiles configured; `acts` points to 16 rows of 64 readable bytes, `stride` apart;
    /// `w_hi` and `w_lo` to [`WEIGHT_BYTES`] readable bytes each.
    pub unsafe fn add_quarter(acts: *const i8, stride: usize, w_hi: *const u8, w_lo: *const u8) {
        // SAFETY: the caller's promise.
        unsafe {
            asm!(
                "tileloadd tmm0, [{a} + {stride}*1]",
                "tileloadd tmm1, [{hi} + {row}*1]",
                "tdpbssd tmm2, tmm0, tmm1",
                "tileloadd tmm1, [{lo} + {row}*1]",
                "tdpbssd tmm3, tmm0, tmm1",
                a = in(reg) acts, stride = in(reg) stride, hi = in(reg) w_hi, lo = in(reg) w_lo,
                row = in(reg) 64usize,
                options(nostack, readonly)
            )
        };
    }

    /// Adds one quarter of the super-block against four sets of weights, `w` and the three
    /// [`WEIGHT_BYTES`] after each other: `sums[i][t][r] += Σ_k acts[t·stride + k]·w_i[k][r]`
    /// (k < 64), exactly in i32.
    ///
    /// # Safety
    /// Tiles configured; `acts` points to 16 rows of 64 readable bytes, `stride` apart; `w` to
    /// four [`WEIGHT_BYTES`] readable bytes.
    pub unsafe fn add_quarter4(acts: *const i8, stride: usize, w: *const u8) {
        // SAFETY: the caller's promise.
        unsafe {
            asm!(
                "tileloadd tmm0, [{a} + {stride}*1]",
                "tileloadd tmm1, [{w} + {row}*1]",
                "tdpbssd tmm2, tmm0, tmm1",
                "tileloadd tmm1, [{w} + {row}*1 + 1024]",
                "tdpbssd tmm3, tmm0, tmm1",
                "tileloadd tmm1, [{w} + {row}*1 + 2048]",
                "tdpbssd tmm4, tmm0, tmm1",
                "tileloadd tmm1, [{w} + {row}*1 + 3072]",
                "tdpbssd tmm5, tmm0, tmm1",
                a = in(reg) acts, stride = in(reg) stride, w = in(reg) w, row = in(reg) 64usize,
                options(nostack, readonly)
            )
        };
    }

    /// Stores the four sums of [`add_quarter4`] (`[token][row]` i32 each, [`super::tiles::Sums`]
    /// after each other).
    ///
    /// # Safety
    /// Tiles configured; `sums` points to 4·256 writable i32.
    pub unsafe fn store4(sums: *mut i32) {
        // SAFETY: the caller's promise.
        unsafe {
            asm!(
                "tilestored [{s} + {row}*1], tmm2",
                "tilestored [{s} + {row}*1 + 1024], tmm3",
                "tilestored [{s} + {row}*1 + 2048], tmm4",
                "tilestored [{s} + {row}*1 + 3072], tmm5",
                s = in(reg) sums, row = in(reg) 64usize,
                options(nostack)
            )
        };
    }

    /// Stores the super-block's two sums (`[token][row]` i32 each).
    ///
    /// # Safety
    /// Tiles configured; `hi` and `lo` point to 256 writable i32 each.
    pub unsafe fn store(hi: *mut i32, lo: *mut i32) {
        // SAFETY: the caller's promise.
        unsafe {
            asm!(
                "tilestored [{hi} + {row}*1], tmm2",
                "tilestored [{lo} + {row}*1], tmm3",
                hi = in(reg) hi, lo = in(reg) lo, row = in(reg) 64usize,
                options(nostack)
            )
        };
    }

    #[cfg(test)]
    mod tests {
        use super::super::tiles::{release, Sums, TOKENS};
        use super::*;

        /// Four quarters sum into each tile: `hi` and `lo` are the integer dots of the tokens
        /// with their own weights over all 256 quants.
        #[test]
        fn quarters_sum_to_the_integer_dots() {
            if !crate::cpu::quant::amx::usable() {
                eprintln!("skipped: no AMX here");
                return;
            }
            let stride = 4 * SPAN + 16;
            let acts: Vec<i8> = (0..TOKENS * stride).map(|i| (i * 37 % 251) as u8 as i8).collect();
            let weights: Vec<u8> = (0..8 * WEIGHT_BYTES).map(|i| (i * 91 % 253) as u8).collect();
            // Quarter q's weight tile (hi: 2q, lo: 2q + 1): row r's k-th value at row k / 4,
            // byte 4·r + k % 4.
            let w = |tile: usize, k: usize, r: usize| {
                weights[tile * WEIGHT_BYTES + (k / 4) * 64 + 4 * r + k % 4] as i8 as i32
            };
            let (mut hi, mut lo) = (Sums::new(), Sums::new());
            // SAFETY: AMX usable (checked); the buffers are as long as the calls read and write.
            unsafe {
                configure();
                start();
                for q in 0..4 {
                    let tiles = weights.as_ptr().add(2 * q * WEIGHT_BYTES);
                    add_quarter(acts.as_ptr().add(q * SPAN), stride, tiles, tiles.add(WEIGHT_BYTES));
                }
                store(hi.as_mut_ptr(), lo.as_mut_ptr());
                release();
            }
            for t in 0..TOKENS {
                for r in 0..16 {
                    let dot = |half: usize| -> i32 {
                        (0..4 * SPAN)
                            .map(|k| acts[t * stride + k] as i32 * w(2 * (k / SPAN) + half, k % SPAN, r))
                            .sum()
                    };
                    assert_eq!(hi.0[t * 16 + r], dot(0), "hi: token {t} row {r}");
                    assert_eq!(lo.0[t * 16 + r], dot(1), "lo: token {t} row {r}");
                }
            }
        }
    }
}
