//! Top-k per row (argmax is k = 1) with bbc's order: larger first, equal values to the lower
//! index, NaN ranked as −∞ (as `ir::reference::ops::top_k`). One block per row, k rounds: in
//! each, threads stride the row keeping their best (value, index) among the elements ranked
//! after the previous round's winner, then a shared-memory tree halves the candidates and the
//! winner is written. k passes over the row: meant for the small k of greedy and top-k
//! sampling heads, where the row (the vocabulary) stays in L2.

use super::BLOCK;
use crate::dsl::*;

/// Whether candidate (v, i) ranks before (bv, bi): larger, or equal and earlier; any
/// candidate ranks before an empty best (bi < 0), and an empty candidate (i < 0) before none.
pub(crate) fn ranks_before(v: Expr, i: Expr, bv: Expr, bi: Expr) -> Expr {
    let larger = bin(BinOp::Gt, v.clone(), bv.clone());
    let tie_earlier = and(bin(BinOp::Eq, v, bv), bin(BinOp::Lt, i.clone(), bi.clone()));
    let best_empty = bin(BinOp::Lt, bi, int(0));
    and(bin(BinOp::Ge, i, int(0)), or(best_empty, or(larger, tie_earlier)))
}

/// Elements of the row a thread loads before it ranks them: a row of the vocabulary is long
/// (Llama 3's 128 256 over 256 threads: 501 a thread), and a block's round is a chain of
/// round trips to L2, one per `LOADS_IN_FLIGHT` elements a thread. On an H200 a batch-1
/// argmax over 128 256 logits took 81 µs with one load at a time and 65 µs (63 round trips)
/// with 8; 32 make it 16 round trips.
const LOADS_IN_FLIGHT: i64 = 32;

/// One round: this thread's best among the elements ranked after (`prev`, `prev_i`), then the
/// block's best in `vals[0]`/`idx[0]`. The thread visits its elements `tid, tid + bdim, …` in
/// that order, [`LOADS_IN_FLIGHT`] loaded at a time.
fn round() -> Vec<Stmt> {
    let candidates = super::loads_in_flight(
        "i",
        (tid(), var("v")),
        bdim(),
        LOADS_IN_FLIGHT,
        &|u, at| vec![(format!("x{u}"), load("logits", var("base") + at))],
        &|u, at| consider(u, var(&format!("x{u}")), at),
    );
    let mut body = vec![
        let_("best", Ty::F32, f(f32::NEG_INFINITY)),
        let_("best_i", Ty::I32, int(-1)),
        candidates,
        // Everyone has read the previous winner from vals[0]/idx[0] before they are rewritten.
        Stmt::SyncThreads,
        store("vals", tid(), var("best")),
        store("idx", tid(), var("best_i")),
        Stmt::SyncThreads,
    ];
    let mut stride = BLOCK / 2;
    while stride > 0 {
        let other = tid() + int(stride as i64);
        body.push(if_(
            bin(BinOp::Lt, tid(), int(stride as i64)),
            vec![
                let_("ov", Ty::F32, load("vals", other.clone())),
                let_("oi", Ty::I32, load("idx", other)),
                let_("mv", Ty::F32, load("vals", tid())),
                let_("mi", Ty::I32, load("idx", tid())),
                if_(
                    ranks_before(var("ov"), var("oi"), var("mv"), var("mi")),
                    vec![store("vals", tid(), var("ov")), store("idx", tid(), var("oi"))],
                ),
            ],
        ));
        body.push(Stmt::SyncThreads);
        stride /= 2;
    }
    body.extend([
        if_(
            bin(BinOp::Eq, tid(), int(0)),
            vec![store("out", bid() * var("k") + var("r"), load("idx", int(0)))],
        ),
        assign("prev", load("vals", int(0))),
        assign("prev_i", load("idx", int(0))),
    ]);
    body
}

/// Element `i` (value `x`, the `u`-th of a step's loads, naming its locals) becomes the
/// thread's best where it ranks after the previous round's winner and before the best so far;
/// NaN ranks as −∞.
fn consider(u: i64, x: Expr, i: Expr) -> Vec<Stmt> {
    let (key, after_prev) = (format!("key{u}"), format!("after_prev{u}"));
    vec![
        // x == x is false for NaN.
        let_(
            &key,
            Ty::F32,
            select(bin(BinOp::Eq, x.clone(), x.clone()), x, f(f32::NEG_INFINITY)),
        ),
        let_(
            &after_prev,
            Ty::Bool,
            or(
                bin(BinOp::Lt, var(&key), var("prev")),
                and(
                    bin(BinOp::Eq, var(&key), var("prev")),
                    bin(BinOp::Gt, i.clone(), var("prev_i")),
                ),
            ),
        ),
        if_(
            and(
                var(&after_prev),
                ranks_before(var(&key), i.clone(), var("best"), var("best_i")),
            ),
            vec![assign("best", var(&key)), assign("best_i", i)],
        ),
    ]
}

pub fn top_k(name: &str, origin: &str) -> Kernel {
    let body = vec![
        let_("base", Ty::I32, bid() * var("v")),
        // The previous round's winner; before the first, a rank above everything.
        let_("prev", Ty::F32, f(f32::INFINITY)),
        let_("prev_i", Ty::I32, int(-1)),
        for_("r", int(0), var("k"), int(1), round()),
    ];
    let shared = |name: &str, ty: Ty| SharedArray {
        name: name.into(),
        ty,
        len: BLOCK as usize,
    };
    Kernel {
        name: name.into(),
        origin: format!("{origin}: top-k indices per row, largest first (ties to the lowest index)"),
        params: vec![
            buffer("logits", Ty::F32, false),
            buffer("out", Ty::I32, true),
            scalar("rows", Ty::I32),
            scalar("v", Ty::I32),
            scalar("k", Ty::I32),
        ],
        shared: vec![shared("vals", Ty::F32), shared("idx", Ty::I32)],
        block_dim: BLOCK,
        grid: var("rows"),
        body,
    }
}
