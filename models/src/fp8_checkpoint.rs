//! FP8 checkpoints: HF directories whose linear weights are FP8 E4M3 codes with scales beside
//! them. `X.weight_scale_inv` is DeepSeek's and Qwen's layout (`quant_method: "fp8"`, blocks of
//! `weight_block_size`, 128 × 128 in every release); `X.weight_scale` is compressed-tensors',
//! FBGEMM's and ModelOpt's (one scale a tensor, a row, a group of a row or a block). Either way
//! a weight is its code times its scale.
//!
//! bbc reads them as transformers does where it does not multiply FP8 (its `dequantize` path):
//! each code widened to f32, multiplied in f32 by its scale. A model that keeps the file's types
//! holds them as FP8 blocks of 32 with their scale ([`blocks_of_32`], where every 32 columns of
//! a row lie under one scale), whose weights are those products; one that computes in f32,
//! bf16 or f16 rounds each product once to that type ([`dequantize`]).

use crate::quant::GgmlType;
use rayon::prelude::*;

/// The methods whose weights are FP8 E4M3 codes with scales.
pub const FP8_METHODS: &str = "fp8, compressed-tensors (float-quantized), fbgemm_fp8, modelopt (FP8)";

/// The block an FP8 method's scales cover where its config names one (needed when a matrix's
/// side is not a whole number of blocks); `None` where `method` names no FP8 method, an error
/// where its config is not FP8 weights.
pub fn fp8_block(method: &str, quant: &serde_json::Value) -> Option<std::result::Result<Option<[usize; 2]>, String>> {
    let text = |v: Option<&serde_json::Value>| v.and_then(|v| v.as_str()).map(str::to_ascii_lowercase);
    Some(match method {
        "fp8" => (|| {
            if let Some(fmt) = text(quant.get("fmt")).filter(|f| f != "e4m3") {
                return Err(format!("`fmt` is `{fmt}`, not `e4m3`"));
            }
            match quant.get("weight_block_size") {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(size) => block_size(size)
                    .map(Some)
                    .ok_or_else(|| format!("`weight_block_size` is {size}, not two positive integers")),
            }
        })(),
        "fbgemm_fp8" => Ok(None),
        "modelopt" => match text(quant.get("quant_algo")).as_deref() {
            Some("fp8") => Ok(None),
            other => Err(format!("ModelOpt's `quant_algo` is {other:?}, not FP8")),
        },
        "compressed-tensors" => compressed_tensors(quant),
        _ => return None,
    })
}

/// compressed-tensors' weights must be 8-bit floats in every group; a block strategy names its
/// block, a group strategy its group of a row.
fn compressed_tensors(quant: &serde_json::Value) -> std::result::Result<Option<[usize; 2]>, String> {
    if let Some(format) = quant.get("format").and_then(|f| f.as_str()) {
        if !matches!(format, "float-quantized" | "naive-quantized") {
            return Err(format!("compressed-tensors format `{format}` is not FP8 weights"));
        }
    }
    let mut block = None;
    let groups = quant.get("config_groups").and_then(|g| g.as_object());
    for (name, group) in groups.into_iter().flatten() {
        let Some(weights) = group.get("weights").filter(|w| !w.is_null()) else {
            continue;
        };
        let kind = weights.get("type").and_then(|t| t.as_str());
        let bits = weights.get("num_bits").and_then(|b| b.as_u64());
        if kind != Some("float") || bits != Some(8) {
            return Err(format!(
                "group `{name}` quantizes weights to {} bits of type {kind:?}, not 8-bit floats",
                bits.map_or("?".into(), |b| b.to_string())
            ));
        }
        let named = match weights.get("strategy").and_then(|s| s.as_str()) {
            Some("block") => weights.get("block_structure").and_then(block_size),
            Some("group") => weights
                .get("group_size")
                .and_then(|g| g.as_u64())
                .filter(|&g| g > 0)
                .map(|g| [1, g as usize]),
            _ => None,
        };
        if named.is_some() {
            block = named;
        }
    }
    Ok(block)
}

