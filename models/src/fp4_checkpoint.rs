//! FP4 checkpoints: linear weights stored as FP4 E2M1 codes, two to a byte (a byte's low
//! nibble the even column), with a scale for each group of a row. NVFP4: an FP8 E4M3 scale
//! for each 16 columns and an f32 scale for the whole tensor, as compressed-tensors (`format:
//! "nvfp4-pack-quantized"`: `X.weight_packed`, `X.weight_scale`, `X.weight_global_scale`, the
//! weight `code · scale / global`) and NVIDIA's ModelOpt (`quant_algo: "NVFP4"`: `X.weight`,
//! `X.weight_scale`, `X.weight_scale_2`, the weight `code · scale · scale_2`) save them.
//! MXFP4: a power of two for each 32 columns, its E8M0 exponent a byte (`2^(e − 127)`), as
//! compressed-tensors saves it (`"mxfp4-pack-quantized"`: `X.weight_packed`, `X.weight_scale`).
//!
//! bbc folds an NVFP4 group's two scales into one f32 (`scale / global` or `scale · scale_2`,
//! rounded once), so a weight is its code's value times that, one product in f32: what
//! compressed-tensors computes before rounding to the model's type, and within an f32 rounding
//! of the exact product FP4 tensor cores take. An MXFP4 weight is exactly its code's value
//! times its power of two. Rows of whole blocks of 32 are held as
//! `quant::fp4_blocks` (6 bits a weight); others, and every weight when the model is read into
//! a float type, are dequantized, each product rounded once to that type. The activations'
//! scales W4A4 checkpoints carry (`input_global_scale`, `input_scale`) are not used: bbc's
//! activations stay floats.

use crate::quant::GgmlType;
use ir::F8E4M3;
use quant::fp4_blocks;
use rayon::prelude::*;

/// The methods whose weights are FP4.
pub const FP4_METHODS: &str = "compressed-tensors (nvfp4-pack-quantized, mxfp4-pack-quantized) and modelopt (NVFP4)";

/// Whose layout an FP4 checkpoint has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp4Layout {
    /// compressed-tensors' NVFP4.
    CompressedTensorsNvfp4,
    /// ModelOpt's NVFP4.
    ModelOptNvfp4,
    /// compressed-tensors' MXFP4.
    CompressedTensorsMxfp4,
}

/// The names of a weight `X.weight`'s parts, after `X.`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp4PartNames {
    pub codes: &'static str,
    pub scales: &'static str,
    /// The tensor's f32 scale (NVFP4's).
    pub global: Option<&'static str>,
    /// The activations' scale a W4A4 checkpoint carries beside the weight (not used).
    pub activations: &'static str,
}

impl Fp4Layout {
    pub fn part_names(self) -> Fp4PartNames {
        match self {
            Self::CompressedTensorsNvfp4 => Fp4PartNames {
                codes: "weight_packed",
                scales: "weight_scale",
                global: Some("weight_global_scale"),
                activations: "input_global_scale",
            },
            Self::ModelOptNvfp4 => Fp4PartNames {
                codes: "weight",
                scales: "weight_scale",
                global: Some("weight_scale_2"),
                activations: "input_scale",
            },
            Self::CompressedTensorsMxfp4 => Fp4PartNames {
                codes: "weight_packed",
                scales: "weight_scale",
                global: None,
                activations: "input_global_scale",
            },
        }
    }

    /// Columns under one scale.
    pub fn group(self) -> usize {
        match self {
            Self::CompressedTensorsMxfp4 => 32,
            _ => 16,
        }
    }

    /// A group's f32 scale from its stored byte (an FP8 E4M3 code, or an E8M0 exponent) and
    /// the tensor's global scale (1 where there is none), rounded once.
    pub fn group_scale(self, scale: u8, global: f32) -> f32 {
        match self {
            Self::CompressedTensorsNvfp4 => F8E4M3(scale).to_f32() / global,
            Self::ModelOptNvfp4 => F8E4M3(scale).to_f32() * global,
            // E8M0: 2^(e − 127) exactly (e = 0 a subnormal), 255 its NaN.
            Self::CompressedTensorsMxfp4 => match scale {
                255 => f32::NAN,
                0 => f32::from_bits(1 << 22),
                e => f32::from_bits(u32::from(e) << 23),
            },
        }
    }
}

