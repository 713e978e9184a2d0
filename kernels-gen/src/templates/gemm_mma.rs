//! Prefill GEMM on tensor cores: `out[t, r] = Σ_k x[t, k]·W[r, k]` with bf16 weights, one warp
//! per 16×8 output tile, K in steps of 16 through `mma.sync.m16n8k16` (activations rounded to
//! bf16, f32 accumulation). Fragments load straight from global memory in the PTX register
//! layout, zero-filled past the edges, so any shape works.
//!
//! Per target: `mma.sync` is the warp-level tensor-core instruction sm_90a, sm_100a and sm_120a
//! all run, so this template serves all three. Hopper's `wgmma` (sm_90a) and Blackwell's
//! `tcgen05` (sm_100a) are faster on large tiles but need shared-memory operand descriptors and
//! asynchronous pipelines the DSL does not model yet; decode is a memory-bound GEMV on every
//! target and gains nothing from them.

use super::blocks_for;
use crate::dsl::*;

const WARPS: i64 = 4;

/// `let name = 0; if cond { name = value }`: loads past the edge never happen.
fn guarded(name: &str, cond: Expr, value: Expr) -> Vec<Stmt> {
    vec![let_(name, Ty::F32, f(0.0)), if_(cond, vec![assign(name, value)])]
}

fn both(a: Expr, b: Expr) -> Expr {
    bin(BinOp::And, a, b)
}

fn lt(a: Expr, b: Expr) -> Expr {
    bin(BinOp::Lt, a, b)
}

pub fn gemm_mma_bf16(name: &str, origin: &str) -> Kernel {
    let names = |p: &str, n: usize| -> Vec<String> { (0..n).map(|i| format!("{p}{i}")).collect() };
    let (a, b, c) = (names("a", 8), names("b", 4), names("c", 4));
    let mut k_step = Vec::new();
    for (i, a_i) in a.iter().enumerate() {
        let row = var("m0") + var("g") + int(if i % 4 >= 2 { 8 } else { 0 });
        let col = var("k0") + var("t2") + int((i % 2) as i64 + if i >= 4 { 8 } else { 0 });
        let cond = both(lt(row.clone(), var("tokens")), lt(col.clone(), var("k")));
        k_step.extend(guarded(a_i, cond, load("x", row * var("x_stride") + col)));
    }
    for (i, b_i) in b.iter().enumerate() {
        let krow = var("k0") + var("t2") + int((i % 2) as i64 + if i >= 2 { 8 } else { 0 });
        let col = var("n0") + var("g");
        let cond = both(lt(col.clone(), var("n")), lt(krow.clone(), var("k")));
        k_step.extend(guarded(b_i, cond, load("w", col * var("k") + krow)));
    }
    k_step.push(Stmt::MmaBf16(Box::new(MmaFragments {
        a: a.clone().try_into().expect("8 names"),
        b: b.clone().try_into().expect("4 names"),
        c: c.clone().try_into().expect("4 names"),
    })));
    let mut store_c = Vec::new();
    for (i, c_i) in c.iter().enumerate() {
        let row = var("m0") + var("g") + int(if i >= 2 { 8 } else { 0 });
        let col = var("n0") + var("t2") + int((i % 2) as i64);
        store_c.push(if_(
            both(lt(row.clone(), var("tokens")), lt(col.clone(), var("n"))),
            vec![store("out", row * var("n") + col, var(c_i))],
        ));
    }
    let tiles_n = (var("n") + int(7)) / int(8);
    let tiles = (var("tokens") + int(15)) / int(16) * tiles_n.clone();
    Kernel {
        name: name.into(),
        origin: format!("{origin}: matmul x·Wᵀ on tensor cores (mma.sync m16n8k16 bf16)"),
        params: vec![
            buffer("x", Ty::F32, false),
            buffer("w", Ty::Bf16, false),
            buffer("out", Ty::F32, true),
            scalar("tokens", Ty::I32),
            scalar("n", Ty::I32),
            scalar("k", Ty::I32),
            scalar("x_stride", Ty::I32),
        ],
        shared: vec![],
        block_dim: (32 * WARPS) as u32,
        grid: blocks_for(tiles.clone(), WARPS),
        body: vec![
            let_("item", Ty::I32, bid() * int(WARPS) + warp()),
            // Whole warps leave together: mma.sync needs every lane.
            if_(
                lt(var("item"), tiles),
                [
                    vec![
                        let_("m0", Ty::I32, var("item") / tiles_n.clone() * int(16)),
                        let_("n0", Ty::I32, bin(BinOp::Rem, var("item"), tiles_n) * int(8)),
                        let_("g", Ty::I32, lane() / int(4)),
                        let_("t2", Ty::I32, bin(BinOp::Rem, lane(), int(4)) * int(2)),
                    ],
                    c.iter().map(|c_i| let_(c_i, Ty::F32, f(0.0))).collect(),
                    vec![for_("k0", int(0), var("k"), int(16), k_step)],
                    store_c,
                ]
                .concat(),
            ),
        ],
    }
}
