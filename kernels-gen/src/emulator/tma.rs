//! TMA on the emulator: tensor maps resolved at launch as the launcher would encode them, and
//! `cp.async.bulk.tensor` copies of a box into shared memory (zeros outside the tensor, the
//! map's swizzle applied to the destination address) that deliver their bytes to an
//! mbarrier. A copy lands at issue, but what it wrote may only be read, or overwritten, by a
//! thread that has waited for the barrier phase its bytes completed. Reported besides: maps
//! the driver would refuse (row pitch, a buffer too short), misaligned destinations, copies
//! over shared memory another thread read since the last `__syncthreads()` or a tensor-core
//! MMA in flight still reads, and reads of never-written sources.

use super::{Array, Block, Fault, Scalar};
use crate::dsl::{Kernel, Swizzle, TmaLoad};
use std::collections::HashMap;

/// A tensor map as the launcher encodes it: sizes evaluated.
#[derive(Debug, Clone)]
pub(super) struct ResolvedMap {
    buffer: String,
    rows: i64,
    cols: i64,
    stride: i64,
    box_rows: usize,
    box_cols: usize,
    swizzle: Swizzle,
}

/// The kernel's tensor maps over `buffers`, their sizes evaluated from `scalars` as a
/// launcher does (`Expr::eval_int`), or why the driver would refuse one.
pub(super) fn resolve_maps(
    kernel: &Kernel,
    buffers: &HashMap<String, Array>,
    scalars: &HashMap<String, Scalar>,
) -> Result<HashMap<String, ResolvedMap>, String> {
    let var = |name: &str| match scalars.get(name) {
        Some(Scalar::Int(v)) => Some(*v),
        _ => None,
    };
    let mut out = HashMap::new();
    for map in kernel.tensor_maps() {
        let (rows, cols, stride) = map.sizes(&var)?;
        let name = &map.name;
        let buffer = &buffers[&map.buffer];
        if !buffer.start.is_multiple_of(8) {
            return Err(format!(
                "tensor map `{name}`: `{}` does not start 16-byte aligned",
                map.buffer
            ));
        }
        if ((rows - 1) * stride + cols) as usize > buffer.len() {
            return Err(format!(
                "tensor map `{name}` of {rows}×{cols}, rows {stride} apart, over `{}` of {} elements",
                map.buffer,
                buffer.len()
            ));
        }
        let resolved = ResolvedMap {
            buffer: map.buffer.clone(),
            rows,
            cols,
            stride,
            box_rows: map.box_rows as usize,
            box_cols: map.box_cols as usize,
            swizzle: map.swizzle,
        };
        out.insert(name.clone(), resolved);
    }
    Ok(out)
}

/// Per shared element: the barrier and phase of the TMA copy that last wrote it, and of the
/// commit of the last `tcgen05.mma` that read it (which a writer must have waited for: the
/// MMA reads its operands some time after it is issued).
pub(super) struct Landings {
    copies: HashMap<String, Vec<Option<(String, u64)>>>,
    mma_reads: HashMap<String, Vec<Option<(String, u64)>>>,
}

impl Landings {
    pub(super) fn new(shared: &[(String, usize)]) -> Self {
        let per_element = || {
            shared
                .iter()
                .map(|(name, len)| (name.clone(), vec![None; *len]))
                .collect()
        };
        Self {
            copies: per_element(),
            mma_reads: per_element(),
        }
    }

    /// A `tcgen05.mma` committed to phase `phase` of `key` read `array[i]`.
    pub(super) fn note_mma_read(&mut self, array: &str, i: usize, key: &str, phase: u64) {
        if let Some(reads) = self.mma_reads.get_mut(array) {
            reads[i] = Some((key.to_string(), phase));
        }
    }
}