fn block_size(size: &serde_json::Value) -> Option<[usize; 2]> {
    match size.as_array()?.as_slice() {
        [rows, cols] => {
            let (rows, cols) = (rows.as_u64()? as usize, cols.as_u64()? as usize);
            (rows > 0 && cols > 0).then_some([rows, cols])
        }
        _ => None,
    }
}

/// How an FP8 weight's scales cover it: `matrices` matrices of `rows × cols` (a tensor's
/// leading dims are its matrices), each scaled by a grid of `grid_rows × grid_cols` scales, one
/// a `block_rows × block_cols` block; one grid shared by every matrix where `shared`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScaleGrid {
    pub matrices: usize,
    pub rows: usize,
    pub cols: usize,
    pub grid_rows: usize,
    pub grid_cols: usize,
    pub block_rows: usize,
    pub block_cols: usize,
    pub shared: bool,
}

impl ScaleGrid {
    /// The grid a scale of shape `scale` gives a weight of shape `weight`: one value (a
    /// tensor's), one a row (`[rows]` or `[rows, 1]`), or a grid of blocks (`[⌈rows/br⌉,
    /// ⌈cols/bc⌉]` of the config's `block`, or a row's groups), each with the weight's leading
    /// dims before it.
    pub fn of(weight: &[usize], scale: &[usize], block: Option<[usize; 2]>) -> std::result::Result<Self, String> {
        let (lead, rows, cols) = match weight {
            [] => return Err("an FP8 weight must have a dim".into()),
            [cols] => (&[][..], 1, *cols),
            [lead @ .., rows, cols] => (lead, *rows, *cols),
        };
        let matrices: usize = lead.iter().product();
        let scale_count: usize = scale.iter().product();
        let grid = |grid_rows: usize, grid_cols: usize, shared: bool| -> std::result::Result<Self, String> {
            // The config's blocks where they give this grid; else only the layouts a grid's
            // shape tells apart: a tensor's scale, a row's, or groups of a row that divide it
            // (a grid of 2 × 3 over 200 × 300 could be blocks of 100 or of 128).
            let blocks = match block {
                Some([br, bc]) if rows.div_ceil(br) == grid_rows && cols.div_ceil(bc) == grid_cols => Some((br, bc)),
                _ if grid_rows == 1 && grid_cols == 1 => Some((rows, cols)),
                _ if grid_rows == rows && cols.is_multiple_of(grid_cols) => Some((1, cols / grid_cols)),
                _ => None,
            };
            let (block_rows, block_cols) = blocks.ok_or_else(|| {
                format!(
                    "its scale grid {grid_rows} × {grid_cols} does not divide {rows} × {cols} into blocks{}",
                    match block {
                        Some([r, c]) => format!(" of the config's {r} × {c}"),
                        None => " the config names (it has no `weight_block_size`)".into(),
                    }
                )
            })?;
            Ok(Self {
                matrices,
                rows,
                cols,
                grid_rows,
                grid_cols,
                block_rows,
                block_cols,
                shared,
            })
        };
        if rows == 0 || cols == 0 {
            return Err("an FP8 weight must not be empty".into());
        }
        if scale_count == 1 {
            return grid(1, 1, true);
        }
        let (scale_lead, grid_dims) = match scale.len().checked_sub(lead.len()) {
            Some(1) => (&scale[..lead.len()], [scale[lead.len()], 1]),
            Some(2) => (&scale[..lead.len()], [scale[lead.len()], scale[lead.len() + 1]]),
            _ => (scale, [0, 0]),
        };
        if scale_lead != lead
            || grid_dims[0] == 0
            || grid_dims[1] == 0
            || (scale.len() == lead.len() + 1 && grid_dims[0] != rows)
        {
            return Err(format!(
                "its scale's shape {scale:?} fits no layout of a weight of shape {weight:?}"
            ));
        }
        grid(grid_dims[0], grid_dims[1], false)
    }

    /// Which scale element `(matrix, row, col)` takes.
    fn scale_index(&self, matrix: usize, row: usize, col: usize) -> usize {
        let grid = if self.shared { 0 } else { matrix };
        (grid * self.grid_rows + row / self.block_rows) * self.grid_cols + col / self.block_cols
    }

