//! The CUDA C emitter: one readable kernel per file, a header naming its origin, no includes
//! (bf16 travels as 16-bit patterns with explicit conversions, so NVRTC needs no headers).

use crate::dsl::*;
use crate::types::Scope;
use std::fmt::Write;

const BF16_HELPERS: &str = r#"// bf16 <-> f32: bf16 is the top half of an f32; rounding to nearest even on the way down.
static __device__ __forceinline__ float bbc_bf16_to_f32(unsigned short v) {
    return __uint_as_float(((unsigned int)v) << 16);
}
static __device__ __forceinline__ unsigned short bbc_f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
// Two bf16 in one register, the lower-indexed element in the low half (the mma operand
// layout), rounded to nearest even by one conversion instruction (the first operand goes high).
static __device__ __forceinline__ unsigned int bbc_pack_bf16x2(float lo, float hi) {
    unsigned int packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}
"#;

const F16_HELPER: &str = r#"// IEEE half (the low 16 bits) -> f32: one exact conversion instruction, subnormals, infinities
// and NaN included (half weights convert 8 to a 16-byte load inside the GEMV's loop).
static __device__ __forceinline__ float bbc_f16_to_f32(unsigned int h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}
"#;

const F16_STORE_HELPER: &str = r#"// f32 -> IEEE half (the low 16 bits), rounded to nearest even: a half KV cache's stores.
static __device__ __forceinline__ unsigned short bbc_f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
"#;

const F16_PACK_HELPER: &str = r#"// Two IEEE halves in one register, the lower-indexed element in the low half (the mma operand
// layout), rounded to nearest even by one conversion instruction (the first operand goes high).
static __device__ __forceinline__ unsigned int bbc_pack_f16x2(float lo, float hi) {
    unsigned int packed;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}
"#;

const FP8_HELPERS: &str = r#"// FP8 E4M3 codes (an FP8 KV cache, FP8 weights) -> f32, exactly: each code to a half (every E4M3 value is
// one), then to f32. The pair form takes two codes, the lower-addressed one in the low byte.
static __device__ __forceinline__ float2 bbc_fp8x2_to_f32x2(unsigned int codes) {
    unsigned int halves;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"((unsigned short)codes));
    float2 f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f.x) : "h"((unsigned short)halves));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f.y) : "h"((unsigned short)(halves >> 16)));
    return f;
}
static __device__ __forceinline__ float bbc_fp8_to_f32(unsigned int code) {
    return bbc_fp8x2_to_f32x2(code & 0xffu).x;
}
"#;

const FP8_STORE_HELPER: &str = r#"// f32 -> FP8 E4M3, rounded to nearest even and saturated to +-448 (an FP8 KV cache's stores,
// as vLLM's cache kernels convert); the instruction converts a pair, the second operand into
// the low byte.
static __device__ __forceinline__ unsigned char bbc_f32_to_fp8(float f) {
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(f));
    return (unsigned char)pair;
}
"#;

const ORDERED_BITS_HELPER: &str = r#"// An f32 as a u32 that orders as bbc's rankings order floats (total order, NaN as -inf): the
// sign bit set for positives, every bit flipped for negatives.
static __device__ __forceinline__ unsigned int bbc_ordered_bits(float f) {
    unsigned int u = f != f ? 0xff800000u : __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
"#;

/// A 4-bit table's values + 128, four bytes a word (value `4w + b` in byte `b` of word `w`).
fn table_words(values: &[i8; 16]) -> [u32; 4] {
    std::array::from_fn(|w| {
        values[4 * w..4 * w + 4]
            .iter()
            .rev()
            .fold(0u32, |word, &x| (word << 8) | (x as i32 + 128) as u32)
    })
}

/// `bbc_{name}`: a 4-bit table ([`table_words`]) at an index, a word picked by two selects,
/// its byte shifted out (no table in memory, no divergent loads).
fn table_helper(name: &str, what: &str, values: &[i8; 16]) -> String {
    let [w0, w1, w2, w3] = table_words(values);
    format!(
        "// {what} at a 4-bit index: its values + 128, four to a word.
static __device__ __forceinline__ int bbc_{name}(unsigned int i) {{
    const unsigned int low = (i & 4) ? 0x{w1:08x}u : 0x{w0:08x}u, high = (i & 4) ? 0x{w3:08x}u : 0x{w2:08x}u;
    return (int)((((i & 8) ? high : low) >> ((i & 3) * 8)) & 0xffu) - 128;
}}
"
    )
}

const ASYNC_HELPERS: &str = r#"// 16 bytes global -> shared without registers (cp.async.cg), or 16 zero bytes when !valid
// (then nothing is read: the source may be past the end of its buffer).
static __device__ __forceinline__ void bbc_cp_async_16(void* dst, const void* src, bool valid) {
    const unsigned int shared_dst = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(shared_dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
"#;

const WGMMA_HELPERS: &str = r#"// A wgmma shared-memory descriptor: start address, leading (K) and stride (M/N) byte offsets,
// each encoded as (x & 0x3ffff) >> 4, and the layout at bits 62-63 (0: no swizzle, 1: the
// 128-byte swizzle, its pattern taken from the address bits: arrays start 1024-byte aligned).
static __device__ __forceinline__ unsigned long long bbc_wgmma_desc(const void* start, unsigned int lbo, unsigned int sbo, unsigned int layout) {
    const unsigned long long address = (unsigned long long)__cvta_generic_to_shared(start);
    return ((address & 0x3ffffull) >> 4) | ((unsigned long long)((lbo & 0x3ffffu) >> 4) << 16)
        | ((unsigned long long)((sbo & 0x3ffffu) >> 4) << 32) | ((unsigned long long)layout << 62);
}
"#;

const MBARRIER_HELPERS: &str = r#"// The 32-bit shared-memory address of a generic pointer into shared memory.
static __device__ __forceinline__ unsigned int bbc_shared_address(const void* p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}
// Spin until the mbarrier's phase of this parity has completed.
static __device__ __forceinline__ void bbc_mbarrier_wait(const void* barrier, int parity) {
    unsigned int done = 0;
    while (!done) {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bbc_shared_address(barrier)), "r"(parity) : "memory");
    }
}
"#;

const TENSOR_MAP_TYPE: &str = r#"// A CUtensorMap as the driver encodes it (cuTensorMapEncodeTiled), passed by value.
struct __align__(64) bbc_tensor_map { unsigned long long opaque[16]; };
"#;

const TCGEN05_HELPERS: &str = r#"// A tcgen05 shared-memory descriptor: start address, leading (K) and stride (M/N) byte
// offsets, each encoded as (x & 0x3ffff) >> 4, the fixed 0b001 at bits 46-48, and the layout at
// bits 61-63 (0: no swizzle, 2: the 128-byte swizzle, from the address bits: 1 KiB aligned).
static __device__ __forceinline__ unsigned long long bbc_tcgen05_desc(const void* start, unsigned int lbo, unsigned int sbo, unsigned int layout) {
    const unsigned long long address = bbc_shared_address(start);
    return ((address & 0x3ffffull) >> 4) | ((unsigned long long)((lbo & 0x3ffffu) >> 4) << 16)
        | ((unsigned long long)((sbo & 0x3ffffu) >> 4) << 32) | (1ull << 46) | ((unsigned long long)layout << 61);
}
"#;

/// The architecture a kernel needs beyond what every target has: `wgmma` exists on sm_90a
/// only, `tcgen05` on sm_100a only (consumer Blackwell, sm_120a, has neither).
pub fn required_arch(kernel: &Kernel) -> Option<&'static str> {
    if any_stmt(&kernel.body, &|s| matches!(s, Stmt::Wgmma(_))) {
        Some("sm_90a")
    } else if any_stmt(&kernel.body, &|s| matches!(s, Stmt::Tcgen05(_))) {
        Some("sm_100a")
    } else {
        None
    }
}

