//! Type checking of DSL kernels: every variable defined before use, operands of one kind,
//! loads from declared arrays, stores only to writable buffers or shared arrays. Both the
//! emitter and the emulator ask it the type of an expression.

use crate::dsl::*;
use rustc_hash::{FxHashMap, FxHashSet};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TypeError {
    #[error("kernel {kernel}: {message}")]
    Invalid { kernel: String, message: String },
}

/// Types of names in scope: parameters, shared arrays (element types) and locals. The
/// emulator looks names up here on every read, hence the fast hash.
#[derive(Debug, Clone, Default)]
pub struct Scope {
    pub vars: FxHashMap<String, Ty>,
    pub arrays: FxHashMap<String, (Ty, bool)>,
    /// The shared-memory arrays and their lengths (the other arrays are global buffers).
    pub shared: FxHashMap<String, usize>,
    /// Buffers the CUDA emitter reads through `__ldg` (those the kernel also prefetches:
    /// see `cuda::emit`).
    pub ldg: FxHashSet<String>,
    /// The tensor maps (TMA views of global buffers).
    pub maps: FxHashMap<String, TensorMap>,
}

impl Scope {
    pub fn of(kernel: &Kernel) -> Self {
        let mut s = Scope::default();
        for p in &kernel.params {
            match p {
                Param::Buffer { name, ty, writable } => {
                    s.arrays.insert(name.clone(), (*ty, *writable));
                }
                Param::Scalar { name, ty } => {
                    s.vars.insert(name.clone(), *ty);
                }
                Param::TensorMap(map) => {
                    s.maps.insert(map.name.clone(), (**map).clone());
                }
            }
        }
        for a in &kernel.shared {
            s.arrays.insert(a.name.clone(), (a.ty, true));
            s.shared.insert(a.name.clone(), a.len);
        }
        s
    }

    /// The compute type of `e`, or why it has none.
    pub fn type_of(&self, e: &Expr) -> Result<Ty, String> {
        Ok(match e {
            Expr::F32(_) => Ty::F32,
            Expr::Int(_) | Expr::Builtin(_) => Ty::I32,
            Expr::Bool(_) => Ty::Bool,
            Expr::Var(n) => *self.vars.get(n).ok_or_else(|| format!("`{n}` is not defined"))?,
            Expr::Load { buf, index } => {
                let (ty, _) = self.arrays.get(buf).ok_or_else(|| format!("`{buf}` is not an array"))?;
                self.int(index)?;
                ty.compute()
            }
            Expr::LoadRow { buf, row, width, col } => {
                let (ty, _) = self.arrays.get(buf).ok_or_else(|| format!("`{buf}` is not an array"))?;
                for part in [row, width, col] {
                    self.int(part)?;
                }
                ty.compute()
            }
            Expr::Bin(op, a, b) => {
                let (ta, tb) = (self.type_of(a)?, self.type_of(b)?);
                if ta != tb {
                    return Err(format!("{op:?} of {ta:?} and {tb:?}"));
                }
                match op {
                    BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge | BinOp::Eq | BinOp::Ne => Ty::Bool,
                    BinOp::And | BinOp::Or if ta == Ty::Bool => Ty::Bool,
                    BinOp::And | BinOp::Or => return Err(format!("{op:?} of {ta:?}")),
                    BinOp::Shl | BinOp::Shr | BinOp::BitAnd | BinOp::BitXor | BinOp::Rem
                        if !matches!(ta, Ty::I32 | Ty::U32) =>
                    {
                        return Err(format!("{op:?} of {ta:?}"))
                    }
                    _ => ta,
                }
            }
            Expr::Un(op, a) => {
                let t = self.type_of(a)?;
                match op {
                    UnOp::HalfToFloat if matches!(t, Ty::I32 | Ty::U32) => Ty::F32,
                    UnOp::HalfToFloat => return Err(format!("half bits of type {t:?}")),
                    UnOp::OrderedBits if t == Ty::F32 => Ty::U32,
                    UnOp::OrderedBits => return Err(format!("ordered bits of {t:?}")),
                    UnOp::Iq4Value | UnOp::Mxfp4Value if matches!(t, Ty::I32 | Ty::U32) => Ty::I32,
                    UnOp::Iq4Value | UnOp::Mxfp4Value => return Err(format!("a 4-bit table index of type {t:?}")),
                    UnOp::Fp8ToFloat | UnOp::BitsToFloat if matches!(t, Ty::I32 | Ty::U32) => Ty::F32,
                    UnOp::Fp8ToFloat | UnOp::BitsToFloat => return Err(format!("{op:?} of {t:?}")),
                    UnOp::Not if t == Ty::Bool => Ty::Bool,
                    UnOp::Neg | UnOp::Abs => t,
                    _ if t == Ty::F32 => Ty::F32,
                    _ => return Err(format!("{op:?} of {t:?}")),
                }
            }
            Expr::Cast(ty, a) => {
                self.type_of(a)?;
                ty.compute()
            }
            Expr::Select(c, a, b) => {
                if self.type_of(c)? != Ty::Bool {
                    return Err("select needs a bool condition".into());
                }
                let (ta, tb) = (self.type_of(a)?, self.type_of(b)?);
                if ta != tb {
                    return Err(format!("select of {ta:?} and {tb:?}"));
                }
                ta
            }
            Expr::ShflXor(a, mask) => {
                if *mask >= 32 {
                    return Err(format!("shuffle mask {mask} leaves the warp"));
                }
                self.type_of(a)?
            }
        })
    }

