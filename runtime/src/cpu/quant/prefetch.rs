//! Software prefetch for the CPU kernels that stream memory (x86): the int8 kernels' weights
//! here, and in the runtime the dense f32/bf16 tiles, attention's cache rows and the INT8
//! head's scoring pass.
//!
//! A decode step over weights larger than the caches reads each weight once, and its kernels
//! load a block, compute on it, load the next: without hints the core waited on memory and
//! computed in turn (a 3B model's Q4_K step at batch 4 took the time at batch 1 plus the
//! arithmetic of 4 tokens; the hardware prefetcher alone did not overlap them). So each kernel
//! asks, a part per step of its loop, for the lines of the block it will read some 2 KiB later,
//! and they arrive while this block's arithmetic runs. Asking for a whole block at once was
//! slower than not asking (the requests queue behind each other and the loads wait on them).

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

/// How far ahead a kernel asks, about: for the K-quants that is the next super-block of the
/// group (2304 bytes for Q4_K, 4384 for Q6_K; two or four Q4_K super-blocks measured no
/// better); for the 32-weight formats a few blocks.
pub const AHEAD_BYTES: usize = 2048;

/// The distance, a whole number of `block_bytes` blocks, at which a kernel over consecutive
/// blocks of that size asks for lines: at least [`AHEAD_BYTES`], at least one block.
pub const fn ahead(block_bytes: usize) -> usize {
    block_bytes * AHEAD_BYTES.div_ceil(block_bytes)
}

/// Asks for the line holding `at` to be brought into L1, a hint that never faults (`at` may
/// be past the weights: it is only an address).
#[inline(always)]
pub fn line(at: *const u8) {
    // SAFETY: a prefetch reads nothing the program sees and never faults.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(at as *const i8) };
}

/// Asks for part `part` of `parts` of the `bytes` bytes at `start` to be brought into L1, a
/// hint that never faults. Every line is asked for once the parts are all asked for: they are
/// contiguous, and no two addresses asked for in a row are more than a line apart.
#[inline(always)]
pub fn part_of(start: *const u8, bytes: usize, part: usize, parts: usize) {
    let (from, to) = (bytes * part / parts, bytes * (part + 1) / parts);
    for offset in (from..to).step_by(64) {
        // `wrapping_add`: the address may be past the weights.
        line(start.wrapping_add(offset));
    }
}

/// Asks for part `part` of `parts` of the block a kernel over consecutive `bytes`-byte blocks
/// reads [`ahead`] of `block`: called once for each part as it reads `block`'s, it asks for
/// every line of that block while computing on this one.
#[inline(always)]
pub fn block_ahead(block: *const u8, bytes: usize, part: usize, parts: usize) {
    part_of(block.wrapping_add(ahead(bytes)), bytes, part, parts);
}