/// The `tcgen05.mma` instruction descriptor for `element` A (K-major) and B (`b_major`), f32
/// D, M = 128: D type at bits 4-5, A and B types at 7-9 and 10-12 (kind::f16's: 0 f16, 1
/// bf16), B transposed (MN-major) at bit 16, N >> 3 at 17-22, M >> 4 at 24-28.
pub fn tcgen05_instruction_descriptor(n: u32, b_major: Major, element: MmaElement) -> u32 {
    const F32: u32 = 1;
    let operands = match element {
        MmaElement::F16 => 0,
        MmaElement::Bf16 => 1,
    };
    let transpose_b = u32::from(b_major == Major::MN);
    (F32 << 4) | (operands << 7) | (operands << 10) | (transpose_b << 16) | ((n >> 3) << 17) | ((128 >> 4) << 24)
}

/// The first statements of every kernel, for programmatic dependent launch (sm_90 and newer;
/// every GPU target is): the runtime may launch a kernel while the one before it in the stream
/// still runs, so that its launch and the fill of the SMs overlap that kernel's tail. Before
/// touching memory each thread waits for the kernels before it to finish and their writes to
/// show (`griddepcontrol.wait`, which returns at once for a kernel launched the ordinary
/// way). Then it lets the next kernel launch: every kernel waiting first, the GPU holds at most
/// one kernel waiting behind the one running, and a kernel that finished has all before it
/// finished too.
const AWAIT_PRIOR_KERNEL: &str = r#"    // Launched behind the kernel before it: wait for that one to finish, then let the next launch.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
"#;

/// Whether `source` (a kernel as [`emit`] writes it) waits for the kernel before it, so that
/// the runtime may launch it before that one has finished.
pub fn awaits_prior_kernel(source: &str) -> bool {
    source.contains(AWAIT_PRIOR_KERNEL)
}

pub fn emit(kernel: &Kernel) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "// bbc kernel `{}`", kernel.name);
    let _ = writeln!(out, "// from: {}", kernel.origin);
    let _ = writeln!(
        out,
        "// block: {} threads; grid: {} blocks",
        kernel.block_dim,
        expr(&kernel.grid, &Scope::of(kernel))
    );
    let _ = writeln!(
        out,
        "// Generated by kernels-gen from the DSL; edit the template, not this file.\n"
    );
    if uses_bf16(kernel) {
        let _ = writeln!(out, "{BF16_HELPERS}");
    }
    if uses_op(&kernel.body, UnOp::HalfToFloat) || has_buffer_of(kernel, Ty::F16) {
        let _ = writeln!(out, "{F16_HELPER}");
    }
    if stores_to(kernel, Ty::F16) {
        let _ = writeln!(out, "{F16_STORE_HELPER}");
    }
    if packs(kernel, MmaElement::F16) {
        let _ = writeln!(out, "{F16_PACK_HELPER}");
    }
    let reads_codes = any_stmt(&kernel.body, &|s| matches!(s, Stmt::LoadVec { fp8_codes: true, .. }));
    if has_buffer_of(kernel, Ty::F8E4M3) || uses_op(&kernel.body, UnOp::Fp8ToFloat) || reads_codes {
        let _ = writeln!(out, "{FP8_HELPERS}");
    }
    if stores_to(kernel, Ty::F8E4M3) {
        let _ = writeln!(out, "{FP8_STORE_HELPER}");
    }
    if uses_op(&kernel.body, UnOp::OrderedBits) {
        let _ = writeln!(out, "{ORDERED_BITS_HELPER}");
    }
    if uses_op(&kernel.body, UnOp::Iq4Value) {
        let what = "The IQ4 formats' table (ggml's kvalues_iq4nl)";
        let _ = writeln!(out, "{}", table_helper("iq4_value", what, &IQ4_VALUES));
    }
    if uses_op(&kernel.body, UnOp::Mxfp4Value) {
        let what = "MXFP4's doubled E2M1 values (ggml's kvalues_mxfp4)";
        let _ = writeln!(out, "{}", table_helper("mxfp4_value", what, &MXFP4_VALUES));
    }
    let copies_async = any_stmt(&kernel.body, &|s| matches!(s, Stmt::CpAsync(_)));
    if copies_async {
        let _ = writeln!(out, "{ASYNC_HELPERS}");
    }
    let uses_wgmma = required_arch(kernel) == Some("sm_90a");
    if uses_wgmma {
        let _ = writeln!(out, "{WGMMA_HELPERS}");
    }
    let uses_tcgen05 = required_arch(kernel) == Some("sm_100a");
    let uses_barriers = any_stmt(&kernel.body, &|s| {
        matches!(s, Stmt::Mbarrier(_) | Stmt::TmaLoad(_) | Stmt::Tcgen05(_))
    });
    if uses_barriers {
        let _ = writeln!(out, "{MBARRIER_HELPERS}");
    }
    if uses_tcgen05 {
        let _ = writeln!(out, "{TCGEN05_HELPERS}");
    }
    if kernel.tensor_maps().next().is_some() {
        let _ = writeln!(out, "{TENSOR_MAP_TYPE}");
    }
    let layout = kernel.shared_layout();
    if layout.dynamic {
        let _ = writeln!(
            out,
            "// Shared memory asked for at launch ({} bytes), its base aligned to {} in the kernel.\nextern __shared__ unsigned char bbc_dynamic_shared[];\n",
            layout.bytes, layout.alignment
        );
    }
    let params: Vec<String> = kernel
        .params
        .iter()
        .map(|p| match p {
            Param::Buffer {
                name,
                ty,
                writable: false,
            } => format!("const {ty}* __restrict__ {name}"),
            Param::Buffer {
                name,
                ty,
                writable: true,
            } => format!("{ty}* __restrict__ {name}"),
            Param::Scalar { name, ty } => format!("{ty} {name}"),
            Param::TensorMap(map) => format!("const __grid_constant__ bbc_tensor_map {}", map.name),
        })
        .collect();
    let _ = writeln!(
        out,
        "extern \"C\" __global__ void {} {}(\n    {}\n) {{",
        launch_bounds(kernel.block_dim, moves_registers(kernel).then_some(1)),
        kernel.name,
        params.join(",\n    ")
    );
    // cp.async destinations, wgmma/tcgen05 operands, mbarriers and vector accesses need
    // aligned shared memory.
    let shared_vectors = any_stmt(&kernel.body, &|s| match s {
        Stmt::LoadVec { buf, .. } | Stmt::StoreVec { buf, .. } => kernel.shared.iter().any(|a| a.name == *buf),
        Stmt::LoadMatrix(_) => true,
        _ => false,
    });
    let align = if copies_async || uses_wgmma || uses_tcgen05 || shared_vectors {
        "__align__(16) "
    } else {
        ""
    };
    if !layout.dynamic {
        for a in &kernel.shared {
            let _ = writeln!(out, "    __shared__ {align}{} {}[{}];", a.ty, a.name, a.len);
        }
    }
    out.push_str(AWAIT_PRIOR_KERNEL);
    if layout.dynamic {
        // Aligned by an offset from the shared array itself (not through an integer cast),
        // so the compiler still knows the arrays' state space and reads them with LDS.
        let _ = writeln!(
            out,
            "    unsigned char* const bbc_shared_base = bbc_dynamic_shared + ((0u - (unsigned int)__cvta_generic_to_shared(bbc_dynamic_shared)) & {}u);",
            layout.alignment - 1
        );
        for (a, offset) in kernel.shared.iter().zip(&layout.offsets) {
            let _ = writeln!(
                out,
                "    {ty}* const {name} = ({ty}*)(bbc_shared_base + {offset}); // {len} elements",
                ty = a.ty,
                name = a.name,
                len = a.len
            );
        }
    }
    let mut scope = Scope::of(kernel);
    // NVRTC reads a `const __restrict__` buffer through the read-only data path by itself,
    // but not once the pointer is also handed to inline assembly (a prefetch): those buffers'
    // vector loads name the path (`__ldg`).
    for p in &kernel.params {
        if let Param::Buffer { name, .. } = p {
            if any_stmt(
                &kernel.body,
                &|s| matches!(s, Stmt::PrefetchL2 { buf, .. } if buf == name),
            ) {
                scope.ldg.insert(name.clone());
            }
        }
    }
    block(&mut out, &kernel.body, &mut scope, 1);
    out.push_str("}\n");
    out
}