    /// The element type of `map`'s buffer, a global bf16 or f16 array.
    fn map_element(&self, map: &TensorMap) -> Result<MmaElement, String> {
        match self.arrays.get(&map.buffer) {
            Some((ty, _)) if !self.shared.contains_key(&map.buffer) => MmaElement::of(*ty),
            _ => None,
        }
        .ok_or_else(|| {
            format!(
                "tensor map `{}` over `{}`, not a global bf16 or f16 array",
                map.name, map.buffer
            )
        })
    }

    /// `name` is a shared array of a tensor-core operand type (bf16 or f16): which.
    fn operand_array(&self, name: &str, what: &str) -> Result<MmaElement, String> {
        match self.arrays.get(name) {
            Some((ty, _)) if self.shared.contains_key(name) => MmaElement::of(*ty),
            _ => None,
        }
        .ok_or_else(|| format!("{what} `{name}` must be a shared bf16 or f16 array"))
    }

    /// `dst` (shared) and `src` (global) hold the same element type, bf16, f16, f32 or FP8: what
    /// one 16-byte `cp.async` copies between them.
    fn copy_arrays(&self, dst: &str, src: &str) -> Result<(), String> {
        let ty = match self.arrays.get(src) {
            Some((ty @ (Ty::Bf16 | Ty::F16 | Ty::F32 | Ty::F8E4M3), _)) if !self.shared.contains_key(src) => *ty,
            _ => {
                return Err(format!(
                    "cp.async source `{src}` must be a global bf16, f16, f32 or FP8 array"
                ))
            }
        };
        match self.arrays.get(dst) {
            Some((t, _)) if *t == ty && self.shared.contains_key(dst) => Ok(()),
            _ => Err(format!(
                "cp.async destination `{dst}` must be a shared {ty:?} array, as its source"
            )),
        }
    }

    /// `name` is a shared array of `ty` with at least `len` elements.
    fn shared_array(&self, name: &str, ty: Ty, len: usize, what: &str) -> Result<(), String> {
        match (self.arrays.get(name), self.shared.get(name)) {
            (Some((t, _)), Some(&l)) if *t == ty && l >= len => Ok(()),
            _ => Err(format!("{what} `{name}` must be a shared {ty:?} array of {len}")),
        }
    }

    /// `barrier` is an mbarrier: a slot of a shared `u32` array (see `MbarrierRef`).
    fn mbarrier(&self, barrier: &MbarrierRef) -> Result<(), String> {
        self.shared_array(&barrier.array, Ty::U32, 2, "mbarrier")?;
        self.int(&barrier.slot)
    }

    /// The element type of `buf`, an array a kernel may write.
    fn writable_array(&self, buf: &str) -> Result<Ty, String> {
        match self.arrays.get(buf) {
            None => Err(format!("`{buf}` is not an array")),
            Some((_, false)) => Err(format!("`{buf}` is read-only")),
            Some(&(ty, true)) => Ok(ty),
        }
    }

