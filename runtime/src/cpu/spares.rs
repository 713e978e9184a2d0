//! A step's spare float buffers: a value's buffer, once its last reader has run, becomes a
//! later op's output of the same length, so outputs are neither zeroed nor faulted in.
//!
//! Why: every op used to allocate its output zeroed (`vec![0.0; n]`), on the step's thread,
//! before the pool's threads filled it. In a 128-token prefill of SmolLM2 those zeroings were
//! 7.5% of the step's time, during which the other thread waited (perf: `memset` under
//! `Tensor::zeros`, the column slices and joins, the GLU). A layer's values come in a few
//! lengths that recur in every layer, so the second layer on takes its outputs from the first's.
//!
//! A taken buffer holds whatever it held before: only an op that writes every element may
//! take one (not the MoE block, which adds each expert's share into zeroed rows). Debug
//! builds, which the tests run, fill every taken buffer with NaN, so an op that leaves an
//! element unwritten shows in every test that runs it.

/// Spares kept at most: a Llama layer holds about six values at once; more than this only
/// keeps memory a step no longer needs.
const KEPT: usize = 16;

#[derive(Default)]
pub struct Spares {
    kept: Vec<Vec<f32>>,
}

impl Spares {
    /// A buffer of `len` floats for an output that writes every one of them.
    pub fn take(&mut self, len: usize) -> Vec<f32> {
        let mut buffer = match self.kept.iter().rposition(|b| b.len() == len) {
            Some(at) => self.kept.swap_remove(at),
            None => vec![0.0; len],
        };
        if cfg!(debug_assertions) {
            buffer.fill(f32::NAN);
        }
        buffer
    }

    /// A copy of `x` in a spare buffer (for an op that works on its input in place).
    pub fn copy_of(&mut self, x: &ir::Tensor) -> ir::Tensor {
        let mut data = self.take(x.data.len());
        data.copy_from_slice(&x.data);
        ir::Tensor::new(x.shape.clone(), data)
    }

    /// Keep `buffer` for a later [`take`](Self::take) of its length (the oldest goes past
    /// [`KEPT`]).
    pub fn keep(&mut self, buffer: Vec<f32>) {
        if buffer.is_empty() {
            return;
        }
        if self.kept.len() == KEPT {
            self.kept.remove(0);
        }
        self.kept.push(buffer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_buffer_is_taken_again_for_its_length_only() {
        let mut spares = Spares::default();
        let first = spares.take(6);
        let address = first.as_ptr();
        spares.keep(first);
        let other = spares.take(5);
        assert_ne!(other.as_ptr(), address, "a buffer of another length");
        assert_eq!(other.len(), 5);
        let again = spares.take(6);
        assert_eq!((again.as_ptr(), again.len()), (address, 6));
        assert_eq!(spares.take(6).len(), 6, "a fresh one once none is kept");
    }

    #[test]
    fn at_most_kept_buffers_stay() {
        let mut spares = Spares::default();
        for len in 1..=KEPT + 3 {
            spares.keep(vec![0.0; len]);
        }
        assert_eq!(spares.kept.len(), KEPT);
        assert!(spares.kept.iter().all(|b| b.len() > 3), "the oldest went first");
    }

    #[test]
    #[cfg(debug_assertions)]
    fn debug_builds_hand_out_nan() {
        let mut spares = Spares::default();
        spares.keep(vec![1.0; 4]);
        assert!(spares.take(4).iter().all(|v| v.is_nan()));
        assert!(spares.take(3).iter().all(|v| v.is_nan()));
    }
}
