//! Runs a DSL kernel on the CPU the way a GPU would: blocks one after another, the threads of a
//! block in lockstep statement by statement with a per-thread active mask (so divergence,
//! loops with per-thread bounds and barriers behave as on the device), warp shuffles reading
//! other lanes, shared memory per block. What a GPU would silently get wrong is an error here:
//! out-of-bounds accesses, reads of never-written memory (outputs start poisoned), a barrier in
//! divergent code, a shuffle with inactive lanes, two threads storing different values to one
//! address in one statement, reading shared memory another thread wrote since the last barrier,
//! and overwriting shared memory another thread read since the last barrier (both a missing
//! `__syncthreads`; the second is invisible to lockstep execution, so it is tracked). What a
//! GPU gets right but slowly, shared-memory bank conflicts, a profiled run counts
//! ([`run_profiled`], `banks`).

mod asynchronous;
mod banks;
mod mbarrier;
mod mma;
mod registers;
mod roles;
mod tcgen05;
mod tma;

use crate::dsl::*;
use crate::types::{check, Scope};
use asynchronous::AsyncState;
pub use banks::{ArrayTraffic, SharedTraffic};
use half::bf16;
use mbarrier::Barriers;
use rustc_hash::FxHashMap;
use std::borrow::Cow;
use std::collections::HashMap;
use tcgen05::TensorMemory;
use tma::{Landings, ResolvedMap};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EmuError {
    #[error("{0}")]
    Type(#[from] crate::types::TypeError),
    #[error("kernel {kernel}, block {block}, thread {thread}: {message}")]
    Fault {
        kernel: String,
        block: usize,
        thread: usize,
        message: String,
    },
    #[error("kernel {kernel}: {message}")]
    Launch { kernel: String, message: String },
}

/// The contents of one array, with which elements hold a written value.
#[derive(Debug, Clone, PartialEq)]
pub struct Array {
    pub ty: Ty,
    values: Vec<f64>,
    init: Vec<bool>,
    /// Elements the array starts past a 256-byte-aligned address (a launch may be handed a
    /// buffer from an offset): vector loads must be aligned in the address, not the index.
    start: usize,
}

impl Array {
    pub fn f32(data: &[f32]) -> Self {
        Self {
            ty: Ty::F32,
            values: data.iter().map(|&v| v as f64).collect(),
            init: vec![true; data.len()],
            start: 0,
        }
    }
    pub fn bf16(data: &[bf16]) -> Self {
        Self {
            ty: Ty::Bf16,
            values: data.iter().map(|v| v.to_f32() as f64).collect(),
            init: vec![true; data.len()],
            start: 0,
        }
    }
    /// IEEE half weights (read-only in kernels).
    pub fn f16(data: &[half::f16]) -> Self {
        Self {
            ty: Ty::F16,
            values: data.iter().map(|v| v.to_f32() as f64).collect(),
            init: vec![true; data.len()],
            start: 0,
        }
    }
    pub fn ints(ty: Ty, data: &[i64]) -> Self {
        Self {
            ty,
            values: data.iter().map(|&v| v as f64).collect(),
            init: vec![true; data.len()],
            start: 0,
        }
    }
    pub fn u8(data: &[u8]) -> Self {
        Self::ints(Ty::U8, &data.iter().map(|&v| v as i64).collect::<Vec<_>>())
    }
    /// An output: `len` elements, every one poisoned until written.
    pub fn poisoned(ty: Ty, len: usize) -> Self {
        Self {
            ty,
            values: vec![f64::NAN; len],
            init: vec![false; len],
            start: 0,
        }
    }
    pub fn len(&self) -> usize {
        self.values.len()
    }
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
    /// The values as f32; an element never written is an error.
    pub fn to_f32(&self) -> Result<Vec<f32>, String> {
        match self.init.iter().position(|&i| !i) {
            Some(i) => Err(format!("element {i} was never written")),
            None => Ok(self.values.iter().map(|&v| v as f32).collect()),
        }
    }
    /// The elements as integers, exactly (a `u32` past 2²⁴ does not survive an f32).
    pub fn to_i64(&self) -> Result<Vec<i64>, String> {
        match self.init.iter().position(|&i| !i) {
            Some(i) => Err(format!("element {i} was never written")),
            None => Ok(self.values.iter().map(|&v| v as i64).collect()),
        }
    }

    /// Device memory as an array of `ty` (little-endian; a trailing partial element is left
    /// out), every element initialised.
    pub fn from_le_bytes(ty: Ty, bytes: &[u8]) -> Self {
        let values: Vec<f64> = match ty {
            Ty::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                .collect(),
            Ty::Bf16 => bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32() as f64)
                .collect(),
            Ty::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32() as f64)
                .collect(),
            Ty::F8E4M3 => bytes.iter().map(|&b| ir::F8E4M3(b).to_f32() as f64).collect(),
            Ty::I32 => bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                .collect(),
            Ty::U32 => bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                .collect(),
            Ty::I8 => bytes.iter().map(|&b| b as i8 as f64).collect(),
            Ty::U8 | Ty::Bool => bytes.iter().map(|&b| b as f64).collect(),
        };
        Self {
            ty,
            init: vec![true; values.len()],
            values,
            start: 0,
        }
    }

    /// The same array, `elements` past an aligned address.
    pub fn placed_at(self, elements: usize) -> Self {
        Self {
            start: elements,
            ..self
        }
    }

    /// The array as device memory (little-endian); never-written elements as zero bytes.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.values.len() * 4);
        for (&v, &init) in self.values.iter().zip(&self.init) {
            let v = if init { v } else { 0.0 };
            match self.ty {
                Ty::F32 => out.extend((v as f32).to_le_bytes()),
                Ty::Bf16 => out.extend(bf16::from_f64(v).to_le_bytes()),
                Ty::F16 => out.extend(half::f16::from_f64(v).to_le_bytes()),
                Ty::F8E4M3 => out.push(ir::F8E4M3::from_f32(v as f32).0),
                Ty::I32 => out.extend((v as i32).to_le_bytes()),
                Ty::U32 => out.extend((v as u32).to_le_bytes()),
                Ty::I8 => out.push(v as i8 as u8),
                Ty::U8 | Ty::Bool => out.push(v as u8),
            }
        }
        out
    }
}

