//! The kernel DSL: a small structured language (not strings) for one CUDA kernel. Values are
//! typed; buffers are global arrays passed as parameters; shared arrays live per block; control
//! flow is structured (`for`, `if`). The CUDA C emitter and the CPU emulator both consume it.

use std::fmt;

/// Element and value types. `Bf16` and `F16` (IEEE half) values are stored as 16-bit patterns
/// and `F8E4M3` (FP8, as KV caches store it: [`ir::F8E4M3`]) as 8-bit codes, all computed in
/// f32: loads widen them exactly, stores round to nearest even (FP8 saturating at ±448).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ty {
    F32,
    Bf16,
    F16,
    F8E4M3,
    I32,
    U32,
    I8,
    U8,
    Bool,
}

impl Ty {
    /// Bytes an element of this type takes in memory.
    pub fn bytes(self) -> usize {
        match self {
            Ty::F32 | Ty::I32 | Ty::U32 => 4,
            Ty::Bf16 | Ty::F16 => 2,
            Ty::F8E4M3 | Ty::I8 | Ty::U8 | Ty::Bool => 1,
        }
    }

    /// The type a loaded element computes in (16- and 8-bit floats widen to f32, small ints to i32).
    pub fn compute(self) -> Ty {
        match self {
            Ty::Bf16 | Ty::F16 | Ty::F8E4M3 => Ty::F32,
            Ty::I8 | Ty::U8 => Ty::I32,
            t => t,
        }
    }
}

/// Thread and block coordinates (x only: our kernels are 1-D grids of 1-D blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Builtin {
    ThreadIdx,
    BlockIdx,
    BlockDim,
    /// `threadIdx.x % 32`.
    Lane,
    /// `threadIdx.x / 32`.
    Warp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    Min,
    Max,
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
    And,
    Or,
    Shl,
    Shr,
    BitAnd,
    BitXor,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnOp {
    Neg,
    Not,
    Exp,
    /// ln(1 + x), accurate near 0 (softplus).
    Log1p,
    Tanh,
    Sqrt,
    Rsqrt,
    Cos,
    Sin,
    Abs,
    /// The f32 value of an IEEE half given as its 16 bits (an integer): GGUF block scales.
    HalfToFloat,
    /// An f32 as a `u32` that orders as bbc's rankings order floats (`ir::reference::ops::
    /// top_k`: `total_cmp`, NaN as −∞): its bits, the sign flipped for positives and every
    /// bit for negatives, so integer comparisons and bit-by-bit searches rank floats.
    OrderedBits,
    /// The value a 4-bit index (an integer, 0..16) stands for in the IQ4 formats' table,
    /// [`IQ4_VALUES`]: IQ4_NL/IQ4_XS weights.
    Iq4Value,
    /// The value a 4-bit MXFP4 code (an integer, 0..16) stands for doubled, [`MXFP4_VALUES`]:
    /// an integer, as ggml's table holds it.
    Mxfp4Value,
    /// The f32 value of an FP8 E4M3 code given as an integer (its low 8 bits), exactly: an
    /// FP8 checkpoint's weights.
    Fp8ToFloat,
    /// The f32 whose bits an integer holds (its low 32 bits): a block's f32 scale read as
    /// four bytes.
    BitsToFloat,
}

/// ggml's `kvalues_iq4nl`: the values of IQ4_NL's and IQ4_XS's 4-bit indices.
pub const IQ4_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// ggml's `kvalues_mxfp4`: MXFP4's E2M1 codes' values doubled (±0, 0.5, 1, 1.5, 2, 3, 4, 6 as
/// integers; −0 as 0).
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    F32(f32),
    Int(i64),
    Bool(bool),
    Builtin(Builtin),
    /// A local variable or a scalar parameter.
    Var(String),
    /// `buf[index]` of a global buffer or shared array, widened to its compute type.
    Load {
        buf: String,
        index: Box<Expr>,
    },
    /// `buf[row·width + col]` with the index computed in 64 bits (`row`, `width` and `col`
    /// are 32-bit): a row of a table past 2³¹ elements (Gemma 4's per-layer embeddings).
    LoadRow {
        buf: String,
        row: Box<Expr>,
        width: Box<Expr>,
        col: Box<Expr>,
    },
    Bin(BinOp, Box<Expr>, Box<Expr>),
    Un(UnOp, Box<Expr>),
    Cast(Ty, Box<Expr>),
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
    /// `__shfl_xor_sync(full mask, value, lane_mask)`: the value held by lane `lane ^ mask`.
    ShflXor(Box<Expr>, u32),
}