impl Block<'_> {
    /// Thread `t` is about to `what` (read or overwrite) shared `array[i]`: if a TMA copy wrote
    /// it, `t` must have waited for the barrier phase that copy completed.
    pub(super) fn check_landed(&self, array: &str, i: usize, t: usize, what: &str) -> Result<(), Fault> {
        self.check_landed_in(self.landed_copies(array), array, i, t, what)
    }

    /// Which TMA copy (barrier, phase) wrote each element of shared `array` (for checks of
    /// many threads' accesses, looked up once).
    pub(super) fn landed_copies(&self, array: &str) -> Option<&[Option<(String, u64)>]> {
        self.landings.copies.get(array).map(Vec::as_slice)
    }

    /// [`check_landed`](Self::check_landed) over `copies`, the array's
    /// [`landed_copies`](Self::landed_copies).
    pub(super) fn check_landed_in(
        &self,
        copies: Option<&[Option<(String, u64)>]>,
        array: &str,
        i: usize,
        t: usize,
        what: &str,
    ) -> Result<(), Fault> {
        match copies.and_then(|l| l[i].as_ref()) {
            Some((key, phase)) if !self.barriers.seen(t, key, *phase) => Err((
                t,
                format!("{what} {array}[{i}] before waiting for phase {phase} of mbarrier {key}, which completes the TMA copy into it"),
            )),
            _ => Ok(()),
        }
    }

    /// Thread `t` is about to overwrite shared `array[i]`: if a `tcgen05.mma` read it, `t`
    /// must have waited for the barrier phase its commit completes.
    pub(super) fn check_mma_read(&self, array: &str, i: usize, t: usize) -> Result<(), Fault> {
        match self.landings.mma_reads.get(array).and_then(|l| l[i].as_ref()) {
            Some((key, phase)) if !self.barriers.seen(t, key, *phase) => Err((
                t,
                format!("overwrites {array}[{i}] before waiting for phase {phase} of mbarrier {key}, which completes the tcgen05.mma reading it"),
            )),
            _ => Ok(()),
        }
    }

    /// A shared element is written by other means than TMA: no copy's any longer, and no
    /// MMA's read to wait for.
    pub(super) fn forget_landing(&mut self, array: &str, i: usize) {
        for map in [&mut self.landings.copies, &mut self.landings.mma_reads] {
            if let Some(l) = map.get_mut(array) {
                l[i] = None;
            }
        }
    }

    pub(super) fn tma_load(
        &mut self,
        op: &TmaLoad,
        mask: &[bool],
        global: &HashMap<String, Array>,
    ) -> Result<(), Fault> {
        let dst_index = self.eval(&op.dst_index, mask, global)?;
        let (rows, cols) = (self.eval(&op.row, mask, global)?, self.eval(&op.col, mask, global)?);
        let keys = self.barrier_keys(&op.barrier, mask, global)?;
        let map = self.maps[&op.map].clone();
        let source = &global[&map.buffer];
        let box_elements = map.box_rows * map.box_cols;
        let alignment = match map.swizzle {
            Swizzle::B128 => 512,
            Swizzle::None => 64,
        };
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            let d = dst_index[t].i();
            if d < 0 || d % alignment != 0 {
                return Err((
                    t,
                    format!(
                        "TMA copy into {}[{d}]: the destination must be {}-byte aligned",
                        op.dst,
                        2 * alignment
                    ),
                ));
            }
            let len = self.shared[&op.dst].len();
            if d as usize + box_elements > len {
                return Err((
                    t,
                    format!(
                        "TMA copy into {}[{d}..+{box_elements}] out of bounds (length {len})",
                        op.dst
                    ),
                ));
            }
            let phase = self.barriers.current_phase(&keys[t], t)?;
            let (row0, col0) = (rows[t].i(), cols[t].i());
            for r in 0..map.box_rows {
                for c in 0..map.box_cols {
                    let (row, col) = (row0 + r as i64, col0 + c as i64);
                    let inside = (0..map.rows).contains(&row) && (0..map.cols).contains(&col);
                    let value = match inside {
                        false => 0.0,
                        true => {
                            let i = (row * map.stride + col) as usize;
                            if !source.init[i] {
                                return Err((t, format!("TMA copy of {}[{i}], which was never written", map.buffer)));
                            }
                            source.values[i]
                        }
                    };
                    let i = map.swizzle.bf16_element(d as usize + r * map.box_cols + c);
                    self.tma_write(&op.dst, i, value, t, (&keys[t], phase))?;
                }
            }
            self.deliver_bytes(&keys[t], 2 * box_elements as u32, t)?;
        }
        Ok(())
    }

    /// One element of a TMA copy by thread `t`, completing with `landing`.
    fn tma_write(&mut self, array: &str, i: usize, value: f64, t: usize, landing: (&str, u64)) -> Result<(), Fault> {
        let knows = self.barriers.knowledge(t);
        if let Some(reader) = self.shared_readers.get_mut()[array][i].unordered_before(t, knows) {
            return Err((
                t,
                format!("TMA copy overwrites {array}[{i}], read by {reader} without a __syncthreads() between"),
            ));
        }
        self.asynch.check_shared(array, i, t)?;
        self.check_landed(array, i, t, "TMA copy overwrites")?;
        self.check_mma_read(array, i, t)?;
        // Through the async proxy, as the tensor cores read: no writer to fence or publish.
        self.asynch.note_async_write(array, i, t)?;
        self.shared_writer.get_mut(array).expect("shared")[i] = None;
        self.forget_landing(array, i);
        self.landings.copies.get_mut(array).expect("shared")[i] = Some((landing.0.to_string(), landing.1));
        let array = self.shared.get_mut(array).expect("shared");
        array.values[i] = value;
        array.init[i] = true;
        Ok(())
    }
}
