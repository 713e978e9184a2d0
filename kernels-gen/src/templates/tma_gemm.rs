//! What the TMA-fed GEMMs (`gemm_tma_wgmma`, `gemm_tma_tcgen05`, `gemm_tma_mma`) share: their
//! parameters (bf16 activations and weights, each read through a tensor map of 64-wide,
//! 128-byte-swizzled boxes), their K steps of 64, the tile's block coordinates, their mbarriers'
//! initialisation, and the filling of a ring buffer by one thread.

use super::split_k;
use crate::dsl::*;

/// K per pipeline step: one 128-byte swizzled row of bf16.
pub const TILE_K: i64 = 64;
/// Bytes between 8-row atoms of a swizzled box: the operand descriptors' stride byte offset.
pub const ATOM_BYTES: u32 = 1024;

/// The prologue and epilogue of the matmul whose result layout a GEMM stores in
/// (`gemv::out_index`; a GLU's products always through the partials).
pub type ResultForm = (Option<super::gemv::NormPrologue>, Option<ir::GluAct>);

/// A tensor map of `rows` × `k` bf16 over `buffer`, rows `stride` apart, in 128-byte-swizzled
/// boxes of `box_rows` × [`TILE_K`].
fn map(name: &str, buffer: &str, rows: &str, stride: &str, box_rows: i64) -> Param {
    Param::TensorMap(Box::new(TensorMap {
        name: name.into(),
        buffer: buffer.into(),
        rows: var(rows),
        cols: var("k"),
        stride: var(stride),
        box_rows: box_rows as u32,
        box_cols: TILE_K as u32,
        swizzle: Swizzle::B128,
    }))
}

/// What every TMA GEMM takes after its activations: `w`, `out` and the sizes.
fn weights_and_sizes() -> [Param; 6] {
    [
        buffer("w", Ty::Bf16, false),
        buffer("out", Ty::F32, true),
        scalar("tokens", Ty::I32),
        scalar("n", Ty::I32),
        scalar("k", Ty::I32),
        scalar("x_stride", Ty::I32),
    ]
}

/// As a plan launches a TMA GEMM in place of a GEMV (`prologue`'s form: plain, norm, or
/// residual add and norm): the GEMV's parameters first (which it does not read but for `w`,
/// `out` and the sizes), the K splits' partials, then `xb`, the rows the
/// `bf16_rows` kernel made (`xb_stride` apart), which the `x_map` reads.
pub fn prologued_params(prologue: Option<super::gemv::NormPrologue>, x_box_rows: i64, w_box_rows: i64) -> Vec<Param> {
    let mut params = super::gemv::prologue_params(prologue);
    params.extend(weights_and_sizes());
    if super::gemv::residual(prologue) {
        params.push(scalar("b_stride", Ty::I32));
    }
    params.extend(split_k::params());
    params.extend([
        buffer("xb", Ty::Bf16, false),
        scalar("xb_stride", Ty::I32),
        map("x_map", "xb", "tokens", "xb_stride", x_box_rows),
        map("w_map", "w", "n", "k", w_box_rows),
    ]);
    params
}

/// `kernel`, a GEMM on [`prologued_params`], as `name` reading its weights from `wb`: a
/// bf16 copy made for the step of a matrix stored otherwise (GGUF blocks, half values; after
/// `xb_stride`; see `weight_convert::to_bf16_for_prefill`). `w` stays where the GEMV has it,
/// as stored (bytes to the kernel, which does not read it).
pub fn over_converted_weights(mut kernel: Kernel, name: &str) -> Kernel {
    let maps = kernel
        .params
        .iter()
        .position(|p| matches!(p, Param::TensorMap(_)))
        .expect("a TMA GEMM's tensor maps");
    for p in &mut kernel.params {
        match p {
            Param::Buffer { name, ty, .. } if name == "w" => *ty = Ty::U8,
            Param::TensorMap(map) if map.buffer == "w" => map.buffer = "wb".into(),
            _ => {}
        }
    }
    kernel.params.insert(maps, buffer("wb", Ty::Bf16, false));
    kernel.name = name.into();
    kernel
}

/// `x` `[tokens, k]` (rows `x_stride` apart) and `w` `[n, k]`, bf16, into `out` `[tokens, n]`
/// f32, with the K splits' partials; the tensor maps over `x` and `w` with boxes of
/// `x_box_rows` and `w_box_rows` rows.
pub fn params(x_box_rows: i64, w_box_rows: i64) -> Vec<Param> {
    [
        vec![buffer("x", Ty::Bf16, false)],
        weights_and_sizes().to_vec(),
        split_k::params(),
        vec![
            map("x_map", "x", "tokens", "x_stride", x_box_rows),
            map("w_map", "w", "n", "k", w_box_rows),
        ],
    ]
    .concat()
}