/// Scalar arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar {
    Int(i64),
    F32(f32),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Val {
    F(f32),
    I(i64),
    B(bool),
    Undef,
}

impl Val {
    fn f(self) -> f32 {
        match self {
            Val::F(v) => v,
            Val::I(v) => v as f32,
            Val::B(b) => b as i32 as f32,
            Val::Undef => f32::NAN,
        }
    }
    fn i(self) -> i64 {
        match self {
            Val::I(v) => v,
            Val::F(v) => v as i64,
            Val::B(b) => b as i64,
            Val::Undef => 0,
        }
    }
    fn b(self) -> bool {
        matches!(self, Val::B(true))
    }
}

/// Round through the element type the way a store to it would.
fn narrow(ty: Ty, v: Val) -> f64 {
    match ty {
        Ty::F32 => v.f() as f64,
        Ty::Bf16 => bf16::from_f32(v.f()).to_f32() as f64,
        Ty::F16 => half::f16::from_f32(v.f()).to_f32() as f64,
        Ty::F8E4M3 => ir::F8E4M3::from_f32(v.f()).to_f32() as f64,
        Ty::I32 => v.i() as i32 as f64,
        Ty::U32 => v.i() as u32 as f64,
        Ty::I8 => v.i() as i8 as f64,
        Ty::U8 => v.i() as u8 as f64,
        Ty::Bool => v.b() as i32 as f64,
    }
}

fn widen(ty: Ty, v: f64) -> Val {
    match ty.compute() {
        Ty::F32 => Val::F(v as f32),
        Ty::Bool => Val::B(v != 0.0),
        _ => Val::I(v as i64),
    }
}

struct Block<'k> {
    kernel: &'k Kernel,
    block: usize,
    threads: usize,
    scope: Scope,
    /// Each local's value on every thread (looked up on every read: a fast hash).
    vars: FxHashMap<String, Vec<Val>>,
    shared: HashMap<String, Array>,
    /// For each shared element: its write since the last barrier.
    shared_writer: HashMap<String, Vec<Option<SharedWrite>>>,
    /// For each shared element: who read it since the last barrier (loads only see `&self`).
    shared_readers: std::cell::RefCell<HashMap<String, Vec<Readers>>>,
    /// cp.async copies and wgmma operations in flight.
    asynch: AsyncState,
    /// Tensor memory and tcgen05 MMAs in flight.
    tmem: TensorMemory,
    /// mbarriers, and the phases each thread has waited for.
    barriers: Barriers,
    /// What a thread of each warpgroup holds of the block's registers (`setmaxnreg`).
    registers: registers::RegisterFile,
    /// The tensor maps, resolved at launch.
    maps: HashMap<String, ResolvedMap>,
    /// Which TMA copy wrote each shared element, and which tcgen05 commit covers an MMA reading it.
    landings: Landings,
    /// Shared-memory traffic by array, where the run is profiled ([`run_profiled`]).
    traffic: Option<std::cell::RefCell<SharedTraffic>>,
    /// Set while a vector load's elements are read one by one (the load counted once).
    traffic_paused: std::cell::Cell<bool>,
}

/// A hasher for element indices: one multiply (Fibonacci hashing).
#[derive(Default)]
struct IndexHasher(u64);

impl std::hash::Hasher for IndexHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_usize(&mut self, i: usize) {
        self.0 = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A generic write of a shared element since the last barrier: by whom, and when (the
/// mbarriers' clock, which counts arrivals).
#[derive(Debug, Clone, Copy, PartialEq)]
struct SharedWrite {
    thread: usize,
    clock: u64,
}

impl SharedWrite {
    /// Whether a thread knowing `knows` (`Barriers::knowledge`) acquired an arrival its writer
    /// made after it: an mbarrier orders it before the thread's reads, as a barrier would.
    fn released_to(self, knows: &HashMap<String, u64>) -> bool {
        knows
            .get(&mbarrier::thread_key(self.thread))
            .is_some_and(|&released| released > self.clock)
    }
}

/// The threads that read a shared element since the last barrier.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Readers {
    None,
    One(usize),
    Many,
    /// Only tensor cores: per warpgroup n of the block, `retired[n]` − 1 the barrier clock at
    /// which the latest of its reads retired (see `Barriers::clock`), 0 where it read none.
    /// Kept per warpgroup: a block's warpgroups retire their reads apart.
    Warpgroups {
        retired: [u32; MAX_WARPGROUPS],
    },
}

/// The most warpgroups a block holds (1 024 threads).
const MAX_WARPGROUPS: usize = 8;

impl Readers {
    fn add(self, t: usize) -> Self {
        match self {
            Readers::None => Readers::One(t),
            Readers::One(r) if r == t => self,
            _ => Readers::Many,
        }
    }

    /// A `wgmma` of warpgroup `wg` that read the element retired at barrier clock `clock`.
    fn add_warpgroup(self, wg: usize, clock: u64) -> Self {
        let mut retired = match self {
            Readers::None => [0; MAX_WARPGROUPS],
            Readers::Warpgroups { retired } => retired,
            _ => return Readers::Many,
        };
        retired[wg] = u32::try_from(clock + 1).expect("fewer than 2^32 mbarrier arrivals a block");
        Readers::Warpgroups { retired }
    }

