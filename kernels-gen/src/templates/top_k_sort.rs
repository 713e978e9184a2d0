//! Top-k per row in one pass over the row, for the larger k of a shortlist (64 candidates
//! out of the vocabulary), where `top_k`'s k passes would each read the whole row again.
//! bbc's order throughout (`ir::reference::ops::top_k`'s): larger first by `total_cmp`, so
//! −0 below +0, NaN ranked as −∞, equal values to the lower index. Values are sorted as their
//! ordered bits (`UnOp::OrderedBits`), which integer comparison ranks that way.
//!
//! 1. `chunks`: a block per (row, chunk of `len` elements): the chunk's (value, index) pairs
//!    into shared memory, a bitonic sort there, its best `k` written out as a list.
//! 2. `merge`, as many times as it takes: a block per (row, group of `len / k` lists): the
//!    group's lists sorted together the same way, their best `k` written out as one list.
//!    The last launch leaves one list a row: the row's top k, in order.
//!
//! A bitonic network needs no atomics, and sorts under any total preorder, so the order
//! above (with padding, index −1, after everything) is all it compares. Sorting a whole chunk
//! costs log₂(len)·(log₂(len)+1)/2 shared-memory stages, each a few compare-exchanges a
//! thread: for 2 048 elements, 66 stages of 4; cheap beside reading the row, which happens
//! once.

use super::top_k::ranks_before;
use super::BLOCK;
use crate::dsl::*;

/// The sort length of the first pass: 8 elements a thread.
pub const CHUNK: usize = 8 * BLOCK as usize;
/// The sort length of a merge: 16 elements a thread, 32 KiB of shared memory (value and
/// index), so a merge of 64-candidate lists takes 64 of them.
pub const MERGE: usize = 16 * BLOCK as usize;
/// The largest k this scheme takes: a merge must shrink at least two lists into one.
pub const MAX_K: usize = MERGE / 2;

/// One launch of a row's top k, with the sizes its kernel and grid take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// The elements a block sorts (a power of two, at least a block's threads).
    pub len: usize,
    /// Lists (the first pass: chunks of the row) read per row.
    pub lists_in: usize,
    /// Lists written per row: blocks per row.
    pub lists_out: usize,
}

/// The launches that take rows of `v` elements to their top `k` (`k ≤ v`, `k ≤ MAX_K`): the
/// first pass over chunks of the row (as short as the row allows), then merges until one list
/// is left. A merge sorts only as many elements as its group's lists hold.
pub fn passes(v: usize, k: usize) -> Vec<Pass> {
    assert!(k >= 1 && k <= v && k <= MAX_K, "top-{k} of {v} by sorting");
    let sort_len = |n: usize| n.next_power_of_two().max(BLOCK as usize);
    let len = sort_len(v.min(CHUNK));
    let chunks = v.div_ceil(len);
    let mut passes = vec![Pass {
        len,
        lists_in: 1,
        lists_out: chunks,
    }];
    let mut lists = chunks;
    while lists > 1 {
        let len = sort_len((lists * k).min(MERGE));
        let groups = lists.div_ceil(len / k);
        passes.push(Pass {
            len,
            lists_in: lists,
            lists_out: groups,
        });
        lists = groups;
    }
    passes
}

fn shared(len: usize) -> Vec<SharedArray> {
    let array = |name: &str, ty| SharedArray {
        name: name.into(),
        ty,
        len,
    };
    vec![array("keys", Ty::U32), array("ids", Ty::I32)]
}

/// Shared memory's `keys`/`ids` (`len` of them) sorted, the first ranking before the rest.
/// Stage (p, s) compares each element with the one `2^s` away, within runs of `2^p` that
/// alternate direction (the last stage's single run ranks forward).
fn bitonic_sort(len: usize) -> Vec<Stmt> {
    let one = || int(1);
    let stage = vec![
        let_("s", Ty::I32, var("p") - int(1) - var("q")),
        for_(
            "t",
            tid(),
            int(len as i64 / 2),
            int(BLOCK as i64),
            vec![
                // Compare-exchange t's pair (lo, hi): t with a zero inserted at bit s, and
                // that with bit s set.
                let_(
                    "lo",
                    Ty::I32,
                    bin(BinOp::Shl, bin(BinOp::Shr, var("t"), var("s")), var("s") + one())
                        + bin(BinOp::BitAnd, var("t"), bin(BinOp::Shl, one(), var("s")) - one()),
                ),
                let_("hi", Ty::I32, var("lo") + bin(BinOp::Shl, one(), var("s"))),
                let_("av", Ty::U32, load("keys", var("lo"))),
                let_("ai", Ty::I32, load("ids", var("lo"))),
                let_("bv", Ty::U32, load("keys", var("hi"))),
                let_("bi", Ty::I32, load("ids", var("hi"))),
                let_(
                    "forward",
                    Ty::Bool,
                    eq(bin(BinOp::BitAnd, var("lo"), bin(BinOp::Shl, one(), var("p"))), int(0)),
                ),
                if_(
                    select(
                        var("forward"),
                        ranks_before(var("bv"), var("bi"), var("av"), var("ai")),
                        ranks_before(var("av"), var("ai"), var("bv"), var("bi")),
                    ),
                    vec![
                        store("keys", var("lo"), var("bv")),
                        store("ids", var("lo"), var("bi")),
                        store("keys", var("hi"), var("av")),
                        store("ids", var("hi"), var("ai")),
                    ],
                ),
            ],
        ),
        Stmt::SyncThreads,
    ];
    let log_len = len.trailing_zeros() as i64;
    vec![for_(
        "p",
        int(1),
        int(log_len + 1),
        int(1),
        vec![for_("q", int(0), var("p"), int(1), stage)],
    )]
}