    /// Whether every 32 columns of a row lie under one scale: the weight can be held as
    /// [`GgmlType::F8E4M3B32`] blocks.
    pub fn fits_blocks_of_32(&self) -> bool {
        self.cols.is_multiple_of(quant::fp8_blocks::BLOCK_ELEMS)
            && self.block_cols.is_multiple_of(quant::fp8_blocks::BLOCK_ELEMS)
    }

    pub fn scales(&self) -> usize {
        if self.shared {
            self.grid_rows * self.grid_cols
        } else {
            self.matrices * self.grid_rows * self.grid_cols
        }
    }
}

/// The weight as blocks of 32 codes with their scale ([`quant::fp8_blocks`]); the grid must
/// [fit them](ScaleGrid::fits_blocks_of_32).
pub fn blocks_of_32(codes: &[u8], scales: &[f32], grid: &ScaleGrid) -> Vec<u8> {
    use quant::fp8_blocks::{block, BLOCK_BYTES, BLOCK_ELEMS};
    assert!(grid.fits_blocks_of_32(), "{grid:?} does not fit blocks of 32");
    let row_bytes = grid.cols / BLOCK_ELEMS * BLOCK_BYTES;
    let mut out = vec![0u8; codes.len() / BLOCK_ELEMS * BLOCK_BYTES];
    out.par_chunks_mut(row_bytes)
        .zip(codes.par_chunks(grid.cols))
        .enumerate()
        .for_each(|(at, (out, codes))| {
            let (matrix, row) = (at / grid.rows, at % grid.rows);
            for (b, (out, codes)) in out
                .chunks_exact_mut(BLOCK_BYTES)
                .zip(codes.chunks_exact(BLOCK_ELEMS))
                .enumerate()
            {
                let scale = scales[grid.scale_index(matrix, row, b * BLOCK_ELEMS)];
                out.copy_from_slice(&block(scale, codes.try_into().expect("32 codes")));
            }
        });
    out
}