    /// A K-major operand of a tensor-core instruction (see `SmemMatrix`): its element type.
    fn operand(&self, what: &str, m: &SmemMatrix) -> Result<MmaElement, String> {
        let element = self.operand_array(&m.array, &format!("{what} operand"))?;
        self.int(&m.start)?;
        for (name, bytes) in [("leading", m.lbo), ("stride", m.sbo)] {
            if bytes % 16 != 0 || bytes >= 1 << 18 {
                return Err(format!(
                    "{what} {name} byte offset {bytes} (a multiple of 16 below 2^18)"
                ));
            }
        }
        Ok(element)
    }

    fn f32_locals<'a>(&self, what: &str, names: impl IntoIterator<Item = &'a String>) -> Result<(), String> {
        for name in names {
            match self.vars.get(name) {
                Some(Ty::F32) => {}
                other => return Err(format!("{what} `{name}` must be an f32 local, is {other:?}")),
            }
        }
        Ok(())
    }

    /// `operand` holds `elements` bf16 a lane: f32 locals, or U32 locals of pairs.
    fn mma_operand(&self, which: &str, operand: &MmaOperand, elements: usize) -> Result<(), String> {
        if operand.elements() != elements {
            return Err(format!(
                "mma operand {which} holds {} elements a lane, needs {elements}",
                operand.elements()
            ));
        }
        match operand {
            MmaOperand::F32(names) => self.f32_locals(&format!("mma operand {which}"), names),
            MmaOperand::Pairs(names) => names.iter().try_for_each(|name| match self.vars.get(name) {
                Some(Ty::U32) => Ok(()),
                other => Err(format!(
                    "mma operand {which}'s pair `{name}` must be a U32 local, is {other:?}"
                )),
            }),
        }
    }

    fn int(&self, e: &Expr) -> Result<(), String> {
        match self.type_of(e)? {
            Ty::I32 | Ty::U32 => Ok(()),
            t => Err(format!("index of type {t:?}")),
        }
    }
}

/// A tensor-core multiply's A and B of one element type.
fn same_elements(what: &str, a: MmaElement, b: MmaElement) -> Result<(), String> {
    match a == b {
        true => Ok(()),
        false => Err(format!("{what} with A of {} and B of {}", a.ptx(), b.ptx())),
    }
}

pub fn check(kernel: &Kernel) -> Result<(), TypeError> {
    let err = |message: String| TypeError::Invalid {
        kernel: kernel.name.clone(),
        message,
    };
    let scope = Scope::of(kernel);
    scope.type_of(&kernel.grid).map_err(err)?;
    for map in kernel.tensor_maps() {
        check_tensor_map(map, &scope).map_err(err)?;
    }
    check_block(&kernel.body, &mut scope.clone()).map_err(err)
}

/// What `cuTensorMapEncodeTiled` accepts of a 2-D map of 16-bit floats (its buffer bf16 or
/// f16), and the box widths bbc's layouts assume: box sides of 1..=256 elements, rows of whole
/// 16-byte units, exactly one 128-byte row under the 128-byte swizzle. Its sizes are
/// expressions of the scalar parameters.
fn check_tensor_map(map: &TensorMap, scope: &Scope) -> Result<(), String> {
    let name = &map.name;
    scope.map_element(map)?;
    for size in [&map.rows, &map.cols, &map.stride] {
        scope.int(size)?;
        if !uses_scalars_only(size) {
            return Err(format!(
                "tensor map `{name}`: its sizes must be expressions of the scalar parameters"
            ));
        }
    }
    for side in [map.box_rows, map.box_cols] {
        if !(1..=256).contains(&side) {
            return Err(format!("tensor map `{name}`: a box side of {side} (1..=256)"));
        }
    }
    if !map.box_cols.is_multiple_of(8) {
        return Err(format!(
            "tensor map `{name}`: box rows of {} bytes, not a multiple of 16",
            2 * map.box_cols
        ));
    }
    if map.swizzle == Swizzle::B128 && map.box_cols != 64 {
        return Err(format!(
            "tensor map `{name}`: a 128-byte swizzle takes boxes 64 elements wide, not {}",
            map.box_cols
        ));
    }
    Ok(())
}