/// Whether the kernel moves registers between warpgroups (`setmaxnreg`): it is then built for
/// one block a multiprocessor, so each thread starts with the registers the emulator counts
/// (`emulator` checks the warpgroups' claims against them), and no build asks for more blocks.
pub fn moves_registers(kernel: &Kernel) -> bool {
    any_stmt(&kernel.body, &|s| matches!(s, Stmt::SetMaxRegisters { .. }))
}

/// The kernel's `__launch_bounds__`: its block size, and optionally the blocks ptxas must fit
/// on one multiprocessor (which bounds the registers it may give a thread).
pub fn launch_bounds(block: u32, min_blocks_per_sm: Option<u32>) -> String {
    match min_blocks_per_sm {
        None => format!("__launch_bounds__({block})"),
        Some(n) => format!("__launch_bounds__({block}, {n})"),
    }
}

/// `source` as [`emit`] wrote it for blocks of `block` threads, asking ptxas to fit
/// `min_blocks_per_sm` blocks on a multiprocessor; `None` where the source does not carry
/// [`emit`]'s launch bounds exactly once.
pub fn with_min_blocks_per_sm(source: &str, block: u32, min_blocks_per_sm: u32) -> Option<String> {
    let plain = launch_bounds(block, None);
    (source.matches(&plain).count() == 1)
        .then(|| source.replacen(&plain, &launch_bounds(block, Some(min_blocks_per_sm)), 1))
}

/// The launch grid (blocks) as C, in terms of the kernel's scalar parameters.
pub fn grid_expr(kernel: &Kernel) -> String {
    expr(&kernel.grid, &Scope::of(kernel))
}

fn uses_op(body: &[Stmt], op: UnOp) -> bool {
    fn in_expr(e: &Expr, op: UnOp) -> bool {
        match e {
            Expr::Un(o, a) => *o == op || in_expr(a, op),
            Expr::Bin(_, a, b) => in_expr(a, op) || in_expr(b, op),
            Expr::Load { index, .. } => in_expr(index, op),
            Expr::LoadRow { row, width, col, .. } => [row, width, col].iter().any(|e| in_expr(e, op)),
            Expr::Cast(_, a) | Expr::ShflXor(a, _) => in_expr(a, op),
            Expr::Select(c, a, b) => in_expr(c, op) || in_expr(a, op) || in_expr(b, op),
            _ => false,
        }
    }
    // The statement's own expressions; `any_stmt` walks into loop bodies and branches.
    any_stmt(body, &|s| match s {
        Stmt::Let { value, .. } | Stmt::Assign { value, .. } => in_expr(value, op),
        Stmt::Store { index, value, .. } => in_expr(index, op) || in_expr(value, op),
        Stmt::StoreVec { index, values, .. } => in_expr(index, op) || values.iter().any(|v| in_expr(v, op)),
        Stmt::For { start, end, step, .. } => [start, end, step].iter().any(|e| in_expr(e, op)),
        Stmt::If { cond, .. } => in_expr(cond, op),
        Stmt::Roles(r) => r.roles.iter().any(|role| in_expr(&role.cond, op)),
        _ => false,
    })
}

fn has_buffer_of(kernel: &Kernel, element: Ty) -> bool {
    kernel
        .params
        .iter()
        .any(|p| matches!(p, Param::Buffer { ty, .. } if *ty == element))
}

