//! A global allocator that starts every allocation of [`FROM_BYTES`] or more on a cache line,
//! for the binaries that run CPU steps (`bbc`, the step benches) to install.
//!
//! Why: glibc returns a large block 16 bytes past a page (its header), so an activation
//! matrix's rows start 16 bytes off a line, and the matmuls, which write each token's results 64
//! bytes (sixteen rows) at a time, split every store over two lines. With each such buffer on a
//! line, 128-token prefills took 2-4% less time (`benches/batched_step.rs`, three alternations
//! with the commit before: SmolLM2 60.6-65.1 ms before, 60.4-61.0 after; Gemma 3 61.6-63.2,
//! 59.9-61.6), decode steps of 16 and 64 sequences about the same or a little less. The tensors
//! are `Vec<f32>`s, which cannot ask for an alignment of their own, so the allocator gives it to
//! every large block.
//!
//! Small blocks go to the system allocator as asked. A large one is carved out of a system
//! block of a line more (plus room for its offset, kept just before it), asked for with the
//! caller's small alignment, so glibc treats it as any block of its size. Asking the system
//! for 64-byte alignment itself (`posix_memalign`) instead made glibc map fresh pages for such
//! blocks step after step (perf: page faults, 4% of the samples), and a Gemma 3 decode step
//! of 64 sequences 18% slower.

use super::line_aligned::LINE;
use std::alloc::{GlobalAlloc, Layout, System};

/// Blocks from this size on start on a line.
pub const FROM_BYTES: usize = 4096;

/// Room for a large block's offset into its system block, just before it.
const HEADER: usize = std::mem::size_of::<usize>();

/// The system allocator, large blocks aligned to a line (see the module's note).
pub struct LineAlignedAlloc;

/// Whether a block of `layout` is carved to start on a line.
fn carved(layout: Layout) -> bool {
    layout.size() >= FROM_BYTES && layout.align() < LINE
}

/// The system block holding a carved block of `layout`: room for the header and for moving
/// the start up to a line; `None` where that size overflows (the allocation then fails: an
/// allocator must not panic).
fn outer(layout: Layout) -> Option<Layout> {
    let size = layout.size().checked_add(HEADER + LINE - 1)?;
    Layout::from_size_align(size, HEADER).ok()
}

/// The line-aligned block inside the system block at `raw`, its offset written before it.
///
/// # Safety
/// `raw` is null or a block of `outer(layout)`.
unsafe fn carve(raw: *mut u8) -> *mut u8 {
    if raw.is_null() {
        return raw;
    }
    let offset = (raw as usize + HEADER).next_multiple_of(LINE) - raw as usize;
    // SAFETY: `HEADER ≤ offset < HEADER + LINE`, so the block and its header lie in the system
    // block; the header is aligned (the block is on a line, the header a word before it).
    unsafe {
        let block = raw.add(offset);
        block.sub(HEADER).cast::<usize>().write(offset);
        block
    }
}

// SAFETY: small blocks are the system allocator's own; a large block lies inside a system
// block of `outer(layout)` (layout being what the caller passes unchanged to `dealloc` and
// `realloc`), starts on a line (which satisfies any alignment below a line), and goes back as
// that system block, found from the offset written before it.
unsafe impl GlobalAlloc for LineAlignedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: layouts of non-zero size; a carved block comes from `outer(layout)`.
        unsafe {
            match carved(layout) {
                true => outer(layout).map_or(std::ptr::null_mut(), |outer| carve(System.alloc(outer))),
                false => System.alloc(layout),
            }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        unsafe {
            match carved(layout) {
                true => outer(layout).map_or(std::ptr::null_mut(), |outer| carve(System.alloc_zeroed(outer))),
                false => System.alloc_zeroed(layout),
            }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with `layout`: carved, its offset is just before it.
        unsafe {
            match carved(layout) {
                true => {
                    let offset = ptr.sub(HEADER).cast::<usize>().read();
                    // The block was allocated, so its outer layout exists.
                    System.dealloc(ptr.sub(offset), outer(layout).unwrap_unchecked())
                }
                false => System.dealloc(ptr, layout),
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller promises `new_size`, rounded up to `layout.align()`, fits an isize.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if !carved(layout) && !carved(new_layout) {
            // SAFETY: a system block of `layout`.
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // A carved block moves: its offset in a grown system block would change.
        // SAFETY: `new_layout` has a non-zero size (the caller's promise); both blocks hold at
        // least the bytes copied, and `ptr` goes back as it was allocated.
        unsafe {
            let moved = self.alloc(new_layout);
            if !moved.is_null() {
                std::ptr::copy_nonoverlapping(ptr, moved, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            moved
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_blocks_start_on_a_line_and_keep_their_bytes_across_reallocation() {
        let a = LineAlignedAlloc;
        let small = Layout::from_size_align(100, 4).unwrap();
        let large = Layout::from_size_align(FROM_BYTES * 3, 4).unwrap();
        // SAFETY: layouts of non-zero size; each block is freed with the layout it has.
        unsafe {
            for _ in 0..8 {
                let p = a.alloc(large);
                assert_eq!(p as usize % LINE, 0);
                let z = a.alloc_zeroed(large);
                assert_eq!(z as usize % LINE, 0);
                assert!(std::slice::from_raw_parts(z, large.size()).iter().all(|&b| b == 0));
                a.dealloc(p, large);
                a.dealloc(z, large);
            }
            // Small to large, large to larger, back to small: contents kept, large ones aligned.
            let p = a.alloc(small);
            for i in 0..100 {
                *p.add(i) = i as u8;
            }
            let p = a.realloc(p, small, large.size());
            assert_eq!(p as usize % LINE, 0);
            assert!((0..100).all(|i| *p.add(i) == i as u8));
            *p.add(large.size() - 1) = 7;
            let p = a.realloc(p, large, large.size() * 2);
            assert_eq!(p as usize % LINE, 0);
            assert!((0..100).all(|i| *p.add(i) == i as u8));
            assert_eq!(*p.add(large.size() - 1), 7);
            let bigger = Layout::from_size_align(large.size() * 2, 4).unwrap();
            let p = a.realloc(p, bigger, 50);
            assert!((0..50).all(|i| *p.add(i) == i as u8));
            a.dealloc(p, Layout::from_size_align(50, 4).unwrap());
        }
    }

    #[test]
    fn a_block_too_large_for_its_room_fails_without_a_panic() {
        let huge = Layout::from_size_align(isize::MAX as usize - 8, 4).unwrap();
        // SAFETY: a layout of non-zero size; a null block is not freed.
        unsafe {
            assert!(LineAlignedAlloc.alloc(huge).is_null());
            assert!(LineAlignedAlloc.alloc_zeroed(huge).is_null());
        }
    }

    #[test]
    fn alignments_asked_for_are_kept() {
        let a = LineAlignedAlloc;
        for (size, align) in [
            (8, 8),
            (FROM_BYTES, 32),
            (FROM_BYTES, 128),
            (FROM_BYTES * 2, 4096),
            (10, 64),
        ] {
            let layout = Layout::from_size_align(size, align).unwrap();
            // SAFETY: a layout of non-zero size, freed with it.
            unsafe {
                let p = a.alloc(layout);
                assert_eq!(p as usize % align, 0, "{size} bytes aligned to {align}");
                a.dealloc(p, layout);
            }
        }
    }
}