    /// A read that thread `t`, knowing `knows` (`Barriers::knowledge`), cannot be sure is
    /// over: by another thread, or by another warpgroup's tensor cores after its last release
    /// that `t` acquired.
    fn unordered_before(self, t: usize, knows: &HashMap<String, u64>) -> Option<String> {
        match self {
            Readers::One(r) if r != t => Some(format!("thread {r}")),
            Readers::Many => Some("other threads".into()),
            Readers::Warpgroups { retired } => (0..MAX_WARPGROUPS)
                .filter(|&wg| retired[wg] > 0 && wg != t / asynchronous::WARPGROUP)
                .find(|&wg| {
                    knows
                        .get(&mbarrier::warpgroup_key(wg))
                        .is_none_or(|&released| released < u64::from(retired[wg]))
                })
                .map(|wg| format!("warpgroup {wg}'s tensor cores")),
            _ => None,
        }
    }
}

/// Run `kernel` over `buffers` (by parameter name) with `scalars`.
pub fn run(
    kernel: &Kernel,
    buffers: &mut HashMap<String, Array>,
    scalars: &HashMap<String, Scalar>,
) -> Result<(), EmuError> {
    run_counting(kernel, buffers, scalars, false).map(|_| ())
}

/// [`run`], counting each shared array's accesses and the bank conflicts they meet (see
/// [`SharedTraffic`]): what the device would spend on them, which runs no slower for being
/// wrong.
pub fn run_profiled(
    kernel: &Kernel,
    buffers: &mut HashMap<String, Array>,
    scalars: &HashMap<String, Scalar>,
) -> Result<SharedTraffic, EmuError> {
    run_counting(kernel, buffers, scalars, true)
}

fn run_counting(
    kernel: &Kernel,
    buffers: &mut HashMap<String, Array>,
    scalars: &HashMap<String, Scalar>,
    profiled: bool,
) -> Result<SharedTraffic, EmuError> {
    check(kernel)?;
    let launch = |message: String| EmuError::Launch {
        kernel: kernel.name.clone(),
        message,
    };
    for p in &kernel.params {
        match p {
            Param::Buffer { name, ty, .. } => match buffers.get(name) {
                Some(a) if a.ty == *ty => {}
                Some(a) => {
                    return Err(launch(format!(
                        "buffer `{name}` is {:?}, the kernel takes {ty:?}",
                        a.ty
                    )))
                }
                None => return Err(launch(format!("buffer `{name}` is missing"))),
            },
            Param::Scalar { name, .. } => {
                if !scalars.contains_key(name) {
                    return Err(launch(format!("scalar `{name}` is missing")));
                }
            }
            // Derived from the buffers and scalars below.
            Param::TensorMap(_) => {}
        }
    }
    let scalar_vals: HashMap<String, Val> = scalars
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                match v {
                    Scalar::Int(i) => Val::I(*i),
                    Scalar::F32(f) => Val::F(*f),
                },
            )
        })
        .collect();
    let shared = kernel.shared_layout().bytes;
    if shared > SHARED_LIMIT {
        return Err(launch(format!(
            "{shared} bytes of shared memory, more than the {SHARED_LIMIT} a block may have"
        )));
    }
    let grid = {
        let mut b = Block::new(kernel, 0, 1);
        b.set_scalars(&scalar_vals);
        b.eval(&kernel.grid, &[true], buffers).map_err(|(_, m)| launch(m))?[0].i()
    };
    let maps = tma::resolve_maps(kernel, buffers, scalars).map_err(launch)?;
    if grid < 0 {
        return Err(launch(format!("grid of {grid} blocks")));
    }
    let mut traffic = SharedTraffic::default();
    for block in 0..grid as usize {
        let mut b = Block::new(kernel, block, kernel.block_dim as usize);
        b.set_scalars(&scalar_vals);
        b.maps = maps.clone();
        if profiled {
            b.traffic = Some(Default::default());
        }
        let mask = vec![true; b.threads];
        b.exec(&kernel.body, &mask, buffers)
            .and_then(|()| b.tmem.check_freed())
            .map_err(|(thread, message)| EmuError::Fault {
                kernel: kernel.name.clone(),
                block,
                thread,
                message,
            })?;
        if let Some(counted) = &b.traffic {
            traffic.add(&counted.borrow());
        }
    }
    Ok(traffic)
}

type Fault = (usize, String);

/// A vector `access` (a load or store) of `width` elements of `buf` at each active thread's
/// index in `idx` lands on a multiple of its width, in the address (a global buffer may start
/// past an aligned address).
fn vector_aligned(
    (access, buf): (&str, &str),
    idx: &[Val],
    mask: &[bool],
    width: usize,
    global: &HashMap<String, Array>,
) -> Result<(), Fault> {
    let width = width as i64;
    let start = global.get(buf).map_or(0, |a| a.start as i64);
    match (0..mask.len()).find(|&t| mask[t] && (start + idx[t].i()) % width != 0) {
        None => Ok(()),
        Some(t) => {
            let place = match start {
                0 => String::new(),
                s => format!(" (the array starts {s} elements past an aligned address)"),
            };
            Err((
                t,
                format!(
                    "vector {access} of {width} at {buf}[{}] is misaligned{place}",
                    idx[t].i()
                ),
            ))
        }
    }
}

impl<'k> Block<'k> {
    fn new(kernel: &'k Kernel, block: usize, threads: usize) -> Self {
        let shared = kernel
            .shared
            .iter()
            .map(|a| (a.name.clone(), Array::poisoned(a.ty, a.len)))
            .collect();
        let shared_writer = kernel
            .shared
            .iter()
            .map(|a| (a.name.clone(), vec![None; a.len]))
            .collect();
        Self {
            kernel,
            block,
            threads,
            scope: Scope::of(kernel),
            vars: FxHashMap::default(),
            shared_readers: std::cell::RefCell::new(
                kernel
                    .shared
                    .iter()
                    .map(|a| (a.name.clone(), vec![Readers::None; a.len]))
                    .collect(),
            ),
            shared,
            shared_writer,
            asynch: AsyncState::new(
                threads,
                &kernel
                    .shared
                    .iter()
                    .map(|a| (a.name.clone(), a.len))
                    .collect::<Vec<_>>(),
            ),
            tmem: TensorMemory::new(threads),
            barriers: Barriers::new(threads),
            registers: registers::RegisterFile::new(threads),
            maps: HashMap::new(),
            traffic: None,
            traffic_paused: std::cell::Cell::new(false),
            landings: Landings::new(
                &kernel
                    .shared
                    .iter()
                    .map(|a| (a.name.clone(), a.len))
                    .collect::<Vec<_>>(),
            ),
        }
    }