/// The NVFP4 layout `quant_method` and its config name, `None` where they name none (the
/// caller tries the other methods); an error says why a named one is not read.
pub fn scheme_of(method: &str, quant: &serde_json::Value) -> Option<Result<Fp4Layout, String>> {
    let text = |v: Option<&serde_json::Value>| v.and_then(|v| v.as_str()).map(str::to_ascii_lowercase);
    match method {
        "compressed-tensors" if text(quant.get("format")).as_deref() == Some("nvfp4-pack-quantized") => {
            Some(compressed_tensors_groups(quant, 16).map(|()| Fp4Layout::CompressedTensorsNvfp4))
        }
        "compressed-tensors" if text(quant.get("format")).as_deref() == Some("mxfp4-pack-quantized") => {
            Some(compressed_tensors_groups(quant, 32).map(|()| Fp4Layout::CompressedTensorsMxfp4))
        }
        "modelopt" if text(quant.get("quant_algo")).as_deref() == Some("nvfp4") => {
            Some(match quant.get("group_size").and_then(|g| g.as_u64()) {
                None | Some(16) => Ok(Fp4Layout::ModelOptNvfp4),
                Some(g) => Err(format!(
                    "ModelOpt NVFP4 in groups of {g} is not read (groups of 16 are)"
                )),
            })
        }
        _ => None,
    }
}

/// compressed-tensors' FP4 weights must be 4-bit floats in groups of `size` (16 for NVFP4, 32
/// for MXFP4) in every group of its config, without zero points.
fn compressed_tensors_groups(quant: &serde_json::Value, size: u64) -> Result<(), String> {
    let groups = quant.get("config_groups").and_then(|g| g.as_object());
    let mut any = false;
    for (name, group) in groups.into_iter().flatten() {
        let Some(weights) = group.get("weights").filter(|w| !w.is_null()) else {
            continue;
        };
        let kind = weights.get("type").and_then(|t| t.as_str());
        let bits = weights.get("num_bits").and_then(|b| b.as_u64());
        let group_size = weights.get("group_size").and_then(|g| g.as_u64());
        if kind != Some("float") || bits != Some(4) || group_size != Some(size) {
            return Err(format!(
                "group `{name}` of an FP4 checkpoint holds {} bits of type {kind:?} in groups of {}, not 4-bit \
                 floats in groups of {size}",
                bits.map_or("?".into(), |b| b.to_string()),
                group_size.map_or("?".into(), |g| g.to_string()),
            ));
        }
        if weights.get("symmetric").and_then(|s| s.as_bool()) == Some(false) {
            return Err(format!("group `{name}`: FP4 weights with zero points are not read"));
        }
        any = true;
    }
    match any {
        true => Ok(()),
        false => Err("an FP4 checkpoint with no group of weights".into()),
    }
}

/// One FP4 weight: `rows × cols` (outputs × inputs), its codes `[rows, cols / 2]` bytes, its
/// scales `[rows, cols / group]` bytes, its global scale (NVFP4's) one f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp4Weight {
    pub layout: Fp4Layout,
    pub rows: usize,
    pub cols: usize,
}

impl Fp4Weight {
    /// The weight the parts' shapes (as the file declares them; `global` where the layout has
    /// one) give, or why they give none.
    pub fn of(layout: Fp4Layout, codes: &[usize], scales: &[usize], global: Option<&[usize]>) -> Result<Self, String> {
        let &[rows, half_cols] = codes else {
            return Err(format!("its codes have shape {codes:?}, not a matrix's"));
        };
        let (cols, group) = (half_cols * 2, layout.group());
        if rows == 0 || !cols.is_multiple_of(group) || cols == 0 {
            return Err(format!("its codes' rows of {cols} are not whole groups of {group}"));
        }
        if scales != [rows, cols / group] {
            return Err(format!(
                "its scales have shape {scales:?}, not [{rows}, {}] (one for each {group} of {cols} columns)",
                cols / group
            ));
        }
        if let Some(global) = global.filter(|g| g.iter().product::<usize>() != 1) {
            return Err(format!("its global scale has shape {global:?}, not one value"));
        }
        Ok(Self { layout, rows, cols })
    }

    /// Whether the weight's rows are whole FP4 blocks of 32.
    pub fn fits_blocks(&self) -> bool {
        self.cols.is_multiple_of(fp4_blocks::BLOCK_ELEMS)
    }

    /// Row `r`'s codes (one a column) and its groups' f32 scales.
    fn row(&self, codes: &[u8], scales: &[u8], global: f32, r: usize, out: &mut (Vec<u8>, Vec<f32>)) {
        let (row_codes, row_scales) = out;
        let packed = &codes[r * self.cols / 2..(r + 1) * self.cols / 2];
        for (pair, &byte) in row_codes.chunks_exact_mut(2).zip(packed) {
            pair[0] = byte & 15;
            pair[1] = byte >> 4;
        }
        // Each 16 columns' scale (an MXFP4 group's twice).
        let group = self.layout.group();
        let groups = &scales[r * self.cols / group..(r + 1) * self.cols / group];
        for (s, c) in row_scales.iter_mut().zip((0..self.cols).step_by(16)) {
            *s = self.layout.group_scale(groups[c / group], global);
        }
    }