/// Whether the kernel writes an array of `element`s (a half or FP8 KV cache, a shared tile).
fn stores_to(kernel: &Kernel, element: Ty) -> bool {
    let buffers: Vec<&str> = kernel
        .params
        .iter()
        .filter_map(|p| match p {
            Param::Buffer { name, ty, .. } if *ty == element => Some(name.as_str()),
            _ => None,
        })
        .chain(
            kernel
                .shared
                .iter()
                .filter(|a| a.ty == element)
                .map(|a| a.name.as_str()),
        )
        .collect();
    any_stmt(
        &kernel.body,
        &|s| matches!(s, Stmt::Store { buf, .. } | Stmt::StoreVec { buf, .. } if buffers.contains(&buf.as_str())),
    )
}

fn uses_bf16(kernel: &Kernel) -> bool {
    has_buffer_of(kernel, Ty::Bf16) || kernel.shared.iter().any(|a| a.ty == Ty::Bf16) || packs(kernel, MmaElement::Bf16)
}

/// Whether the kernel packs f32 operands into pairs of `element`s: an `mma.sync` or `wgmma`
/// of them.
fn packs(kernel: &Kernel, element: MmaElement) -> bool {
    let scope = Scope::of(kernel);
    any_stmt(&kernel.body, &|s| match s {
        Stmt::Mma(m) => m.element == element,
        Stmt::Wgmma(w) => mma_element(&w.b, &scope) == element,
        _ => false,
    })
}

/// The element type of a tensor-core operand in shared memory (type-checked: bf16 or f16).
fn mma_element(m: &SmemMatrix, scope: &Scope) -> MmaElement {
    MmaElement::of(scope.arrays[&m.array].0).expect("type-checked")
}

fn indent(out: &mut String, depth: usize) {
    for _ in 0..depth {
        out.push_str("    ");
    }
}

fn block(out: &mut String, body: &[Stmt], scope: &mut Scope, depth: usize) {
    for s in body {
        indent(out, depth);
        match s {
            Stmt::Let { name, ty, value } => {
                let _ = writeln!(out, "{} {name} = {};", ty.compute(), expr(value, scope));
                scope.vars.insert(name.clone(), *ty);
            }
            Stmt::Assign { name, value } => {
                let _ = writeln!(out, "{name} = {};", expr(value, scope));
            }
            Stmt::Store { buf, index, value } => {
                let ty = scope.arrays[buf].0;
                let v = expr(value, scope);
                let v = match ty {
                    Ty::Bf16 => format!("bbc_f32_to_bf16({v})"),
                    Ty::F16 => format!("bbc_f32_to_f16({v})"),
                    Ty::F8E4M3 => format!("bbc_f32_to_fp8({v})"),
                    Ty::I8 | Ty::U8 => format!("({ty})({v})"),
                    _ => v,
                };
                let _ = writeln!(out, "{buf}[{}] = {v};", expr(index, scope));
            }
            Stmt::For {
                var,
                start,
                end,
                step,
                body,
            } => {
                let _ = writeln!(
                    out,
                    "for (int {var} = {}; {var} < {}; {var} += {}) {{",
                    expr(start, scope),
                    expr(end, scope),
                    expr(step, scope)
                );
                let mut inner = scope.clone();
                inner.vars.insert(var.clone(), Ty::I32);
                block(out, body, &mut inner, depth + 1);
                indent(out, depth);
                out.push_str("}\n");
            }
            Stmt::Roles(r) => {
                for (i, role) in r.roles.iter().enumerate() {
                    if i > 0 {
                        indent(out, depth);
                    }
                    // A role takes whole warps, so its condition is the same across a warp:
                    // broadcast from lane 0, the compiler knows it too, and `wgmma`s inside are
                    // not serialised as if in a divergent branch.
                    let _ = writeln!(
                        out,
                        "if (__shfl_sync(0xffffffffu, (int)({}), 0)) {{",
                        expr(&role.cond, scope)
                    );
                    block(out, &role.body, &mut scope.clone(), depth + 1);
                    indent(out, depth);
                    out.push_str("}\n");
                }
            }
            Stmt::If { cond, then, otherwise } => {
                let _ = writeln!(out, "if ({}) {{", expr(cond, scope));
                block(out, then, &mut scope.clone(), depth + 1);
                if !otherwise.is_empty() {
                    indent(out, depth);
                    out.push_str("} else {\n");
                    block(out, otherwise, &mut scope.clone(), depth + 1);
                }
                indent(out, depth);
                out.push_str("}\n");
            }
            Stmt::SyncThreads => out.push_str("__syncthreads();\n"),
            Stmt::Mma(m) => {
                let (a, b, c) = (mma_registers(&m.a, m.element), mma_registers(&m.b, m.element), &m.c);
                let _ = writeln!(
                    out,
                    "asm volatile(\"mma.sync.aligned.m16n8k16.row.col.f32.{e}.{e}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};\" : \"+f\"({}), \"+f\"({}), \"+f\"({}), \"+f\"({}) : \"r\"({}), \"r\"({}), \"r\"({}), \"r\"({}), \"r\"({}), \"r\"({}));",
                    c[0],
                    c[1],
                    c[2],
                    c[3],
                    a[0],
                    a[1],
                    a[2],
                    a[3],
                    b[0],
                    b[1],
                    e = m.element.ptx(),
                );
            }
            Stmt::LoadMatrix(m) => {
                let outputs: Vec<String> = (0..m.names.len()).map(|i| format!("%{i}")).collect();
                let written: Vec<String> = m.names.iter().map(|n| format!("\"=r\"({n})")).collect();
                let _ = writeln!(out, "unsigned int {};", m.names.join(", "));
                indent(out, depth);
                let _ = writeln!(
                    out,
                    "asm volatile(\"ldmatrix.sync.aligned.m8n8.x{}{}.shared.b16 {{{}}}, [%{}];\" : {} : \"r\"((unsigned int)__cvta_generic_to_shared(&{}[{}])));",
                    m.names.len(),
                    if m.transpose { ".trans" } else { "" },
                    outputs.join(", "),
                    m.names.len(),
                    written.join(", "),
                    m.buf,
                    expr(&m.row, scope),
                );
                for name in &m.names {
                    scope.vars.insert(name.clone(), Ty::U32);
                }
            }
            Stmt::LoadVec {
                buf,
                index,
                names,
                fp8_codes,
            } => {
                let ty = match fp8_codes {
                    true => Ty::F8E4M3,
                    false => scope.arrays[buf.as_str()].0,
                };
                vector_load(out, (buf, ty), &expr(index, scope), names, scope, depth)
            }
            Stmt::StoreVec { buf, index, values } => {
                let values: Vec<String> = values.iter().map(|v| expr(v, scope)).collect();
                vector_store(out, buf, &expr(index, scope), &values, scope);
            }
            Stmt::CpAsync(c) => {
                let (dst, src) = (&c.dst, &c.src);
                let (dst_index, src_index) = (expr(&c.dst_index, scope), expr(&c.src_index, scope));
                // An invalid copy reads nothing: it is handed the buffer's start.
                let _ = match &c.valid {
                    Expr::Bool(true) => writeln!(
                        out,
                        "bbc_cp_async_16(&{dst}[{dst_index}], {src} + ({src_index}), true);"
                    ),
                    valid => {
                        let valid = expr(valid, scope);
                        writeln!(
                            out,
                            "bbc_cp_async_16(&{dst}[{dst_index}], ({valid}) ? (const void*)({src} + ({src_index})) : (const void*){src}, {valid});"
                        )
                    }
                };
            }
            Stmt::PrefetchL2 { buf, index } => {
                let _ = writeln!(
                    out,
                    "asm volatile(\"prefetch.global.L2 [%0];\\n\" :: \"l\"({buf} + ({})));",
                    expr(index, scope)
                );
            }
            Stmt::CpAsyncCommit => out.push_str("asm volatile(\"cp.async.commit_group;\\n\" ::: \"memory\");\n"),
            Stmt::CpAsyncWait(n) => {
                let _ = writeln!(out, "asm volatile(\"cp.async.wait_group {n};\\n\" ::: \"memory\");");
            }
            Stmt::FenceProxyAsync => {
                out.push_str("asm volatile(\"fence.proxy.async.shared::cta;\\n\" ::: \"memory\");\n")
            }
            Stmt::WgmmaFence => out.push_str("asm volatile(\"wgmma.fence.sync.aligned;\\n\" ::: \"memory\");\n"),
            Stmt::WgmmaCommit => {
                out.push_str("asm volatile(\"wgmma.commit_group.sync.aligned;\\n\" ::: \"memory\");\n")
            }
            Stmt::WgmmaWait(n) => {
                let _ = writeln!(
                    out,
                    "asm volatile(\"wgmma.wait_group.sync.aligned {n};\\n\" ::: \"memory\");"
                );
            }
            Stmt::SetMaxRegisters { change, count } => {
                let action = match change {
                    RegisterChange::Release => "dec",
                    RegisterChange::Claim => "inc",
                };
                let _ = writeln!(
                    out,
                    "asm volatile(\"setmaxnreg.{action}.sync.aligned.u32 {count};\\n\" ::: \"memory\");"
                );
            }
            Stmt::Wgmma(w) => wgmma(out, w, scope, depth),
            Stmt::Tcgen05(op) => tcgen05(out, op, scope, depth),
            Stmt::Mbarrier(op) => mbarrier(out, op, scope, depth),
            Stmt::TmaLoad(tma) => {
                let _ = writeln!(
                    out,
                    "asm volatile(\"cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {{%2, %3}}], [%4];\\n\"\n\
                     {pad}    :: \"r\"(bbc_shared_address(&{}[{}])), \"l\"(&{}), \"r\"({}), \"r\"({}), \"r\"({}) : \"memory\");",
                    tma.dst,
                    expr(&tma.dst_index, scope),
                    tma.map,
                    expr(&tma.col, scope),
                    expr(&tma.row, scope),
                    barrier_address(&tma.barrier, scope),
                    pad = "    ".repeat(depth)
                );
            }
            Stmt::Comment(c) => {
                let _ = writeln!(out, "// {c}");
            }
        }
    }
}