    fn set_scalars(&mut self, scalars: &HashMap<String, Val>) {
        for (k, v) in scalars {
            self.vars.insert(k.clone(), vec![*v; self.threads]);
        }
    }

    fn exec(&mut self, body: &[Stmt], mask: &[bool], global: &mut HashMap<String, Array>) -> Result<(), Fault> {
        for s in body {
            if !mask.iter().any(|&m| m) {
                return Ok(());
            }
            self.stmt(s, mask, global)?;
        }
        Ok(())
    }

    fn stmt(&mut self, s: &Stmt, mask: &[bool], global: &mut HashMap<String, Array>) -> Result<(), Fault> {
        match s {
            Stmt::Let { name, ty, value } => {
                let v = self.eval(value, mask, global)?;
                self.touch(name, mask)?;
                self.declare(name, *ty, &v, mask);
            }
            Stmt::Assign { name, value } => {
                let v = self.eval(value, mask, global)?;
                self.touch(name, mask)?;
                let slot = self.vars.get_mut(name).expect("type-checked");
                for (t, &m) in mask.iter().enumerate() {
                    if m {
                        slot[t] = v[t];
                    }
                }
            }
            Stmt::Store { buf, index, value } => {
                let (idx, v) = (self.eval(index, mask, global)?, self.eval(value, mask, global)?);
                self.store(buf, &idx, &v, mask, global)?;
            }
            Stmt::StoreVec { buf, index, values } => {
                let idx = self.eval(index, mask, global)?;
                vector_aligned(("store", buf), &idx, mask, values.len(), global)?;
                // Every value before any store: the device writes them at once.
                let values = values
                    .iter()
                    .map(|v| self.eval(v, mask, global))
                    .collect::<Result<Vec<_>, _>>()?;
                if let Some(array) = self.shared.get(buf) {
                    let bytes = array.ty.bytes();
                    self.count_traffic(buf, &idx, mask, (bytes, values.len() * bytes));
                }
                // Element by element through `store`, which checks bounds, races and
                // shared-memory ordering (and counts nothing more).
                self.traffic_paused.set(true);
                let stored = values.iter().enumerate().try_for_each(|(j, v)| {
                    let at: Vec<Val> = idx
                        .iter()
                        .map(|i| match i {
                            Val::I(i) => Val::I(i + j as i64),
                            other => *other,
                        })
                        .collect();
                    self.store(buf, &at, v, mask, global)
                });
                self.traffic_paused.set(false);
                stored?;
            }
            Stmt::LoadVec {
                buf,
                index,
                names,
                fp8_codes,
            } => {
                let idx = self.eval(index, mask, global)?;
                vector_aligned(("load", buf), &idx, mask, names.len(), global)?;
                let ty = match fp8_codes {
                    true => Ty::F32,
                    false => self.array_type(buf, global),
                };
                if let Some(array) = self.shared.get(buf) {
                    let bytes = array.ty.bytes();
                    self.count_traffic(buf, &idx, mask, (bytes, names.len() * bytes));
                }
                // Element by element through `Load`, which checks bounds, initialisation and
                // shared-memory ordering (and counts nothing more).
                self.traffic_paused.set(true);
                for (j, name) in names.iter().enumerate() {
                    let element = Expr::Load {
                        buf: buf.clone(),
                        index: Box::new(index.clone() + int(j as i64)),
                    };
                    let v = self.eval(&element, mask, global);
                    if v.is_err() {
                        self.traffic_paused.set(false);
                    }
                    let mut v = v?;
                    if *fp8_codes {
                        for v in v.iter_mut().filter(|v| !matches!(v, Val::Undef)) {
                            *v = Val::F(ir::F8E4M3(v.i() as u8).to_f32());
                        }
                    }
                    self.touch(name, mask)?;
                    self.declare(name, ty, &v, mask);
                }
                self.traffic_paused.set(false);
            }
            Stmt::For {
                var,
                start,
                end,
                step,
                body,
            } => {
                let (start, step) = self.loop_start(var, (start, step), mask, global)?;
                let previous = self.vars.insert(var.clone(), start);
                self.scope.vars.insert(var.clone(), Ty::I32);
                loop {
                    let live = self.loop_live(var, end, mask, global)?;
                    if !live.iter().any(|&l| l) {
                        break;
                    }
                    self.exec(body, &live, global)?;
                    self.loop_step(var, &step, &live);
                }
                match previous {
                    Some(p) => self.vars.insert(var.clone(), p),
                    None => self.vars.remove(var),
                };
            }
            Stmt::If { cond, then, otherwise } => {
                let c = self.eval(cond, mask, global)?;
                let yes: Vec<bool> = (0..mask.len()).map(|t| mask[t] && c[t].b()).collect();
                let no: Vec<bool> = (0..mask.len()).map(|t| mask[t] && !c[t].b()).collect();
                self.exec(then, &yes, global)?;
                self.exec(otherwise, &no, global)?;
            }
            Stmt::Roles(r) => self.roles(r, mask, global)?,
            Stmt::SyncThreads => {
                if let Some(t) = mask.iter().position(|&m| !m) {
                    return Err((
                        t,
                        "__syncthreads() in divergent code: this thread does not reach it".into(),
                    ));
                }
                for w in self.shared_writer.values_mut() {
                    w.fill(None);
                }
                self.barriers.writes_synchronised();
                for r in self.shared_readers.get_mut().values_mut() {
                    r.fill(Readers::None);
                }
            }
            Stmt::Mma(m) => self.mma_sync(m, mask)?,
            Stmt::LoadMatrix(m) => self.load_matrix(m, mask, global)?,
            Stmt::CpAsync(copy) => self.cp_async(copy, mask, global)?,
            Stmt::CpAsyncCommit => self.cp_async_commit(mask),
            // No effect but where it points: a prefetch outside its buffer is a mistake.
            Stmt::PrefetchL2 { buf, index } => {
                let idx = self.eval(index, mask, global)?;
                let len = global.get(buf).expect("type-checked").len();
                if let Some(t) = (0..mask.len()).find(|&t| mask[t] && !(0..len as i64).contains(&idx[t].i())) {
                    return Err((
                        t,
                        format!("prefetch of {buf}[{}] out of bounds (length {len})", idx[t].i()),
                    ));
                }
            }
            Stmt::CpAsyncWait(n) => self.cp_async_wait(*n, mask)?,
            Stmt::FenceProxyAsync => self.fence_proxy_async(mask),
            Stmt::WgmmaFence => self.wgmma_fence(mask)?,
            Stmt::Wgmma(op) => self.wgmma(op, mask, global)?,
            Stmt::WgmmaCommit => self.wgmma_commit(mask)?,
            Stmt::WgmmaWait(n) => self.wgmma_wait(*n, mask)?,
            Stmt::Tcgen05(op) => self.tcgen05(op, mask, global)?,
            Stmt::Mbarrier(op) => self.mbarrier(op, mask, global)?,
            Stmt::TmaLoad(op) => self.tma_load(op, mask, global)?,
            Stmt::SetMaxRegisters { change, count } => {
                for wg in self.registers.warpgroups(mask)? {
                    let count = *count as usize;
                    if !self.registers.can_set(wg, *change, count)? {
                        return Err(self.registers.shortfall(wg, count));
                    }
                    self.registers.set(wg, count);
                }
            }
            Stmt::Comment(_) => {}
        }
        Ok(())
    }

