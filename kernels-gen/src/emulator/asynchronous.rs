//! The asynchronous operations on the emulator: `cp.async` copies (sm_80 and later) and
//! Hopper's `wgmma`. On the device both finish some time after they are issued. The emulator
//! lands a copy when the device guarantees it has landed (its group retired by
//! `cp.async.wait_group`) and computes a `wgmma` at issue (its result is not observable
//! before its group retires), and it reports every access the device would race: touching a
//! copy's destination before it lands, touching a `wgmma`'s registers or shared operand
//! before its group retires, a `wgmma` with no `wgmma.fence` since the last wait, a
//! `wgmma` reading shared memory that was not fenced into the async proxy
//! (`fence.proxy.async`) and published with a barrier, and a `wgmma`'s operands overwritten
//! by another warpgroup with no barrier since it retired.

use super::mma::rounded;
use super::{Block, Fault, Val};
use crate::dsl::{AsyncCopy, Major, MmaElement, SmemMatrix, Swizzle, WgmmaA, WgmmaOp};
use std::collections::{HashMap, HashSet, VecDeque};

/// Threads in a warpgroup, the unit that issues `wgmma`.
pub(super) const WARPGROUP: usize = 128;
/// Bytes of one `cp.async`.
const COPY_BYTES: usize = 16;

struct PendingCopy {
    array: String,
    index: usize,
    /// The copy's elements (8 bf16 or 4 f32), in order.
    values: Vec<f64>,
}

/// What one `wgmma` keeps busy until its group retires.
#[derive(Default)]
struct Footprint {
    registers: Vec<(usize, String)>,
    shared: Vec<(String, usize)>,
}

/// The in-flight state of one block's asynchronous operations.
pub(super) struct AsyncState {
    /// Per thread: copies issued since its last commit, and its committed groups, oldest first.
    uncommitted_copies: Vec<Vec<PendingCopy>>,
    copy_groups: Vec<VecDeque<Vec<PendingCopy>>>,
    /// Per shared element: a copy in flight will write it.
    copy_targets: HashMap<String, Vec<bool>>,
    /// Per shared element: the thread that wrote it and has not run `fence.proxy.async` since.
    unfenced: HashMap<String, Vec<Option<usize>>>,
    /// Per warpgroup: a `wgmma.fence` since its last wait; its uncommitted and committed wgmmas.
    wgmma_fenced: Vec<bool>,
    uncommitted_wgmma: Vec<Footprint>,
    wgmma_groups: Vec<VecDeque<Footprint>>,
    /// (warpgroup, local) that some wgmma in flight uses; per shared element, how many
    /// tensor-core MMAs in flight (wgmma or tcgen05) read it.
    busy_registers: HashSet<(usize, String)>,
    busy_shared: HashMap<String, Vec<u32>>,
}

impl AsyncState {
    pub(super) fn new(threads: usize, shared: &[(String, usize)]) -> Self {
        let warpgroups = threads.div_ceil(WARPGROUP);
        Self {
            uncommitted_copies: (0..threads).map(|_| Vec::new()).collect(),
            copy_groups: (0..threads).map(|_| VecDeque::new()).collect(),
            copy_targets: per_element(shared, false),
            unfenced: per_element(shared, None),
            wgmma_fenced: vec![false; warpgroups],
            uncommitted_wgmma: (0..warpgroups).map(|_| Footprint::default()).collect(),
            wgmma_groups: (0..warpgroups).map(|_| VecDeque::new()).collect(),
            busy_registers: HashSet::new(),
            busy_shared: per_element(shared, 0),
        }
    }

    pub(super) fn registers_busy(&self) -> bool {
        !self.busy_registers.is_empty()
    }

    /// Thread `t` reads or writes local `name`: not while a wgmma of its warpgroup uses it.
    pub(super) fn check_register(&self, name: &str, t: usize) -> Result<(), Fault> {
        if self.registers_busy() && self.busy_registers.contains(&(t / WARPGROUP, name.to_string())) {
            return Err((
                t,
                format!("touches `{name}` while a wgmma using it is in flight (no wgmma.wait_group)"),
            ));
        }
        Ok(())
    }

