//! Where the lanes of a warp point `ldmatrix` (`Stmt::LoadMatrix`) to load `mma.sync`
//! operands from a tile in shared memory, four 8×8 matrices at once.
//!
//! A tile is read as rows of 8 contiguous bf16 (16 bytes): lane `8i + r` names row r of
//! matrix i. Which corner each matrix starts at decides which operand registers come out:
//! - [`Quad::RowsThenColumns`] (matrices 1 and 3 eight rows on, 2 and 3 eight columns on):
//!   A's four pairs a lane over a row-major A (rows M, columns K), or, transposed, B's pairs
//!   of two 8-column blocks over a tile whose rows are B's rows (K).
//! - [`Quad::ColumnsThenRows`] (1 and 3 eight columns on, 2 and 3 eight rows on): B's pairs
//!   of two 8-column blocks over a tile whose rows are B's columns (N), K contiguous (weights
//!   `W[n, k]`, keys `K[key, dim]`).

use crate::dsl::*;

/// How the four matrices of an `ldmatrix.x4` lie in the tile (see the module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quad {
    RowsThenColumns,
    ColumnsThenRows,
}

/// This lane's row and column, from the first matrix's corner, of the row it names.
pub fn lane_row(quad: Quad) -> (Expr, Expr) {
    let (matrix, r) = (lane() / int(8), rem(lane(), int(8)));
    let (low, high) = (rem(matrix.clone(), int(2)), matrix / int(2));
    let (row_step, column_step) = match quad {
        Quad::RowsThenColumns => (low, high),
        Quad::ColumnsThenRows => (high, low),
    };
    (row_step * int(8) + r, column_step * int(8))
}

/// [`lane_row`] as an element offset in a row-major tile of `pitch` elements a row.
pub fn lane_offset(quad: Quad, pitch: i64) -> Expr {
    let (row, column) = lane_row(quad);
    row * int(pitch) + column
}

/// The four U32 locals of one `ldmatrix.x4`, `{prefix}{at}_{i}`.
pub fn x4_names(prefix: &str, at: &str) -> Vec<String> {
    (0..4).map(|i| format!("{prefix}{at}_{i}")).collect()
}

/// The two pairs of `x4`'s registers that make B's fragment of 8-column block `block` (0 or
/// 1) in either quad: registers 2·block and 2·block + 1.
pub fn b_block(x4: &[String], block: usize) -> MmaOperand {
    MmaOperand::Pairs(x4[2 * block..2 * block + 2].to_vec())
}
