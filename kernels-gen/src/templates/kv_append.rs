//! Appending a step's keys or values to a layer's cache: row `t` of `src` (rows `src_stride`
//! apart: V is a slice of the joined QKV output) becomes the cache row of its position
//! (`first + t`, or the row's own in a batched step).

use super::cache_layout::CacheLayout;
use super::{blocks_for, BLOCK};
use crate::dsl::*;

pub fn kv_append(name: &str, origin: &str) -> Kernel {
    kv_append_with(name, origin, CacheLayout::Contiguous)
}

/// Append into a cache in `layout` (contiguous, or paged through a block table).
pub fn kv_append_with(name: &str, origin: &str, layout: CacheLayout) -> Kernel {
    Kernel {
        name: name.into(),
        origin: format!("{origin}: append to the KV cache, {}", layout.describe()),
        params: [
            vec![
                buffer("src", Ty::F32, false),
                buffer("cache", Ty::F32, true),
                scalar("tokens", Ty::I32),
                scalar("kv_dim", Ty::I32),
                scalar("first", Ty::I32),
                scalar("src_stride", Ty::I32),
            ],
            layout.params(),
        ]
        .concat(),
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("tokens") * var("kv_dim"), BLOCK as i64),
        body: vec![
            let_("e", Ty::I32, bid() * bdim() + tid()),
            if_(
                bin(BinOp::Lt, var("e"), var("tokens") * var("kv_dim")),
                [
                    vec![
                        let_("t", Ty::I32, var("e") / var("kv_dim")),
                        let_("c", Ty::I32, bin(BinOp::Rem, var("e"), var("kv_dim"))),
                    ],
                    layout.prologue(var("t")),
                    vec![store(
                        "cache",
                        layout.row(layout.position(var("t"))) * var("kv_dim") + var("c"),
                        load("src", var("t") * var("src_stride") + var("c")),
                    )],
                ]
                .concat(),
            ),
        ],
    }
}