impl Expr {
    /// The value of an integer expression of literals and variables (`var` gives each
    /// variable's), as a launcher evaluates a grid or a tensor map's sizes from the scalar
    /// arguments: in 64 bits, so nothing a launch passes overflows.
    pub fn eval_int(&self, var: &dyn Fn(&str) -> Option<i64>) -> Result<i64, String> {
        Ok(match self {
            Expr::Int(v) => *v,
            Expr::Var(name) => var(name).ok_or_else(|| format!("no value for `{name}`"))?,
            Expr::Bin(op, a, b) => {
                let (a, b) = (a.eval_int(var)?, b.eval_int(var)?);
                match op {
                    BinOp::Add => a + b,
                    BinOp::Sub => a - b,
                    BinOp::Mul => a * b,
                    BinOp::Div | BinOp::Rem if b == 0 => return Err("integer division by zero".into()),
                    BinOp::Div => a / b,
                    BinOp::Rem => a % b,
                    BinOp::Min => a.min(b),
                    BinOp::Max => a.max(b),
                    op => return Err(format!("{op:?} in an integer expression of the scalars")),
                }
            }
            other => return Err(format!("{other:?} is not an integer expression of the scalars")),
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Stmt {
    Let {
        name: String,
        ty: Ty,
        value: Expr,
    },
    Assign {
        name: String,
        value: Expr,
    },
    /// `buf[index] = value`, narrowed to the buffer's element type.
    Store {
        buf: String,
        index: Expr,
        value: Expr,
    },
    /// `for (i32 var = start; var < end; var += step)`.
    For {
        var: String,
        start: Expr,
        end: Expr,
        step: Expr,
        body: Vec<Stmt>,
    },
    If {
        cond: Expr,
        then: Vec<Stmt>,
        otherwise: Vec<Stmt>,
    },
    /// `__syncthreads()`: every thread of the block must reach it together.
    SyncThreads,
    /// Tensor cores, `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32`: the warp
    /// multiplies a 16×16 A by a 16×8 B (bf16 or f16 operands, [`MmaFragments::element`]) into
    /// a 16×8 f32 accumulator, `c += a·b`. Each lane
    /// holds its fragments in f32 locals, in the PTX ISA's register layout (g = lane / 4,
    /// t = lane % 4): `a[0..2]` = A[g][2t, 2t+1], `a[2..4]` = A[g+8][2t, 2t+1], `a[4..6]` =
    /// A[g][2t+8, 2t+9], `a[6..8]` = A[g+8][2t+8, 2t+9]; `b[0..2]` = B[2t, 2t+1][g], `b[2..4]` =
    /// B[2t+8, 2t+9][g]; `c[0..2]` = C[g][2t, 2t+1], `c[2..4]` = C[g+8][2t, 2t+1]. A and B
    /// may instead be held as 16-bit pairs (see [`MmaOperand`]). Every lane of the warp must
    /// execute it together.
    Mma(Box<MmaFragments>),
    /// `ldmatrix` (see [`LoadMatrix`]): a warp's `mma.sync` operands straight from shared memory.
    LoadMatrix(Box<LoadMatrix>),
    /// Warp specialisation: the block's threads split into roles that each run on their own,
    /// meeting only at mbarriers (see [`Roles`]).
    Roles(Box<Roles>),
    /// Declare locals `names[j] = buf[index + j]` of the buffer's compute type (f32, or i32
    /// for bytes), read as one 4-, 8- or 16-byte load (2, 4 or 8 bf16; 2 or 4 f32; 4, 8 or 16
    /// FP8 codes or bytes). `index` must be a multiple of `names.len()`: buffers start 16-byte
    /// aligned, so the load is aligned. What lets a warp read 512 bytes at once.
    LoadVec {
        buf: String,
        index: Expr,
        names: Vec<String>,
        /// Bytes read as FP8 E4M3 codes, each widened to an f32 local (two a conversion
        /// instruction): an FP8 checkpoint's weights inside its blocks.
        fp8_codes: bool,
    },
    /// `buf[index + j] = values[j]` as one 4-, 8- or 16-byte store (as `LoadVec`'s widths;
    /// `index` a multiple of `values.len()`): a lane writes a row's 16 bytes in one access, so
    /// 8 lanes fill 128 bytes together where 2-byte stores 16 bytes apart would queue on a
    /// quarter of the banks.
    StoreVec {
        buf: String,
        index: Expr,
        values: Vec<Expr>,
    },
    /// `prefetch.global.L2`: start bringing the line holding `buf[index]` (a global buffer)
    /// into L2 and go on. Nothing waits for it and nothing reads it: a later load of the line
    /// finds it nearer. What gives a warp more loads in flight than the registers it loads
    /// into allow (the compiler schedules those, and waits for each where it is used). Changes
    /// no value; `index` must be inside the buffer.
    PrefetchL2 {
        buf: String,
        index: Expr,
    },
    /// `cp.async.cg.shared.global` (sm_80 and later): copy 16 bytes (8 bf16 or f16, 4 f32 or
    /// 16 FP8 codes: the arrays' common type) from the global `src[src_index..]` to the shared
    /// `dst[dst_index..]` without passing through registers, or 16 zero bytes when `valid` is
    /// false. The copy lands at a later `CpAsyncWait`; until then the destination must not be
    /// touched. Both places are 16-byte aligned.
    CpAsync(Box<AsyncCopy>),
    /// `cp.async.commit_group`: the thread's copies issued since the last commit form a group.
    CpAsyncCommit,
    /// `cp.async.wait_group n`: wait until at most `n` of the thread's newest groups are still
    /// in flight (other threads see the data after the next barrier).
    CpAsyncWait(u32),
    /// `fence.proxy.async.shared::cta`: makes this thread's shared-memory writes (stores and
    /// landed `cp.async`) visible to the async proxy that `wgmma` reads through; each writer
    /// runs it before the barrier that precedes the `wgmma`.
    FenceProxyAsync,
    /// `wgmma.fence.sync.aligned`: orders the warpgroup's register accesses before its next
    /// `wgmma` (needed before the first one and after the accumulators were touched).
    WgmmaFence,
    /// `wgmma.mma_async` (sm_90a only): see `WgmmaOp`. Asynchronous: its registers and shared
    /// operands must not be touched until a `WgmmaWait` retires its group.
    Wgmma(Box<WgmmaOp>),
    /// `wgmma.commit_group.sync.aligned`: the warpgroup's uncommitted `wgmma`s form a group.
    WgmmaCommit,
    /// `wgmma.wait_group.sync.aligned n`: wait until at most `n` groups are in flight.
    WgmmaWait(u32),
    /// Blackwell datacenter (sm_100a) tensor cores: see `Tcgen05`.
    Tcgen05(Box<Tcgen05>),
    /// Shared-memory barriers with arrival counts and transaction bytes: see `Mbarrier`.
    Mbarrier(Box<Mbarrier>),
    /// The Tensor Memory Accelerator (sm_90 and later): see `TmaLoad`.
    TmaLoad(Box<TmaLoad>),
    /// `setmaxnreg.{inc,dec}.sync.aligned.u32 count` (sm_90a and later): the registers a thread
    /// of the executing warpgroup may use become `count` (a multiple of 8 from 24 to 256),
    /// released to the block's pool or taken from it; an increase waits until the pool holds
    /// them. Every thread of the warpgroup executes it together. What lets a warp-specialised
    /// block give a producer that needs few registers' share to consumers holding
    /// accumulators: a block's registers a thread are otherwise what its most crowded quarter
    /// of the multiprocessor leaves (168 with 9 to 12 warps). A kernel using it is built for
    /// one block a multiprocessor, so each thread starts with that many.
    SetMaxRegisters {
        change: RegisterChange,
        count: u32,
    },
    Comment(String),
}

/// Which way a `Stmt::SetMaxRegisters` moves a warpgroup's registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegisterChange {
    /// `.dec`: release registers to the block's pool.
    Release,
    /// `.inc`: take registers from the pool, waiting until it holds them.
    Claim,
}

/// An mbarrier (sm_80 and later): 8 bytes of shared memory, slot `slot` of a shared `u32`
/// array (elements `2·slot`, `2·slot + 1`). A phase completes when its expected arrivals have
/// arrived and the transaction bytes announced to it (`ArriveExpectTx`) have been delivered
/// (by TMA copies); the next phase then begins. Waits name a phase by its parity.
#[derive(Debug, Clone, PartialEq)]
pub struct MbarrierRef {
    pub array: String,
    pub slot: Expr,
}

impl MbarrierRef {
    /// The barrier of the whole array (slot 0).
    pub fn whole(array: &str) -> Self {
        Self {
            array: array.into(),
            slot: int(0),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Mbarrier {
    /// One thread: a barrier expecting `count` arrivals per phase (made visible to the
    /// block by the `__syncthreads()` that must follow before any other use).
    Init { barrier: MbarrierRef, count: u32 },
    /// Each active thread arrives once and announces `bytes` more transaction bytes for the
    /// current phase (`mbarrier.arrive.expect_tx`).
    ArriveExpectTx { barrier: MbarrierRef, bytes: u32 },
    /// Each active thread arrives once.
    Arrive { barrier: MbarrierRef },
    /// Wait until the phase of `barrier` with this parity (0 or 1) has completed.
    Wait { barrier: MbarrierRef, parity: Expr },
}

/// How a tile's 16-byte chunks sit in shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Swizzle {
    /// As addressed: a tensor-core operand is read as 8×8 core matrices placed by its leading
    /// and stride byte offsets (`SmemMatrix`), a TMA box is written row after row.
    None,
    /// The 128-byte swizzle: rows of 128 bytes (64 bf16 or f16) whose 16-byte chunk `c` of row `r`
    /// lies at chunk `c ^ (r % 8)`, so the eight rows of a 1 KiB atom spread one column of
    /// chunks over all 32 banks. Applied to shared-memory address bits (bits 4–6 XOR bits
    /// 7–9), so arrays holding such tiles start 1024-byte aligned. What TMA writes and the
    /// tensor cores read without bank conflicts.
    B128,
}

impl Swizzle {
    /// The element of a 16-bit (bf16 or f16) array, 1024-byte aligned, that address `index`
    /// lands on.
    pub fn bf16_element(self, index: usize) -> usize {
        match self {
            Swizzle::None => index,
            Swizzle::B128 => index ^ (((index >> 6) & 7) << 3),
        }
    }
}

/// A two-dimensional view of a global bf16 or f16 buffer for TMA (`CUtensorMap`, of the
/// buffer's element type; the box lands in a shared array of the same): `rows` × `cols`
/// elements, row-major with rows `stride` elements apart, copied in boxes of `box_rows` ×
/// `box_cols`. Not a launch argument: the launcher derives it from `buffer` and the scalar
/// parameters (`rows`, `cols`, `stride` are expressions of them) and passes it as a
/// `__grid_constant__`. The row pitch must be a multiple of 16 bytes (`stride` of 8);
/// elements of a box outside the tensor arrive as zeros.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorMap {
    pub name: String,
    pub buffer: String,
    pub rows: Expr,
    pub cols: Expr,
    pub stride: Expr,
    pub box_rows: u32,
    pub box_cols: u32,
    /// The layout the box lands in: with `B128`, `box_cols` is 64 (one 128-byte row).
    pub swizzle: Swizzle,
}

impl TensorMap {
    /// Its (rows, cols, row stride) from the scalar arguments (`var`, as [`Expr::eval_int`]
    /// reads them), or why the driver would refuse them: an empty tensor, rows overlapping,
    /// or a row pitch that is not a multiple of 16 bytes. What the launcher encodes and the
    /// emulator resolves alike.
    pub fn sizes(&self, var: &dyn Fn(&str) -> Option<i64>) -> Result<(i64, i64, i64), String> {
        let name = &self.name;
        let size = |e: &Expr| e.eval_int(var).map_err(|e| format!("tensor map `{name}`: {e}"));
        let (rows, cols, stride) = (size(&self.rows)?, size(&self.cols)?, size(&self.stride)?);
        if rows < 1 || cols < 1 || stride < cols {
            return Err(format!(
                "tensor map `{name}` of {rows}×{cols} elements, rows {stride} apart"
            ));
        }
        if stride % 8 != 0 {
            return Err(format!(
                "tensor map `{name}`: rows {} bytes apart, not a multiple of 16",
                2 * stride
            ));
        }
        Ok((rows, cols, stride))
    }
}

/// `cp.async.bulk.tensor.2d` (TMA, sm_90 and later), issued by each active thread (kernels
/// issue it from one): the box of `map` whose first element is (`row`, `col`) lands in the shared `dst` from element `dst_index`
/// (box row after box row, in the map's swizzle; 1024-byte aligned with `B128`, 128-byte
/// otherwise) and delivers its bytes, the whole box's, to `barrier`'s current phase. The
/// destination may be read once that phase has been waited for.
#[derive(Debug, Clone, PartialEq)]
pub struct TmaLoad {
    pub map: String,
    pub dst: String,
    pub dst_index: Expr,
    pub row: Expr,
    pub col: Expr,
    pub barrier: MbarrierRef,
}

/// The `tcgen05` family (sm_100a only) and the mbarriers that order it. The accumulator lives
/// in tensor memory (TMEM: 128 lanes × 512 columns of 32 bits per SM, allocated by columns),
/// an MMA is issued by one thread and completes asynchronously, signalled through an mbarrier;
/// warps read their quarter of the lanes back into registers (see `Mbarrier` for the barriers).
#[derive(Debug, Clone, PartialEq)]
pub enum Tcgen05 {
    /// One whole warp: allocate `columns` TMEM columns (a power of two, 32..=512) and write
    /// their address to the shared i32 `slot[0]`; then give up the right to allocate more, so
    /// other blocks on the SM can allocate.
    Alloc { columns: u32, slot: String },
    /// One whole warp: free the `columns` columns at `address` (required before the block ends).
    Dealloc { columns: u32, address: Expr },
    /// One thread: see `TmemMma`.
    Mma(Box<TmemMma>),
    /// The issuing thread: one arrival on `barrier` once its MMAs issued so far complete.
    Commit { barrier: MbarrierRef },
    /// One whole warp (warp w of each group of 4 reads lanes 32·(w % 4)..+32):
    /// `tcgen05.ld.32x32b.xN`, lane l gets TMEM lane `(address >> 16) + l`, columns
    /// `(address & 0xffff) + j` as new f32 locals `names[j]`; valid after `WaitLd`.
    Load { address: Expr, names: Vec<String> },
    /// `tcgen05.wait::ld`: this thread's loads from TMEM have landed in its registers.
    WaitLd,
    /// `tcgen05.fence::before_thread_sync`: orders prior tcgen05 work before a barrier.
    FenceBeforeSync,
    /// `tcgen05.fence::after_thread_sync`: orders later tcgen05 work after a barrier or wait.
    FenceAfterSync,
}

/// One `cp.async` of 16 bytes (see `Stmt::CpAsync`); indices in elements.
#[derive(Debug, Clone, PartialEq)]
pub struct AsyncCopy {
    pub dst: String,
    pub dst_index: Expr,
    pub src: String,
    pub src_index: Expr,
    pub valid: Expr,
}

/// A K-major operand in shared memory, as a `wgmma`/`tcgen05` descriptor sees it: a bf16 or
/// f16 array (its type is the instruction's, [`MmaElement`]; A's and B's the same).
/// Without swizzling: 8×8 "core matrices" (8 rows of 16 bytes, 128 contiguous bytes);
/// element (row, k) sits at `start + (row / 8)·sbo + (k / 8)·lbo + (row % 8)·8 + k % 8`
/// elements, with `lbo`/`sbo` the leading/stride byte offsets given here in bytes. With the
/// 128-byte swizzle (wgmma only): rows of 128 bytes, 8-row groups `sbo` bytes apart, element
/// (row, k) at the swizzled address of `start + (row / 8)·sbo + (row % 8)·64 + k` (`lbo`
/// unused); `start` steps along K inside a row (32 bytes a 16-wide k slice). Read MN-major,
/// see [`Major::MN`].
#[derive(Debug, Clone, PartialEq)]
pub struct SmemMatrix {
    pub array: String,
    /// First element, a multiple of 8 (the descriptor's address is 16-byte aligned).
    pub start: Expr,
    /// Bytes between core matrices adjacent along K.
    pub lbo: u32,
    /// Bytes between core matrices adjacent along M/N (8-row groups).
    pub sbo: u32,
    pub swizzle: Swizzle,
}

/// How a `wgmma`'s B lies in its core matrices (8×8 elements, 128 contiguous bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Major {
    /// Each core matrix 8 rows (N) of 8 consecutive k: `SmemMatrix`'s offsets as written there.
    K,
    /// N contiguous (`imm-trans-b` = 1): a row-major K×N matrix. Unswizzled, each core
    /// matrix is 8 rows (k) of 8 consecutive N, copied 16 bytes at a time: the leading byte
    /// offset steps 8 k, the stride byte offset 8 N. Under the 128-byte swizzle, each
    /// 128-byte row holds 64 consecutive N of one k, as a TMA box of 64 columns lands: element (n, k) at the swizzled address of `start + (n / 64)·lbo + (k / 8)·sbo +
    /// (k % 8)·64 + n % 64`, so the leading byte offset steps 64 N and the stride byte offset
    /// 8 k (roles the other way round from unswizzled), and `start` is a 1024-byte atom's.
    MN,
}

/// Where a `wgmma` takes A from.
#[derive(Debug, Clone, PartialEq)]
pub enum WgmmaA {
    /// f32 locals, laid out as `mma.sync`'s A (see `Stmt::Mma`), rounded to B's element type
    /// when packed.
    Registers([String; 8]),
    /// A 64×16 K-major operand in shared memory.
    Shared(SmemMatrix),
}

/// `wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}.{bf16,f16}` (the type of B's array,
/// and of A's from shared memory): the warpgroup (4 consecutive
/// warps, 128 threads) multiplies a 64×16 A by a 16×N B into a 64×N f32 accumulator,
/// `d += a·b`. Warp w of the group holds rows 16w..16w+16 of D (and of A, from registers).
/// Per lane (g = lane / 4, t = lane % 4, rows relative to 16w): `d[4j..4j+2]` =
/// D[g][8j+2t, +1], `d[4j+2..4j+4]` = D[g+8][8j+2t, +1]. B comes from shared memory: B[k][col]
/// is element (col, k) of `b`, laid out as `b_major` says.
#[derive(Debug, Clone, PartialEq)]
pub struct WgmmaOp {
    pub n: u32,
    pub a: WgmmaA,
    pub b: SmemMatrix,
    pub b_major: Major,
    /// N/2 f32 accumulator locals.
    pub d: Vec<String>,
}

/// `tcgen05.mma.cta_group::1.kind::f16`: D (f32, in TMEM at `tmem`) = A·B, plus D when
/// `accumulate`; A is 128×16 and B is N×16 (the transpose of the K×N operand), both bf16 or
/// both f16 in shared memory (`SmemMatrix`), A K-major and B laid out as `b_major` says (as `wgmma`'s B). Row i
/// of D is TMEM lane i, column j is column `tmem + j`.
#[derive(Debug, Clone, PartialEq)]
pub struct TmemMma {
    pub tmem: Expr,
    pub a: SmemMatrix,
    pub b: SmemMatrix,
    pub b_major: Major,
    pub n: u32,
    pub accumulate: Expr,
}

/// The roles of a warp-specialised block: each role's threads (those for which `cond` holds,
/// whole warps, one role a thread) run its `body`. On the device the roles run apart (`if
/// (cond) { body }` each, `cond` broadcast from lane 0 so the compiler knows it the same
/// across a warp), so nothing but mbarriers orders one role's work against another's,
/// and registers a role declares (a consumer's accumulators) are its own: what lets `ptxas`
/// keep a role's `wgmma`s asynchronous. A role loops as it needs (a producer over K steps, a
/// persistent consumer over tiles and, inside, their K steps). The emulator runs the roles as
/// coroutines: each runs until it begins a loop iteration or reaches an mbarrier wait whose
/// phase has not completed, then the next takes its turn (a schedule the device may take);
/// every order the device may take is checked through the mbarriers' releases and
/// acquisitions, and roles that all wait on phases nothing can complete are reported.
#[derive(Debug, Clone, PartialEq)]
pub struct Roles {
    pub roles: Vec<Role>,
}

/// One role of [`Roles`].
#[derive(Debug, Clone, PartialEq)]
pub struct Role {
    pub cond: Expr,
    pub body: Vec<Stmt>,
}

/// The 16-bit float type a tensor-core multiply takes A and B as (f32 accumulation either
/// way): what f32 operands round to (nearest even), what 16-bit pairs and shared operands
/// hold. bf16 keeps f32's range; IEEE half keeps three more mantissa bits, exactly what an f16
/// KV cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MmaElement {
    Bf16,
    F16,
}

impl MmaElement {
    /// The element type of the arrays it reads.
    pub fn ty(self) -> Ty {
        match self {
            MmaElement::Bf16 => Ty::Bf16,
            MmaElement::F16 => Ty::F16,
        }
    }

    /// The type arrays of `ty` hold as tensor-core operands, if any.
    pub fn of(ty: Ty) -> Option<Self> {
        match ty {
            Ty::Bf16 => Some(MmaElement::Bf16),
            Ty::F16 => Some(MmaElement::F16),
            _ => None,
        }
    }

    /// The PTX type's name (`bf16`, `f16`).
    pub fn ptx(self) -> &'static str {
        match self {
            MmaElement::Bf16 => "bf16",
            MmaElement::F16 => "f16",
        }
    }
}

/// The fragment locals of one `mma.sync` (see `Stmt::Mma`): A's 8 elements a lane, B's 4,
/// the accumulator's 4 f32.
#[derive(Debug, Clone, PartialEq)]
pub struct MmaFragments {
    /// The operands' type.
    pub element: MmaElement,
    pub a: MmaOperand,
    pub b: MmaOperand,
    pub c: [String; 4],
}

/// How a lane holds an `mma.sync` operand's elements (in `Stmt::Mma`'s order).
#[derive(Debug, Clone, PartialEq)]
pub enum MmaOperand {
    /// An f32 local an element, rounded to the MMA's element type (nearest even) as it takes
    /// them.
    F32(Vec<String>),
    /// A U32 local a pair of elements, their 16 bits each (the first in the low half), as
    /// `Stmt::LoadMatrix` gives them: handed to the MMA as they are, nothing converted, so of
    /// the MMA's element type.
    Pairs(Vec<String>),
}

impl MmaOperand {
    /// Elements it holds a lane.
    pub fn elements(&self) -> usize {
        match self {
            MmaOperand::F32(names) => names.len(),
            MmaOperand::Pairs(names) => 2 * names.len(),
        }
    }
}

/// `ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16`: the warp reads `names.len()` (1, 2
/// or 4) 8×8 matrices of the shared array `buf` (bf16 or f16: the pairs' bits), lane `8i + r` giving at `row` the index of
/// matrix i's row r (8 elements in turn, 16-byte aligned; lanes past the last matrix's give
/// none). Each lane declares U32 locals `names[i]`, a pair of matrix i's elements (g = lane / 4,
/// t = lane % 4): row g, columns 2t and 2t + 1; with `transpose`, column g, rows 2t and 2t + 1.
/// Those are `mma.sync`'s A and B fragments ([`MmaOperand::Pairs`]) where the rows are
/// along K (A's rows, or a B stored a column of B a row), and B's where the rows are B's own
/// (transposed). One instruction for what would take 8 loads and 8 conversions a lane. Every
/// lane of the warp executes it together.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadMatrix {
    pub buf: String,
    pub row: Expr,
    pub names: Vec<String>,
    pub transpose: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Param {
    /// A global array; `writable` ones are outputs.
    Buffer {
        name: String,
        ty: Ty,
        writable: bool,
    },
    Scalar {
        name: String,
        ty: Ty,
    },
    /// Derived by the launcher, not passed by the caller: see `TensorMap`.
    TensorMap(Box<TensorMap>),
}

impl Param {
    pub fn name(&self) -> &str {
        match self {
            Param::Buffer { name, .. } | Param::Scalar { name, .. } => name,
            Param::TensorMap(map) => &map.name,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SharedArray {
    pub name: String,
    pub ty: Ty,
    pub len: usize,
}

/// The most shared memory a block may have (sm_90 and sm_100; beyond the static limit it is
/// asked for at launch).
pub const SHARED_LIMIT: usize = 227 * 1024;
/// The most shared memory a kernel may declare statically.
pub const STATIC_SHARED_LIMIT: usize = 48 * 1024;
/// Alignment of each shared array in dynamic shared memory where TMA writes it or tensor cores
/// read it swizzled: the 128-byte swizzle's period, which they assume of their addresses.
pub const SHARED_ALIGNMENT: usize = 1024;
/// Alignment of each shared array in dynamic shared memory otherwise: a 16-byte access's (and
/// the least the device guarantees the allocation).
pub const VECTOR_ALIGNMENT: usize = 16;

/// How a kernel's shared arrays are placed. Static arrays (16-byte aligned) while they fit in
/// 48 KiB and nothing needs more alignment; otherwise one dynamic allocation of `bytes`
/// (asked for at launch) in which array i starts at byte `offsets[i]` past a base aligned to
/// `alignment` ([`SHARED_ALIGNMENT`] for TMA and swizzled operands, `bytes` then including
/// the 1 KiB the kernel may skip to align it; else [`VECTOR_ALIGNMENT`], which the
/// allocation has). Arrays TMA writes or swizzled operands read start 1 KiB aligned, the
/// others 16 bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedLayout {
    pub dynamic: bool,
    pub offsets: Vec<usize>,
    pub bytes: usize,
    pub alignment: usize,
}

/// Whether any statement of `body`, nested ones included, satisfies `pred`.
pub fn any_stmt(body: &[Stmt], pred: &dyn Fn(&Stmt) -> bool) -> bool {
    body.iter().any(|s| {
        pred(s)
            || match s {
                Stmt::For { body, .. } => any_stmt(body, pred),
                Stmt::If { then, otherwise, .. } => any_stmt(then, pred) || any_stmt(otherwise, pred),
                Stmt::Roles(r) => r.roles.iter().any(|role| any_stmt(&role.body, pred)),
                _ => false,
            }
    })
}

/// `edit` applied to every statement of `body`, nested ones included (each after those it
/// holds).
pub fn edit_stmts(body: &mut [Stmt], edit: &mut dyn FnMut(&mut Stmt)) {
    for s in body {
        match s {
            Stmt::For { body, .. } => edit_stmts(body, edit),
            Stmt::If { then, otherwise, .. } => {
                edit_stmts(then, edit);
                edit_stmts(otherwise, edit);
            }
            Stmt::Roles(r) => r.roles.iter_mut().for_each(|role| edit_stmts(&mut role.body, edit)),
            _ => {}
        }
        edit(s);
    }
}

/// One kernel: launched as `grid` blocks (a scalar expression of the parameters) of
/// `block_dim` threads.
#[derive(Debug, Clone, PartialEq)]
pub struct Kernel {
    pub name: String,
    /// Where it came from (IR node, target), for the generated file's header.
    pub origin: String,
    pub params: Vec<Param>,
    pub shared: Vec<SharedArray>,
    pub block_dim: u32,
    /// Blocks to launch, in terms of the scalar parameters.
    pub grid: Expr,
    pub body: Vec<Stmt>,
}

impl Kernel {
    pub fn param(&self, name: &str) -> Option<&Param> {
        self.params.iter().find(|p| p.name() == name)
    }

    /// The parameters a launch passes, in order: all but the tensor maps, which the launcher
    /// derives from them.
    pub fn launch_params(&self) -> impl Iterator<Item = &Param> {
        self.params.iter().filter(|p| !matches!(p, Param::TensorMap(_)))
    }

    /// Where the shared arrays live (see `SharedLayout`).
    pub fn shared_layout(&self) -> SharedLayout {
        let declared: usize = self.shared.iter().map(|a| a.len * a.ty.bytes()).sum();
        let swizzled = |m: &SmemMatrix| m.swizzle != Swizzle::None;
        let aligned = self.tensor_maps().next().is_some()
            || any_stmt(&self.body, &|s| match s {
                Stmt::Wgmma(w) => swizzled(&w.b) || matches!(&w.a, WgmmaA::Shared(a) if swizzled(a)),
                Stmt::Tcgen05(op) => matches!(&**op, Tcgen05::Mma(m) if swizzled(&m.a) || swizzled(&m.b)),
                Stmt::TmaLoad(_) => true,
                _ => false,
            });
        if !aligned && declared <= STATIC_SHARED_LIMIT {
            return SharedLayout {
                dynamic: false,
                offsets: vec![],
                bytes: declared,
                alignment: VECTOR_ALIGNMENT,
            };
        }
        let alignment = match aligned {
            true => SHARED_ALIGNMENT,
            false => VECTOR_ALIGNMENT,
        };
        let mut offsets = Vec::new();
        let mut end = 0;
        for a in &self.shared {
            let own = match aligned && self.swizzled_or_tma_written(&a.name) {
                true => SHARED_ALIGNMENT,
                false => VECTOR_ALIGNMENT,
            };
            end = usize::next_multiple_of(end, own);
            offsets.push(end);
            end += a.len * a.ty.bytes();
        }
        SharedLayout {
            dynamic: true,
            offsets,
            // Room to skip to an aligned base where the allocation's own alignment is less.
            bytes: end.next_multiple_of(VECTOR_ALIGNMENT) + if alignment > VECTOR_ALIGNMENT { alignment } else { 0 },
            alignment,
        }
    }

    /// Whether shared array `name` is a TMA copy's destination or a swizzled tensor-core
    /// operand: its swizzle pattern repeats every 1 KiB of address, so it starts 1 KiB aligned.
    fn swizzled_or_tma_written(&self, name: &str) -> bool {
        let swizzled = |m: &SmemMatrix| m.swizzle != Swizzle::None && m.array == name;
        any_stmt(&self.body, &|s| match s {
            Stmt::Wgmma(w) => swizzled(&w.b) || matches!(&w.a, WgmmaA::Shared(a) if swizzled(a)),
            Stmt::Tcgen05(op) => matches!(&**op, Tcgen05::Mma(m) if swizzled(&m.a) || swizzled(&m.b)),
            Stmt::TmaLoad(copy) => copy.dst == name,
            _ => false,
        })
    }

    /// The tensor maps the launcher derives (see `TensorMap`).
    pub fn tensor_maps(&self) -> impl Iterator<Item = &TensorMap> {
        self.params.iter().filter_map(|p| match p {
            Param::TensorMap(map) => Some(&**map),
            _ => None,
        })
    }
}

// Builders: the templates read like the kernels they describe.

pub fn f(v: f32) -> Expr {
    Expr::F32(v)
}
pub fn int(v: i64) -> Expr {
    Expr::Int(v)
}
pub fn var(name: &str) -> Expr {
    Expr::Var(name.into())
}
pub fn tid() -> Expr {
    Expr::Builtin(Builtin::ThreadIdx)
}
pub fn bid() -> Expr {
    Expr::Builtin(Builtin::BlockIdx)
}
pub fn bdim() -> Expr {
    Expr::Builtin(Builtin::BlockDim)
}
pub fn lane() -> Expr {
    Expr::Builtin(Builtin::Lane)
}
pub fn warp() -> Expr {
    Expr::Builtin(Builtin::Warp)
}
pub fn load(buf: &str, index: Expr) -> Expr {
    Expr::Load {
        buf: buf.into(),
        index: Box::new(index),
    }
}
pub fn load_row(buf: &str, row: Expr, width: Expr, col: Expr) -> Expr {
    Expr::LoadRow {
        buf: buf.into(),
        row: Box::new(row),
        width: Box::new(width),
        col: Box::new(col),
    }
}
pub fn bin(op: BinOp, a: Expr, b: Expr) -> Expr {
    Expr::Bin(op, Box::new(a), Box::new(b))
}
pub fn un(op: UnOp, a: Expr) -> Expr {
    Expr::Un(op, Box::new(a))
}
pub fn cast(ty: Ty, a: Expr) -> Expr {
    Expr::Cast(ty, Box::new(a))
}
pub fn select(c: Expr, a: Expr, b: Expr) -> Expr {
    Expr::Select(Box::new(c), Box::new(a), Box::new(b))
}
pub fn shfl_xor(a: Expr, mask: u32) -> Expr {
    Expr::ShflXor(Box::new(a), mask)
}
pub fn lt(a: Expr, b: Expr) -> Expr {
    bin(BinOp::Lt, a, b)
}
pub fn eq(a: Expr, b: Expr) -> Expr {
    bin(BinOp::Eq, a, b)
}
pub fn rem(a: Expr, b: Expr) -> Expr {
    bin(BinOp::Rem, a, b)
}
/// Logical and of two bools.
pub fn and(a: Expr, b: Expr) -> Expr {
    bin(BinOp::And, a, b)
}
/// Logical or of two bools.
pub fn or(a: Expr, b: Expr) -> Expr {
    bin(BinOp::Or, a, b)
}

impl std::ops::Add for Expr {
    type Output = Expr;
    fn add(self, o: Expr) -> Expr {
        bin(BinOp::Add, self, o)
    }
}
impl std::ops::Sub for Expr {
    type Output = Expr;
    fn sub(self, o: Expr) -> Expr {
        bin(BinOp::Sub, self, o)
    }
}
impl std::ops::Mul for Expr {
    type Output = Expr;
    fn mul(self, o: Expr) -> Expr {
        bin(BinOp::Mul, self, o)
    }
}
impl std::ops::Div for Expr {
    type Output = Expr;
    fn div(self, o: Expr) -> Expr {
        bin(BinOp::Div, self, o)
    }
}

pub fn let_(name: &str, ty: Ty, value: Expr) -> Stmt {
    Stmt::Let {
        name: name.into(),
        ty,
        value,
    }
}
pub fn assign(name: &str, value: Expr) -> Stmt {
    Stmt::Assign {
        name: name.into(),
        value,
    }
}
/// `let names[j] = buf[index + j]` as one vector load (see `Stmt::LoadVec`).
pub fn load_vec(buf: &str, index: Expr, names: &[String]) -> Stmt {
    Stmt::LoadVec {
        buf: buf.into(),
        index,
        names: names.to_vec(),
        fp8_codes: false,
    }
}
/// `let names[j] = e4m3(buf[index + j])`: bytes of a `u8` buffer as FP8 codes, widened, in
/// one vector load (see `Stmt::LoadVec`).
pub fn load_fp8_codes(buf: &str, index: Expr, names: &[String]) -> Stmt {
    Stmt::LoadVec {
        buf: buf.into(),
        index,
        names: names.to_vec(),
        fp8_codes: true,
    }
}

/// `let names[i]` = this lane's pair of matrix i of `buf`, lane `8i + r` giving the index of
/// its row r at `row` (see `Stmt::LoadMatrix`).
pub fn load_matrix(buf: &str, row: Expr, names: &[String], transpose: bool) -> Stmt {
    Stmt::LoadMatrix(Box::new(LoadMatrix {
        buf: buf.into(),
        row,
        names: names.to_vec(),
        transpose,
    }))
}

/// Bring the line of global `buf[index]` into L2 (see `Stmt::PrefetchL2`).
pub fn prefetch_l2(buf: &str, index: Expr) -> Stmt {
    Stmt::PrefetchL2 { buf: buf.into(), index }
}

/// `buf[index + j] = values[j]` as one vector store (see `Stmt::StoreVec`).
pub fn store_vec(buf: &str, index: Expr, values: Vec<Expr>) -> Stmt {
    Stmt::StoreVec {
        buf: buf.into(),
        index,
        values,
    }
}

pub fn store(buf: &str, index: Expr, value: Expr) -> Stmt {
    Stmt::Store {
        buf: buf.into(),
        index,
        value,
    }
}
pub fn for_(v: &str, start: Expr, end: Expr, step: Expr, body: Vec<Stmt>) -> Stmt {
    Stmt::For {
        var: v.into(),
        start,
        end,
        step,
        body,
    }
}
pub fn if_(cond: Expr, then: Vec<Stmt>) -> Stmt {
    Stmt::If {
        cond,
        then,
        otherwise: vec![],
    }
}
pub fn if_else(cond: Expr, then: Vec<Stmt>, otherwise: Vec<Stmt>) -> Stmt {
    Stmt::If { cond, then, otherwise }
}
pub fn buffer(name: &str, ty: Ty, writable: bool) -> Param {
    Param::Buffer {
        name: name.into(),
        ty,
        writable,
    }
}
pub fn scalar(name: &str, ty: Ty) -> Param {
    Param::Scalar { name: name.into(), ty }
}

impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Ty::F32 => "float",
            Ty::Bf16 | Ty::F16 => "unsigned short",
            Ty::I32 => "int",
            Ty::U32 => "unsigned int",
            Ty::I8 => "signed char",
            Ty::U8 | Ty::F8E4M3 => "unsigned char",
            Ty::Bool => "bool",
        })
    }
}
