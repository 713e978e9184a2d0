//! Where position `p` of a sequence lives in a KV cache: a contiguous buffer (row `p`), or a
//! paged pool (vLLM's PagedAttention): fixed-size blocks handed out by the scheduler, the
//! sequence's block table mapping `p / block_size` to a physical block, so sequences grow
//! without copying and share prefix blocks. `Batched` is the paged pool with the step's rows
//! from many sequences (continuous batching): each row carries its own position (`row_pos`)
//! and where its sequence's block table starts in the step's concatenated tables (`row_table`).

use crate::dsl::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheLayout {
    Contiguous,
    Paged,
    Batched,
}

impl CacheLayout {
    /// Statements a kernel runs for step row `t` before it addresses the cache (declares
    /// `table_at` for `Batched`).
    pub fn prologue(self, t: Expr) -> Vec<Stmt> {
        match self {
            Self::Batched => vec![let_("table_at", Ty::I32, load("row_table", t))],
            _ => vec![],
        }
    }

    /// The position of step row `t`: the rows of one sequence from `first` on, or each row's own.
    pub fn position(self, t: Expr) -> Expr {
        match self {
            Self::Batched => load("row_pos", t),
            _ => var("first") + t,
        }
    }

    /// The physical cache row of logical position `pos` (of the row the prologue ran for).
    pub fn row(self, pos: Expr) -> Expr {
        let table = match self {
            Self::Contiguous => return pos,
            Self::Paged => load("block_table", pos.clone() / var("block_size")),
            Self::Batched => load("block_tables", var("table_at") + pos.clone() / var("block_size")),
        };
        table * var("block_size") + bin(BinOp::Rem, pos, var("block_size"))
    }

    /// The extra parameters the layout needs.
    pub fn params(self) -> Vec<Param> {
        match self {
            Self::Contiguous => vec![],
            Self::Paged => vec![buffer("block_table", Ty::I32, false), scalar("block_size", Ty::I32)],
            Self::Batched => vec![
                buffer("block_tables", Ty::I32, false),
                buffer("row_table", Ty::I32, false),
                buffer("row_pos", Ty::I32, false),
                scalar("block_size", Ty::I32),
            ],
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Self::Contiguous => "contiguous cache",
            Self::Paged => "paged cache",
            Self::Batched => "paged cache, rows of many sequences",
        }
    }
}