    /// Thread `t` accesses shared `array[index]` with an ordinary load or store.
    pub(super) fn check_shared(&self, array: &str, index: usize, t: usize) -> Result<(), Fault> {
        check_copy_target(self.copy_targets(array), array, index, t)
    }

    /// Which elements of shared `array` a `cp.async` in flight writes (for checks of many
    /// threads' accesses, looked up once).
    pub(super) fn copy_targets(&self, array: &str) -> Option<&[bool]> {
        self.copy_targets.get(array).map(Vec::as_slice)
    }

    /// Thread `t` writes shared `array[index]` (a store or a landed copy).
    pub(super) fn note_write(&mut self, array: &str, index: usize, t: usize) -> Result<(), Fault> {
        self.note_async_write(array, index, t)?;
        if let Some(slots) = self.unfenced.get_mut(array) {
            slots[index] = Some(t);
        }
        Ok(())
    }

    /// Shared `array[index]` is written through the async proxy (a TMA copy issued by `t`):
    /// not while a tensor-core MMA reads it; nothing to fence.
    pub(super) fn note_async_write(&mut self, array: &str, index: usize, t: usize) -> Result<(), Fault> {
        if self.busy_shared.get(array).is_some_and(|b| b[index] > 0) {
            return Err((
                t,
                format!("overwrites {array}[{index}] while a tensor-core MMA reading it is in flight"),
            ));
        }
        if let Some(slots) = self.unfenced.get_mut(array) {
            slots[index] = None;
        }
        Ok(())
    }
}

/// One `init` per element of every shared array.
fn per_element<T: Clone>(shared: &[(String, usize)], init: T) -> HashMap<String, Vec<T>> {
    shared
        .iter()
        .map(|(name, len)| (name.clone(), vec![init.clone(); *len]))
        .collect()
}

fn warpgroups(mask: &[bool]) -> impl Iterator<Item = usize> + '_ {
    (0..mask.len().div_ceil(WARPGROUP)).filter(move |wg| {
        mask[wg * WARPGROUP..((wg + 1) * WARPGROUP).min(mask.len())]
            .iter()
            .any(|&m| m)
    })
}

