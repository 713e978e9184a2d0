//! Causal attention over a contiguous KV cache (decode: one query; prefill: many), optionally
//! windowed, grouped KV heads. One block per (query, head); keys in chunks of the block size:
//! each thread scores one key (a full q·k dot), the block takes the chunk's max, rescales its
//! running sum and accumulator (online softmax, FlashAttention's recurrence), and each thread
//! `d < head_dim` accumulates `Σ p_j·v_j[d]`. Softmax in f32.

use super::cache_layout::CacheLayout;
use super::{warp_scratch, BLOCK};
use crate::dsl::*;

const WARPS: u32 = BLOCK / 32;

/// Max of `value` across the block (every thread ends with it), through `scratch`.
fn block_max(value: &str, scratch: &str) -> Vec<Stmt> {
    let mut s: Vec<Stmt> = [16, 8, 4, 2, 1]
        .iter()
        .map(|&m| assign(value, bin(BinOp::Max, var(value), shfl_xor(var(value), m))))
        .collect();
    s.push(if_(
        bin(BinOp::Eq, lane(), int(0)),
        vec![store(scratch, warp(), var(value))],
    ));
    s.push(Stmt::SyncThreads);
    s.push(for_(
        "w",
        int(0),
        int(WARPS as i64),
        int(1),
        vec![assign(value, bin(BinOp::Max, var(value), load(scratch, var("w"))))],
    ));
    s.push(Stmt::SyncThreads);
    s
}

/// `window` ≤ 0 means none. The cache holds `first + tokens` rows: the new keys included.
pub fn attention(name: &str, origin: &str) -> Kernel {
    attention_with(name, origin, CacheLayout::Contiguous)
}

/// Attention over a cache in `layout` (contiguous, or paged through a block table).
pub fn attention_with(name: &str, origin: &str, layout: CacheLayout) -> Kernel {
    let chunk = BLOCK as i64;
    let q = |d: Expr| {
        load(
            "q",
            var("t") * var("heads") * var("head_dim") + var("h") * var("head_dim") + d,
        )
    };
    let kv_at = |buf: &str, j: Expr, d: Expr| {
        load(
            buf,
            layout.row(j) * var("kv_heads") * var("head_dim") + var("kvh") * var("head_dim") + d,
        )
    };
    let body = [
        vec![let_("t", Ty::I32, bid() / var("heads"))],
        layout.prologue(var("t")),
        vec![
            let_("h", Ty::I32, bin(BinOp::Rem, bid(), var("heads"))),
            let_("kvh", Ty::I32, var("h") / (var("heads") / var("kv_heads"))),
            let_("pos", Ty::I32, layout.position(var("t"))),
            let_("hi", Ty::I32, var("pos") + int(1)),
            let_(
                "lo",
                Ty::I32,
                select(
                    bin(BinOp::Gt, var("window"), int(0)),
                    bin(BinOp::Max, int(0), var("hi") - var("window")),
                    int(0),
                ),
            ),
            let_("m", Ty::F32, f(f32::NEG_INFINITY)),
            let_("l", Ty::F32, f(0.0)),
            let_("acc", Ty::F32, f(0.0)),
            for_(
                "c0",
                var("lo"),
                var("hi"),
                int(chunk),
                [
                    vec![
                        let_("j", Ty::I32, var("c0") + tid()),
                        let_("s", Ty::F32, f(f32::NEG_INFINITY)),
                        if_(
                            bin(BinOp::Lt, var("j"), var("hi")),
                            vec![
                                assign("s", f(0.0)),
                                for_(
                                    "d",
                                    int(0),
                                    var("head_dim"),
                                    int(1),
                                    vec![assign("s", var("s") + q(var("d")) * kv_at("k", var("j"), var("d")))],
                                ),
                                assign("s", var("s") * var("scale")),
                            ],
                        ),
                        store("scores", tid(), var("s")),
                        let_("cm", Ty::F32, var("s")),
                    ],
                    block_max("cm", "partial"),
                    vec![
                        let_("m_new", Ty::F32, bin(BinOp::Max, var("m"), var("cm"))),
                        let_("correction", Ty::F32, un(UnOp::Exp, var("m") - var("m_new"))),
                        assign("l", var("l") * var("correction")),
                        assign("acc", var("acc") * var("correction")),
                        let_("n", Ty::I32, bin(BinOp::Min, int(chunk), var("hi") - var("c0"))),
                        for_(
                            "jj",
                            int(0),
                            var("n"),
                            int(1),
                            vec![
                                let_("p", Ty::F32, un(UnOp::Exp, load("scores", var("jj")) - var("m_new"))),
                                assign("l", var("l") + var("p")),
                                if_(
                                    bin(BinOp::Lt, tid(), var("head_dim")),
                                    vec![assign(
                                        "acc",
                                        var("acc") + var("p") * kv_at("v", var("c0") + var("jj"), tid()),
                                    )],
                                ),
                            ],
                        ),
                        assign("m", var("m_new")),
                        Stmt::SyncThreads,
                    ],
                ]
                .concat(),
            ),
            if_(
                bin(BinOp::Lt, tid(), var("head_dim")),
                vec![store(
                    "out",
                    var("t") * var("heads") * var("head_dim") + var("h") * var("head_dim") + tid(),
                    var("acc") / var("l"),
                )],
            ),
        ],
    ]
    .concat();
    Kernel {
        name: name.into(),
        origin: format!("{origin}: causal attention, online softmax, {}", layout.describe()),
        params: [
            vec![
                buffer("q", Ty::F32, false),
                buffer("k", Ty::F32, false),
                buffer("v", Ty::F32, false),
                buffer("out", Ty::F32, true),
                scalar("tokens", Ty::I32),
                scalar("first", Ty::I32),
                scalar("heads", Ty::I32),
                scalar("kv_heads", Ty::I32),
                scalar("head_dim", Ty::I32),
                scalar("window", Ty::I32),
                scalar("scale", Ty::F32),
            ],
            layout.params(),
        ]
        .concat(),
        shared: vec![
            SharedArray {
                name: "scores".into(),
                ty: Ty::F32,
                len: BLOCK as usize,
            },
            warp_scratch("partial", WARPS),
        ],
        block_dim: BLOCK,
        grid: var("tokens") * var("heads"),
        body,
    }
}