/// One `wgmma.mma_async` of B's element type, A from registers (packed to pairs of it) or
/// through a descriptor, B through a descriptor; the accumulators are read-write operands.
/// scale-d is 1 (accumulate), so is the scale of A and B; A from shared memory is K-major, B
/// as `b_major` says.
fn wgmma(out: &mut String, w: &WgmmaOp, scope: &Scope, depth: usize) {
    let accumulators = w.d.len();
    let registers = |from: usize, count: usize| (from..from + count).map(|i| format!("%{i}")).collect::<Vec<_>>();
    let pad = "    ".repeat(depth);
    let d_list = registers(0, accumulators)
        .chunks(8)
        .map(|c| c.join(", "))
        .collect::<Vec<_>>()
        .join(&format!(",\\n\"\n{pad}    \""));
    let trans_b = match w.b_major {
        Major::K => 0,
        Major::MN => 1,
    };
    let element = mma_element(&w.b, scope).ptx();
    let (a_operand, a_inputs, a_count, transposes) = match &w.a {
        WgmmaA::Registers(a) => (
            format!("{{{}}}", registers(accumulators, 4).join(", ")),
            a.chunks(2)
                .map(|pair| format!("\"r\"(bbc_pack_{element}x2({}, {})),", pair[0], pair[1]))
                .collect::<Vec<_>>()
                .join(" "),
            4,
            format!("{trans_b}"),
        ),
        WgmmaA::Shared(a) => (
            format!("%{accumulators}"),
            format!("\"l\"({}),", descriptor(a, scope)),
            1,
            format!("0, {trans_b}"),
        ),
    };
    let (desc, one) = (accumulators + a_count, accumulators + a_count + 1);
    let _ = writeln!(
        out,
        "asm volatile(\"{{\\n.reg .pred scale_d;\\nsetp.ne.b32 scale_d, %{one}, 0;\\n\""
    );
    let _ = writeln!(
        out,
        "{pad}    \"wgmma.mma_async.sync.aligned.m64n{}k16.f32.{element}.{element} {{{d_list}}},\\n\"",
        w.n
    );
    let _ = writeln!(
        out,
        "{pad}    \"{a_operand}, %{desc}, scale_d, 1, 1, {transposes};\\n}}\\n\""
    );
    let d_operands =
        w.d.chunks(8)
            .map(|c| c.iter().map(|d| format!("\"+f\"({d})")).collect::<Vec<_>>().join(", "))
            .collect::<Vec<_>>()
            .join(&format!(",\n{pad}      "));
    let _ = writeln!(out, "{pad}    : {d_operands}");
    let _ = writeln!(out, "{pad}    : {a_inputs}");
    let _ = writeln!(out, "{pad}      \"l\"({}), \"r\"(1));", descriptor(&w.b, scope));
}

/// A wgmma descriptor of a shared operand (see `SmemMatrix`).
fn descriptor(m: &SmemMatrix, scope: &Scope) -> String {
    let layout = match m.swizzle {
        Swizzle::None => 0,
        Swizzle::B128 => 1,
    };
    format!(
        "bbc_wgmma_desc(&{}[{}], {}u, {}u, {layout}u)",
        m.array,
        expr(&m.start, scope),
        m.lbo,
        m.sbo
    )
}

