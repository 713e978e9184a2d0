//! A global allocator that starts every allocation of [`FROM_BYTES`] or more on a cache line,
//! for the binaries that run CPU steps (`bbc`, the step benches) to install.
//!
//! Why: glibc returns a large block 16 bytes past a page (its header), so an activation
//! matrix's rows start 16 bytes off a line, and the matmuls, which write each token's results 64
//! bytes (sixteen rows) at a time, split every store over two lines. With each such buffer on a
//! line, a SmolLM2 decode step of 16 sequences took 4% less time (`benches/batched_step.rs`,
//! seven alternations: 14.5-15.5 ms before, 13.8-15.0 after) and a 128-token prefill about 2%
//! less (three: 61.3-63.9 ms, 60.8-62.2). The tensors are `Vec<f32>`s, which cannot ask for an
//! alignment of their own, so the allocator gives it to every large block.
//!
//! Small blocks go to the system allocator as asked. A large one is asked for with alignment
//! 64 and freed with the same adjusted layout, so the system allocator sees matching pairs.

use std::alloc::{GlobalAlloc, Layout, System};

/// Blocks from this size on start on a line.
pub const FROM_BYTES: usize = 4096;

/// A cache line.
const LINE: usize = 64;

/// The system allocator, large blocks aligned to a line (see the module's note).
pub struct LineAlignedAlloc;

/// The layout asked of the system for `layout`.
fn adjusted(layout: Layout) -> Layout {
    if layout.size() < FROM_BYTES || layout.align() >= LINE {
        return layout;
    }
    // A power of two above the original alignment, and the size is unchanged: valid.
    Layout::from_size_align(layout.size(), LINE).expect("a line's alignment is valid for any valid size")
}

// SAFETY: every block comes from `System` with a layout at least as aligned as the one asked
// for, and goes back to it with the layout it was allocated with (`adjusted` is a function of
// the caller's layout, which the caller passes unchanged to `dealloc` and `realloc`).
unsafe impl GlobalAlloc for LineAlignedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: `adjusted` keeps the caller's non-zero size.
        unsafe { System.alloc(adjusted(layout)) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        unsafe { System.alloc_zeroed(adjusted(layout)) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with `layout`, so from `System` with `adjusted(layout)`.
        unsafe { System.dealloc(ptr, adjusted(layout)) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller promises `new_size`, rounded up to `layout.align()`, fits an isize.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        let old = adjusted(layout);
        if adjusted(new_layout).align() == old.align() {
            // `System` gives the new block `old`'s alignment, which is what it needs.
            // SAFETY: `ptr` came from `System` with `old`.
            return unsafe { System.realloc(ptr, old, new_size) };
        }
        // Across `FROM_BYTES`: a block of the other alignment, the contents copied over.
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
    fn alignments_asked_for_are_kept() {
        let a = LineAlignedAlloc;
        for (size, align) in [(8, 8), (FROM_BYTES, 128), (FROM_BYTES * 2, 4096), (10, 64)] {
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