/// The weight's bytes as `dtype` (f32, bf16 or f16): each code widened, times its scale in
/// f32, the product rounded to `dtype`.
pub fn dequantize(codes: &[u8], scales: &[f32], grid: &ScaleGrid, dtype: GgmlType) -> Vec<u8> {
    let widened = quant::fp8_blocks::code_values();
    let size = quant::tensor::float_bytes(dtype)
        .unwrap_or_else(|| panic!("FP8 weights are read as f32, bf16 or f16, not {}", dtype.name()));
    let mut out = vec![0u8; codes.len() * size];
    out.par_chunks_mut(size * grid.cols)
        .zip(codes.par_chunks(grid.cols))
        .enumerate()
        .for_each(|(at, (out, codes))| {
            let (matrix, row) = (at / grid.rows, at % grid.rows);
            for (col, (out, &code)) in out.chunks_exact_mut(size).zip(codes).enumerate() {
                let value = widened[usize::from(code)] * scales[grid.scale_index(matrix, row, col)];
                quant::tensor::write_float(value, dtype, out);
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};
    use ir::F8E4M3;

    fn grid(weight: &[usize], scale: &[usize], block: Option<[usize; 2]>) -> std::result::Result<ScaleGrid, String> {
        ScaleGrid::of(weight, scale, block)
    }

    #[test]
    fn scale_shapes_give_their_layouts() {
        // A tensor's one scale, as a scalar or `[1]`.
        for scale in [&[][..], &[1]] {
            let g = grid(&[4, 6], scale, None).unwrap();
            assert_eq!((g.block_rows, g.block_cols, g.shared), (4, 6, true));
        }
        // A row's, as `[rows, 1]` or `[rows]`.
        for scale in [&[4, 1][..], &[4]] {
            let g = grid(&[4, 6], scale, None).unwrap();
            assert_eq!((g.grid_rows, g.grid_cols, g.block_rows, g.block_cols), (4, 1, 1, 6));
        }
        // Groups of a row, and the config's blocks, whole or past the edge.
        assert_eq!(grid(&[4, 6], &[4, 3], None).unwrap().block_cols, 2);
        let g = grid(&[256, 384], &[2, 3], Some([128, 128])).unwrap();
        assert_eq!((g.block_rows, g.block_cols), (128, 128));
        let g = grid(&[200, 300], &[2, 3], Some([128, 128])).unwrap();
        assert_eq!((g.block_rows, g.block_cols), (128, 128));
        // Stacked experts: a grid each, or one scale each.
        let g = grid(&[3, 200, 300], &[3, 2, 3], Some([128, 128])).unwrap();
        assert_eq!((g.matrices, g.shared, g.scales()), (3, false, 18));
        let g = grid(&[3, 8, 6], &[3, 8, 1], None).unwrap();
        assert_eq!((g.grid_rows, g.scales()), (8, 24));
    }

    #[test]
    fn scale_shapes_that_fit_no_layout_are_refused() {
        // Blocks need the config's block size, even where a size divides the sides.
        for (weight, scale) in [([200, 300], [2, 3]), ([256, 384], [2, 3]), ([100, 300], [1, 3])] {
            let err = grid(&weight, &scale, None).unwrap_err();
            assert!(err.contains("weight_block_size"), "{err}");
        }
        // The config's block that does not give the grid.
        assert!(grid(&[256, 384], &[2, 3], Some([64, 64])).is_err());
        for scale in [&[5, 1][..], &[3], &[2, 4, 3], &[4, 0]] {
            assert!(grid(&[4, 6], scale, None).is_err(), "{scale:?}");
        }
        assert!(grid(&[3, 8, 6], &[2, 8, 1], None).is_err());
        assert!(grid(&[0, 6], &[1], None).is_err());
    }

    /// Every element takes its block's scale, its product rounded once to the type asked
    /// for: a 5 × 7 weight in 2 × 3 blocks (the last ones short), two matrices, scales that
    /// make products f16 and bf16 round.
    #[test]
    fn each_element_is_its_code_times_its_blocks_scale() {
        let g = grid(&[2, 5, 7], &[2, 3, 3], Some([2, 3])).unwrap();
        let codes: Vec<u8> = (0..70)
            .map(|i| (i * 37 % 251) as u8 & 0x7e | (i as u8 & 1) << 7)
            .collect();
        let scales: Vec<f32> = (0..g.scales()).map(|i| 0.013 + i as f32 * 0.6173).collect();
        let want =
            |at: usize, m: usize, r: usize, c: usize| F8E4M3(codes[at]).to_f32() * scales[(m * 3 + r / 2) * 3 + c / 3];
        let (f32s, bf16s, f16s) = (
            dequantize(&codes, &scales, &g, GgmlType::F32),
            dequantize(&codes, &scales, &g, GgmlType::BF16),
            dequantize(&codes, &scales, &g, GgmlType::F16),
        );
        let mut rounded = 0;
        for m in 0..2 {
            for r in 0..5 {
                for c in 0..7 {
                    let at = (m * 5 + r) * 7 + c;
                    let value = want(at, m, r, c);
                    let word = |b: &[u8]| [b[2 * at], b[2 * at + 1]];
                    assert_eq!(
                        f32::from_le_bytes(f32s[4 * at..4 * at + 4].try_into().unwrap()).to_bits(),
                        value.to_bits()
                    );
                    assert_eq!(
                        bf16::from_le_bytes(word(&bf16s)),
                        bf16::from_f32(value),
                        "({m}, {r}, {c})"
                    );
                    assert_eq!(f16::from_le_bytes(word(&f16s)), f16::from_f32(value), "({m}, {r}, {c})");
                    rounded += usize::from(bf16::from_f32(value).to_f32() != value);
                }
            }
        }
        assert!(rounded > 20, "only {rounded} products needed rounding");
    }

    /// Held as blocks of 32, each weight is the same f32 product; grids whose scales change
    /// within 32 columns do not fit.
    #[test]
    fn blocks_of_32_hold_the_same_products() {
        let g = grid(&[2, 3, 128], &[2, 2, 2], Some([2, 64])).unwrap();
        assert!(g.fits_blocks_of_32());
        let codes: Vec<u8> = (0..768)
            .map(|i| (i * 91 % 253) as u8 & 0x7e | (i as u8 & 2) << 6)
            .collect();
        let scales: Vec<f32> = (0..g.scales()).map(|i| 0.25 + i as f32 * 0.37).collect();
        let blocks = blocks_of_32(&codes, &scales, &g);
        let mut widened = vec![0f32; codes.len()];
        GgmlType::F8E4M3B32.dequantize(&blocks, &mut widened);
        let products = dequantize(&codes, &scales, &g, GgmlType::F32);
        let products: Vec<f32> = products
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(widened, products);
        assert!(!grid(&[4, 48], &[4, 1], None).unwrap().fits_blocks_of_32());
        assert!(!grid(&[4, 64], &[4, 4], None).unwrap().fits_blocks_of_32());
        assert!(grid(&[4, 64], &[4, 1], None).unwrap().fits_blocks_of_32());
    }

    /// The checks of one grid: every element takes a scale the file holds, every scale covers
    /// an element, and blocks of 32 are chosen only where each 32 columns of a row share one.
    fn check_covers(g: &ScaleGrid, count: usize) -> std::result::Result<(), String> {
        if g.scales() != count {
            return Err(format!("{} scales for {count}", g.scales()));
        }
        let mut used = vec![false; count];
        for m in 0..g.matrices {
            for r in 0..g.rows {
                for c in 0..g.cols {
                    let at = g.scale_index(m, r, c);
                    if at >= count {
                        return Err(format!("({m}, {r}, {c}) takes scale {at} of {count}"));
                    }
                    used[at] = true;
                    if g.fits_blocks_of_32() && at != g.scale_index(m, r, c / 32 * 32) {
                        return Err(format!("({m}, {r}, {c}): two scales in a block of 32"));
                    }
                }
            }
        }
        match used.iter().all(|&u| u) {
            true => Ok(()),
            false => Err("a scale no element takes".into()),
        }
    }

    proptest::proptest! {
        /// Whatever shapes a file declares, a grid is refused or covers the weight (see
        /// `check_covers`); the layouts files use (a tensor's scale, a row's, groups of a row,
        /// the config's blocks) are accepted.
        #[test]
        fn a_grid_covers_its_weight_with_the_scales_it_has(
            lead in proptest::collection::vec(1usize..4, 0..2),
            rows in 1usize..40,
            cols in 1usize..100,
            scale in proptest::collection::vec(0usize..40, 0..4),
            block in proptest::option::of((1usize..40, 1usize..100)),
            group in 1usize..8,
        ) {
            let weight: Vec<usize> = lead.iter().copied().chain([rows, cols]).collect();
            let with_lead = |tail: &[usize]| -> Vec<usize> { lead.iter().chain(tail).copied().collect() };
            let group = (1..=group).rev().find(|g| cols % g == 0).unwrap_or(1);
            let mut used = vec![
                (scale.clone(), None, false),
                (vec![], None, true),
                (with_lead(&[rows]), None, true),
                (with_lead(&[rows, 1]), None, true),
                (with_lead(&[rows, cols / group]), None, true),
            ];
            if let Some((br, bc)) = block {
                used.push((with_lead(&[rows.div_ceil(br), cols.div_ceil(bc)]), Some([br, bc]), true));
                used.push((scale.clone(), Some([br, bc]), false));
            }
            for (scale, block, accepted) in used {
                match grid(&weight, &scale, block) {
                    Ok(g) => {
                        let count: usize = scale.iter().product();
                        let covered = check_covers(&g, count);
                        proptest::prop_assert!(covered.is_ok(), "{weight:?} by {scale:?}: {covered:?}");
                    }
                    Err(e) => proptest::prop_assert!(!accepted, "{weight:?} by {scale:?} ({block:?}): {e}"),
                }
            }
        }
    }
}