/// The shared-memory address of an mbarrier (see `MbarrierRef`).
fn barrier_address(barrier: &MbarrierRef, scope: &Scope) -> String {
    format!(
        "bbc_shared_address(&{}[2 * ({})])",
        barrier.array,
        expr(&barrier.slot, scope)
    )
}

/// One `Mbarrier` statement as inline PTX.
fn mbarrier(out: &mut String, op: &Mbarrier, scope: &Scope, depth: usize) {
    let pad = "    ".repeat(depth);
    let line = match op {
        Mbarrier::Init { barrier, count } => format!(
            "asm volatile(\"mbarrier.init.shared::cta.b64 [%0], {count};\\n\" :: \"r\"({}) : \"memory\");\n\
             {pad}asm volatile(\"fence.mbarrier_init.release.cluster;\\n\" ::: \"memory\");",
            barrier_address(barrier, scope)
        ),
        Mbarrier::ArriveExpectTx { barrier, bytes } => format!(
            "asm volatile(\"mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], {bytes};\\n\" :: \"r\"({}) : \"memory\");",
            barrier_address(barrier, scope)
        ),
        Mbarrier::Arrive { barrier } => format!(
            "asm volatile(\"mbarrier.arrive.shared::cta.b64 _, [%0];\\n\" :: \"r\"({}) : \"memory\");",
            barrier_address(barrier, scope)
        ),
        Mbarrier::Wait { barrier, parity } => format!(
            "bbc_mbarrier_wait(&{}[2 * ({})], {});",
            barrier.array,
            expr(&barrier.slot, scope),
            expr(parity, scope)
        ),
    };
    let _ = writeln!(out, "{line}");
}

/// One `tcgen05` statement (see `Tcgen05`) as inline PTX.
fn tcgen05(out: &mut String, op: &Tcgen05, scope: &mut Scope, depth: usize) {
    let pad = "    ".repeat(depth);
    let address = |array: &str| format!("bbc_shared_address(&{array}[0])");
    let desc = |m: &SmemMatrix, scope: &Scope| {
        let layout = match m.swizzle {
            Swizzle::None => 0,
            Swizzle::B128 => 2,
        };
        format!(
            "bbc_tcgen05_desc(&{}[{}], {}u, {}u, {layout}u)",
            m.array,
            expr(&m.start, scope),
            m.lbo,
            m.sbo
        )
    };
    let asm = |text: &str| format!("asm volatile(\"{text}\\n\" ::: \"memory\");");
    let line = match op {
        Tcgen05::Alloc { columns, slot } => format!(
            "asm volatile(\"tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], {columns};\\n\" :: \"r\"({}) : \"memory\");\n{pad}{}",
            address(slot),
            asm("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;")
        ),
        Tcgen05::Dealloc { columns, address } => format!(
            "asm volatile(\"tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, {columns};\\n\" :: \"r\"({}) : \"memory\");",
            expr(address, scope)
        ),
        Tcgen05::Mma(mma) => {
            let TmemMma {
                tmem,
                a,
                b,
                b_major,
                n,
                accumulate,
            } = &**mma;
            let element = mma_element(b, scope);
            let name = element.ptx();
            let majors = match b_major {
                Major::K => "both K-major",
                Major::MN => "A K-major, B MN-major",
            };
            format!(
            "asm volatile(\"{{\\n.reg .pred accumulate;\\nsetp.ne.b32 accumulate, %4, 0;\\n\"\n\
             {pad}    \"tcgen05.mma.cta_group::1.kind::f16 [%0], %1, %2, %3, accumulate;\\n}}\\n\"\n\
             {pad}    :: \"r\"({}), \"l\"({}), \"l\"({}),\n\
             {pad}       \"r\"({:#010x}u /* {name} x {name} -> f32, M = 128, N = {n}, {majors} */), \"r\"((int)({}))\n\
             {pad}    : \"memory\");",
            expr(tmem, scope),
            desc(a, scope),
            desc(b, scope),
            tcgen05_instruction_descriptor(*n, *b_major, element),
            expr(accumulate, scope)
        )
        }
        Tcgen05::Commit { barrier } => format!(
            "asm volatile(\"tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];\\n\" :: \"r\"({}) : \"memory\");",
            barrier_address(barrier, scope)
        ),
        Tcgen05::Load { address, names } => {
            let registers = (0..names.len()).map(|i| format!("%{i}")).collect::<Vec<_>>().join(", ");
            let outputs = names.iter().map(|n| format!("\"=f\"({n})")).collect::<Vec<_>>().join(", ");
            let text = format!(
                "float {};\n\
                 {pad}asm volatile(\"tcgen05.ld.sync.aligned.32x32b.x{}.b32 {{{registers}}}, [%{}];\\n\"\n\
                 {pad}    : {outputs} : \"r\"({}) : \"memory\");",
                names.join(", "),
                names.len(),
                names.len(),
                expr(address, scope)
            );
            for name in names {
                scope.vars.insert(name.clone(), Ty::F32);
            }
            text
        }
        Tcgen05::WaitLd => asm("tcgen05.wait::ld.sync.aligned;"),
        Tcgen05::FenceBeforeSync => asm("tcgen05.fence::before_thread_sync;"),
        Tcgen05::FenceAfterSync => asm("tcgen05.fence::after_thread_sync;"),
    };
    let _ = writeln!(out, "{line}");
}

/// An `mma.sync` operand's 32-bit registers: f32 pairs packed to `element`s, or the pairs as
/// held.
fn mma_registers(operand: &MmaOperand, element: MmaElement) -> Vec<String> {
    match operand {
        MmaOperand::F32(names) => names
            .chunks(2)
            .map(|pair| format!("bbc_pack_{}x2({}, {})", element.ptx(), pair[0], pair[1]))
            .collect(),
        MmaOperand::Pairs(names) => names.clone(),
    }
}

