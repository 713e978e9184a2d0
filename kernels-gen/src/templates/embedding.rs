//! Embedding gather: `out[t, i] = table[ids[t], i]·scale` (Gemma's √hidden folds in as
//! `scale`), a thread per element. Ids are checked against the vocabulary by the runtime.

use super::{blocks_for, BLOCK};
use crate::dsl::*;

pub fn embedding(name: &str, origin: &str, table: Ty) -> Kernel {
    Kernel {
        name: name.into(),
        origin: format!("{origin}: embedding, {table:?} table"),
        params: vec![
            buffer("table", table, false),
            buffer("ids", Ty::I32, false),
            buffer("out", Ty::F32, true),
            scalar("tokens", Ty::I32),
            scalar("d", Ty::I32),
            scalar("scale", Ty::F32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("tokens") * var("d"), BLOCK as i64),
        body: vec![
            let_("e", Ty::I32, bid() * bdim() + tid()),
            if_(
                bin(BinOp::Lt, var("e"), var("tokens") * var("d")),
                vec![
                    let_("t", Ty::I32, var("e") / var("d")),
                    let_("id", Ty::I32, load("ids", var("t"))),
                    store(
                        "out",
                        var("e"),
                        load("table", var("id") * var("d") + bin(BinOp::Rem, var("e"), var("d"))) * var("scale"),
                    ),
                ],
            ),
        ],
    }
}