/// Whether `e` reads nothing but literals and variables (the scalar parameters, at the
/// launcher): no builtins, no memory.
fn uses_scalars_only(e: &Expr) -> bool {
    match e {
        Expr::F32(_) | Expr::Int(_) | Expr::Bool(_) | Expr::Var(_) => true,
        Expr::Bin(_, a, b) => uses_scalars_only(a) && uses_scalars_only(b),
        Expr::Un(_, a) | Expr::Cast(_, a) => uses_scalars_only(a),
        Expr::Select(c, a, b) => [c, a, b].iter().all(|e| uses_scalars_only(e)),
        Expr::Builtin(_) | Expr::Load { .. } | Expr::LoadRow { .. } | Expr::ShflXor(..) => false,
    }
}

fn check_block(body: &[Stmt], scope: &mut Scope) -> Result<(), String> {
    check_block_declaring(body, scope, std::collections::HashSet::new())
}

/// Declare local `name` of type `ty` in the block whose declarations so far are `declared`.
/// C++ rejects a second declaration of a name in one block; an inner block may shadow an
/// outer name in C++, but not here: the emulator keeps one variable a name (only a loop's own
/// variable is restored after its loop), so a shadowing declaration would change the outer
/// variable there and not on the device.
fn declare<'a>(
    name: &'a String,
    ty: Ty,
    scope: &mut Scope,
    declared: &mut std::collections::HashSet<&'a String>,
) -> Result<(), String> {
    if !declared.insert(name) {
        return Err(format!("`{name}` is declared twice in one block"));
    }
    if scope.vars.contains_key(name) {
        return Err(format!(
            "`{name}` is declared in an inner block while an enclosing one declares it (shadowing)"
        ));
    }
    scope.vars.insert(name.clone(), ty);
    Ok(())
}

