//! Sampling at a temperature by inverse CDF: `p_i ∝ exp((x_i − max)/T)`, and the token is the
//! first index whose running sum passes `u·Σp` for a uniform `u` the host draws (seeded, so a
//! seed reproduces a run). One block per row: each thread owns a contiguous chunk of the
//! vocabulary, so the running sum is a prefix over per-thread sums (in shared memory) followed
//! by the owning thread's scan of its chunk: the same left-to-right order a sequential sampler
//! uses.

use super::{block_sum, warp_scratch, BLOCK};
use crate::dsl::*;

const WARPS: u32 = BLOCK / 32;

pub fn sample(name: &str, origin: &str) -> Kernel {
    let x = |i: Expr| load("logits", var("base") + i);
    let p = |i: Expr| un(UnOp::Exp, (x(i) - var("max")) / var("temperature"));
    let over_chunk = |body: Vec<Stmt>| for_("i", var("lo"), var("hi"), int(1), body);
    let not_found = || lt(var("owner"), int(0));
    let body = [
        vec![
            let_("base", Ty::I32, bid() * var("v")),
            let_("chunk", Ty::I32, (var("v") + int(BLOCK as i64 - 1)) / int(BLOCK as i64)),
            let_("lo", Ty::I32, bin(BinOp::Min, tid() * var("chunk"), var("v"))),
            let_("hi", Ty::I32, bin(BinOp::Min, var("lo") + var("chunk"), var("v"))),
            let_("max", Ty::F32, f(f32::NEG_INFINITY)),
            over_chunk(vec![assign("max", bin(BinOp::Max, var("max"), x(var("i"))))]),
        ],
        [16u32, 8, 4, 2, 1]
            .iter()
            .map(|&m| assign("max", bin(BinOp::Max, var("max"), shfl_xor(var("max"), m))))
            .collect(),
        vec![
            if_(
                bin(BinOp::Eq, lane(), int(0)),
                vec![store("partial", warp(), var("max"))],
            ),
            Stmt::SyncThreads,
            for_(
                "w",
                int(0),
                int(WARPS as i64),
                int(1),
                vec![assign("max", bin(BinOp::Max, var("max"), load("partial", var("w"))))],
            ),
            Stmt::SyncThreads,
            let_("mine", Ty::F32, f(0.0)),
            over_chunk(vec![assign("mine", var("mine") + p(var("i")))]),
            store("sums", tid(), var("mine")),
            let_("total", Ty::F32, var("mine")),
        ],
        // Also the barrier that makes every `sums` entry visible.
        block_sum("total", "partial", WARPS),
        vec![
            let_("target", Ty::F32, load("u", bid()) * var("total")),
            // The chunk holding the target: the first whose running sum passes it (or, when
            // rounding leaves the target at the very top, the last non-empty one).
            let_("before", Ty::F32, f(0.0)),
            let_("owner", Ty::I32, int(-1)),
            let_("last", Ty::I32, int(0)),
            let_("last_before", Ty::F32, f(0.0)),
            for_(
                "c",
                int(0),
                int(BLOCK as i64),
                int(1),
                vec![if_(
                    not_found(),
                    vec![
                        let_("s", Ty::F32, load("sums", var("c"))),
                        if_(
                            lt(f(0.0), var("s")),
                            vec![assign("last", var("c")), assign("last_before", var("before"))],
                        ),
                        if_else(
                            and(lt(f(0.0), var("s")), lt(var("target"), var("before") + var("s"))),
                            vec![assign("owner", var("c"))],
                            vec![assign("before", var("before") + var("s"))],
                        ),
                    ],
                )],
            ),
            if_(
                not_found(),
                vec![assign("owner", var("last")), assign("before", var("last_before"))],
            ),
            if_(
                bin(BinOp::Eq, tid(), var("owner")),
                vec![
                    let_("acc", Ty::F32, var("before")),
                    let_("pick", Ty::I32, var("hi") - int(1)),
                    let_("done", Ty::Bool, Expr::Bool(false)),
                    over_chunk(vec![if_(
                        un(UnOp::Not, var("done")),
                        vec![
                            assign("acc", var("acc") + p(var("i"))),
                            if_(
                                lt(var("target"), var("acc")),
                                vec![assign("pick", var("i")), assign("done", Expr::Bool(true))],
                            ),
                        ],
                    )]),
                    store("out", bid(), var("pick")),
                ],
            ),
        ],
    ]
    .concat();
    Kernel {
        name: name.into(),
        origin: format!("{origin}: sample at a temperature (inverse CDF)"),
        params: vec![
            buffer("logits", Ty::F32, false),
            buffer("u", Ty::F32, false),
            buffer("out", Ty::I32, true),
            scalar("rows", Ty::I32),
            scalar("v", Ty::I32),
            scalar("temperature", Ty::F32),
        ],
        shared: vec![
            SharedArray {
                name: "sums".into(),
                ty: Ty::F32,
                len: BLOCK as usize,
            },
            warp_scratch("partial", WARPS),
        ],
        block_dim: BLOCK,
        grid: var("rows"),
        body,
    }
}