/// One aligned 4/8/16-byte load into a CUDA vector, then its lanes as f32 locals (a bf16 is
/// the top half of an f32: the low element shifted up, the high one masked; an IEEE half
/// goes through `bbc_f16_to_f32`; FP8 codes widen two at a time), or bytes as int locals.
/// `ty` is the buffer's element type, or FP8 for bytes read as codes.
fn vector_load(
    out: &mut String,
    (buf, ty): (&str, Ty),
    index: &str,
    names: &[String],
    scope: &mut Scope,
    depth: usize,
) {
    let words = names.len() * ty.bytes() / 4;
    let (vector, parts): (&str, &[&str]) = match (ty, words) {
        (Ty::Bf16 | Ty::F16 | Ty::F8E4M3 | Ty::U8, 1) => ("unsigned int", &[""]),
        (Ty::Bf16 | Ty::F16 | Ty::F8E4M3 | Ty::U8, 2) => ("uint2", &[".x", ".y"]),
        (Ty::Bf16 | Ty::F16 | Ty::F8E4M3 | Ty::U8, _) => ("uint4", &[".x", ".y", ".z", ".w"]),
        (_, 2) => ("float2", &[".x", ".y"]),
        _ => ("float4", &[".x", ".y", ".z", ".w"]),
    };
    let v = format!("{}_vec", names[0]);
    let address = format!("reinterpret_cast<const {vector}*>({buf} + ({index}))");
    let _ = match scope.ldg.contains(buf) {
        true => writeln!(out, "const {vector} {v} = __ldg({address});"),
        false => writeln!(out, "const {vector} {v} = *{address};"),
    };
    for (j, name) in names.iter().enumerate() {
        indent(out, depth);
        let value = match ty {
            Ty::Bf16 if j % 2 == 0 => format!("__uint_as_float({v}{} << 16)", parts[j / 2]),
            Ty::Bf16 => format!("__uint_as_float({v}{} & 0xffff0000u)", parts[j / 2]),
            Ty::F16 if j % 2 == 0 => format!("bbc_f16_to_f32({v}{} & 0xffffu)", parts[j / 2]),
            Ty::F16 => format!("bbc_f16_to_f32({v}{} >> 16)", parts[j / 2]),
            Ty::F8E4M3 if j % 2 == 0 => {
                // Codes j and j + 1: the low or high half of word j / 4.
                let codes = match j / 2 % 2 {
                    0 => format!("{v}{}", parts[j / 4]),
                    _ => format!("{v}{} >> 16", parts[j / 4]),
                };
                let _ = writeln!(out, "const float2 {v}_{j} = bbc_fp8x2_to_f32x2({codes});");
                indent(out, depth);
                format!("{v}_{j}.x")
            }
            Ty::F8E4M3 => format!("{v}_{}.y", j - 1),
            Ty::U8 => {
                // Byte j: bits 8·(j mod 4) of word j / 4.
                let _ = writeln!(
                    out,
                    "int {name} = (int)(({v}{} >> {}) & 0xffu);",
                    parts[j / 4],
                    8 * (j % 4)
                );
                scope.vars.insert(name.clone(), Ty::I32);
                continue;
            }
            _ => format!("{v}{}", parts[j]),
        };
        let _ = writeln!(out, "float {name} = {value};");
        scope.vars.insert(name.clone(), Ty::F32);
    }
}

/// `buf[index + j] = values[j]` as one vector store (see `Stmt::StoreVec`): halves packed two
/// a 32-bit word and FP8 codes four, the lowest-indexed in the low bits.
fn vector_store(out: &mut String, buf: &str, index: &str, values: &[String], scope: &Scope) {
    let ty = scope.arrays[buf].0;
    let words: Vec<String> = match ty {
        Ty::Bf16 => values
            .chunks(2)
            .map(|pair| format!("bbc_pack_bf16x2({}, {})", pair[0], pair[1]))
            .collect(),
        Ty::F16 => values
            .chunks(2)
            .map(|pair| {
                format!(
                    "((unsigned int)bbc_f32_to_f16({}) | ((unsigned int)bbc_f32_to_f16({}) << 16))",
                    pair[0], pair[1]
                )
            })
            .collect(),
        Ty::F8E4M3 => values
            .chunks(4)
            .map(|four| {
                let codes: Vec<String> = four
                    .iter()
                    .enumerate()
                    .map(|(k, x)| format!("((unsigned int)bbc_f32_to_fp8({x}) << {})", 8 * k))
                    .collect();
                format!("({})", codes.join(" | "))
            })
            .collect(),
        _ => values.to_vec(),
    };
    let (vector, make) = match (ty, words.len()) {
        (Ty::Bf16 | Ty::F16 | Ty::F8E4M3, 1) => ("unsigned int", ""),
        (Ty::Bf16 | Ty::F16 | Ty::F8E4M3, 2) => ("uint2", "make_uint2"),
        (Ty::Bf16 | Ty::F16 | Ty::F8E4M3, _) => ("uint4", "make_uint4"),
        (_, 2) => ("float2", "make_float2"),
        _ => ("float4", "make_float4"),
    };
    let _ = writeln!(
        out,
        "*reinterpret_cast<{vector}*>({buf} + ({index})) = {make}({});",
        words.join(", ")
    );
}

fn float_literal(v: f32) -> String {
    if v.is_infinite() {
        return if v > 0.0 {
            "__int_as_float(0x7f800000)".into()
        } else {
            "__int_as_float(0xff800000)".into()
        };
    }
    let s = format!("{v:?}");
    let s = if s.contains('.') || s.contains('e') {
        s
    } else {
        format!("{s}.0")
    };
    format!("{s}f")
}

/// `buf[i]` widened to its compute type.
fn load_expr(buf: &str, i: &str, scope: &Scope) -> String {
    match scope.arrays.get(buf).map(|a| a.0) {
        Some(Ty::Bf16) => format!("bbc_bf16_to_f32({buf}[{i}])"),
        Some(Ty::F16) => format!("bbc_f16_to_f32({buf}[{i}])"),
        Some(Ty::F8E4M3) => format!("bbc_fp8_to_f32({buf}[{i}])"),
        Some(Ty::I8 | Ty::U8) => format!("(int){buf}[{i}]"),
        _ => format!("{buf}[{i}]"),
    }
}