    /// A `for` loop's start and step on `mask`'s threads, the step checked positive.
    fn loop_start(
        &self,
        var: &str,
        (start, step): (&Expr, &Expr),
        mask: &[bool],
        global: &HashMap<String, Array>,
    ) -> Result<(Vec<Val>, Vec<Val>), Fault> {
        let start = self.eval(start, mask, global)?;
        let step = self.eval(step, mask, global)?;
        if let Some(t) = (0..mask.len()).find(|&t| mask[t] && step[t].i() <= 0) {
            return Err((t, format!("loop `{var}` has step {}", step[t].i())));
        }
        Ok((start, step))
    }

    /// The threads of `mask` whose loop variable `var` is still below `end`.
    fn loop_live(
        &self,
        var: &str,
        end: &Expr,
        mask: &[bool],
        global: &HashMap<String, Array>,
    ) -> Result<Vec<bool>, Fault> {
        let end = self.eval(end, mask, global)?;
        let cur = &self.vars[var];
        Ok((0..mask.len()).map(|t| mask[t] && cur[t].i() < end[t].i()).collect())
    }

    /// The `live` threads' loop variable `var` advanced by their `step`.
    fn loop_step(&mut self, var: &str, step: &[Val], live: &[bool]) {
        let slot = self.vars.get_mut(var).expect("loop variable");
        for t in (0..live.len()).filter(|&t| live[t]) {
            slot[t] = Val::I(slot[t].i() + step[t].i());
        }
    }

    /// The active threads access local `name`: not while a wgmma uses it or a tcgen05.ld fills it.
    fn touch(&self, name: &str, mask: &[bool]) -> Result<(), Fault> {
        if self.asynch.registers_busy() || self.tmem.loads_outstanding() {
            for t in (0..mask.len()).filter(|&t| mask[t]) {
                self.asynch.check_register(name, t)?;
                self.tmem.check_register(name, t)?;
            }
        }
        Ok(())
    }

    /// Declare local `name` of type `ty`, set to `values` on the active threads.
    fn declare(&mut self, name: &str, ty: Ty, values: &[Val], mask: &[bool]) {
        // A loop's body declares its locals again each time round: no new key then.
        if !self.vars.contains_key(name) {
            self.vars.insert(name.to_string(), vec![Val::Undef; mask.len()]);
        }
        let slot = self.vars.get_mut(name).expect("just inserted");
        for (t, &m) in mask.iter().enumerate() {
            if m {
                slot[t] = values[t];
            }
        }
        if self.scope.vars.get(name) != Some(&ty) {
            self.scope.vars.insert(name.to_string(), ty);
        }
    }

    /// A generic write of shared memory by thread `t`, now.
    fn shared_write(&mut self, t: usize) -> SharedWrite {
        self.barriers.note_write(t);
        SharedWrite {
            thread: t,
            clock: self.barriers.clock,
        }
    }