/// A `for` loop's variable counts as declared in its body's block. `declared` starts with the
/// names the enclosing construct declares there.
fn check_block_declaring<'a>(
    body: &'a [Stmt],
    scope: &mut Scope,
    mut declared: std::collections::HashSet<&'a String>,
) -> Result<(), String> {
    for s in body {
        match s {
            Stmt::Let { name, ty, value } => {
                let t = scope.type_of(value)?;
                if t != ty.compute() {
                    return Err(format!("`{name}`: {ty:?} initialised with {t:?}"));
                }
                not_an_array(name, scope)?;
                declare(name, *ty, scope, &mut declared)?;
            }
            Stmt::Assign { name, value } => {
                let want = *scope.vars.get(name).ok_or_else(|| format!("`{name}` is not defined"))?;
                let got = scope.type_of(value)?;
                if got != want.compute() {
                    return Err(format!("`{name}`: {want:?} assigned {got:?}"));
                }
            }
            Stmt::Store { buf, index, value } => {
                let ty = scope.writable_array(buf)?;
                scope.int(index)?;
                let got = scope.type_of(value)?;
                if got != ty.compute() {
                    return Err(format!("store of {got:?} into {ty:?} `{buf}`"));
                }
            }
            Stmt::StoreVec { buf, index, values } => {
                let ty = scope.writable_array(buf)?;
                // Bytes are loaded four to sixteen at once, never stored so.
                if ty == Ty::U8 || !vector_widths(ty).contains(&values.len()) {
                    return Err(format!("a vector store of {} {ty:?} into `{buf}`", values.len()));
                }
                scope.int(index)?;
                for value in values {
                    let got = scope.type_of(value)?;
                    if got != Ty::F32 {
                        return Err(format!("vector store of {got:?} into {ty:?} `{buf}`"));
                    }
                }
            }
            Stmt::For {
                var,
                start,
                end,
                step,
                body,
            } => {
                for e in [start, end, step] {
                    scope.int(e)?;
                }
                not_an_array(var, scope)?;
                let mut inner = scope.clone();
                inner.vars.insert(var.clone(), Ty::I32);
                check_block_declaring(body, &mut inner, std::collections::HashSet::from([var]))?;
            }
            Stmt::If { cond, then, otherwise } => {
                if scope.type_of(cond)? != Ty::Bool {
                    return Err("if needs a bool condition".into());
                }
                check_block(then, &mut scope.clone())?;
                check_block(otherwise, &mut scope.clone())?;
            }
            // Each role as it is emitted: a block of its own.
            Stmt::Roles(r) => {
                for role in &r.roles {
                    if scope.type_of(&role.cond)? != Ty::Bool {
                        return Err("a role needs a bool condition".into());
                    }
                    check_block(&role.body, &mut scope.clone())?;
                }
            }
            Stmt::Mma(m) => {
                scope.mma_operand("A", &m.a, 8)?;
                scope.mma_operand("B", &m.b, 4)?;
                scope.f32_locals("mma accumulator", &m.c)?;
            }
            Stmt::LoadMatrix(m) => {
                scope.operand_array(&m.buf, "ldmatrix source")?;
                if ![1, 2, 4].contains(&m.names.len()) {
                    return Err(format!("ldmatrix of {} matrices (1, 2 or 4)", m.names.len()));
                }
                scope.int(&m.row)?;
                for name in &m.names {
                    declare(name, Ty::U32, scope, &mut declared)?;
                }
            }
            Stmt::PrefetchL2 { buf, index } => {
                if !scope.arrays.contains_key(buf) || scope.shared.contains_key(buf) {
                    return Err(format!("a prefetch into L2 from `{buf}`, which is not a global buffer"));
                }
                scope.int(index)?;
            }
            Stmt::CpAsync(c) => {
                scope.copy_arrays(&c.dst, &c.src)?;
                scope.int(&c.dst_index)?;
                scope.int(&c.src_index)?;
                if scope.type_of(&c.valid)? != Ty::Bool {
                    return Err("cp.async needs a bool `valid`".into());
                }
            }
            Stmt::Wgmma(w) => {
                if w.n == 0 || w.n > 256 || w.n % 8 != 0 {
                    return Err(format!("wgmma with N = {} (8..=256, a multiple of 8)", w.n));
                }
                if w.d.len() != w.n as usize / 2 {
                    return Err(format!(
                        "wgmma N = {} needs {} accumulators, has {}",
                        w.n,
                        w.n / 2,
                        w.d.len()
                    ));
                }
                scope.f32_locals("wgmma accumulator", &w.d)?;
                let b = scope.operand("wgmma", &w.b)?;
                match &w.a {
                    WgmmaA::Registers(a) => scope.f32_locals("wgmma operand", a)?,
                    WgmmaA::Shared(a) => same_elements("wgmma", scope.operand("wgmma", a)?, b)?,
                }
            }
            Stmt::Mbarrier(op) => match &**op {
                Mbarrier::Init { barrier, count } => {
                    scope.mbarrier(barrier)?;
                    if *count == 0 || *count >= 1 << 20 {
                        return Err(format!("an mbarrier expecting {count} arrivals (1..2^20)"));
                    }
                }
                Mbarrier::ArriveExpectTx { barrier, bytes } => {
                    scope.mbarrier(barrier)?;
                    if *bytes >= 1 << 20 {
                        return Err(format!("an mbarrier expecting {bytes} transaction bytes (below 2^20)"));
                    }
                }
                Mbarrier::Arrive { barrier } => scope.mbarrier(barrier)?,
                Mbarrier::Wait { barrier, parity } => {
                    scope.mbarrier(barrier)?;
                    scope.int(parity)?;
                }
            },
            Stmt::TmaLoad(tma) => {
                let Some(map) = scope.maps.get(&tma.map) else {
                    return Err(format!("`{}` is not a tensor map", tma.map));
                };
                let element = scope.map_element(map)?;
                match scope.arrays.get(&tma.dst) {
                    Some((ty, _)) if *ty == element.ty() && scope.shared.contains_key(&tma.dst) => {}
                    _ => {
                        return Err(format!(
                            "TMA destination `{}` must be a shared {} array, as its map's buffer",
                            tma.dst,
                            element.ptx()
                        ))
                    }
                }
                for e in [&tma.dst_index, &tma.row, &tma.col] {
                    scope.int(e)?;
                }
                scope.mbarrier(&tma.barrier)?;
            }
            Stmt::LoadVec {
                buf,
                index,
                names,
                fp8_codes,
            } => {
                let (ty, _) = *scope
                    .arrays
                    .get(buf)
                    .ok_or_else(|| format!("`{buf}` is not an array"))?;
                if !vector_widths(ty).contains(&names.len()) {
                    return Err(format!("a vector load of {} {ty:?} from `{buf}`", names.len()));
                }
                if *fp8_codes && ty != Ty::U8 {
                    return Err(format!("FP8 codes read from `{buf}`, an array of {ty:?}, not bytes"));
                }
                scope.int(index)?;
                let local = if *fp8_codes { Ty::F32 } else { ty.compute() };
                for name in names {
                    declare(name, local, scope, &mut declared)?;
                }
            }
            Stmt::Tcgen05(op) => check_tcgen05(op, scope, &mut declared)?,
            Stmt::SetMaxRegisters { count, .. } => {
                if count % 8 != 0 || !(24..=256).contains(count) {
                    return Err(format!(
                        "setmaxnreg to {count} registers: a count is a multiple of 8 from 24 to 256"
                    ));
                }
            }
            Stmt::SyncThreads
            | Stmt::CpAsyncCommit
            | Stmt::CpAsyncWait(_)
            | Stmt::FenceProxyAsync
            | Stmt::WgmmaFence
            | Stmt::WgmmaCommit
            | Stmt::WgmmaWait(_)
            | Stmt::Comment(_) => {}
        }
    }
    Ok(())
}

