//! Gathers, a thread per element (memory-bound; the rows are few or the widths small).
//! - Rows: `out[t, j] = src[index[t], j]` for `rows` rows of `width`, `src`'s rows `src_stride`
//!   apart. In a batched step it picks each sequence's last row (the IR's `last_token`, one row
//!   per sequence) so that the final norm and the LM head run on those rows only (and, of
//!   i32 positions, where layers run on those rows alone: Gemma 4's KV-shared ones).
//! - Column groups (the IR's `group_slice`): columns `start..start + len` of every group of
//!   `group` columns, side by side; Qwen3.5's query projection interleaves each head's query
//!   and output gate, and this splits them.
//! - Columns in an order (the IR's `permute_columns`): `out[t, j] = src[t, order[j]]`, the
//!   input of a linear layer whose weight's columns are held in that order (a GPTQ act-order
//!   checkpoint's, regrouped so that each block of a row lies in one group).
//! - Columns side by side (the IR's `concat_columns`): two values' rows joined into one
//!   wider row, as a multi-token prediction head joins a token's embedding and the target's
//!   hidden state before projecting them.

use super::{blocks_for, per_row_element, BLOCK};
use crate::dsl::*;

pub fn gather_rows(name: &str, origin: &str) -> Kernel {
    gather_rows_of(name, origin, Ty::F32)
}

/// [`gather_rows`] of elements of type `ty`.
pub fn gather_rows_of(name: &str, origin: &str, ty: Ty) -> Kernel {
    let from = load("index", var("t")) * var("src_stride") + var("j");
    indexed_gather(name, format!("{origin}: gather rows by index"), ty, "index", from)
}

/// `out[t, j] = src[t·src_stride + order[j]]` for `rows` rows of `width` columns.
pub fn gather_columns(name: &str, origin: &str) -> Kernel {
    let from = var("t") * var("src_stride") + load("order", var("j"));
    indexed_gather(
        name,
        format!("{origin}: gather columns in an order"),
        Ty::F32,
        "order",
        from,
    )
}

/// `out[t, j] = src[from]` for `rows` rows of `width` elements of `ty`, `from` an index into
/// `src` (rows `src_stride` apart) through the i32 buffer `index`.
fn indexed_gather(name: &str, origin: String, ty: Ty, index: &str, from: Expr) -> Kernel {
    Kernel {
        name: name.into(),
        origin,
        params: vec![
            buffer("src", ty, false),
            buffer(index, Ty::I32, false),
            buffer("out", ty, true),
            scalar("rows", Ty::I32),
            scalar("width", Ty::I32),
            scalar("src_stride", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("rows") * var("width"), BLOCK as i64),
        body: per_row_element(
            var("rows") * var("width"),
            vec![store("out", var("i"), load("src", from))],
        ),
    }
}

/// `out[t, g·len + j] = src[t·src_stride + g·group + start + j]` for `rows` rows of `width`
/// (`groups · len`) columns.
pub fn gather_column_groups(name: &str, origin: &str) -> Kernel {
    Kernel {
        name: name.into(),
        origin: format!("{origin}: gather column groups"),
        params: vec![
            buffer("src", Ty::F32, false),
            buffer("out", Ty::F32, true),
            scalar("rows", Ty::I32),
            scalar("width", Ty::I32),
            scalar("src_stride", Ty::I32),
            scalar("group", Ty::I32),
            scalar("start", Ty::I32),
            scalar("len", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("rows") * var("width"), BLOCK as i64),
        body: per_row_element(
            var("rows") * var("width"),
            vec![
                let_(
                    "col",
                    Ty::I32,
                    var("j") / var("len") * var("group") + var("start") + rem(var("j"), var("len")),
                ),
                store("out", var("i"), load("src", var("t") * var("src_stride") + var("col"))),
            ],
        ),
    }
}

/// `out[t, j] = a[t·a_stride + j]` for `j < a_width`, else `b[t·b_stride + j − a_width]`, for
/// `rows` rows of `width` (`a_width` + `b`'s width) columns.
pub fn concat_columns(name: &str, origin: &str) -> Kernel {
    Kernel {
        name: name.into(),
        origin: format!("{origin}: concatenate columns"),
        params: vec![
            buffer("a", Ty::F32, false),
            buffer("b", Ty::F32, false),
            buffer("out", Ty::F32, true),
            scalar("rows", Ty::I32),
            scalar("width", Ty::I32),
            scalar("a_width", Ty::I32),
            scalar("a_stride", Ty::I32),
            scalar("b_stride", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("rows") * var("width"), BLOCK as i64),
        body: per_row_element(
            var("rows") * var("width"),
            vec![if_else(
                lt(var("j"), var("a_width")),
                vec![store("out", var("i"), load("a", var("t") * var("a_stride") + var("j")))],
                vec![store(
                    "out",
                    var("i"),
                    load("b", var("t") * var("b_stride") + var("j") - var("a_width")),
                )],
            )],
        ),
    }
}