    fn store(
        &mut self,
        buf: &str,
        idx: &[Val],
        v: &[Val],
        mask: &[bool],
        global: &mut HashMap<String, Array>,
    ) -> Result<(), Fault> {
        let is_shared = self.shared.contains_key(buf);
        let (len, ty) = match is_shared {
            true => (self.shared[buf].len(), self.shared[buf].ty),
            false => (global[buf].len(), global[buf].ty),
        };
        if is_shared {
            self.count_traffic(buf, idx, mask, (ty.bytes(), ty.bytes()));
        }
        // Each index this statement stored to: (thread, value). Keyed by small integers, so
        // hashed by a multiply, not SipHash: every thread of every store looks itself up.
        let mut this_stmt: HashMap<usize, (usize, f64), std::hash::BuildHasherDefault<IndexHasher>> =
            HashMap::default();
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            let i = idx[t].i();
            if i < 0 || i as usize >= len {
                return Err((t, format!("store to {buf}[{i}] out of bounds (length {len})")));
            }
            let i = i as usize;
            let value = narrow(ty, v[t]);
            if let Some(&(other, prev)) = this_stmt.get(&i) {
                if prev.to_bits() != value.to_bits() {
                    return Err((
                        t,
                        format!("threads {other} and {t} store different values to {buf}[{i}] at once"),
                    ));
                }
            }
            this_stmt.insert(i, (t, value));
            if is_shared {
                let readers = self.shared_readers.get_mut().get(buf).expect("shared")[i];
                if let Some(reader) = readers.unordered_before(t, self.barriers.knowledge(t)) {
                    return Err((
                        t,
                        format!("overwrites {buf}[{i}], read by {reader} without a __syncthreads() between"),
                    ));
                }
                self.asynch.check_shared(buf, i, t)?;
                self.check_landed(buf, i, t, "overwrites")?;
                self.check_mma_read(buf, i, t)?;
                self.asynch.note_write(buf, i, t)?;
                self.forget_landing(buf, i);
                let write = self.shared_write(t);
                self.shared_writer.get_mut(buf).expect("shared")[i] = Some(write);
            }
            let array = match is_shared {
                true => self.shared.get_mut(buf),
                false => global.get_mut(buf),
            }
            .expect("type-checked");
            array.values[i] = value;
            array.init[i] = true;
        }
        Ok(())
    }

    /// `buf[idx[t]]` for every active thread, widened to its compute type: bounds,
    /// initialisation and shared-memory ordering checked.
    /// Where the run is profiled: an access of `buf` at element `idx[t]` by each active thread,
    /// `width` bytes a lane from elements of `element` bytes, counted a warp at a time.
    fn count_traffic(&self, buf: &str, idx: &[Val], mask: &[bool], (element, width): (usize, usize)) {
        let Some(traffic) = &self.traffic else { return };
        if self.traffic_paused.get() {
            return;
        }
        let mut traffic = traffic.borrow_mut();
        for warp in (0..mask.len()).step_by(32) {
            let lanes: Vec<Option<usize>> = (warp..(warp + 32).min(mask.len()))
                .map(|t| match (mask[t], idx[t]) {
                    (true, Val::I(i)) if i >= 0 => Some(i as usize * element),
                    _ => None,
                })
                .collect();
            traffic.record(buf, width, &lanes);
        }
    }

    fn load_at(
        &self,
        buf: &str,
        idx: &[Val],
        mask: &[bool],
        global: &HashMap<String, Array>,
    ) -> Result<Vec<Val>, Fault> {
        let n = mask.len();
        let (array, writers) = match self.shared.get(buf) {
            Some(a) => (a, self.shared_writer.get(buf)),
            None => (global.get(buf).expect("type-checked"), None),
        };
        if writers.is_some() {
            self.count_traffic(buf, idx, mask, (array.ty.bytes(), array.ty.bytes()));
        }
        // A shared array's bookkeeping, looked up once for all the threads.
        let in_flight = writers.map(|_| (self.asynch.copy_targets(buf), self.landed_copies(buf)));
        let mut all_readers = writers.map(|_| self.shared_readers.borrow_mut());
        let mut readers = all_readers.as_mut().map(|r| r.get_mut(buf).expect("shared"));
        let mut out = vec![Val::Undef; n];
        for t in (0..n).filter(|&t| mask[t]) {
            let i = idx[t].i();
            if i < 0 || i as usize >= array.len() {
                return Err((t, format!("load of {buf}[{i}] out of bounds (length {})", array.len())));
            }
            let i = i as usize;
            if let Some((targets, copies)) = in_flight {
                asynchronous::check_copy_target(targets, buf, i, t)?;
                self.check_landed_in(copies, buf, i, t, "reads")?;
            }
            if !array.init[i] {
                return Err((t, format!("load of {buf}[{i}], which was never written")));
            }
            if let Some(Some(w)) = writers.map(|w| w[i]) {
                if w.thread != t && !w.released_to(self.barriers.knowledge(t)) {
                    return Err((
                        t,
                        format!(
                            "reads {buf}[{i}] written by thread {} without a __syncthreads() between",
                            w.thread
                        ),
                    ));
                }
            }
            if let Some(readers) = readers.as_mut() {
                let r = &mut readers[i];
                *r = r.add(t);
            }
            out[t] = widen(array.ty, array.values[i]);
        }
        Ok(out)
    }

    fn eval(&self, e: &Expr, mask: &[bool], global: &HashMap<String, Array>) -> Result<Vec<Val>, Fault> {
        Ok(self.eval_typed(e, mask, global)?.0.into_owned())
    }

    /// [`eval_typed`](Self::eval_typed)'s values alone, a local's borrowed.
    fn operand(&self, e: &Expr, mask: &[bool], global: &HashMap<String, Array>) -> Result<Cow<'_, [Val]>, Fault> {
        Ok(self.eval_typed(e, mask, global)?.0)
    }

    /// `e`'s values on the active threads and its compute type (`Scope::type_of`'s, found
    /// on the way up rather than by walking each operand again: the kernel is type-checked).
    /// A local's values are borrowed, not copied: most operands are locals.
    fn eval_typed(
        &self,
        e: &Expr,
        mask: &[bool],
        global: &HashMap<String, Array>,
    ) -> Result<(Cow<'_, [Val]>, Ty), Fault> {
        let n = mask.len();
        let (values, ty) = match e {
            Expr::F32(v) => (vec![Val::F(*v); n], Ty::F32),
            Expr::Int(v) => (vec![Val::I(*v); n], Ty::I32),
            Expr::Bool(b) => (vec![Val::B(*b); n], Ty::Bool),
            Expr::Builtin(b) => {
                let values = (0..n)
                    .map(|t| {
                        Val::I(match b {
                            Builtin::ThreadIdx => t as i64,
                            Builtin::BlockIdx => self.block as i64,
                            Builtin::BlockDim => self.kernel.block_dim as i64,
                            Builtin::Lane => (t % 32) as i64,
                            Builtin::Warp => (t / 32) as i64,
                        })
                    })
                    .collect();
                (values, Ty::I32)
            }
            Expr::Var(name) => {
                self.touch(name, mask)?;
                let vals = self.vars.get(name).ok_or((0, format!("`{name}` has no value")))?;
                if let Some(t) = vals.iter().zip(mask).position(|(v, &m)| m && *v == Val::Undef) {
                    return Err((t, format!("`{name}` read before it was set on this thread")));
                }
                let ty = self.scope.vars.get(name).copied().unwrap_or(Ty::I32);
                return Ok((Cow::Borrowed(vals), ty));
            }
            Expr::Load { buf, index } => {
                let idx = self.operand(index, mask, global)?;
                (self.load_at(buf, &idx, mask, global)?, self.array_type(buf, global))
            }
            Expr::LoadRow { buf, row, width, col } => {
                let (r, w, c) = (
                    self.operand(row, mask, global)?,
                    self.operand(width, mask, global)?,
                    self.operand(col, mask, global)?,
                );
                // In 64 bits, as the emitted `(long long)` product is.
                let idx: Vec<Val> = (0..n).map(|t| Val::I(r[t].i() * w[t].i() + c[t].i())).collect();
                (self.load_at(buf, &idx, mask, global)?, self.array_type(buf, global))
            }
            Expr::Bin(op, a, b) => {
                let ((x, ty), y) = (self.eval_typed(a, mask, global)?, self.operand(b, mask, global)?);
                let mut out = vec![Val::Undef; n];
                // Zipped, not indexed: no bounds checks in the loop every operator runs.
                let lanes = out.iter_mut().zip(mask).zip(x.iter().zip(y.iter())).enumerate();
                for (t, ((out, _), (&x, &y))) in lanes.filter(|(_, ((_, &m), _))| m) {
                    *out = binop(*op, x, y, ty).ok_or_else(|| (t, binop_fault(*op, x, y, ty)))?;
                }
                let result = match op {
                    BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge | BinOp::Eq | BinOp::Ne => Ty::Bool,
                    _ => ty,
                };
                (out, result)
            }
            Expr::Un(op, a) => {
                let (x, ty) = self.eval_typed(a, mask, global)?;
                let values = x
                    .iter()
                    .map(|&v| match (op, v) {
                        (_, Val::Undef) => Val::Undef,
                        (UnOp::Neg, Val::I(i)) => Val::I(-i),
                        (UnOp::Abs, Val::I(i)) => Val::I(i.abs()),
                        (UnOp::Not, v) => Val::B(!v.b()),
                        (UnOp::HalfToFloat, v) => Val::F(half::f16::from_bits(v.i() as u16).to_f32()),
                        (UnOp::OrderedBits, v) => Val::I(ordered_bits(v.f()) as i64),
                        (UnOp::Iq4Value, v) => Val::I(IQ4_VALUES[v.i() as usize & 15] as i64),
                        (UnOp::Mxfp4Value, v) => Val::I(MXFP4_VALUES[v.i() as usize & 15] as i64),
                        (UnOp::Fp8ToFloat, v) => Val::F(ir::F8E4M3(v.i() as u8).to_f32()),
                        (UnOp::BitsToFloat, v) => Val::F(f32::from_bits(v.i() as u32)),
                        (op, v) => Val::F(unop_f32(*op, v.f())),
                    })
                    .collect();
                let result = match op {
                    UnOp::HalfToFloat | UnOp::Fp8ToFloat | UnOp::BitsToFloat => Ty::F32,
                    UnOp::OrderedBits => Ty::U32,
                    UnOp::Iq4Value | UnOp::Mxfp4Value => Ty::I32,
                    UnOp::Not | UnOp::Neg | UnOp::Abs => ty,
                    _ => Ty::F32,
                };
                (values, result)
            }
            Expr::Cast(ty, a) => {
                let x = self.operand(a, mask, global)?;
                let values = x
                    .iter()
                    .map(|&v| match v {
                        Val::Undef => Val::Undef,
                        v => widen(*ty, narrow(*ty, v)),
                    })
                    .collect();
                (values, ty.compute())
            }
            Expr::Select(c, a, b) => {
                let (c, (x, ty), y) = (
                    self.operand(c, mask, global)?,
                    self.eval_typed(a, mask, global)?,
                    self.operand(b, mask, global)?,
                );
                ((0..n).map(|t| if c[t].b() { x[t] } else { y[t] }).collect(), ty)
            }
            Expr::ShflXor(a, m) => {
                let (x, ty) = self.eval_typed(a, mask, global)?;
                // A shuffle is the whole warp's: each warp with a lane here has all of them.
                for (w, lanes) in mask.chunks(32).enumerate() {
                    if let (Some(first), Some(off)) = (lanes.iter().position(|&m| m), lanes.iter().position(|&m| !m)) {
                        return Err((w * 32 + first, format!("shuffle with lane {off} of the warp inactive")));
                    }
                }
                let mut out = vec![Val::Undef; n];
                for t in (0..n).filter(|&t| mask[t]) {
                    let src = t ^ *m as usize;
                    if src >= n {
                        return Err((t, format!("shuffle from lane {src} outside the block")));
                    }
                    out[t] = x[src];
                }
                (out, ty)
            }
        };
        Ok((Cow::Owned(values), ty))
    }

    /// The compute type of array `buf`'s elements (shared or global).
    fn array_type(&self, buf: &str, global: &HashMap<String, Array>) -> Ty {
        match self.shared.get(buf) {
            Some(a) => a.ty.compute(),
            None => global.get(buf).map_or(Ty::F32, |a| a.ty.compute()),
        }
    }
}

