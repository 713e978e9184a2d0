//! Embedding gather: `out[t, i] = table[ids[t], i]·scale` (Gemma's √hidden folds in as
//! `scale`), a thread per element, from a dense table or one in a GGUF block format (each
//! element dequantized as the GEMV does). Ids are checked against the vocabulary by the runtime.
//! A dense table's rows are indexed in 64 bits: a table may hold more than 2³¹ elements
//! (Gemma 4's per-layer embeddings: 262 144 rows of 35 × 256).

use super::quant::WeightFormat;
use super::{blocks_for, per_element, BLOCK};
use crate::dsl::*;

pub fn embedding(name: &str, origin: &str, table: WeightFormat) -> Kernel {
    Kernel {
        name: name.into(),
        origin: format!("{origin}: embedding, {} table", table.describe()),
        params: vec![
            buffer("w", table.buffer_ty(), false),
            buffer("ids", Ty::I32, false),
            buffer("out", Ty::F32, true),
            scalar("tokens", Ty::I32),
            scalar("d", Ty::I32),
            scalar("scale", Ty::F32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("tokens") * var("d"), BLOCK as i64),
        body: per_element(
            var("tokens") * var("d"),
            [
                vec![
                    let_("t", Ty::I32, var("i") / var("d")),
                    let_("id", Ty::I32, load("ids", var("t"))),
                ],
                match table {
                    WeightFormat::Dense(_) => vec![let_(
                        "v",
                        Ty::F32,
                        load_row("w", var("id"), var("d"), bin(BinOp::Rem, var("i"), var("d"))),
                    )],
                    _ => table.element("v", var("id"), var("d"), bin(BinOp::Rem, var("i"), var("d"))),
                },
                vec![store("out", var("i"), var("v") * var("scale"))],
            ]
            .concat(),
        ),
    }
}
