//! mbarriers on the emulator: arrival counts, transaction bytes (announced by
//! `mbarrier.arrive.expect_tx`, delivered by TMA copies) and phases, which complete when both
//! are met. Each thread remembers the phases it has waited for: what it may then read (TMA
//! destinations, TMEM written by `tcgen05.mma`) is checked against that. Reported: using a
//! barrier before its `mbarrier.init` or initialising it twice, a wait on a phase that can
//! never complete (the arrivals or bytes it still lacks named), an arrival on a phase that
//! already has all its arrivals, and bytes delivered beyond those announced.
//!
//! An arrival releases and a wait acquires, as on the device: a thread that waited for a
//! phase knows what each thread arriving on it knew (the phases it had seen complete, the
//! tensor-core reads its warpgroup had retired, and its own writes of shared memory), so a
//! producer warp may refill a buffer the consumers' `wgmma`s read once it has waited on the
//! barrier they arrive on after retiring them, and consumers may read what a producer stored
//! or copied (`st.shared`, landed `cp.async`) once they waited on the phase it arrived on
//! after, with no `__syncthreads()` between (warp specialisation).

use super::{Block, Fault};
use crate::dsl::{Expr, Mbarrier, MbarrierRef};
use std::collections::HashMap;

pub(super) struct Barrier {
    count: u32,
    arrivals: u32,
    /// Transaction bytes announced for the current phase and not yet delivered (below zero
    /// where a copy delivered them before their announcement, which the device allows).
    pending_bytes: i64,
    /// Phases completed so far.
    pub(super) completed: u64,
    /// Shared elements read by tensor-core MMAs committed to the current phase: off limits
    /// until it completes.
    held: Vec<(String, usize)>,
    /// What the current phase's arrivals knew (see [`Barriers::knowledge`]), and what those
    /// of every completed phase did, which a waiter comes to know.
    releasing: Knowledge,
    released: Knowledge,
}

/// What a thread knows has happened: per barrier key, the phases it has seen complete; per
/// warpgroup (`@wg{n}`), the clock of its latest release, every tensor-core read the
/// warpgroup retired before that being over; per warp (`@warp{n}`), likewise, every
/// `tcgen05.ld` the warp issued before it being over; per thread (`@t{n}`), the clock of its
/// latest release after a write of shared memory, every write before it being visible.
type Knowledge = HashMap<String, u64>;

/// Max-merge `from` into `into`.
fn merge(into: &mut Knowledge, from: &Knowledge) {
    for (key, &value) in from {
        let entry = into.entry(key.clone()).or_insert(0);
        *entry = (*entry).max(value);
    }
}

/// The knowledge key of warpgroup `wg`'s releases.
pub(super) fn warpgroup_key(wg: usize) -> String {
    format!("@wg{wg}")
}

/// The knowledge key of warp `warp`'s releases.
pub(super) fn warp_key(warp: usize) -> String {
    format!("@warp{warp}")
}

/// The knowledge key of thread `t`'s releases of its shared-memory writes.
pub(super) fn thread_key(t: usize) -> String {
    format!("@t{t}")
}

#[derive(Default)]
pub(super) struct Barriers {
    barriers: HashMap<String, Barrier>,
    /// Per thread: how many phases of each barrier it has seen complete, directly or through
    /// the arrivals of a phase it waited for, and the warpgroups' releases it has acquired.
    observed: Vec<Knowledge>,
    /// Counts arrivals: what orders a warpgroup's tensor-core reads and a thread's writes
    /// against their releases.
    pub(super) clock: u64,
    /// Per thread: whether it wrote shared memory since the last `__syncthreads()` (only then
    /// is its key worth carrying: an arrival releases every write before it).
    wrote_shared: Vec<bool>,
}

impl Barriers {
    pub(super) fn new(threads: usize) -> Self {
        Self {
            barriers: HashMap::new(),
            observed: vec![HashMap::new(); threads],
            clock: 0,
            wrote_shared: vec![false; threads],
        }
    }

    /// Thread `t` wrote shared memory: its arrivals release it.
    pub(super) fn note_write(&mut self, t: usize) {
        self.wrote_shared[t] = true;
    }