fn check_tcgen05<'a>(
    op: &'a Tcgen05,
    scope: &mut Scope,
    declared: &mut std::collections::HashSet<&'a String>,
) -> Result<(), String> {
    match op {
        Tcgen05::Alloc { columns, slot } => {
            tmem_columns(*columns)?;
            scope.shared_array(slot, Ty::I32, 1, "the TMEM address slot")?;
        }
        Tcgen05::Dealloc { columns, address } => {
            tmem_columns(*columns)?;
            scope.int(address)?;
        }
        Tcgen05::Commit { barrier } => scope.mbarrier(barrier)?,
        Tcgen05::Mma(mma) => {
            let TmemMma {
                tmem,
                a,
                b,
                b_major: _,
                n,
                accumulate,
            } = &**mma;
            if *n < 16 || *n > 256 || n % 16 != 0 {
                return Err(format!(
                    "tcgen05.mma with M = 128 takes N = 16..=256 in steps of 16, not {n}"
                ));
            }
            scope.int(tmem)?;
            same_elements(
                "tcgen05.mma",
                scope.operand("tcgen05.mma", a)?,
                scope.operand("tcgen05.mma", b)?,
            )?;
            if scope.type_of(accumulate)? != Ty::Bool {
                return Err("tcgen05.mma needs a bool `accumulate`".into());
            }
        }
        Tcgen05::Load { address, names } => {
            if !names.len().is_power_of_two() || names.len() > 128 {
                return Err(format!(
                    "tcgen05.ld.32x32b loads 1..=128 columns, a power of two: {}",
                    names.len()
                ));
            }
            scope.int(address)?;
            for name in names {
                declare(name, Ty::F32, scope, declared)?;
            }
        }
        Tcgen05::WaitLd | Tcgen05::FenceBeforeSync | Tcgen05::FenceAfterSync => {}
    }
    Ok(())
}

/// A local named like a buffer or shared array would hide it in C, where the DSL still means
/// the array (as a GEMM's lane group `g` would hide a norm weight `g`).
fn not_an_array(name: &str, scope: &Scope) -> Result<(), String> {
    match scope.arrays.contains_key(name) {
        true => Err(format!("`{name}` names an array and a local")),
        false => Ok(()),
    }
}

fn tmem_columns(columns: u32) -> Result<(), String> {
    match columns.is_power_of_two() && (32..=512).contains(&columns) {
        true => Ok(()),
        false => Err(format!(
            "TMEM allocations are 32..=512 columns, a power of two: {columns}"
        )),
    }
}

/// The elements a vector load or store of `ty` takes: 4, 8 or 16 bytes.
fn vector_widths(ty: Ty) -> &'static [usize] {
    match ty {
        Ty::F8E4M3 | Ty::U8 => &[4, 8, 16],
        Ty::Bf16 | Ty::F16 => &[2, 4, 8],
        Ty::F32 => &[2, 4],
        _ => &[],
    }
}