    /// Scratch for [`Self::row`].
    fn scratch(&self) -> (Vec<u8>, Vec<f32>) {
        (vec![0; self.cols], vec![0.0; self.cols / 16])
    }

    /// The weight as FP4 blocks (`quant::fp4_blocks`), the rows on the pool (`global` 1 where
    /// the layout has none). The rows must be [whole blocks](Self::fits_blocks).
    pub fn blocks(&self, codes: &[u8], scales: &[u8], global: f32) -> Vec<u8> {
        assert!(self.fits_blocks(), "{self:?} is not whole blocks of 32");
        let row_bytes = self.cols / fp4_blocks::BLOCK_ELEMS * fp4_blocks::BLOCK_BYTES;
        let mut out = vec![0u8; self.rows * row_bytes];
        out.par_chunks_mut(row_bytes).enumerate().for_each_init(
            || self.scratch(),
            |row, (r, out)| {
                self.row(codes, scales, global, r, row);
                let (row_codes, row_scales) = row;
                for (b, out) in out.chunks_exact_mut(fp4_blocks::BLOCK_BYTES).enumerate() {
                    let block_codes = std::array::from_fn(|e| row_codes[b * 32 + e]);
                    let block_scales = [row_scales[2 * b], row_scales[2 * b + 1]];
                    out.copy_from_slice(&fp4_blocks::block(block_scales, &block_codes));
                }
            },
        );
        out
    }