/// `x op y` for operands of type `ty`. Integer results are those of 32-bit hardware: `u32`
/// arithmetic wraps (defined in C++), and an `i32` result that does not fit is `None`, since
/// signed overflow is undefined in CUDA C++ (and in practice an index that went wrong); so
/// are the other faults [`binop_fault`] names. `Option` rather than a message: this runs for
/// every thread of every operator, and a small result comes back in registers.
#[inline]
fn binop(op: BinOp, x: Val, y: Val, ty: Ty) -> Option<Val> {
    if x == Val::Undef || y == Val::Undef {
        return Some(Val::Undef);
    }
    if let (Val::B(a), Val::B(b)) = (x, y) {
        return Some(Val::B(match op {
            BinOp::And => a && b,
            BinOp::Or => a || b,
            BinOp::Eq => a == b,
            BinOp::Ne => a != b,
            _ => return None,
        }));
    }
    if ty == Ty::F32 {
        let (a, b) = (x.f(), y.f());
        if let Some(c) = compare(op, a, b) {
            return Some(Val::B(c));
        }
        return Some(match op {
            BinOp::Add => Val::F(a + b),
            BinOp::Sub => Val::F(a - b),
            BinOp::Mul => Val::F(a * b),
            BinOp::Div => Val::F(a / b),
            BinOp::Min => Val::F(a.min(b)),
            BinOp::Max => Val::F(a.max(b)),
            _ => return None,
        });
    }
    let (a, b) = (x.i(), y.i());
    if let Some(c) = compare(op, a, b) {
        return Some(Val::B(c));
    }
    let v = match op {
        BinOp::Add => a.wrapping_add(b),
        BinOp::Sub => a.wrapping_sub(b),
        BinOp::Mul => a.wrapping_mul(b),
        BinOp::Div | BinOp::Rem if b == 0 => return None,
        BinOp::Div => a / b,
        BinOp::Rem => a % b,
        BinOp::Min => a.min(b),
        BinOp::Max => a.max(b),
        BinOp::Shl | BinOp::Shr if !(0..32).contains(&b) => return None,
        // A left shift keeps the low 32 bits in both types (C++20 defines it for signed too).
        BinOp::Shl if ty == Ty::U32 => ((a as u32) << b) as i64,
        BinOp::Shl => ((a as i32) << b) as i64,
        BinOp::Shr if ty == Ty::U32 => ((a as u32) >> b) as i64,
        BinOp::Shr => ((a as i32) >> b) as i64,
        BinOp::BitAnd => a & b,
        BinOp::BitXor => a ^ b,
        _ => return None,
    };
    match ty {
        Ty::U32 => Some(Val::I(v as u32 as i64)),
        Ty::I32 if i32::try_from(v).is_err() => None,
        _ => Some(Val::I(v)),
    }
}