/// The best `k` of the sorted shared arrays into list `list` (of `lists` a row) of row
/// `row`'s `out_keys`/`out_ids`.
fn write_best() -> Stmt {
    let at = (var("row") * var("lists_out") + var("list")) * var("k") + var("j");
    for_(
        "j",
        tid(),
        var("k"),
        bdim(),
        vec![
            store("out_keys", at.clone(), load("keys", var("j"))),
            store("out_ids", at, load("ids", var("j"))),
        ],
    )
}

fn kernel(name: &str, origin: String, len: usize, inputs: Vec<Param>, load_body: Vec<Stmt>) -> Kernel {
    assert!(len.is_power_of_two() && len >= BLOCK as usize, "sort length {len}");
    let mut params = inputs;
    params.extend([
        buffer("out_keys", Ty::U32, true),
        buffer("out_ids", Ty::I32, true),
        scalar("rows", Ty::I32),
        scalar("k", Ty::I32),
        scalar("lists_out", Ty::I32),
    ]);
    let mut body = vec![
        let_("row", Ty::I32, bid() / var("lists_out")),
        let_("list", Ty::I32, rem(bid(), var("lists_out"))),
        // Constant bounds and stride: the compiler unrolls the loads, all in flight at once.
        for_("j", tid(), int(len as i64), int(BLOCK as i64), load_body),
        Stmt::SyncThreads,
    ];
    body.extend(bitonic_sort(len));
    body.push(write_best());
    Kernel {
        name: name.into(),
        origin,
        params,
        shared: shared(len),
        block_dim: BLOCK,
        grid: var("rows") * var("lists_out"),
        body,
    }
}

/// (1): chunk `list` of row `row` of `logits` (rows `v` wide), `len` elements a chunk, sorted;
/// its best `k` into `out_keys` (ordered bits) and `out_ids`: a list of `k` per (row, chunk),
/// padded with index −1 where the chunk holds fewer.
pub fn chunks(name: &str, origin: &str, len: usize) -> Kernel {
    let load_body = vec![
        let_("i", Ty::I32, var("list") * int(len as i64) + var("j")),
        if_else(
            lt(var("i"), var("v")),
            vec![
                store(
                    "keys",
                    var("j"),
                    un(UnOp::OrderedBits, load("logits", var("row") * var("v") + var("i"))),
                ),
                store("ids", var("j"), var("i")),
            ],
            pad(),
        ),
    ];
    let inputs = vec![buffer("logits", Ty::F32, false), scalar("v", Ty::I32)];
    let origin = format!("{origin}: top-k, each chunk of {len} of a row sorted, its best kept");
    kernel(name, origin, len, inputs, load_body)
}

/// (2): lists `list·(len/k) ..` of row `row` of `in_keys`/`in_ids` (`lists_in` of `k` a row)
/// sorted together; their best `k` into list `list` of `out_keys`/`out_ids`.
pub fn merge(name: &str, origin: &str, len: usize) -> Kernel {
    let load_body = vec![
        let_("per_group", Ty::I32, int(len as i64) / var("k")),
        let_("from", Ty::I32, var("list") * var("per_group") + var("j") / var("k")),
        if_else(
            and(
                lt(var("j"), var("per_group") * var("k")),
                lt(var("from"), var("lists_in")),
            ),
            vec![
                let_(
                    "at",
                    Ty::I32,
                    (var("row") * var("lists_in") + var("from")) * var("k") + rem(var("j"), var("k")),
                ),
                store("keys", var("j"), load("in_keys", var("at"))),
                store("ids", var("j"), load("in_ids", var("at"))),
            ],
            pad(),
        ),
    ];
    let inputs = vec![
        buffer("in_keys", Ty::U32, false),
        buffer("in_ids", Ty::I32, false),
        scalar("lists_in", Ty::I32),
    ];
    let origin = format!("{origin}: top-k, lists merged {len} elements a block, the best kept");
    kernel(name, origin, len, inputs, load_body)
}

/// An empty place: ranked after every element (by its index; its key is the lowest).
fn pad() -> Vec<Stmt> {
    vec![
        store("keys", var("j"), cast(Ty::U32, int(0))),
        store("ids", var("j"), int(-1)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_shrink_to_one_list_of_k() {
        // Llama 3's vocabulary, 64 candidates: 63 chunks of 2 048, one merge of 63 lists.
        assert_eq!(
            passes(128_256, 64),
            vec![
                Pass {
                    len: 2048,
                    lists_in: 1,
                    lists_out: 63
                },
                Pass {
                    len: 4096,
                    lists_in: 63,
                    lists_out: 1
                },
            ]
        );
        // Gemma's 262 144: 128 chunks, two merges.
        assert_eq!(passes(262_144, 64).len(), 3);
        // A row shorter than a chunk: one sort of the row, padded to a block's threads.
        assert_eq!(
            passes(100, 64),
            vec![Pass {
                len: 256,
                lists_in: 1,
                lists_out: 1
            }]
        );
        for (v, k) in [(1, 1), (300, 64), (9000, 8), (262_144, 64), (5000, 1024), (70_000, 3)] {
            let passes = passes(v, k);
            assert_eq!(passes.last().unwrap().lists_out, 1, "{v}, {k}");
            assert!(passes.iter().all(|p| p.len >= k && p.len.is_power_of_two()));
            for pair in passes.windows(2) {
                assert_eq!(pair[0].lists_out, pair[1].lists_in);
                assert!(pair[1].lists_out < pair[1].lists_in, "every merge shrinks");
            }
        }
    }
}
