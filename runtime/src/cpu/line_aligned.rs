//! A growable pool of cache-row elements whose first element starts a cache line.
//!
//! The allocator places a large `Vec` 16 bytes past a page, so every cache row of a pool of
//! halves (`2·kv_dim` bytes, a multiple of 64 for the usual head sizes) started 16 bytes into
//! a line, and half of attention's 32-byte loads of sixteen halves straddled two lines: each
//! costs two. Rows of such widths now start lines.

use super::kv_element::KvElement;
use std::marker::PhantomData;

/// Bytes of a cache line.
pub(super) const LINE: usize = 64;

/// One cache line's bytes, aligned as a line: the pool's unit of allocation.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; LINE]);

/// `len` elements of type `T` from the start of `lines`.
#[derive(Clone)]
pub struct LineAligned<T> {
    lines: Vec<Line>,
    len: usize,
    element: PhantomData<T>,
}

impl<T: KvElement> LineAligned<T> {
    pub fn new() -> Self {
        const { assert!(std::mem::align_of::<T>() <= LINE) };
        Self {
            lines: Vec::new(),
            len: 0,
            element: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Grows the pool to `len` elements, the new ones zero (`T::default()`); never shrinks it.
    pub fn grow(&mut self, len: usize) {
        if len <= self.len {
            return;
        }
        self.lines
            .resize((len * std::mem::size_of::<T>()).div_ceil(LINE), Line([0; LINE]));
        self.len = len;
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `lines` holds at least `len · size_of::<T>()` initialised bytes, aligned for
        // `T` (asserted in `new`), and every bit pattern is a `T` (`KvElement`'s contract).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
    }
}

impl<T: KvElement> Default for LineAligned<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> std::fmt::Debug for LineAligned<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LineAligned {{ len: {} }}", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn grows_zeroed_keeps_what_it_held_and_starts_a_line() {
        let mut pool = LineAligned::<f16>::new();
        assert!(pool.is_empty() && pool.as_slice().is_empty());
        pool.grow(40);
        assert_eq!(pool.as_slice(), &[f16::ZERO; 40][..]);
        pool.as_mut_slice()[39] = f16::ONE;
        pool.grow(10_000);
        assert_eq!(pool.len(), 10_000);
        assert_eq!(pool.as_slice()[39], f16::ONE, "kept across a reallocation");
        assert!(pool.as_slice()[40..].iter().all(|&x| x == f16::ZERO));
        assert_eq!(pool.as_slice().as_ptr() as usize % LINE, 0);
        pool.grow(5);
        assert_eq!(pool.len(), 10_000, "never shrinks");
    }
}