impl Block<'_> {
    pub(super) fn cp_async(
        &mut self,
        copy: &AsyncCopy,
        mask: &[bool],
        global: &HashMap<String, super::Array>,
    ) -> Result<(), Fault> {
        let dst_index = self.eval(&copy.dst_index, mask, global)?;
        let src_index = self.eval(&copy.src_index, mask, global)?;
        let valid = self.eval(&copy.valid, mask, global)?;
        // 16 bytes of the arrays' element type (the type checker made both alike).
        let elements = COPY_BYTES / self.shared[&copy.dst].ty.bytes();
        let width = elements as i64;
        // A global buffer may start past an aligned address: the address must be aligned.
        let src_start = global.get(&copy.src).map_or(0, |a| a.start as i64);
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            let (d, s) = (dst_index[t].i(), src_index[t].i());
            if d % width != 0 || (valid[t].b() && (src_start + s) % width != 0) {
                return Err((
                    t,
                    format!(
                        "cp.async from {}[{s}] to {}[{d}] is not 16-byte aligned",
                        copy.src, copy.dst
                    ),
                ));
            }
            let dst_len = self.shared[&copy.dst].len() as i64;
            if d < 0 || d + width > dst_len {
                return Err((
                    t,
                    format!(
                        "cp.async to {}[{d}..+{width}] out of bounds (length {dst_len})",
                        copy.dst
                    ),
                ));
            }
            let mut values = vec![0.0; elements];
            if valid[t].b() {
                let src = &global[&copy.src];
                if s < 0 || s + width > src.len() as i64 {
                    return Err((
                        t,
                        format!(
                            "cp.async from {}[{s}..+{width}] out of bounds (length {})",
                            copy.src,
                            src.len()
                        ),
                    ));
                }
                for (j, v) in values.iter_mut().enumerate() {
                    let i = s as usize + j;
                    if !src.init[i] {
                        return Err((t, format!("cp.async of {}[{i}], which was never written", copy.src)));
                    }
                    *v = src.values[i];
                }
            }
            let d = d as usize;
            for i in d..d + elements {
                let knows = self.barriers.knowledge(t);
                if let Some(reader) = self.shared_readers.get_mut()[&copy.dst][i].unordered_before(t, knows) {
                    return Err((
                        t,
                        format!(
                            "cp.async overwrites {}[{i}], read by {reader} without a __syncthreads() between",
                            copy.dst
                        ),
                    ));
                }
                self.asynch.check_shared(&copy.dst, i, t)?;
                self.check_landed(&copy.dst, i, t, "cp.async overwrites")?;
                self.check_mma_read(&copy.dst, i, t)?;
                if self.asynch.busy_shared[&copy.dst][i] > 0 {
                    return Err((
                        t,
                        format!(
                            "cp.async overwrites {}[{i}] while a tensor-core MMA reading it is in flight",
                            copy.dst
                        ),
                    ));
                }
                self.asynch.copy_targets.get_mut(&copy.dst).expect("shared")[i] = true;
            }
            self.asynch.uncommitted_copies[t].push(PendingCopy {
                array: copy.dst.clone(),
                index: d,
                values,
            });
        }
        Ok(())
    }

    pub(super) fn cp_async_commit(&mut self, mask: &[bool]) {
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            let group = std::mem::take(&mut self.asynch.uncommitted_copies[t]);
            self.asynch.copy_groups[t].push_back(group);
        }
    }

    /// Land every group of each thread but its newest `pending`.
    pub(super) fn cp_async_wait(&mut self, pending: u32, mask: &[bool]) -> Result<(), Fault> {
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            while self.asynch.copy_groups[t].len() > pending as usize {
                let group = self.asynch.copy_groups[t].pop_front().expect("non-empty");
                for copy in group {
                    self.land(copy, t)?;
                }
            }
        }
        Ok(())
    }

    fn land(&mut self, copy: PendingCopy, t: usize) -> Result<(), Fault> {
        for (j, value) in copy.values.into_iter().enumerate() {
            let i = copy.index + j;
            self.asynch.copy_targets.get_mut(&copy.array).expect("shared")[i] = false;
            self.asynch.note_write(&copy.array, i, t)?;
            self.forget_landing(&copy.array, i);
            let write = self.shared_write(t);
            self.shared_writer.get_mut(&copy.array).expect("shared")[i] = Some(write);
            let array = self.shared.get_mut(&copy.array).expect("shared");
            array.values[i] = value;
            array.init[i] = true;
        }
        Ok(())
    }

    /// `fence.proxy.async`: the active threads' writes become visible to wgmma.
    pub(super) fn fence_proxy_async(&mut self, mask: &[bool]) {
        for slots in self.asynch.unfenced.values_mut() {
            for slot in slots.iter_mut() {
                if matches!(*slot, Some(w) if mask[w]) {
                    *slot = None;
                }
            }
        }
    }

    /// The warpgroups taking part in a warpgroup-wide instruction: all 128 threads of each.
    fn full_warpgroups(&self, what: &str, mask: &[bool]) -> Result<Vec<usize>, Fault> {
        let groups: Vec<usize> = warpgroups(mask).collect();
        for &wg in &groups {
            let threads = wg * WARPGROUP..(wg + 1) * WARPGROUP;
            if threads.end > mask.len() {
                return Err((threads.start, format!("{what} needs a whole warpgroup of 128 threads")));
            }
            if let Some(t) = threads.clone().find(|&t| !mask[t]) {
                return Err((
                    t,
                    format!("{what} with an inactive thread: the whole warpgroup must take part"),
                ));
            }
        }
        Ok(groups)
    }

    pub(super) fn wgmma_fence(&mut self, mask: &[bool]) -> Result<(), Fault> {
        for wg in self.full_warpgroups("wgmma.fence", mask)? {
            self.asynch.wgmma_fenced[wg] = true;
        }
        Ok(())
    }

    pub(super) fn wgmma_commit(&mut self, mask: &[bool]) -> Result<(), Fault> {
        for wg in self.full_warpgroups("wgmma.commit_group", mask)? {
            let group = std::mem::take(&mut self.asynch.uncommitted_wgmma[wg]);
            self.asynch.wgmma_groups[wg].push_back(group);
        }
        Ok(())
    }

    pub(super) fn wgmma_wait(&mut self, pending: u32, mask: &[bool]) -> Result<(), Fault> {
        for wg in self.full_warpgroups("wgmma.wait_group", mask)? {
            while self.asynch.wgmma_groups[wg].len() > pending as usize {
                let done = self.asynch.wgmma_groups[wg].pop_front().expect("non-empty");
                for r in &done.registers {
                    self.asynch.busy_registers.remove(r);
                }
                // Retired, its operands count as read by the warpgroup until the next barrier
                // or until the writer acquires the warpgroup's next release (an mbarrier it
                // arrives on): another warpgroup must not refill them before, as it could on
                // the device, where warpgroups do not run in lockstep.
                let readers = self.shared_readers.get_mut();
                let clock = self.barriers.clock;
                for (array, i) in &done.shared {
                    self.asynch.busy_shared.get_mut(array).expect("shared")[*i] -= 1;
                    let r = &mut readers.get_mut(array).expect("shared")[*i];
                    *r = r.add_warpgroup(wg, clock);
                }
            }
            self.asynch.wgmma_fenced[wg] = false;
        }
        Ok(())
    }

    /// One `wgmma.mma_async` per warpgroup (layouts in `WgmmaOp` and `SmemMatrix`): bf16 or
    /// f16 operands (B's array's type), f32 accumulation.
    pub(super) fn wgmma(
        &mut self,
        op: &WgmmaOp,
        mask: &[bool],
        global: &HashMap<String, super::Array>,
    ) -> Result<(), Fault> {
        let n = op.n as usize;
        let element = self.element_of(&op.b.array);
        for wg in self.full_warpgroups("wgmma", mask)? {
            let first = wg * WARPGROUP;
            if !self.asynch.wgmma_fenced[wg] {
                return Err((
                    first,
                    "wgmma without a wgmma.fence since the last wgmma.wait_group".into(),
                ));
            }
            let mut footprint = Footprint::default();
            let a = match &op.a {
                WgmmaA::Registers(names) => {
                    footprint.registers.extend(names.iter().map(|name| (wg, name.clone())));
                    self.gather_a(names, element, first)?
                }
                WgmmaA::Shared(matrix) => {
                    let start = self.operand_start(matrix, Major::K, mask, global, first)?;
                    let (values, indices) = self.read_operand("wgmma", matrix, Major::K, start, 64, first)?;
                    footprint
                        .shared
                        .extend(indices.into_iter().map(|i| (matrix.array.clone(), i)));
                    let mut a = [[0f32; 16]; 64];
                    for (row, v) in a.iter_mut().zip(values) {
                        *row = v.map(|x| rounded(element, x));
                    }
                    a
                }
            };
            let start = self.operand_start(&op.b, op.b_major, mask, global, first)?;
            let (b, b_indices) = self.read_operand("wgmma", &op.b, op.b_major, start, n, first)?;
            footprint
                .shared
                .extend(b_indices.into_iter().map(|i| (op.b.array.clone(), i)));
            let mut d = vec![[0f32; 256]; 64];
            for warp in 0..4 {
                for lane in 0..32 {
                    let t = first + 32 * warp + lane;
                    for (i, name) in op.d.iter().enumerate() {
                        let (row, col) = accumulator_position(warp, lane, i);
                        d[row][col] = self.register(name, t)?;
                    }
                }
            }
            for (row, acc) in d.iter_mut().enumerate() {
                for (col, out) in acc.iter_mut().take(n).enumerate() {
                    *out += (0..16).map(|k| a[row][k] * b[col][k]).sum::<f32>();
                }
            }
            for warp in 0..4 {
                for lane in 0..32 {
                    let t = first + 32 * warp + lane;
                    for (i, name) in op.d.iter().enumerate() {
                        let (row, col) = accumulator_position(warp, lane, i);
                        self.vars.get_mut(name).expect("type-checked")[t] = Val::F(d[row][col]);
                    }
                }
            }
            footprint.registers.extend(op.d.iter().map(|name| (wg, name.clone())));
            for r in &footprint.registers {
                self.asynch.busy_registers.insert(r.clone());
            }
            for (array, i) in &footprint.shared {
                self.hold_shared(array, &[*i], 1);
            }
            let uncommitted = &mut self.asynch.uncommitted_wgmma[wg];
            uncommitted.registers.append(&mut footprint.registers);
            uncommitted.shared.append(&mut footprint.shared);
        }
        Ok(())
    }

    /// The first element of a shared wgmma operand, the same across the warpgroup starting at
    /// `first`, 16-byte aligned, and under the 128-byte swizzle a k slice inside one row
    /// (K-major) or a whole atom (MN-major).
    fn operand_start(
        &self,
        matrix: &SmemMatrix,
        major: Major,
        mask: &[bool],
        global: &HashMap<String, super::Array>,
        first: usize,
    ) -> Result<usize, Fault> {
        let start = self.eval(&matrix.start, mask, global)?;
        let s = start[first].i();
        if let Some(t) = (first..first + WARPGROUP).find(|&t| start[t].i() != s) {
            return Err((t, "wgmma descriptor differs across the warpgroup".into()));
        }
        match misplaced_operand("wgmma", matrix, major, s) {
            Some(fault) => Err((first, fault)),
            None => Ok(s as usize),
        }
    }

    /// A wgmma operand. Wgmmas in flight may share it: the device orders wgmmas on the same
    /// accumulators, and operands are only read.
    fn register(&self, name: &str, t: usize) -> Result<f32, Fault> {
        match self.vars.get(name).map(|v| v[t]) {
            Some(Val::Undef) | None => Err((t, format!("wgmma operand `{name}` is not set"))),
            Some(v) => Ok(v.f()),
        }
    }

    /// A (64×16, rounded to `element`) from the fragments of the warpgroup starting at thread
    /// `first`.
    fn gather_a(&self, names: &[String; 8], element: MmaElement, first: usize) -> Result<[[f32; 16]; 64], Fault> {
        let mut a = [[0f32; 16]; 64];
        for warp in 0..4 {
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                for (i, name) in names.iter().enumerate() {
                    let row = 16 * warp + g + if i % 4 >= 2 { 8 } else { 0 };
                    let col = 2 * t + (i % 2) + if i >= 4 { 8 } else { 0 };
                    a[row][col] = rounded(element, self.register(name, first + 32 * warp + lane)?);
                }
            }
        }
        Ok(a)
    }

    /// `rows` × 16 elements of a K-major shared operand (`matrix` from element `start`, see
    /// `SmemMatrix`) as the tensor cores read them: `[row][k]`, with each element's index.
    /// Checks the device's visibility rules for the `what` instruction reading them.
    pub(super) fn read_operand(
        &mut self,
        what: &str,
        matrix: &SmemMatrix,
        major: Major,
        start: usize,
        rows: usize,
        thread: usize,
    ) -> Result<(Vec<[f32; 16]>, Vec<usize>), Fault> {
        let name = &matrix.array;
        let (mut values, mut indices) = (vec![[0f32; 16]; rows], Vec::with_capacity(rows * 16));
        // Not recorded as readers: the tensor cores read through the async proxy, and the
        // elements stay held (`hold_shared`) until the instruction completes instead.
        let array = &self.shared[name];
        for (row, out) in values.iter_mut().enumerate() {
            for (k, out) in out.iter_mut().enumerate() {
                let i = operand_element(matrix, major, start, row, k);
                if i >= array.len() {
                    let len = array.len();
                    return Err((thread, format!("{what} reads {name}[{i}] out of bounds (length {len})")));
                }
                self.asynch.check_shared(name, i, thread)?;
                self.check_landed(name, i, thread, &format!("{what} reads"))?;
                if !array.init[i] {
                    return Err((thread, format!("{what} reads {name}[{i}], which was never written")));
                }
                match self.shared_writer[name][i] {
                    Some(w) if !w.released_to(self.barriers.knowledge(thread)) => {
                        return Err((
                            thread,
                            format!(
                                "{what} reads {name}[{i}] written by thread {} without a __syncthreads() between",
                                w.thread
                            ),
                        ));
                    }
                    _ => {}
                }
                if let Some(w) = self.asynch.unfenced[name][i] {
                    return Err((
                        thread,
                        format!("{what} reads {name}[{i}] written by thread {w} without fence.proxy.async"),
                    ));
                }
                *out = array.values[i] as f32;
                indices.push(i);
            }
        }
        Ok((values, indices))
    }

    /// Shared elements an asynchronous MMA reads stay off limits until it completes.
    pub(super) fn hold_shared(&mut self, array: &str, indices: &[usize], by: isize) {
        let counts = self.asynch.busy_shared.get_mut(array).expect("shared");
        for &i in indices {
            counts[i] = counts[i].saturating_add_signed(by as i32);
        }
    }
}

