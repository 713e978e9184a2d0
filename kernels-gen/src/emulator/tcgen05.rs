//! Blackwell's `tcgen05` on the emulator: tensor memory (TMEM, 128 lanes × 512 columns of 32
//! bits per block), its allocation by whole warps, and MMAs issued by one thread that complete
//! asynchronously, signalled through an mbarrier (`mbarrier.rs`). An MMA is computed at issue
//! but its TMEM cells only become readable to a thread that has waited on the mbarrier phase
//! of a commit by its issuer at or after it (a commit tracks every earlier MMA of the
//! thread); its shared operands stay off limits until its first commit's phase completes.
//! Reported: reading TMEM an MMA is still writing (no commit, or no wait), an MMA writing
//! TMEM another warp read with nothing ordering the read first (the reader's arrival on an
//! mbarrier after it, which the issuer waited on: how an epilogue hands an accumulator back),
//! touching `tcgen05.ld` results before `tcgen05.wait::ld`, a warp reading lanes outside its
//! quarter, MMAs outside allocated columns, an allocation never freed, and every
//! shared-memory rule `wgmma` has. The `tcgen05.fence` instructions order work around barriers on the device;
//! lockstep execution has nothing to reorder, so they are accepted as written.
use super::mma::rounded;
use super::{Block, Fault, Val};
use crate::dsl::{Expr, Major, Tcgen05, TmemMma};
use std::collections::{HashMap, HashSet};

const LANES: usize = 128;
const COLUMNS: usize = 512;
/// tcgen05.mma's M with `cta_group::1` as generated here.
const M: usize = 128;

/// When a TMEM cell written by an MMA may be read.
#[derive(Debug, Clone, PartialEq)]
enum Ready {
    /// Issued by this thread, not yet committed.
    Uncommitted(usize),
    /// Committed by `thread`, first in its commit `seq`: the phase of that commit or of any
    /// later one of the thread completes it.
    Committed { thread: usize, seq: usize },
}

#[derive(Default)]
struct Footprint {
    cells: Vec<usize>,
    shared: Vec<(String, usize)>,
}

pub(super) struct TensorMemory {
    cells: Vec<f32>,
    /// Per cell: `None` never written (or freed), else when its value is readable.
    ready: Vec<Option<Ready>>,
    /// (first column, columns) of each live allocation.
    allocations: Vec<(usize, usize)>,
    /// Per thread: MMAs issued and not yet committed.
    uncommitted: Vec<Vec<Footprint>>,
    /// Per thread: its commits in order, each the (barrier, phase) it arrives on.
    commits: Vec<Vec<(String, u64)>>,
    /// Per cell: the warp that last read it with `tcgen05.ld`, and the barriers' clock then
    /// (`Barriers::clock`), until an MMA ordered after the read writes it.
    read_by: Vec<Option<(usize, u64)>>,
    /// (thread, local) written by a `tcgen05.ld` not yet waited for.
    loading: HashSet<(usize, String)>,
}

impl TensorMemory {
    /// Its cells are made at the first allocation: most kernels never allocate, and every
    /// block of every launch makes its tensor memory.
    pub(super) fn new(threads: usize) -> Self {
        Self {
            cells: Vec::new(),
            ready: Vec::new(),
            allocations: Vec::new(),
            uncommitted: (0..threads).map(|_| Vec::new()).collect(),
            commits: vec![Vec::new(); threads],
            read_by: Vec::new(),
            loading: HashSet::new(),
        }
    }

    /// Thread `t` touches local `name`: not while a `tcgen05.ld` into it is outstanding.
    pub(super) fn check_register(&self, name: &str, t: usize) -> Result<(), Fault> {
        if !self.loading.is_empty() && self.loading.contains(&(t, name.to_string())) {
            return Err((t, format!("uses `{name}` before tcgen05.wait::ld")));
        }
        Ok(())
    }

    pub(super) fn loads_outstanding(&self) -> bool {
        !self.loading.is_empty()
    }

