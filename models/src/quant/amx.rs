//! Intel AMX (Advanced Matrix Extensions, Sapphire Rapids and later Xeons): eight tile
//! registers of up to 16 rows × 64 bytes, and `tdpbssd`, which adds a 16×K signed-byte tile
//! times a K×16 signed-byte tile into a 16×16 tile of i32 sums in one instruction. Where the
//! int8 kernels' `vpdpbusd` advances one token's dot with sixteen rows by four weights, one
//! `tdpbssd` advances sixteen tokens' dots with sixteen rows by 32 weights: the products of a
//! prefill step come from the tiles, and the per-block float work stays on AVX-512.
//!
//! Stable Rust has neither AMX intrinsics nor their feature detection, so this module asks
//! CPUID itself, asks Linux for the permission a process needs before it may touch the tile
//! data (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and issues the instructions in `asm!` blocks
//! naming the tile registers outright (the compiler never allocates them). A block's tiles
//! are only read by later blocks of the same kernel, and `asm!` blocks keep their order.

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

/// The tile shapes of the 32-weight block kernels: tokens' quantized activations of one
/// block (16 rows × 32 signed bytes), a group's signed weights of one block in the layout
/// `tdpbssd` reads (8 rows of 4 k × 16 weight rows), and the 16×16 sums.
#[cfg(target_arch = "x86_64")]
pub mod block32 {
    use std::arch::asm;

    /// Rows of the activation and sum tiles: tokens a tile.
    pub const TOKENS: usize = 16;
    /// Bytes of one token's activation row in a tile: one block.
    pub const BLOCK: usize = 32;
    /// Bytes of the weight tile: 8 rows of 64.
    pub const WEIGHT_BYTES: usize = 512;

    /// `ldtilecfg`'s 64 bytes: palette 1; tmm0 activations (16 × 32 bytes), tmm1 weights
    /// (8 × 64), tmm2 sums (16 × 64).
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    const CONFIG: Config = {
        let mut c = [0u8; 64];
        c[0] = 1;
        // (tile, rows, bytes a row): colsb at 16 + 2·tile (u16), rows at 48 + tile.
        let shapes = [(0, 16, 32), (1, 8, 64), (2, 16, 64)];
        let mut i = 0;
        while i < shapes.len() {
            let (tile, rows, bytes) = shapes[i];
            c[16 + 2 * tile] = bytes;
            c[48 + tile] = rows;
            i += 1;
        }
        Config(c)
    };

    /// Configures this thread's tiles for the functions below (and zeroes them).
    ///
    /// # Safety
    /// [`super::usable`] said yes.
    pub unsafe fn configure() {
        // SAFETY: the configuration is valid for palette 1; AMX is usable (the caller).
        unsafe { asm!("ldtilecfg [{0}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly)) };
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
        use super::*;

        /// The tiles compute what the integers say, rows and columns where the layout puts
        /// them (a swapped operand or a wrong config gives other sums).
        #[test]
        fn products_are_the_integer_dots() {
            if !super::super::usable() {
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