    /// The weight's bytes as `dtype` (f32, bf16 or f16): each code's value times its group's
    /// scale in f32, the product rounded to `dtype` (`global` as for [`Self::blocks`]).
    pub fn dequantize(&self, codes: &[u8], scales: &[u8], global: f32, dtype: GgmlType) -> Vec<u8> {
        let size = quant::tensor::float_bytes(dtype).unwrap_or_else(|| {
            panic!(
                "NVFP4 weights are dequantized to f32, bf16 or f16, not {}",
                dtype.name()
            )
        });
        let mut out = vec![0u8; self.rows * self.cols * size];
        out.par_chunks_mut(self.cols * size).enumerate().for_each_init(
            || self.scratch(),
            |row, (r, out)| {
                self.row(codes, scales, global, r, row);
                let (row_codes, row_scales) = row;
                for (c, out) in out.chunks_exact_mut(size).enumerate() {
                    let value = fp4_blocks::CODE_VALUES[usize::from(row_codes[c])] * row_scales[c / 16];
                    quant::tensor::write_float(value, dtype, out);
                }
            },
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use proptest::prelude::*;
    use serde_json::json;

    fn f32s(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Whatever the codes, scales and global scale, every element read back is its code's
        /// value times its group's scale: NVFP4's FP8 scale over (compressed-tensors) or times
        /// (ModelOpt) the global one, folded first; MXFP4's power of two. The FP4 blocks hold
        /// the same products bit for bit; bf16 is each product rounded once.
        #[test]
        fn every_element_is_its_codes_value_times_its_groups_scale(
            which in 0usize..3,
            rows in 1usize..5,
            col_groups in 1usize..7,
            global_bits in 0x3000_0000u32..0x4800_0000,
            seed in any::<u64>(),
        ) {
            let layout = [Fp4Layout::CompressedTensorsNvfp4, Fp4Layout::ModelOptNvfp4, Fp4Layout::CompressedTensorsMxfp4][which];
            let group = layout.group();
            let cols = col_groups * group;
            let mut state = seed | 1;
            let mut next = move || { state ^= state << 13; state ^= state >> 7; state ^= state << 17; state };
            let codes: Vec<u8> = (0..rows * cols / 2).map(|_| next() as u8).collect();
            // Finite, non-negative FP8 scales (NVFP4's are), or exponents of 2^-27 to 2^22.
            let scales: Vec<u8> = (0..rows * cols / group)
                .map(|_| match layout {
                    Fp4Layout::CompressedTensorsMxfp4 => (100 + next() % 50) as u8,
                    _ => (next() % 0x7f) as u8,
                })
                .collect();
            let global = match layout {
                Fp4Layout::CompressedTensorsMxfp4 => 1.0,
                _ => f32::from_bits(global_bits),
            };
            let weight = Fp4Weight::of(layout, &[rows, cols / 2], &[rows, cols / group], Some(&[1])).unwrap();
            prop_assert_eq!(weight.fits_blocks(), cols.is_multiple_of(32));
            let values = f32s(&weight.dequantize(&codes, &scales, global, GgmlType::F32));
            for r in 0..rows {
                for c in 0..cols {
                    let byte = codes[(r * cols + c) / 2];
                    let code = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
                    let stored = scales[(r * cols + c) / group];
                    let folded = match layout {
                        Fp4Layout::CompressedTensorsNvfp4 => F8E4M3(stored).to_f32() / global,
                        Fp4Layout::ModelOptNvfp4 => F8E4M3(stored).to_f32() * global,
                        Fp4Layout::CompressedTensorsMxfp4 => 2f32.powi(i32::from(stored) - 127),
                    };
                    let want = fp4_blocks::CODE_VALUES[code as usize] * folded;
                    prop_assert_eq!(values[r * cols + c].to_bits(), want.to_bits(), "({}, {})", r, c);
                }
            }
            if weight.fits_blocks() {
                let mut widened = vec![0f32; rows * cols];
                GgmlType::F4E2M1B32.dequantize(&weight.blocks(&codes, &scales, global), &mut widened);
                prop_assert!(widened.iter().zip(&values).all(|(a, b)| a.to_bits() == b.to_bits()));
            }
            let halves = weight.dequantize(&codes, &scales, global, GgmlType::BF16);
            for (h, v) in halves.chunks_exact(2).zip(&values) {
                prop_assert_eq!(bf16::from_le_bytes([h[0], h[1]]), bf16::from_f32(*v));
            }
        }
    }

    #[test]
    fn parts_of_other_shapes_are_refused() {
        let (ct, mx) = (Fp4Layout::CompressedTensorsNvfp4, Fp4Layout::CompressedTensorsMxfp4);
        assert!(Fp4Weight::of(ct, &[8, 16], &[8, 2], Some(&[1])).is_ok());
        assert!(Fp4Weight::of(ct, &[8, 16], &[8, 2], Some(&[])).is_ok());
        assert!(Fp4Weight::of(mx, &[8, 16], &[8, 1], None).is_ok());
        for (layout, codes, scales, global, said) in [
            (ct, &[2, 8, 16][..], &[8, 2][..], Some(&[1][..]), "not a matrix"),
            (ct, &[8, 12], &[8, 1], Some(&[1]), "whole groups of 16"),
            (ct, &[8, 16], &[8, 4], Some(&[1]), "one for each 16"),
            (ct, &[8, 16], &[8, 2], Some(&[2]), "not one value"),
            (mx, &[8, 8], &[8, 1], None, "whole groups of 32"),
            (mx, &[8, 16], &[8, 2], None, "one for each 32"),
        ] {
            let err = Fp4Weight::of(layout, codes, scales, global).unwrap_err();
            assert!(err.contains(said), "{err}");
        }
        // E8M0 exponents: powers of two, 0 the least, 255 not a number.
        assert_eq!(mx.group_scale(127, 1.0), 1.0);
        assert_eq!(mx.group_scale(130, 1.0), 8.0);
        assert_eq!(mx.group_scale(0, 1.0), 2f32.powi(-127));
        assert!(mx.group_scale(255, 1.0).is_nan());
    }

    #[test]
    fn schemes_are_read_or_refused_by_name() {
        let ct = |weights: serde_json::Value| json!({"format": "nvfp4-pack-quantized", "config_groups": {"group_0": {"weights": weights}}});
        let nvfp4 = json!({"num_bits": 4, "type": "float", "group_size": 16, "symmetric": true});
        assert_eq!(
            scheme_of("compressed-tensors", &ct(nvfp4)),
            Some(Ok(Fp4Layout::CompressedTensorsNvfp4))
        );
        let err = scheme_of(
            "compressed-tensors",
            &ct(json!({"num_bits": 4, "type": "float", "group_size": 32})),
        );
        assert!(err.unwrap().unwrap_err().contains("not 4-bit floats in groups of 16"));
        let mx = json!({"format": "mxfp4-pack-quantized", "config_groups": {"group_0": {"weights":
            {"num_bits": 4, "type": "float", "group_size": 32, "symmetric": true}}}});
        assert_eq!(
            scheme_of("compressed-tensors", &mx),
            Some(Ok(Fp4Layout::CompressedTensorsMxfp4))
        );
        let err = scheme_of(
            "compressed-tensors",
            &ct(json!({"num_bits": 4, "type": "float", "group_size": 16, "symmetric": false})),
        );
        assert!(err.unwrap().unwrap_err().contains("zero points"));
        assert_eq!(
            scheme_of("compressed-tensors", &json!({"format": "pack-quantized"})),
            None
        );
        assert_eq!(
            scheme_of("modelopt", &json!({"quant_algo": "NVFP4", "group_size": 16})),
            Some(Ok(Fp4Layout::ModelOptNvfp4))
        );
        let err = scheme_of("modelopt", &json!({"quant_algo": "NVFP4", "group_size": 32}));
        assert!(err.unwrap().unwrap_err().contains("groups of 32"));
        assert_eq!(scheme_of("modelopt", &json!({"quant_algo": "FP8"})), None);
        assert_eq!(scheme_of("fp8", &json!({})), None);
    }
}