fn expr(e: &Expr, scope: &Scope) -> String {
    match e {
        Expr::F32(v) => float_literal(*v),
        Expr::Int(v) => format!("{v}"),
        Expr::Bool(b) => format!("{b}"),
        Expr::Builtin(Builtin::ThreadIdx) => "(int)threadIdx.x".into(),
        Expr::Builtin(Builtin::BlockIdx) => "(int)blockIdx.x".into(),
        Expr::Builtin(Builtin::BlockDim) => "(int)blockDim.x".into(),
        Expr::Builtin(Builtin::Lane) => "((int)threadIdx.x & 31)".into(),
        Expr::Builtin(Builtin::Warp) => "((int)threadIdx.x >> 5)".into(),
        Expr::Var(n) => n.clone(),
        Expr::Load { buf, index } => load_expr(buf, &expr(index, scope), scope),
        Expr::LoadRow { buf, row, width, col } => {
            let i = format!(
                "(long long)({}) * ({}) + ({})",
                expr(row, scope),
                expr(width, scope),
                expr(col, scope)
            );
            load_expr(buf, &i, scope)
        }
        Expr::Bin(op, a, b) => {
            let float = scope.type_of(a).map(|t| t == Ty::F32).unwrap_or(false);
            let (x, y) = (expr(a, scope), expr(b, scope));
            match op {
                BinOp::Min if float => format!("fminf({x}, {y})"),
                BinOp::Max if float => format!("fmaxf({x}, {y})"),
                BinOp::Min => format!("min({x}, {y})"),
                BinOp::Max => format!("max({x}, {y})"),
                op => {
                    let sym = match op {
                        BinOp::Add => "+",
                        BinOp::Sub => "-",
                        BinOp::Mul => "*",
                        BinOp::Div => "/",
                        BinOp::Rem => "%",
                        BinOp::Lt => "<",
                        BinOp::Le => "<=",
                        BinOp::Gt => ">",
                        BinOp::Ge => ">=",
                        BinOp::Eq => "==",
                        BinOp::Ne => "!=",
                        BinOp::And => "&&",
                        BinOp::Or => "||",
                        BinOp::Shl => "<<",
                        BinOp::Shr => ">>",
                        BinOp::BitAnd => "&",
                        BinOp::BitXor => "^",
                        BinOp::Min | BinOp::Max => unreachable!("handled above"),
                    };
                    format!("({x} {sym} {y})")
                }
            }
        }
        Expr::Un(op, a) => {
            let x = expr(a, scope);
            match op {
                UnOp::Neg => format!("(-{x})"),
                UnOp::Not => format!("(!{x})"),
                UnOp::Exp => format!("expf({x})"),
                UnOp::Log1p => format!("log1pf({x})"),
                UnOp::Tanh => format!("tanhf({x})"),
                UnOp::Sqrt => format!("sqrtf({x})"),
                UnOp::Rsqrt => format!("rsqrtf({x})"),
                UnOp::Cos => format!("cosf({x})"),
                UnOp::Sin => format!("sinf({x})"),
                UnOp::HalfToFloat => format!("bbc_f16_to_f32((unsigned int)({x}))"),
                UnOp::OrderedBits => format!("bbc_ordered_bits({x})"),
                UnOp::Iq4Value => format!("bbc_iq4_value((unsigned int)({x}))"),
                UnOp::Mxfp4Value => format!("bbc_mxfp4_value((unsigned int)({x}))"),
                UnOp::Fp8ToFloat => format!("bbc_fp8_to_f32((unsigned int)({x}))"),
                UnOp::BitsToFloat => format!("__uint_as_float((unsigned int)({x}))"),
                UnOp::Abs if scope.type_of(a) == Ok(Ty::F32) => format!("fabsf({x})"),
                UnOp::Abs => format!("abs({x})"),
            }
        }
        Expr::Cast(ty, a) => format!("(({})({}))", ty.compute(), expr(a, scope)),
        Expr::Select(c, a, b) => format!("({} ? {} : {})", expr(c, scope), expr(a, scope), expr(b, scope)),
        Expr::ShflXor(a, m) => format!("__shfl_xor_sync(0xffffffffu, {}, {m})", expr(a, scope)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 4-bit table helpers' words give back every value: `bbc_*_value`'s selects and
    /// shift, restated, at every index of both tables.
    #[test]
    fn table_helpers_hold_their_tables() {
        for values in [IQ4_VALUES, MXFP4_VALUES] {
            let [w0, w1, w2, w3] = table_words(&values);
            for i in 0..16u32 {
                let (low, high) = if i & 4 != 0 { (w1, w3) } else { (w0, w2) };
                let word = if i & 8 != 0 { high } else { low };
                assert_eq!(
                    ((word >> ((i & 3) * 8)) & 0xff) as i32 - 128,
                    i32::from(values[i as usize])
                );
            }
        }
        let helper = table_helper("mxfp4_value", "MXFP4", &MXFP4_VALUES);
        assert!(helper.contains("int bbc_mxfp4_value(unsigned int i)"), "{helper}");
    }

    /// The runtime launches a kernel before the one it follows has finished only where it
    /// waits for it: every kernel does, before any statement of its own.
    #[test]
    fn every_kernel_waits_for_the_prior_kernel_before_its_first_statement() {
        for kernel in crate::templates::catalog() {
            let source = emit(&kernel);
            assert!(awaits_prior_kernel(&source), "{}", kernel.name);
            let kernel_at = source.find("__global__").unwrap();
            let body = &source[kernel_at + source[kernel_at..].find(") {\n").unwrap() + 4..];
            let before_wait = &body[..body.find(AWAIT_PRIOR_KERNEL).unwrap()];
            assert!(
                before_wait.lines().all(|l| l.trim_start().starts_with("__shared__")),
                "{}: {before_wait}",
                kernel.name
            );
        }
        assert!(!awaits_prior_kernel("extern \"C\" __global__ void k() {}"));
    }

    /// The `tcgen05.mma` instruction descriptor's fields where the PTX ISA puts them (kind::f16):
    /// f32 D at bit 4, bf16 A and B at 7 and 10 (f16's 0), B transposed (MN-major) at 16, N / 8
    /// from bit 17 and M / 16 from 24.
    #[test]
    fn the_tcgen05_instruction_descriptor_has_the_ptx_fields() {
        let common = (1 << 4) | ((128 / 16) << 24);
        let bf16 = (1 << 7) | (1 << 10);
        assert_eq!(
            tcgen05_instruction_descriptor(64, Major::K, MmaElement::Bf16),
            common | bf16 | ((64 / 8) << 17)
        );
        assert_eq!(
            tcgen05_instruction_descriptor(128, Major::MN, MmaElement::Bf16),
            common | bf16 | (1 << 16) | ((128 / 8) << 17)
        );
        assert_eq!(
            tcgen05_instruction_descriptor(128, Major::MN, MmaElement::F16),
            common | (1 << 16) | ((128 / 8) << 17)
        );
    }

    #[test]
    fn a_minimum_of_blocks_goes_into_the_emitted_launch_bounds() {
        let kernel = crate::templates::glu::glu("swiglu", "test", ir::GluAct::Silu);
        let (source, block) = (emit(&kernel), kernel.block_dim);
        assert_eq!(block, 256);
        assert!(source.contains("void __launch_bounds__(256) swiglu("), "{source}");
        let hinted = with_min_blocks_per_sm(&source, block, 6).unwrap();
        assert!(hinted.contains("void __launch_bounds__(256, 6) swiglu("), "{hinted}");
        assert_eq!(hinted.replace("(256, 6)", "(256)"), source);
        // Not the emitter's launch bounds (another block size, or already hinted): no guess.
        assert_eq!(with_min_blocks_per_sm(&source, 128, 6), None);
        assert_eq!(with_min_blocks_per_sm(&hinted, block, 4), None);
    }
}