/// Why a tensor-core instruction (`what`) cannot read a shared operand laid out as `major`
/// says from element `s`: not 16-byte aligned, or under the 128-byte swizzle a k slice
/// crossing its row (K-major) or a start inside an atom (MN-major).
pub(super) fn misplaced_operand(what: &str, matrix: &SmemMatrix, major: Major, s: i64) -> Option<String> {
    let array = &matrix.array;
    if s < 0 || s % 8 != 0 {
        return Some(format!("{what} operand at {array}[{s}] is not 16-byte aligned"));
    }
    match (major, matrix.swizzle) {
        (Major::MN, Swizzle::B128) if s % 512 != 0 => Some(format!(
            "{what} operand at {array}[{s}]: an MN-major swizzled operand starts at a 1024-byte atom"
        )),
        (Major::K, Swizzle::B128) if s % 64 > 48 => Some(format!(
            "{what} operand at {array}[{s}]: a 16-wide k slice crosses its 128-byte swizzled row"
        )),
        _ => None,
    }
}

/// The element of row `row` (M or N), column `k` of a shared operand laid out as `major`
/// says (see `SmemMatrix`, `Major`).
fn operand_element(matrix: &SmemMatrix, major: Major, start: usize, row: usize, k: usize) -> usize {
    let (lbo, sbo) = (matrix.lbo as usize / 2, matrix.sbo as usize / 2);
    match (major, matrix.swizzle) {
        (Major::K, Swizzle::None) => start + (row / 8) * sbo + (k / 8) * lbo + (row % 8) * 8 + k % 8,
        (Major::K, Swizzle::B128) => Swizzle::B128.bf16_element(start + (row / 8) * sbo + (row % 8) * 64 + k),
        (Major::MN, Swizzle::None) => start + (row / 8) * sbo + (k / 8) * lbo + (k % 8) * 8 + row % 8,
        (Major::MN, Swizzle::B128) => {
            Swizzle::B128.bf16_element(start + (row / 64) * lbo + (k / 8) * sbo + (k % 8) * 64 + row % 64)
        }
    }
}

/// (row, column) of accumulator `i` of `lane` in `warp` of a warpgroup (see `WgmmaOp`).
fn accumulator_position(warp: usize, lane: usize, i: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    (
        16 * warp + g + if i % 4 >= 2 { 8 } else { 0 },
        8 * (i / 4) + 2 * t + (i % 2),
    )
}

/// [`AsyncState::check_shared`] over `targets`, the array's [`AsyncState::copy_targets`].
pub(super) fn check_copy_target(targets: Option<&[bool]>, array: &str, index: usize, t: usize) -> Result<(), Fault> {
    if targets.is_some_and(|c| c[index]) {
        return Err((
            t,
            format!("touches {array}[{index}] while a cp.async into it is in flight"),
        ));
    }
    Ok(())
}