    /// A `__syncthreads()`: every write is everyone's, and no arrival need release one.
    pub(super) fn writes_synchronised(&mut self) {
        self.wrote_shared.fill(false);
    }

    /// What thread `t` knows (see [`Knowledge`]).
    pub(super) fn knowledge(&self, t: usize) -> &Knowledge {
        &self.observed[t]
    }

    /// Whether thread `t` has waited for phase `phase` of barrier `key` (or a later one).
    pub(super) fn seen(&self, t: usize, key: &str, phase: u64) -> bool {
        self.observed[t].get(key).is_some_and(|&seen| seen > phase)
    }

    /// The phase of `key` now collecting arrivals and bytes.
    pub(super) fn current_phase(&self, key: &str, t: usize) -> Result<u64, Fault> {
        self.barriers
            .get(key)
            .map(|b| b.completed)
            .ok_or_else(|| (t, format!("uses mbarrier {key} before mbarrier.init")))
    }
}

impl Block<'_> {
    /// Per thread, the key naming the barrier `r` picks (`array[slot]`), bounds checked.
    pub(super) fn barrier_keys(
        &self,
        r: &MbarrierRef,
        mask: &[bool],
        global: &HashMap<String, super::Array>,
    ) -> Result<Vec<String>, Fault> {
        let slots = self.eval(&r.slot, mask, global)?;
        let len = self.shared[&r.array].len() as i64;
        let mut keys = vec![String::new(); mask.len()];
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            let slot = slots[t].i();
            if slot < 0 || 2 * slot + 2 > len {
                return Err((
                    t,
                    format!(
                        "mbarrier slot {slot} of `{}` out of bounds ({} slots)",
                        r.array,
                        len / 2
                    ),
                ));
            }
            keys[t] = format!("{}[{slot}]", r.array);
        }
        Ok(keys)
    }

    pub(super) fn mbarrier(
        &mut self,
        op: &Mbarrier,
        mask: &[bool],
        global: &HashMap<String, super::Array>,
    ) -> Result<(), Fault> {
        match op {
            Mbarrier::Init { barrier, count } => {
                let t = self.one_thread("mbarrier.init", mask)?;
                let key = self.barrier_keys(barrier, mask, global)?.swap_remove(t);
                let fresh = Barrier {
                    count: *count,
                    arrivals: 0,
                    pending_bytes: 0,
                    completed: 0,
                    held: Vec::new(),
                    releasing: Knowledge::new(),
                    released: Knowledge::new(),
                };
                if self.barriers.barriers.insert(key.clone(), fresh).is_some() {
                    return Err((t, format!("mbarrier {key} initialised twice")));
                }
                Ok(())
            }
            Mbarrier::ArriveExpectTx { barrier, bytes } => {
                let keys = self.barrier_keys(barrier, mask, global)?;
                for t in (0..mask.len()).filter(|&t| mask[t]) {
                    self.barrier_mut(&keys[t], t)?.pending_bytes += *bytes as i64;
                    self.arrive(&keys[t], t, Vec::new())?;
                }
                Ok(())
            }
            Mbarrier::Arrive { barrier } => {
                let keys = self.barrier_keys(barrier, mask, global)?;
                for t in (0..mask.len()).filter(|&t| mask[t]) {
                    self.arrive(&keys[t], t, Vec::new())?;
                }
                Ok(())
            }
            Mbarrier::Wait { barrier, parity } => self.mbarrier_wait(barrier, parity, mask, global),
        }
    }

    fn barrier_mut(&mut self, key: &str, t: usize) -> Result<&mut Barrier, Fault> {
        self.barriers
            .barriers
            .get_mut(key)
            .ok_or_else(|| (t, format!("uses mbarrier {key} before mbarrier.init")))
    }

    /// Thread `t` arrives on `key`, releasing what it knows, its warpgroup's tensor-core reads
    /// retired so far among it; `held` are shared elements the phase's completion frees.
    pub(super) fn arrive(&mut self, key: &str, t: usize, held: Vec<(String, usize)>) -> Result<(), Fault> {
        self.barriers.clock += 1;
        let mut knows = self.barriers.observed[t].clone();
        knows.insert(warpgroup_key(t / super::asynchronous::WARPGROUP), self.barriers.clock);
        knows.insert(warp_key(t / 32), self.barriers.clock);
        if self.barriers.wrote_shared[t] {
            knows.insert(thread_key(t), self.barriers.clock);
        }
        let b = self.barrier_mut(key, t)?;
        merge(&mut b.releasing, &knows);
        if b.arrivals == b.count {
            return Err((
                t,
                format!(
                    "arrives on mbarrier {key}, whose phase has all its {} arrivals ({} transaction bytes outstanding)",
                    b.count, b.pending_bytes
                ),
            ));
        }
        b.arrivals += 1;
        b.held.extend(held);
        self.complete_if_met(key, t)
    }

    /// A TMA copy issued by thread `t` delivers `bytes` to the current phase of `key`.
    pub(super) fn deliver_bytes(&mut self, key: &str, bytes: u32, t: usize) -> Result<(), Fault> {
        self.barrier_mut(key, t)?.pending_bytes -= bytes as i64;
        self.complete_if_met(key, t)
    }

    /// Completes the current phase of `key` once its arrivals and bytes are all in.
    fn complete_if_met(&mut self, key: &str, t: usize) -> Result<(), Fault> {
        let b = self.barrier_mut(key, t)?;
        if b.arrivals < b.count {
            return Ok(());
        }
        if b.pending_bytes < 0 {
            return Err((
                t,
                format!(
                    "mbarrier {key} received {} transaction bytes more than its phase announced",
                    -b.pending_bytes
                ),
            ));
        }
        if b.pending_bytes > 0 {
            return Ok(());
        }
        b.arrivals = 0;
        b.completed += 1;
        let releasing = std::mem::take(&mut b.releasing);
        merge(&mut b.released, &releasing);
        for (array, i) in std::mem::take(&mut b.held) {
            self.hold_shared(&array, &[i], -1);
        }
        Ok(())
    }

    fn mbarrier_wait(
        &mut self,
        barrier: &MbarrierRef,
        parity: &Expr,
        mask: &[bool],
        global: &HashMap<String, super::Array>,
    ) -> Result<(), Fault> {
        let parity = self.eval(parity, mask, global)?;
        let keys = self.barrier_keys(barrier, mask, global)?;
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            let key = &keys[t];
            let b = self.barrier_mut(key, t)?;
            // A parity's phase is complete once the current phase has the other parity; a wait
            // is run only once it is or nothing else can arrive (every thread in lockstep
            // code, every role of warp-specialised code waits), so otherwise it never is.
            if b.completed % 2 == parity[t].i() as u64 % 2 {
                return Err((
                    t,
                    format!(
                        "waits on phase parity {} of mbarrier {key}, which never completes ({} of {} arrivals, {} transaction bytes outstanding)",
                        parity[t].i(),
                        b.arrivals,
                        b.count,
                        b.pending_bytes
                    ),
                ));
            }
            let (completed, released) = (b.completed, b.released.clone());
            let observed = &mut self.barriers.observed[t];
            merge(observed, &released);
            observed.insert(key.clone(), completed);
        }
        Ok(())
    }

    /// Whether the phase each thread of `mask` waits for has completed.
    pub(super) fn wait_completes(
        &self,
        barrier: &MbarrierRef,
        parity: &Expr,
        mask: &[bool],
        global: &HashMap<String, super::Array>,
    ) -> Result<bool, Fault> {
        let parity = self.eval(parity, mask, global)?;
        let keys = self.barrier_keys(barrier, mask, global)?;
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            let b = self.barriers.barriers.get(&keys[t]);
            let b = b.ok_or_else(|| (t, format!("uses mbarrier {} before mbarrier.init", keys[t])))?;
            if b.completed % 2 == parity[t].i() as u64 % 2 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The one active thread of a single-thread instruction.
    pub(super) fn one_thread(&self, what: &str, mask: &[bool]) -> Result<usize, Fault> {
        let threads: Vec<usize> = (0..mask.len()).filter(|&t| mask[t]).collect();
        match threads[..] {
            [t] => Ok(t),
            _ => Err((
                threads[0],
                format!(
                    "{what} issued by {} threads at once: one thread issues it",
                    threads.len()
                ),
            )),
        }
    }
}
