//! What the prefill attention kernels loading their key and value tiles by TMA share
//! (`flash_attention_wgmma`'s `Schedule::Tma`, `flash_attention_tcgen05`'s `Loads::Tma`),
//! FlashAttention-3's loads: one thread announces a key tile's bytes (64 or 128 keys) on an
//! mbarrier and issues its boxes, each [`TMA_KEYS`] keys' rows of `TMA_DIMS` dims of the
//! block's KV head (a cache block's rows, or part of one), which land 128-byte swizzled: a
//! buffer holds its tile's dims in halves of `TMA_DIMS`, each half a row of 128 bytes a key.
//! The tensor cores read the keys from it K-major (`key_slice`) and the values MN-major
//! (`value_slice`), and no thread spends an instruction on a 16-byte copy.
//!
//! Boxes past the block's last key copy the box holding it again (a paged sequence's table
//! has no block there); the rows past it in a box are other positions of the cache (zeroed
//! at allocation, so finite), which the causal mask leaves out. A box never crosses a block
//! of a paged cache, whose blocks therefore hold a multiple of [`TMA_KEYS`] positions.

use super::cache_layout::CacheLayout;
use super::flash_attention as flash;
use super::tma_gemm;
use crate::dsl::*;

/// Keys a box holds: a paged cache's blocks hold a multiple of them.
pub const TMA_KEYS: i64 = 16;
/// Dims a box holds: one 128-byte swizzled row of 16-bit elements (bf16 or f16).
const TMA_DIMS: i64 = 64;

/// Whether the kernels loading by TMA take a head of `head_dim`: whole boxes of `TMA_DIMS`,
/// up to the 128 dims their outputs keep in registers.
pub fn supports(head_dim: usize) -> bool {
    flash::supports(head_dim) && head_dim <= flash::QUERIES_IN_REGISTERS && head_dim.is_multiple_of(TMA_DIMS as usize)
}

/// The parameters past the flash kernels' own: the cache's positions (`cache_rows`) and a
/// position's elements (`cache_width`, `kv_heads · head_dim`), and the tensor maps over the
/// cache sized by them, `k_map` over `k` and `v_map` over `v`, in boxes of [`TMA_KEYS`] ×
/// [`TMA_DIMS`], 128-byte swizzled.
pub(super) fn params() -> Vec<Param> {
    let maps = ["k", "v"].into_iter().map(|buffer| {
        Param::TensorMap(Box::new(TensorMap {
            name: format!("{buffer}_map"),
            buffer: buffer.into(),
            rows: var("cache_rows"),
            cols: var("cache_width"),
            stride: var("cache_width"),
            box_rows: TMA_KEYS as u32,
            box_cols: TMA_DIMS as u32,
            swizzle: Swizzle::B128,
        }))
    });
    [scalar("cache_rows", Ty::I32), scalar("cache_width", Ty::I32)]
        .into_iter()
        .chain(maps)
        .collect()
}

/// `last_box`: the first key of the box holding the block's last key (`hi − 1`).
pub(super) fn last_box() -> Stmt {
    let_(
        "last_box",
        Ty::I32,
        (var("hi") - int(1)) / int(TMA_KEYS) * int(TMA_KEYS),
    )
}

/// For the one thread loading: the bytes of the tile of `keys` keys from key `first_key`
/// announced on `barrier`, then its boxes issued, keys into `ks` and values into `vs`, the
/// buffer from element `buffer` of each (needs [`last_box`]).
pub(super) fn load_tile(
    layout: CacheLayout,
    (head_dim, keys): (usize, i64),
    (first_key, buffer): (Expr, Expr),
    barrier: MbarrierRef,
) -> Vec<Stmt> {
    let boxes = |map: &str, dst: &str| -> Vec<Stmt> {
        (0..head_dim as i64 / TMA_DIMS)
            .map(|half| {
                Stmt::TmaLoad(Box::new(TmaLoad {
                    map: map.into(),
                    dst: dst.into(),
                    dst_index: buffer.clone() + int(half * keys * TMA_DIMS) + var("b") * int(TMA_KEYS * TMA_DIMS),
                    row: var("box_row"),
                    col: var("kvh") * int(head_dim as i64) + int(half * TMA_DIMS),
                    barrier: barrier.clone(),
                }))
            })
            .collect()
    };
    vec![
        Stmt::Mbarrier(Box::new(Mbarrier::ArriveExpectTx {
            barrier: barrier.clone(),
            bytes: (2 * keys * head_dim as i64 * 2) as u32,
        })),
        for_(
            "b",
            int(0),
            int(keys / TMA_KEYS),
            int(1),
            [
                vec![
                    let_(
                        "box_key",
                        Ty::I32,
                        bin(BinOp::Min, first_key + var("b") * int(TMA_KEYS), var("last_box")),
                    ),
                    let_("box_row", Ty::I32, layout.row(var("box_key"))),
                ],
                boxes("k_map", "ks"),
                boxes("v_map", "vs"),
            ]
            .concat(),
        ),
    ]
}

/// Dims `16·step..+16` of every key of the tile (of `keys`) in the buffer at `buffer`, as a K-major
/// operand (a slice 32 bytes into its half's rows, 8-row atoms 1 KiB apart).
pub(super) fn key_slice(buffer: Expr, keys: i64, step: i64) -> SmemMatrix {
    SmemMatrix {
        array: "ks".into(),
        start: buffer + int(step / 4 * keys * TMA_DIMS + step % 4 * 16),
        lbo: 16,
        sbo: tma_gemm::ATOM_BYTES,
        swizzle: Swizzle::B128,
    }
}

/// Keys `16·u..+16` of the value tile (of `keys`) in the buffer at `buffer`, every dim, as an MN-major
/// operand: a row of 128 bytes a key's [`TMA_DIMS`] dims, the next 8 keys an atom on, the
/// next half of the dims a half-tile on.
pub(super) fn value_slice(buffer: Expr, keys: i64, u: i64) -> SmemMatrix {
    SmemMatrix {
        array: "vs".into(),
        start: buffer + int(16 * TMA_DIMS * u),
        lbo: (2 * keys * TMA_DIMS) as u32,
        sbo: tma_gemm::ATOM_BYTES,
        swizzle: Swizzle::B128,
    }
}