/// Why [`binop`] gave no value for `x op y`.
fn binop_fault(op: BinOp, x: Val, y: Val, ty: Ty) -> String {
    match (x, y) {
        (Val::B(_), Val::B(_)) => format!("{op:?} of bools"),
        _ if ty == Ty::F32 => format!("{op:?} of floats"),
        _ => {
            let (a, b) = (x.i(), y.i());
            match op {
                BinOp::Div | BinOp::Rem if b == 0 => "integer division by zero".into(),
                BinOp::Shl | BinOp::Shr if !(0..32).contains(&b) => format!("a shift by {b} bits"),
                BinOp::Add
                | BinOp::Sub
                | BinOp::Mul
                | BinOp::Div
                | BinOp::Rem
                | BinOp::Min
                | BinOp::Max
                | BinOp::Shl
                | BinOp::Shr
                | BinOp::BitAnd
                | BinOp::BitXor => format!("{a} {op:?} {b} overflows i32 (undefined in CUDA C++)"),
                _ => format!("{op:?} of integers"),
            }
        }
    }
}

/// `a op b` for the comparison operators (floats and integers alike); `None` for the others.
fn compare<T: PartialOrd>(op: BinOp, a: T, b: T) -> Option<bool> {
    Some(match op {
        BinOp::Lt => a < b,
        BinOp::Le => a <= b,
        BinOp::Gt => a > b,
        BinOp::Ge => a >= b,
        BinOp::Eq => a == b,
        BinOp::Ne => a != b,
        _ => return None,
    })
}

/// `UnOp::OrderedBits`: the `u32` whose order is `f32::total_cmp`'s, NaN taken as −∞.
pub fn ordered_bits(v: f32) -> u32 {
    let bits = if v.is_nan() { f32::NEG_INFINITY } else { v }.to_bits();
    match bits >> 31 {
        1 => !bits,
        _ => bits | 0x8000_0000,
    }
}

fn unop_f32(op: UnOp, v: f32) -> f32 {
    match op {
        UnOp::Neg => -v,
        UnOp::Exp => v.exp(),
        UnOp::Log1p => v.ln_1p(),
        UnOp::Tanh => v.tanh(),
        UnOp::Sqrt => v.sqrt(),
        UnOp::Rsqrt => 1.0 / v.sqrt(),
        UnOp::Cos => v.cos(),
        UnOp::Sin => v.sin(),
        UnOp::Abs => v.abs(),
        UnOp::Not => (v == 0.0) as i32 as f32,
        UnOp::HalfToFloat => half::f16::from_bits(v as u16).to_f32(),
        UnOp::OrderedBits | UnOp::Iq4Value | UnOp::Mxfp4Value | UnOp::Fp8ToFloat | UnOp::BitsToFloat => {
            unreachable!("an integer operand, evaluated apart")
        }
    }
}