    /// At the end of the block: TMEM must have been freed.
    pub(super) fn check_freed(&self) -> Result<(), Fault> {
        match self.allocations.first() {
            Some((start, columns)) => Err((
                0,
                format!("{columns} TMEM columns at {start} are still allocated when the block exits"),
            )),
            None => Ok(()),
        }
    }

    /// The allocation holding columns `start..start + columns`, if any.
    fn allocated(&self, start: usize, columns: usize) -> bool {
        self.allocations
            .iter()
            .any(|&(s, c)| start >= s && start + columns <= s + c)
    }
}

fn active(mask: &[bool]) -> Vec<usize> {
    (0..mask.len()).filter(|&t| mask[t]).collect()
}

impl Block<'_> {
    pub(super) fn tcgen05(
        &mut self,
        op: &Tcgen05,
        mask: &[bool],
        global: &HashMap<String, super::Array>,
    ) -> Result<(), Fault> {
        match op {
            Tcgen05::Alloc { columns, slot } => self.tmem_alloc(*columns as usize, slot, mask),
            Tcgen05::Dealloc { columns, address } => self.tmem_dealloc(*columns as usize, address, mask, global),
            Tcgen05::Mma(mma) => self.mma(mma, mask, global),
            Tcgen05::Commit { barrier } => self.commit(barrier, mask, global),
            Tcgen05::Load { address, names } => self.tmem_load(address, names, mask, global),
            Tcgen05::WaitLd => {
                self.tmem.loading.retain(|(t, _)| !mask[*t]);
                Ok(())
            }
            Tcgen05::FenceBeforeSync | Tcgen05::FenceAfterSync => Ok(()),
        }
    }

    /// The first thread of the one whole warp a warp-wide instruction runs on.
    fn one_warp(&self, what: &str, mask: &[bool]) -> Result<usize, Fault> {
        let threads = active(mask);
        let first = threads[0];
        let whole = first.is_multiple_of(32) && threads.len() == 32 && threads[31] == first + 31;
        match whole {
            true => Ok(first),
            false => Err((
                first,
                format!("{what} needs exactly one whole warp ({} threads active)", threads.len()),
            )),
        }
    }

    fn tmem_alloc(&mut self, columns: usize, slot: &str, mask: &[bool]) -> Result<(), Fault> {
        let t = self.one_warp("tcgen05.alloc", mask)?;
        // First fit, aligned to the allocation's size.
        let start = (0..COLUMNS)
            .step_by(columns)
            .find(|&s| {
                s + columns <= COLUMNS && !self.tmem.allocations.iter().any(|&(a, c)| s < a + c && a < s + columns)
            })
            .ok_or((t, format!("no {columns} free TMEM columns")))?;
        if self.tmem.cells.is_empty() {
            self.tmem.cells = vec![0.0; LANES * COLUMNS];
            self.tmem.ready = vec![None; LANES * COLUMNS];
            self.tmem.read_by = vec![None; LANES * COLUMNS];
        }
        self.tmem.allocations.push((start, columns));
        // The address lands in shared memory, written by the warp: readers need a barrier.
        self.asynch.note_write(slot, 0, t)?;
        let write = self.shared_write(t);
        self.shared_writer.get_mut(slot).expect("shared")[0] = Some(write);
        let array = self.shared.get_mut(slot).expect("shared");
        array.values[0] = start as f64;
        array.init[0] = true;
        Ok(())
    }

    fn tmem_dealloc(
        &mut self,
        columns: usize,
        address: &Expr,
        mask: &[bool],
        global: &HashMap<String, super::Array>,
    ) -> Result<(), Fault> {
        let t = self.one_warp("tcgen05.dealloc", mask)?;
        let start = self.eval(address, mask, global)?[t].i() as usize;
        let Some(i) = self.tmem.allocations.iter().position(|&a| a == (start, columns)) else {
            return Err((
                t,
                format!("tcgen05.dealloc of {columns} columns at {start}, which is not an allocation"),
            ));
        };
        let in_flight = (0..LANES).flat_map(|lane| (start..start + columns).map(move |c| lane * COLUMNS + c));
        for cell in in_flight {
            if matches!(self.tmem.ready[cell], Some(Ready::Uncommitted(_))) {
                return Err((t, "tcgen05.dealloc while an MMA into those columns is in flight".into()));
            }
            self.tmem.ready[cell] = None;
            self.tmem.read_by[cell] = None;
        }
        self.tmem.allocations.remove(i);
        Ok(())
    }

    fn mma(&mut self, mma: &TmemMma, mask: &[bool], global: &HashMap<String, super::Array>) -> Result<(), Fault> {
        let TmemMma {
            tmem,
            a,
            b,
            b_major,
            n,
            accumulate,
        } = mma;
        let n = *n as usize;
        let t = self.one_thread("tcgen05.mma", mask)?;
        let address = self.eval(tmem, mask, global)?[t].i() as usize;
        let accumulate = self.eval(accumulate, mask, global)?[t].b();
        let (lane, column) = (address >> 16, address & 0xffff);
        if lane != 0 || !self.tmem.allocated(column, n) {
            return Err((
                t,
                format!("tcgen05.mma into TMEM lane {lane}, columns {column}..+{n}, not allocated from lane 0"),
            ));
        }
        let mut starts = Vec::new();
        for (operand, major) in [(a, Major::K), (b, *b_major)] {
            let s = self.eval(&operand.start, mask, global)?[t].i();
            if let Some(fault) = super::asynchronous::misplaced_operand("tcgen05.mma", operand, major, s) {
                return Err((t, fault));
            }
            starts.push(s as usize);
        }
        let (a_values, a_indices) = self.read_operand("tcgen05.mma", a, Major::K, starts[0], M, t)?;
        let (b_values, b_indices) = self.read_operand("tcgen05.mma", b, *b_major, starts[1], n, t)?;
        let element = self.element_of(&b.array);
        let round = |v: f32| rounded(element, v);
        let mut footprint = Footprint::default();
        for (row, a_row) in a_values.iter().enumerate() {
            for (col, b_row) in b_values.iter().enumerate() {
                let cell = row * COLUMNS + column + col;
                self.check_read_before(cell, t)?;
                let before = match (accumulate, &self.tmem.ready[cell]) {
                    (false, _) => 0.0,
                    (true, Some(_)) => self.tmem.cells[cell],
                    (true, None) => return Err((t, "tcgen05.mma accumulates into TMEM never written".into())),
                };
                let product: f32 = (0..16).map(|k| round(a_row[k]) * round(b_row[k])).sum();
                self.tmem.cells[cell] = before + product;
                self.tmem.ready[cell] = Some(Ready::Uncommitted(t));
                footprint.cells.push(cell);
            }
        }
        for (operand, indices) in [(a, a_indices), (b, b_indices)] {
            self.hold_shared(&operand.array, &indices, 1);
            footprint
                .shared
                .extend(indices.into_iter().map(|i| (operand.array.clone(), i)));
        }
        self.tmem.uncommitted[t].push(footprint);
        Ok(())
    }

    /// An MMA issued by thread `t` may write `cell` only once any other warp's read of it is
    /// known to `t` to be over: the reader arrived on an mbarrier after it, and `t` waited on
    /// that phase (the warp's release in `t`'s knowledge is later than the read).
    fn check_read_before(&mut self, cell: usize, t: usize) -> Result<(), Fault> {
        if let Some((warp, clock)) = self.tmem.read_by[cell] {
            let released = self.barriers.knowledge(t).get(&super::mbarrier::warp_key(warp));
            if warp != t / 32 && released.is_none_or(|&r| r <= clock) {
                return Err((
                    t,
                    format!(
                        "tcgen05.mma writes TMEM lane {}, column {} that warp {warp} read (tcgen05.ld), \
                         with no mbarrier it arrived on after the read waited on first",
                        cell / COLUMNS,
                        cell % COLUMNS
                    ),
                ));
            }
            self.tmem.read_by[cell] = None;
        }
        Ok(())
    }

    /// `tcgen05.commit`: the thread's uncommitted MMAs complete with the barrier's current
    /// phase (as its earlier ones, which the commit tracks too), and the thread arrives on it.
    fn commit(
        &mut self,
        barrier: &crate::dsl::MbarrierRef,
        mask: &[bool],
        global: &HashMap<String, super::Array>,
    ) -> Result<(), Fault> {
        let t = self.one_thread("tcgen05.commit", mask)?;
        let key = self.barrier_keys(barrier, mask, global)?.swap_remove(t);
        let phase = self.barriers.current_phase(&key, t)?;
        let seq = self.tmem.commits[t].len();
        self.tmem.commits[t].push((key.clone(), phase));
        let mut held = Vec::new();
        for footprint in std::mem::take(&mut self.tmem.uncommitted[t]) {
            for &cell in &footprint.cells {
                self.tmem.ready[cell] = Some(Ready::Committed { thread: t, seq });
            }
            for (array, i) in &footprint.shared {
                self.landings.note_mma_read(array, *i, &key, phase);
            }
            held.extend(footprint.shared);
        }
        self.arrive(&key, t, held)
    }

    /// `tcgen05.ld.32x32b`: each active warp reads its 32 lanes, `names.len()` columns.
    fn tmem_load(
        &mut self,
        address: &Expr,
        names: &[String],
        mask: &[bool],
        global: &HashMap<String, super::Array>,
    ) -> Result<(), Fault> {
        let address = self.eval(address, mask, global)?;
        let mut values = vec![vec![Val::Undef; mask.len()]; names.len()];
        for warp_start in (0..mask.len())
            .step_by(32)
            .filter(|&w| mask[w..(w + 32).min(mask.len())].iter().any(|&m| m))
        {
            let lanes = warp_start..(warp_start + 32).min(mask.len());
            if let Some(t) = lanes
                .clone()
                .find(|&t| !mask[t])
                .or((lanes.len() < 32).then_some(warp_start))
            {
                return Err((t, "tcgen05.ld needs every lane of the warp".into()));
            }
            let a = address[warp_start].i() as usize;
            if let Some(t) = lanes.clone().find(|&t| address[t].i() as usize != a) {
                return Err((t, "tcgen05.ld address differs across the warp".into()));
            }
            let (lane_base, column) = (a >> 16, a & 0xffff);
            let quarter = 32 * (warp_start / 32 % 4);
            if lane_base != quarter {
                return Err((
                    warp_start,
                    format!(
                        "warp {} reads TMEM lanes {lane_base}..+32; it may read only {quarter}..+32",
                        warp_start / 32
                    ),
                ));
            }
            if !self.tmem.allocated(column, names.len()) {
                return Err((
                    warp_start,
                    format!(
                        "tcgen05.ld of columns {column}..+{} outside any allocation",
                        names.len()
                    ),
                ));
            }
            for t in lanes {
                for (j, out) in values.iter_mut().enumerate() {
                    let cell = (lane_base + t - warp_start) * COLUMNS + column + j;
                    match &self.tmem.ready[cell] {
                        None => {
                            return Err((
                                t,
                                format!(
                                    "tcgen05.ld of TMEM lane {}, column {}, never written",
                                    cell / COLUMNS,
                                    cell % COLUMNS
                                ),
                            ))
                        }
                        Some(Ready::Uncommitted(_)) => {
                            return Err((t, "tcgen05.ld of TMEM an MMA is still writing (not committed)".into()))
                        }
                        Some(Ready::Committed { thread, seq }) => {
                            let commits = &self.tmem.commits[*thread][*seq..];
                            if !commits
                                .iter()
                                .any(|(barrier, phase)| self.barriers.seen(t, barrier, *phase))
                            {
                                return Err((
                                    t,
                                    format!(
                                        "tcgen05.ld of TMEM before waiting on the `{}` phase that completes its MMA \
                                         (or a later commit's)",
                                        commits[0].0
                                    ),
                                ));
                            }
                        }
                    }
                    out[t] = Val::F(self.tmem.cells[cell]);
                    self.tmem.read_by[cell] = Some((t / 32, self.barriers.clock));
                }
            }
        }
        for (name, v) in names.iter().zip(&values) {
            self.touch(name, mask)?;
            self.declare(name, crate::dsl::Ty::F32, v, mask);
            for t in active(mask) {
                self.tmem.loading.insert((t, name.clone()));
            }
        }
        Ok(())
    }
}