/// Tile `index`'s coordinates (a block's own tile is its index): `m0` (tokens, `tile_m` a
/// tile), `split` and `n0` (weight rows, `tile_n` a tile). Token tiles vary fastest, so
/// neighbouring tiles share a weight tile; then the K splits of one weight tile, then the
/// weight tiles. Then the split's K span (`k_begin`, `k_end`) and its `steps` of [`TILE_K`]
/// (none past the end of K).
pub fn tile_coordinates(tile_m: i64, tile_n: i64, index: Expr) -> Vec<Stmt> {
    let tiles_m = (var("tokens") + int(tile_m - 1)) / int(tile_m);
    [
        vec![
            let_("m0", Ty::I32, rem(index.clone(), tiles_m.clone()) * int(tile_m)),
            let_("split", Ty::I32, rem(index.clone() / tiles_m.clone(), var("splits"))),
            let_("n0", Ty::I32, index / tiles_m / var("splits") * int(tile_n)),
        ],
        split_k::k_span(var("split"), TILE_K),
        vec![let_(
            "steps",
            Ty::I32,
            bin(
                BinOp::Max,
                int(0),
                (var("k_end") - var("k_begin") + int(TILE_K - 1)) / int(TILE_K),
            ),
        )],
    ]
    .concat()
}

/// The tiles of a GEMM with `tile_m` × `tile_n` tiles, K splits counted apart: the launch grid
/// of a block a tile.
pub fn grid(tile_m: i64, tile_n: i64) -> Expr {
    let tiles_m = (var("tokens") + int(tile_m - 1)) / int(tile_m);
    let tiles_n = (var("n") + int(tile_n - 1)) / int(tile_n);
    tiles_m * tiles_n * var("splits")
}

/// Slot `slot` of the shared mbarrier array `array`.
pub fn barrier(array: &str, slot: Expr) -> MbarrierRef {
    MbarrierRef {
        array: array.into(),
        slot,
    }
}

/// Thread 0 initialises `stages` barriers in each of `arrays`, each `(array, arrivals a
/// phase)`.
pub fn init_barriers(arrays: &[(&str, u32)], stages: i64) -> Stmt {
    let inits = (0..stages).flat_map(|s| {
        arrays.iter().map(move |&(array, count)| {
            Stmt::Mbarrier(Box::new(Mbarrier::Init {
                barrier: barrier(array, int(s)),
                count,
            }))
        })
    });
    if_(eq(tid(), int(0)), inits.collect())
}

/// The weight rows of a tile's buffer: the tile's rows from `n0` (one box), or, for a GLU
/// whose GEMM gates its own products, half of them gate rows from `n0 / 2` and half the same
/// outputs' up rows from `n / 2 + n0 / 2` (the tile's `n0 / 2` onwards are its columns of the
/// gated product), in boxes of `group` rows: `group` gate rows, then their `group` up rows,
/// and so on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightBoxes {
    Rows,
    GateAndUp { group: i64 },
}

/// Thread 0's part of filling ring buffer `s` with step `step` (relative to `k_begin`): the
/// bytes of both operands announced on `full[s]`, then the activations' box (`x_elements` a
/// buffer of `xs`, from token `m0`) and the weights' (`w_elements` a buffer of `ws`, in
/// `weights`' boxes) copied.
pub fn fill(s: Expr, step: Expr, x_elements: i64, w_elements: i64, weights: WeightBoxes) -> Vec<Stmt> {
    let k0 = var("k_begin") + step * int(TILE_K);
    let copy = |map: &str, dst: &str, dst_index: Expr, row: Expr| {
        Stmt::TmaLoad(Box::new(TmaLoad {
            map: map.into(),
            dst: dst.into(),
            dst_index,
            row,
            col: k0.clone(),
            barrier: barrier("full", s.clone()),
        }))
    };
    let w_start = s.clone() * int(w_elements);
    let weight_copies = match weights {
        WeightBoxes::Rows => vec![copy("w_map", "ws", w_start, var("n0"))],
        WeightBoxes::GateAndUp { group } => {
            // Rows of a box, the buffer's elements it fills, and the pairs of boxes.
            let box_elements = group * TILE_K;
            (0..w_elements / box_elements / 2)
                .flat_map(|pair| {
                    let gate = var("n0") / int(2) + int(pair * group);
                    let at = w_start.clone() + int(2 * pair * box_elements);
                    [
                        copy("w_map", "ws", at.clone(), gate.clone()),
                        copy("w_map", "ws", at + int(box_elements), var("n") / int(2) + gate),
                    ]
                })
                .collect()
        }
    };
    [
        vec![
            Stmt::Mbarrier(Box::new(Mbarrier::ArriveExpectTx {
                barrier: barrier("full", s.clone()),
                bytes: 2 * (x_elements + w_elements) as u32,
            })),
            copy("x_map", "xs", s.clone() * int(x_elements), var("m0")),
        ],
        weight_copies,
    ]
    .concat()
}

/// Thread `producer` fills the first `stages` buffers (those the split has steps for).
pub fn fill_ring(producer: i64, stages: i64, x_elements: i64, w_elements: i64, weights: WeightBoxes) -> Stmt {
    if_(
        eq(tid(), int(producer)),
        (0..stages)
            .map(|s| {
                if_(
                    lt(int(s), var("steps")),
                    fill(int(s), int(s), x_elements, w_elements, weights),
                )
            })
            .collect(),
    )
}

/// A K-major operand of `array` from element `start` under the 128-byte swizzle, as the
/// tensor cores' descriptors read a TMA box (the leading offset unused: one row holds the
/// step's K).
pub fn swizzled_operand(array: &str, start: Expr) -> SmemMatrix {
    SmemMatrix {
        array: array.into(),
        start,
        lbo: 16,
        sbo: ATOM_BYTES,
        swizzle: Swizzle::B128,
    }
}
