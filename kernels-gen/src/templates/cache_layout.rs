//! Where position `p` of a sequence lives in a KV cache: a contiguous buffer (row `p`), or a
//! paged pool (vLLM's PagedAttention): fixed-size blocks handed out by the scheduler, the
//! sequence's block table mapping `p / block_size` to a physical block, so sequences grow
//! without copying and share prefix blocks.

use crate::dsl::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheLayout {
    Contiguous,
    Paged,
}

impl CacheLayout {
    /// The physical cache row of logical position `pos`.
    pub fn row(self, pos: Expr) -> Expr {
        match self {
            Self::Contiguous => pos,
            Self::Paged => {
                let block = load("block_table", pos.clone() / var("block_size"));
                block * var("block_size") + bin(BinOp::Rem, pos, var("block_size"))
            }
        }
    }

    /// The extra parameters the layout needs.
    pub fn params(self) -> Vec<Param> {
        match self {
            Self::Contiguous => vec![],
            Self::Paged => vec![buffer("block_table", Ty::I32, false), scalar("block_size", Ty::I32)],
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Self::Contiguous => "contiguous cache",
            Self::Paged => "paged cache",
        }
    }
}
