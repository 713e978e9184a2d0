//! Appending a step's keys and values to a layer's caches, both in one launch: row `t` of
//! `k_src` and of `v_src` (rows `k_stride` and `v_stride` apart: K is a slice of the joined
//! ropes' output, V of the joined QKV output) become the cache rows of its position (`first +
//! t`, or the row's own in a batched step), stored as the cache's type (f32, or bf16 rounded to
//! nearest even).

use super::cache_layout::CacheLayout;
use super::{blocks_for, per_element, BLOCK};
use crate::dsl::*;

pub fn kv_append(name: &str, origin: &str) -> Kernel {
    kv_append_with(name, origin, CacheLayout::Contiguous, Ty::F32)
}

/// Append into caches in `layout` (contiguous, or paged through a block table) holding `cache`
/// elements (f32 or bf16).
pub fn kv_append_with(name: &str, origin: &str, layout: CacheLayout, cache: Ty) -> Kernel {
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: append keys and values to the {} KV cache, {}",
            format!("{cache:?}").to_lowercase(),
            layout.describe()
        ),
        params: [
            vec![
                buffer("k_src", Ty::F32, false),
                buffer("v_src", Ty::F32, false),
                buffer("k_cache", cache, true),
                buffer("v_cache", cache, true),
                scalar("tokens", Ty::I32),
                scalar("kv_dim", Ty::I32),
                scalar("first", Ty::I32),
                scalar("k_stride", Ty::I32),
                scalar("v_stride", Ty::I32),
            ],
            layout.params(),
        ]
        .concat(),
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("tokens") * var("kv_dim"), BLOCK as i64),
        body: per_element(
            var("tokens") * var("kv_dim"),
            [
                vec![
                    let_("t", Ty::I32, var("i") / var("kv_dim")),
                    let_("c", Ty::I32, bin(BinOp::Rem, var("i"), var("kv_dim"))),
                ],
                layout.prologue(var("t")),
                vec![
                    let_(
                        "at",
                        Ty::I32,
                        layout.row(layout.position(var("t"))) * var("kv_dim") + var("c"),
                    ),
                    store(
                        "k_cache",
                        var("at"),
                        load("k_src", var("t") * var("k_stride") + var("c")),
                    ),
                    store(
                        "v_cache",
                        var("at"),
                        load("v_src", var("t") * var("v_stride") + var("c")),
                    ),
                ],
            ]
            .concat(),
        ),
    }
}

/// The append with the rope before it (`rope_attention`): a thread per element of a step row's
/// `[q | k | v]`. Query elements are rotated into `q_out` (rows `q_dim` wide, what attention
/// reads next), key elements rotated into the cache, value elements copied into it. Each source
/// is read in place from its own rows (`*_stride` apart: slices of the joined QKV output).
pub fn rope_kv_append(
    name: &str,
    origin: &str,
    layout: CacheLayout,
    cache: Ty,
    rotation: super::rope::Rotation,
) -> Kernel {
    let rotated = |src: &'static str, stride: &str, col: Expr, put: &dyn Fn(Expr) -> Stmt| {
        super::rope::rotated(
            rotation,
            super::rope::Rotated {
                src,
                row: var("t") * var(stride),
                col,
            },
            put,
        )
    };
    let cache_at = |col: &str| var("at") + var(col);
    // A step row's `[q | k | v]`: a thread per element.
    let width = var("q_dim") + int(2) * var("kv_dim");
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: rotate queries and keys ({}), append keys and values to the {} KV cache, {}",
            rotation.describe(),
            format!("{cache:?}").to_lowercase(),
            layout.describe()
        ),
        params: [
            vec![
                buffer("q_src", Ty::F32, false),
                buffer("k_src", Ty::F32, false),
                buffer("v_src", Ty::F32, false),
                buffer("positions", Ty::I32, false),
                buffer("inv_freq", Ty::F32, false),
                buffer("q_out", Ty::F32, true),
                buffer("k_cache", cache, true),
                buffer("v_cache", cache, true),
                scalar("tokens", Ty::I32),
                scalar("q_dim", Ty::I32),
                scalar("kv_dim", Ty::I32),
                scalar("head_dim", Ty::I32),
                scalar("rotary_dim", Ty::I32),
                scalar("first", Ty::I32),
                scalar("q_stride", Ty::I32),
                scalar("k_stride", Ty::I32),
                scalar("v_stride", Ty::I32),
            ],
            layout.params(),
        ]
        .concat(),
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("tokens") * width.clone(), BLOCK as i64),
        body: per_element(
            var("tokens") * width.clone(),
            vec![
                let_("width", Ty::I32, width),
                let_("t", Ty::I32, var("i") / var("width")),
                let_("c", Ty::I32, bin(BinOp::Rem, var("i"), var("width"))),
                if_else(
                    bin(BinOp::Lt, var("c"), var("q_dim")),
                    rotated("q_src", "q_stride", var("c"), &|value| {
                        store("q_out", var("t") * var("q_dim") + var("c"), value)
                    }),
                    [
                        layout.prologue(var("t")),
                        vec![
                            let_("at", Ty::I32, layout.row(layout.position(var("t"))) * var("kv_dim")),
                            let_("kc", Ty::I32, var("c") - var("q_dim")),
                            let_("vc", Ty::I32, var("kc") - var("kv_dim")),
                            if_else(
                                bin(BinOp::Lt, var("kc"), var("kv_dim")),
                                rotated("k_src", "k_stride", var("kc"), &|value| {
                                    store("k_cache", cache_at("kc"), value)
                                }),
                                vec![store(
                                    "v_cache",
                                    cache_at("vc"),
                                    load("v_src", var("t") * var("v_stride") + var("vc")),
                                )],
                            ),
                        ],
                    ]
                    .concat(),
                ),
            ],
        ),
    }
}
