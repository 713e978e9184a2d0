//! Integer checkpoints: linear weights stored as packed integer levels `q` with a scale `s`
//! (and a zero point `z`) for each group of a row, as GPTQ (`quant_method: "gptq"`), AWQ
//! (`"awq"`, its GEMM layout), AutoRound (`"auto-round"`, packed as either) and
//! compressed-tensors (`"compressed-tensors"`, `pack-quantized`, and `int-quantized` a level a
//! byte) save them. A weight is `(q − z) · s`.
//!
//! bbc reads them as those libraries dequantize them, each product in f32. Where levels have
//! at most 4 bits and every 32 columns of a row lie in one group, each 32 columns of a row
//! become a block of 32 with their group's scale: 4-bit blocks (`quant::u4_blocks`: the
//! levels, the scale and `−z · s`, 6 bits a weight; blocks of 128, 4.5 bits, where every 128
//! columns lie in one group) where the scales make `q · s − z · s`
//! exact (every f16 and bf16 scale does), else FP8 blocks (`quant::fp8_blocks`: `q − z`, at
//! most 16 in magnitude, is exactly an E4M3 code; 9 bits a weight). Either way the products
//! are the same, run by kernels every such block has. Wider levels under f16 scales (bf16
//! ones nearly always are) are held as GGUF's Q8_0 blocks where every `q − z` is a signed byte
//! (levels of up to 7 bits, or 8 with every zero point 128: symmetric checkpoints), each weight
//! exactly `(q − z) · s` again. Act-order groups (listed out of order, `group_cols` columns
//! each) are held the same way with a matrix's columns regrouped by group
//! ([`PackedLayout::input_order`]). Other wider levels, other listed groups and groups that
//! split a block of 32 are dequantized into a float type instead, as is everything when the
//! model is read into one.

use crate::quant::GgmlType;
use ir::F8E4M3;
use quant::fp8_blocks::{block, BLOCK_BYTES, BLOCK_ELEMS};
use quant::u4_blocks;
use rayon::prelude::*;

/// How a method packs its levels and zero points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    /// GPTQ: levels packed `32 / bits` to a word along the input dim (`qweight`
    /// `[cols·bits/32, rows]`), zero points along the output dim (`qzeros` `[groups,
    /// rows·bits/32]`) stored less `zero_offset` (1 in GPTQ's first format, 0 in `gptq_v2`),
    /// scales `[groups, rows]`, and `g_idx`, each column's group.
    Gptq { zero_offset: i32 },
    /// AWQ's GEMM layout: 4-bit levels and zero points packed eight to a word along the output
    /// dim in the order 0, 2, 4, 6, 1, 3, 5, 7 (`qweight` `[cols, rows/8]`, `qzeros`
    /// `[groups, rows/8]`), scales `[groups, rows]`.
    Awq,
    /// compressed-tensors' `pack-quantized`: signed levels offset by `2^(bits−1)`, packed
    /// densely along the input dim (`weight_packed` `[rows, ⌈cols·bits/32⌉]`, a row's element
    /// `c` at bit `c·bits`), zero points the same way along the output dim
    /// (`weight_zero_point` `[⌈rows·bits/32⌉, groups]`, asymmetric schemes only), scales
    /// `[rows, groups]`, the weight's shape (`weight_shape`) and with act-order
    /// `weight_g_idx`. Stacked experts lead every part with their dim.
    CompressedTensors,
    /// compressed-tensors' `int-quantized`: a signed level a byte (`weight`, `I8`, `[rows,
    /// cols]`), zero points a byte (`weight_zero_point` `[rows, groups]`, asymmetric only),
    /// scales `[rows, groups]`; stacked experts lead every part with their dim.
    CompressedTensorsBytes,
}

/// What a checkpoint's `quantization_config` says of its integer weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntScheme {
    pub packing: Packing,
    pub bits: u32,
    /// Columns a group, where the config names it (a row's last group may be shorter).
    pub group_size: Option<usize>,
}

/// The tensors that hold one weight `X.weight`, by their names' ends after `X.`.
pub struct PartNames {
    pub levels: &'static str,
    pub zeros: &'static str,
    pub scales: &'static str,
    pub group_index: &'static str,
    /// compressed-tensors records the weight's shape (a packed row may end in padding).
    pub shape: Option<&'static str>,
}

/// The order AWQ packs eight outputs into a word: output `j` of a group of eight is the
/// word's nibble `AWQ_NIBBLE[j]`.
const AWQ_NIBBLE: [u32; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

impl IntScheme {
    pub fn part_names(&self) -> PartNames {
        match self.packing {
            Packing::Gptq { .. } | Packing::Awq => PartNames {
                levels: "qweight",
                zeros: "qzeros",
                scales: "scales",
                group_index: "g_idx",
                shape: None,
            },
            Packing::CompressedTensors => PartNames {
                levels: "weight_packed",
                zeros: "weight_zero_point",
                scales: "weight_scale",
                group_index: "weight_g_idx",
                shape: Some("weight_shape"),
            },
            Packing::CompressedTensorsBytes => PartNames {
                levels: "weight",
                zeros: "weight_zero_point",
                scales: "weight_scale",
                group_index: "weight_g_idx",
                shape: None,
            },
        }
    }

    fn mask(&self) -> u64 {
        (1u64 << self.bits) - 1
    }

    /// What compressed-tensors adds to a signed level to pack it (and what bbc adds to its
    /// signed bytes, so every packing's levels are unsigned).
    fn offset(&self) -> i32 {
        match self.packing {
            Packing::CompressedTensors | Packing::CompressedTensorsBytes => 1 << (self.bits - 1),
            _ => 0,
        }
    }

    /// Bytes of a level or zero point as the file stores them: a 32-bit word of several, or a
    /// byte of one.
    pub fn element_bytes(&self) -> usize {
        match self.packing {
            Packing::CompressedTensorsBytes => 1,
            _ => 4,
        }
    }
}

/// The integer scheme `quant_method` names, `None` where it names none (FP8 or unknown: the
/// caller decides); an error says why a named one is not read.
pub fn scheme_of(method: &str, quant: &serde_json::Value) -> Option<Result<IntScheme, String>> {
    let text = |key: &str| quant.get(key).and_then(|v| v.as_str()).map(str::to_ascii_lowercase);
    let bits = |keys: &[&str]| keys.iter().find_map(|k| quant.get(*k).and_then(|b| b.as_u64()));
    let group_size = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| quant.get(*k).and_then(|g| g.as_i64()))
            .filter(|&g| g > 0)
            .map(|g| g as usize)
    };
    match method {
        // AutoRound's checkpoints packed as GPTQ or AWQ pack them (the formats vLLM reads).
        "auto-round" | "intel/auto-round" => Some((|| {
            let layout = text("packing_format").unwrap_or_else(|| "auto_round:auto_gptq".into());
            let same = match layout.as_str() {
                "auto_round:auto_gptq" => "gptq",
                "auto_round:auto_awq" => "awq",
                other => {
                    return Err(format!(
                    "AutoRound's `{other}` packing is not read (`auto_round:auto_gptq` and `auto_round:auto_awq` are)"
                ))
                }
            };
            if let Some(kind) = text("data_type").filter(|t| t != "int") {
                return Err(format!("AutoRound's `{kind}` weights are not read (integers are)"));
            }
            let scheme = scheme_of(same, quant).expect("a method read")?;
            auto_round_layers_agree(quant, scheme)?;
            Ok(scheme)
        })()),
        "gptq" => Some((|| {
            let bits = bits(&["bits"]).ok_or("GPTQ's config has no `bits`")?;
            if !matches!(bits, 2 | 4 | 8) {
                return Err(format!("{bits}-bit GPTQ weights are not read (2, 4 and 8 bits are)"));
            }
            if quant.get("is_marlin_format").and_then(|m| m.as_bool()) == Some(true) {
                return Err("GPTQ weights repacked for Marlin are not read".into());
            }
            let zero_offset = match text("checkpoint_format").as_deref() {
                None | Some("gptq") => 1,
                Some("gptq_v2") => 0,
                Some(other) => return Err(format!("GPTQ's `checkpoint_format` `{other}` is not read")),
            };
            Ok(IntScheme {
                packing: Packing::Gptq { zero_offset },
                bits: bits as u32,
                group_size: group_size(&["group_size"]),
            })
        })()),
        "awq" => Some((|| {
            let bits = bits(&["bits", "w_bit"]).ok_or("AWQ's config has no `bits`")?;
            if bits != 4 {
                return Err(format!("{bits}-bit AWQ weights are not read (4 bits are)"));
            }
            match text("version").as_deref() {
                None | Some("gemm") => {}
                Some(other) => return Err(format!("AWQ's `{other}` layout is not read (its GEMM layout is)")),
            }
            if quant.get("zero_point").and_then(|z| z.as_bool()) == Some(false) {
                return Err("AWQ weights without zero points are not read".into());
            }
            Ok(IntScheme {
                packing: Packing::Awq,
                bits: 4,
                group_size: group_size(&["group_size", "q_group_size"]),
            })
        })()),
        "compressed-tensors" => {
            let packing = match text("format").as_deref() {
                Some("pack-quantized") => Packing::CompressedTensors,
                Some("int-quantized") => Packing::CompressedTensorsBytes,
                _ => return None,
            };
            Some(compressed_tensors_weights(quant).map(|(bits, group_size)| IntScheme {
                packing,
                bits,
                group_size,
            }))
        }
        _ => None,
    }
}

/// AutoRound's per-layer settings (`extra_config`, by module name) may keep a layer in floats
/// (16 bits or more: its file holds floats) or repeat the checkpoint's width and group size;
/// other widths or group sizes are refused, naming the layer.
fn auto_round_layers_agree(quant: &serde_json::Value, scheme: IntScheme) -> Result<(), String> {
    let layers = quant.get("extra_config").and_then(|c| c.as_object());
    for (name, layer) in layers.into_iter().flatten() {
        let bits = layer
            .get("bits")
            .and_then(|b| b.as_u64())
            .unwrap_or(u64::from(scheme.bits));
        let group = layer.get("group_size").and_then(|g| g.as_i64());
        let group = match group {
            Some(g) if g > 0 => Some(g as usize),
            Some(_) => None,
            None => scheme.group_size,
        };
        if bits < 16 && (bits != u64::from(scheme.bits) || group != scheme.group_size) {
            let groups = |g: Option<usize>| g.map_or("a scale a row".to_string(), |g| format!("groups of {g}"));
            return Err(format!(
                "AutoRound's layer `{name}` has {bits}-bit weights in {}, the checkpoint's are {}-bit in {}: \
                 layers of other widths or groups are not read",
                groups(group),
                scheme.bits,
                groups(scheme.group_size)
            ));
        }
    }
    Ok(())
}

/// compressed-tensors' integer weights must have the same width (and group size) in every
/// group of its config.
fn compressed_tensors_weights(quant: &serde_json::Value) -> Result<(u32, Option<usize>), String> {
    let groups = quant.get("config_groups").and_then(|g| g.as_object());
    let mut width = None;
    for (name, group) in groups.into_iter().flatten() {
        let Some(weights) = group.get("weights").filter(|w| !w.is_null()) else {
            continue;
        };
        let kind = weights.get("type").and_then(|t| t.as_str());
        let bits = weights.get("num_bits").and_then(|b| b.as_u64()).unwrap_or(0);
        if kind != Some("int") || !(1..=8).contains(&bits) {
            return Err(format!(
                "group `{name}` holds weights of {bits} bits of type {kind:?}, not integers of 1 to 8 bits"
            ));
        }
        let group_size = weights
            .get("group_size")
            .and_then(|g| g.as_i64())
            .filter(|&g| g > 0)
            .map(|g| g as usize);
        if width.is_some_and(|w| w != (bits, group_size)) {
            return Err("its groups pack weights of different widths or group sizes".into());
        }
        width = Some((bits, group_size));
    }
    width
        .map(|(w, g)| (w as u32, g))
        .ok_or_else(|| "integer weights with no group of weights".into())
}

/// The shapes of one weight's parts as the file declares them.
pub struct PartShapes<'a> {
    pub levels: &'a [usize],
    pub zeros: Option<&'a [usize]>,
    pub scales: &'a [usize],
    pub group_index: Option<&'a [usize]>,
    /// compressed-tensors' `weight_shape`, read.
    pub shape: Option<Vec<usize>>,
}

/// How one packed weight lies in its parts: `matrices` matrices of `rows × cols` (outputs ×
/// inputs), `groups` groups of each row, each a scale (and zero point) per row; a column's
/// group is `group_index[c]` where the checkpoint lists them, else `c / group_cols`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedLayout {
    pub scheme: IntScheme,
    pub matrices: usize,
    pub rows: usize,
    pub cols: usize,
    pub groups: usize,
    pub group_cols: usize,
    /// Scales (and zero points) for every row, or one row of them broadcast.
    scale_rows: usize,
    /// Words of a packed row of levels (compressed-tensors) or of zero points.
    row_words: usize,
    zero_words: usize,
    /// The listed groups, where they are not `c / group_cols` (act-order).
    pub group_index: Option<Vec<u32>>,
    /// Where listed groups each take `group_cols` columns (the last one the rest) of a single
    /// matrix, as GPTQ's act-order lists them: the columns by group, in order within each
    /// (`input_order[j]` the column held as column `j`). Held so, every group is a run of
    /// `group_cols` columns again, and blocks are made as for groups in order; the layer's
    /// input is taken in the same order (the IR's `permute_columns`).
    pub input_order: Option<Vec<u32>>,
}

impl PackedLayout {
    /// The layout the parts' shapes give (`group_index`: the values of the listed groups),
    /// or why they fit none.
    pub fn of(scheme: IntScheme, parts: &PartShapes<'_>, group_index: Option<&[i64]>) -> Result<Self, String> {
        let per = (32 / scheme.bits) as usize;
        let (matrices, rows, cols, row_words) = match (scheme.packing, parts.levels, &parts.shape) {
            (Packing::Gptq { .. }, &[packed, rows], _) => (1, rows, packed * per, 0),
            (Packing::Awq, &[cols, packed], _) => (1, packed * 8, cols, 0),
            (Packing::CompressedTensors, levels, Some(shape)) => {
                let (lead, rows, cols) = match shape[..] {
                    [rows, cols] => (1, rows, cols),
                    [experts, rows, cols] => (experts, rows, cols),
                    _ => {
                        return Err(format!(
                            "its `weight_shape` {shape:?} is not a matrix or a stack of them"
                        ))
                    }
                };
                let words = (cols * scheme.bits as usize).div_ceil(32);
                let want: Vec<usize> = match shape.len() {
                    2 => vec![rows, words],
                    _ => vec![lead, rows, words],
                };
                if levels != want {
                    return Err(format!(
                        "its packed levels are {levels:?}, not {want:?} for a weight of {shape:?} at {} bits",
                        scheme.bits
                    ));
                }
                (lead, rows, cols, words)
            }
            (Packing::CompressedTensors, _, None) => return Err("it has no `weight_shape`".into()),
            (Packing::CompressedTensorsBytes, &[rows, cols], _) => (1, rows, cols, 0),
            (Packing::CompressedTensorsBytes, &[experts, rows, cols], _) => (experts, rows, cols, 0),
            (_, levels, _) => return Err(format!("its packed levels are {levels:?}, not a matrix")),
        };
        if rows == 0 || cols == 0 {
            return Err("the weight is empty".into());
        }
        let lead = |dims: &[usize]| -> Result<Vec<usize>, String> {
            match (matrices, dims.len()) {
                (1, _) => Ok(dims.to_vec()),
                (m, n) if n > 1 && dims[0] == m => Ok(dims[1..].to_vec()),
                _ => Err(format!(
                    "a part of shape {dims:?} does not lead with the {matrices} experts"
                )),
            }
        };
        let compressed_tensors = matches!(
            scheme.packing,
            Packing::CompressedTensors | Packing::CompressedTensorsBytes
        );
        let (scale_rows, groups) = match (compressed_tensors, &lead(parts.scales)?[..]) {
            (true, &[r, g]) if r == rows || r == 1 => (r, g),
            (true, &[n]) if n == rows || n == 1 => (n, 1),
            (false, &[g, r]) if r == rows => (rows, g),
            (_, dims) => return Err(format!("its scales {dims:?} fit no layout of {rows} × {cols}")),
        };
        if groups == 0 || groups > cols {
            return Err(format!("its scales have {groups} groups for {cols} columns"));
        }
        let zero_words = match (scheme.packing, parts.zeros.map(lead).transpose()?) {
            (Packing::Gptq { .. }, Some(z)) if z == [groups, rows / per] && rows.is_multiple_of(per) => 0,
            (Packing::Awq, Some(z)) if z == [groups, rows / 8] && rows.is_multiple_of(8) => 0,
            (Packing::CompressedTensors, Some(z)) if z == [(rows * scheme.bits as usize).div_ceil(32), groups] => z[0],
            (Packing::CompressedTensorsBytes, Some(z)) if z == [rows, groups] => 0,
            (Packing::CompressedTensors | Packing::CompressedTensorsBytes, None) => 0,
            (_, None) => return Err("it has no zero points".into()),
            (_, Some(z)) => {
                return Err(format!(
                    "its zero points {z:?} fit no layout of {rows} rows in {groups} groups"
                ))
            }
        };
        let listed = match (parts.group_index, group_index) {
            (Some(dims), Some(values)) => {
                if dims != [cols] {
                    return Err(format!("its group index {dims:?} does not list {cols} columns"));
                }
                if let Some(bad) = values.iter().find(|&&g| g < 0 || g as usize >= groups) {
                    return Err(format!("its group index names group {bad} of {groups}"));
                }
                Some(values.iter().map(|&g| g as u32).collect::<Vec<u32>>())
            }
            _ => None,
        };
        // The config's group size where it gives these groups (a row's last one shorter), else
        // groups that divide the row evenly; listed groups in that order are no list.
        let group_cols = match scheme.group_size {
            Some(size) if cols.div_ceil(size) == groups => Some(size),
            _ if cols.is_multiple_of(groups) => Some(cols / groups),
            _ => None,
        };
        let listed =
            listed.filter(|g| group_cols.is_none_or(|size| g.iter().enumerate().any(|(c, &g)| g as usize != c / size)));
        let group_cols = match (group_cols, &listed) {
            (Some(size), _) => size,
            (None, Some(_)) => cols.div_ceil(groups),
            (None, None) => return Err(format!("{groups} groups do not divide {cols} columns evenly")),
        };
        let input_order = listed
            .as_deref()
            .filter(|_| matrices == 1)
            .and_then(|listed| columns_by_group(listed, groups, group_cols));
        Ok(Self {
            scheme,
            matrices,
            rows,
            cols,
            groups,
            group_cols,
            scale_rows,
            row_words,
            zero_words,
            group_index: listed,
            input_order,
        })
    }

    /// Whether every group is a run of `group_cols` columns as the weight is held: groups in
    /// order, or listed ones held in [`Self::input_order`].
    pub fn groups_held_in_order(&self) -> bool {
        self.group_index.is_none() || self.input_order.is_some()
    }

    /// The stored column held as column `col` ([`Self::input_order`]).
    fn stored_column(&self, col: usize) -> usize {
        self.input_order.as_ref().map_or(col, |order| order[col] as usize)
    }

    /// Whether the weight can be held as FP8 blocks of 32 (see the module's notes).
    pub fn fits_blocks_of_32(&self) -> bool {
        self.scheme.bits <= 4
            && self.groups_held_in_order()
            && self.cols.is_multiple_of(BLOCK_ELEMS)
            && (self.groups == 1 || self.group_cols.is_multiple_of(BLOCK_ELEMS))
    }

    /// The weight's shape as bbc addresses it.
    pub fn shape(&self) -> Vec<usize> {
        match self.matrices {
            1 => vec![self.rows, self.cols],
            m => vec![m, self.rows, self.cols],
        }
    }

    fn group(&self, col: usize) -> usize {
        match &self.group_index {
            Some(listed) => listed[col] as usize,
            None => col / self.group_cols,
        }
    }

    /// Group `group`'s zero point in row `row` of matrix `matrix` as stored, unsigned
    /// (compressed-tensors' signed ones plus their offset; a symmetric scheme's, without
    /// `zeros`, the offset: the differences are the same).
    fn zero_point(&self, zeros: Option<&[u8]>, matrix: usize, row: usize, group: usize) -> i32 {
        let scheme = self.scheme;
        let (mask, offset, bits) = (scheme.mask(), scheme.offset(), scheme.bits as usize);
        let Some(zeros) = zeros else { return offset };
        let per = 32 / bits;
        match scheme.packing {
            Packing::Gptq { zero_offset } => {
                let w = word(zeros, group * (self.rows / per) + row / per);
                ((u64::from(w) >> (row % per * bits)) & mask) as i32 + zero_offset
            }
            Packing::Awq => {
                let w = word(zeros, group * (self.rows / 8) + row / 8);
                ((w >> (AWQ_NIBBLE[row % 8] * 4)) & 0xF) as i32
            }
            Packing::CompressedTensors => {
                let first = matrix * self.zero_words * self.groups + group;
                dense_bits(zeros, first, self.groups, row * bits, bits, mask)
            }
            Packing::CompressedTensorsBytes => {
                i32::from(zeros[(matrix * self.rows + row) * self.groups + group] as i8) + offset
            }
        }
    }

    /// Row `row` of matrix `matrix` into `out`: its levels and each group's zero point as
    /// stored, unsigned ([`Self::zero_point`]), and each group's scale.
    fn row(&self, parts: &PackedParts<'_>, matrix: usize, row: usize, out: &mut Row) {
        let scheme = self.scheme;
        let (mask, offset) = (scheme.mask(), scheme.offset());
        let bits = scheme.bits as usize;
        let per = 32 / bits;
        let scale_row = if self.scale_rows == 1 { 0 } else { row };
        // compressed-tensors' scales lie `[rows, groups]`, GPTQ's and AWQ's `[groups, rows]`.
        let scale_at = |group: usize| match scheme.packing {
            Packing::CompressedTensors | Packing::CompressedTensorsBytes => {
                (matrix * self.scale_rows + scale_row) * self.groups + group
            }
            _ => group * self.rows + row,
        };
        let zero = |group: usize| self.zero_point(parts.zeros, matrix, row, group);
        for (g, (z, s)) in out.zeros.iter_mut().zip(&mut out.scales).enumerate() {
            *z = zero(g);
            *s = parts.scales[scale_at(g)];
        }
        for (col, level) in out.levels.iter_mut().enumerate() {
            *level = match scheme.packing {
                Packing::Gptq { .. } => {
                    let w = word(parts.levels, col / per * self.rows + row);
                    ((u64::from(w) >> (col % per * bits)) & mask) as i32
                }
                Packing::Awq => {
                    let w = word(parts.levels, col * (self.rows / 8) + row / 8);
                    ((w >> (AWQ_NIBBLE[row % 8] * 4)) & 0xF) as i32
                }
                Packing::CompressedTensors => {
                    let first = (matrix * self.rows + row) * self.row_words;
                    dense_bits(parts.levels, first, 1, col * bits, bits, mask)
                }
                Packing::CompressedTensorsBytes => {
                    i32::from(parts.levels[(matrix * self.rows + row) * self.cols + col] as i8) + offset
                }
            };
        }
    }

    /// Scratch for [`Self::row`].
    fn scratch(&self) -> Row {
        Row {
            levels: vec![0; self.cols],
            held: Vec::with_capacity(self.cols),
            zeros: vec![0; self.groups],
            scales: vec![0.0; self.groups],
        }
    }

    /// The weight as FP8 blocks of 32 (`quant::fp8_blocks`): each block's codes its levels less
    /// their zero points, its scale their group's. The layout must
    /// [fit them](Self::fits_blocks_of_32).
    pub fn blocks_of_32(&self, parts: &PackedParts<'_>) -> Vec<u8> {
        assert!(self.fits_blocks_of_32(), "{self:?} does not fit blocks of 32");
        self.in_blocks(parts, BLOCK_ELEMS, BLOCK_BYTES, |levels, zero, scale, out| {
            let codes = std::array::from_fn(|i| F8E4M3::from_f32((levels[i] - zero) as f32).0);
            out.copy_from_slice(&block(scale, &codes));
        })
    }

    /// The widest 4-bit blocks (`quant::u4_blocks`) whose columns lie in one group, where the
    /// levels have at most 4 bits and the groups are in order: blocks of 128 at groups of 128
    /// (GPTQ's and AWQ's default) or a scale a row, else of 32.
    pub fn u4_size(&self) -> Option<u4_blocks::Size> {
        let group = (self.groups > 1).then_some(self.group_cols);
        match self.scheme.bits <= 4 && self.groups_held_in_order() {
            true => u4_blocks::Size::widest(self.cols, group),
            false => None,
        }
    }

    /// The weight as 4-bit blocks of `size` (`quant::u4_blocks`): each block's levels as
    /// stored, its scale its group's, its offset the group's zero point times the scale,
    /// negated, so each weight is `level · scale − zero · scale`, exactly `(q − z) · s` where
    /// every scale is `u4_blocks::exact`. Each block must lie in one group (`size` no wider
    /// than [`Self::u4_size`]).
    pub fn u4_blocks(&self, parts: &PackedParts<'_>, size: u4_blocks::Size) -> Vec<u8> {
        assert!(
            self.u4_size().is_some_and(|widest| widest.elems() >= size.elems()),
            "{self:?} does not fit 4-bit blocks of {}",
            size.elems()
        );
        self.in_blocks(parts, size.elems(), size.bytes(), |stored, zero, scale, out| {
            // Levels of at most 4 bits; a byte's out of range for its width is masked.
            let mut levels = [0u8; 128];
            let levels = &mut levels[..stored.len()];
            for (level, &q) in levels.iter_mut().zip(stored) {
                *level = (q & 15) as u8;
            }
            u4_blocks::write_block(scale, -(zero as f32) * scale, levels, out)
        })
    }

    /// Whether the weight can be held as GGUF's Q8_0 blocks (`q · d`, `q` a signed byte, `d` an
    /// f16) of the same weights, its scales being f16s: every 32 columns of a row lie in one
    /// group, and every `q − z` is a signed byte, as levels of up to 7 bits always are and 8-bit
    /// ones where every zero point is 128 (symmetric; `zeros` the zero points as stored).
    pub fn fits_q8_0(&self, zeros: Option<&[u8]>) -> bool {
        let bits = self.scheme.bits;
        let whole_blocks = self.groups_held_in_order()
            && self.cols.is_multiple_of(BLOCK_ELEMS)
            && (self.groups == 1 || self.group_cols.is_multiple_of(BLOCK_ELEMS));
        let zero_rows = self.matrices * self.rows;
        whole_blocks
            && (bits <= 7
                || (0..zero_rows * self.groups).all(|at| {
                    let (row, group) = (at / self.groups, at % self.groups);
                    self.zero_point(zeros, row / self.rows, row % self.rows, group) == 128
                }))
    }

    /// The weight as GGUF's Q8_0 blocks: each block's bytes its levels less their zero point,
    /// its scale its group's as an f16. The layout must [fit them](Self::fits_q8_0) and every
    /// scale be an f16, so each weight is exactly `(q − z) · s`.
    pub fn q8_0_blocks(&self, parts: &PackedParts<'_>) -> Vec<u8> {
        assert!(self.fits_q8_0(parts.zeros), "{self:?} does not fit Q8_0 blocks");
        let (elems, bytes) = GgmlType::Q8_0.block_layout();
        self.in_blocks(parts, elems, bytes, |levels, zero, scale, out| {
            out[..2].copy_from_slice(&half::f16::from_f32(scale).to_le_bytes());
            for (q, &level) in out[2..].iter_mut().zip(levels) {
                *q = (level - zero) as i8 as u8;
            }
        })
    }

    /// The weight in blocks of `elems` columns, `bytes` bytes each: `make(levels, zero, scale,
    /// block)` writes each block from its levels with their group's zero point and scale, the
    /// rows on the pool, their columns in [`Self::input_order`] where there is one. Each block
    /// must lie in one group.
    fn in_blocks(
        &self,
        parts: &PackedParts<'_>,
        elems: usize,
        bytes: usize,
        make: impl Fn(&[i32], i32, f32, &mut [u8]) + Sync,
    ) -> Vec<u8> {
        let row_bytes = self.cols / elems * bytes;
        let mut out = vec![0u8; self.matrices * self.rows * row_bytes];
        out.par_chunks_mut(row_bytes).enumerate().for_each_init(
            || self.scratch(),
            |row, (at, out)| {
                self.row(parts, at / self.rows, at % self.rows, row);
                if let Some(order) = &self.input_order {
                    row.held.clear();
                    row.held.extend(order.iter().map(|&c| row.levels[c as usize]));
                    std::mem::swap(&mut row.levels, &mut row.held);
                }
                for (b, (out, levels)) in out
                    .chunks_exact_mut(bytes)
                    .zip(row.levels.chunks_exact(elems))
                    .enumerate()
                {
                    let group = self.group(self.stored_column(b * elems));
                    make(levels, row.zeros[group], row.scales[group], out);
                }
            },
        );
        out
    }

    /// The weight's bytes as `dtype` (f32, bf16 or f16): each level less its zero point, times
    /// its scale in f32, the product rounded to `dtype`.
    pub fn dequantize(&self, parts: &PackedParts<'_>, dtype: GgmlType) -> Vec<u8> {
        let size = quant::tensor::float_bytes(dtype).unwrap_or_else(|| {
            panic!(
                "packed integer weights are read as f32, bf16 or f16, not {}",
                dtype.name()
            )
        });
        let mut out = vec![0u8; self.matrices * self.rows * self.cols * size];
        out.par_chunks_mut(self.cols * size).enumerate().for_each_init(
            || self.scratch(),
            |row, (at, out)| {
                self.row(parts, at / self.rows, at % self.rows, row);
                for (col, (out, &level)) in out.chunks_exact_mut(size).zip(&row.levels).enumerate() {
                    let group = self.group(col);
                    let value = (level - row.zeros[group]) as f32 * row.scales[group];
                    quant::tensor::write_float(value, dtype, out);
                }
            },
        );
        out
    }
}

/// The columns by group (`listed[c]` column `c`'s), in order within each, where every group
/// but the last takes `group_cols` columns and the last the rest; `None` otherwise.
fn columns_by_group(listed: &[u32], groups: usize, group_cols: usize) -> Option<Vec<u32>> {
    let mut counts = vec![0usize; groups];
    for &g in listed {
        counts[g as usize] += 1;
    }
    let fits = counts
        .iter()
        .enumerate()
        .all(|(g, &n)| n == group_cols.min(listed.len().saturating_sub(g * group_cols)));
    if !fits {
        return None;
    }
    let mut order: Vec<u32> = (0..listed.len() as u32).collect();
    order.sort_by_key(|&c| listed[c as usize]);
    Some(order)
}

/// Word `at` of little-endian 32-bit words.
fn word(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at * 4..at * 4 + 4].try_into().expect("4 bytes"))
}

/// The `bits` bits (under `mask`) at bit `bit` of a dense stream of words, `stride` words
/// apart from word `first`.
fn dense_bits(bytes: &[u8], first: usize, stride: usize, bit: usize, bits: usize, mask: u64) -> i32 {
    let at = first + bit / 32 * stride;
    let low = u64::from(word(bytes, at));
    let high = match bit % 32 + bits > 32 {
        true => u64::from(word(bytes, at + stride)) << 32,
        false => 0,
    };
    (((low | high) >> (bit % 32)) & mask) as i32
}

/// One row of a packed weight as [`PackedLayout::row`] reads it.
struct Row {
    levels: Vec<i32>,
    /// The levels in the order the weight is held in, where it is not as stored.
    held: Vec<i32>,
    zeros: Vec<i32>,
    scales: Vec<f32>,
}

/// One packed weight's bytes: its levels and zero points as the file stores them (little-endian
/// 32-bit words), its scales widened to f32.
pub struct PackedParts<'a> {
    pub levels: &'a [u8],
    pub zeros: Option<&'a [u8]>,
    pub scales: &'a [f32],
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A weight's parts packed as `scheme` packs them, from its levels `q[m][r][c]`, zero
    /// points `z[m][r][g]` (levels as stored: unsigned) and scales, groups of `group_cols`.
    struct Packed {
        levels: Vec<u8>,
        levels_shape: Vec<usize>,
        zeros: Option<(Vec<u8>, Vec<usize>)>,
        scales_shape: Vec<usize>,
        scales: Vec<f32>,
        shape: Option<Vec<usize>>,
    }

    fn words(values: &[u32]) -> Vec<u8> {
        values.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// `values` (`bits` each) packed densely, `stride` words apart from `first`.
    fn pack_dense(out: &mut [u32], first: usize, stride: usize, bits: usize, values: impl Iterator<Item = u32>) {
        for (i, v) in values.enumerate() {
            let bit = i * bits;
            let at = first + bit / 32 * stride;
            let wide = u64::from(v) << (bit % 32);
            out[at] |= wide as u32;
            if bit % 32 + bits > 32 {
                out[at + stride] |= (wide >> 32) as u32;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn pack(
        scheme: IntScheme,
        matrices: usize,
        rows: usize,
        cols: usize,
        group_cols: usize,
        q: &[u32],
        z: Option<&[u32]>,
        s: &[f32],
    ) -> Packed {
        let bits = scheme.bits as usize;
        let per = 32 / bits;
        let groups = cols / group_cols;
        let at = |m: usize, r: usize, c: usize| (m * rows + r) * cols + c;
        let zat = |m: usize, r: usize, g: usize| (m * rows + r) * groups + g;
        match scheme.packing {
            Packing::Gptq { zero_offset } => {
                assert_eq!(matrices, 1);
                let mut lw = vec![0u32; cols / per * rows];
                for r in 0..rows {
                    for c in 0..cols {
                        lw[c / per * rows + r] |= q[at(0, r, c)] << (c % per * bits);
                    }
                }
                let mut zw = vec![0u32; groups * rows / per];
                let z = z.expect("GPTQ has zero points");
                for r in 0..rows {
                    for g in 0..groups {
                        let stored = (z[zat(0, r, g)] as i32 - zero_offset) as u32 & ((1 << bits) - 1);
                        zw[g * rows / per + r / per] |= stored << (r % per * bits);
                    }
                }
                let scales = (0..groups)
                    .flat_map(|g| (0..rows).map(move |r| s[zat(0, r, g)]))
                    .collect();
                Packed {
                    levels: words(&lw),
                    levels_shape: vec![cols / per, rows],
                    zeros: Some((words(&zw), vec![groups, rows / per])),
                    scales_shape: vec![groups, rows],
                    scales,
                    shape: None,
                }
            }
            Packing::Awq => {
                let order = [0, 2, 4, 6, 1, 3, 5, 7];
                let mut lw = vec![0u32; cols * rows / 8];
                for c in 0..cols {
                    for w in 0..rows / 8 {
                        for (i, &j) in order.iter().enumerate() {
                            lw[c * rows / 8 + w] |= q[at(0, w * 8 + j, c)] << (i * 4);
                        }
                    }
                }
                let z = z.expect("AWQ has zero points");
                let mut zw = vec![0u32; groups * rows / 8];
                for g in 0..groups {
                    for w in 0..rows / 8 {
                        for (i, &j) in order.iter().enumerate() {
                            zw[g * rows / 8 + w] |= z[zat(0, w * 8 + j, g)] << (i * 4);
                        }
                    }
                }
                let scales = (0..groups)
                    .flat_map(|g| (0..rows).map(move |r| s[zat(0, r, g)]))
                    .collect();
                Packed {
                    levels: words(&lw),
                    levels_shape: vec![cols, rows / 8],
                    zeros: Some((words(&zw), vec![groups, rows / 8])),
                    scales_shape: vec![groups, rows],
                    scales,
                    shape: None,
                }
            }
            Packing::CompressedTensorsBytes => {
                let offset = 1i32 << (bits - 1);
                let signed = |v: u32| (v as i32 - offset) as i8 as u8;
                Packed {
                    levels: q.iter().map(|&v| signed(v)).collect(),
                    levels_shape: lead(matrices, vec![rows, cols]),
                    zeros: z.map(|z| {
                        (
                            z.iter().map(|&v| signed(v)).collect(),
                            lead(matrices, vec![rows, groups]),
                        )
                    }),
                    scales_shape: lead(matrices, vec![rows, groups]),
                    scales: s.to_vec(),
                    shape: None,
                }
            }
            Packing::CompressedTensors => {
                let row_words = (cols * bits).div_ceil(32);
                let mut lw = vec![0u32; matrices * rows * row_words];
                for m in 0..matrices {
                    for r in 0..rows {
                        let first = (m * rows + r) * row_words;
                        pack_dense(&mut lw, first, 1, bits, (0..cols).map(|c| q[at(m, r, c)]));
                    }
                }
                let zero_words = (rows * bits).div_ceil(32);
                let zeros = z.map(|z| {
                    let mut zw = vec![0u32; matrices * zero_words * groups];
                    for m in 0..matrices {
                        for g in 0..groups {
                            let first = m * zero_words * groups + g;
                            pack_dense(&mut zw, first, groups, bits, (0..rows).map(|r| z[zat(m, r, g)]));
                        }
                    }
                    (words(&zw), lead(matrices, vec![zero_words, groups]))
                });
                Packed {
                    levels: words(&lw),
                    levels_shape: lead(matrices, vec![rows, row_words]),
                    zeros,
                    scales_shape: lead(matrices, vec![rows, groups]),
                    scales: s.to_vec(),
                    shape: Some(lead(matrices, vec![rows, cols])),
                }
            }
        }
    }

    fn lead(matrices: usize, dims: Vec<usize>) -> Vec<usize> {
        match matrices {
            1 => dims,
            m => [vec![m], dims].concat(),
        }
    }

    impl Packed {
        /// The parts' shapes, no group index listed.
        fn shapes(&self) -> PartShapes<'_> {
            PartShapes {
                levels: &self.levels_shape,
                zeros: self.zeros.as_ref().map(|z| &z.1[..]),
                scales: &self.scales_shape,
                group_index: None,
                shape: self.shape.clone(),
            }
        }

        /// The parts' bytes.
        fn parts(&self) -> PackedParts<'_> {
            PackedParts {
                levels: &self.levels,
                zeros: self.zeros.as_ref().map(|z| &z.0[..]),
                scales: &self.scales,
            }
        }
    }

    fn layout(scheme: IntScheme, p: &Packed) -> PackedLayout {
        PackedLayout::of(scheme, &p.shapes(), None).expect("a layout")
    }

    fn schemes() -> Vec<IntScheme> {
        let s = |packing, bits| IntScheme {
            packing,
            bits,
            group_size: None,
        };
        vec![
            s(Packing::Gptq { zero_offset: 1 }, 4),
            s(Packing::Gptq { zero_offset: 0 }, 4),
            s(Packing::Gptq { zero_offset: 1 }, 2),
            s(Packing::Gptq { zero_offset: 1 }, 8),
            s(Packing::Awq, 4),
            s(Packing::CompressedTensors, 4),
            s(Packing::CompressedTensors, 3),
            s(Packing::CompressedTensors, 8),
            s(Packing::CompressedTensorsBytes, 8),
            s(Packing::CompressedTensorsBytes, 4),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Whatever the levels, zero points and scales, every element read back is
        /// `(q − z) · s` of its own row and group (compressed-tensors' signed levels less the
        /// offset), and the FP8, 4-bit and Q8_0 blocks hold the same products; with act-order
        /// groups (a random order's runs of `group_cols` columns, listed), a single matrix's
        /// blocks hold them in `input_order`, experts' none.
        #[test]
        fn every_element_is_its_level_less_its_zero_times_its_scale(
            which in 0usize..10,
            act_order in any::<bool>(),
            experts in 1usize..3,
            row_octets in 1usize..3,
            col_blocks in 1usize..6,
            groups_per_block in prop::sample::select(vec![0usize, 1, 2, 3, 4]),
            asymmetric in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let scheme = schemes()[which];
            let compressed_tensors = matches!(scheme.packing, Packing::CompressedTensors | Packing::CompressedTensorsBytes);
            let matrices = if compressed_tensors { experts } else { 1 };
            let (rows, cols) = (row_octets * 8 * (32 / scheme.bits as usize).max(8) / 8, col_blocks * 32);
            // Groups of 64 columns, 32, 16 (which split a block), 128, or a row's.
            let group_cols = match groups_per_block {
                0 if cols % 64 == 0 => 64,
                2 => 16,
                3 if cols % 128 == 0 => 128,
                4 => cols,
                _ => 32,
            };
            let groups = cols / group_cols;
            let mut state = seed | 1;
            let mut next = move || { state ^= state << 13; state ^= state >> 7; state ^= state << 17; state };
            let top = 1u32 << scheme.bits;
            let q: Vec<u32> = (0..matrices * rows * cols).map(|_| (next() % u64::from(top)) as u32).collect();
            let with_zeros = asymmetric || !compressed_tensors;
            // Now and then every zero point the middle level (symmetric, as GPTQ stores it).
            let middle = next() % 3 == 0;
            let z: Vec<u32> = (0..matrices * rows * groups)
                .map(|_| if middle { top / 2 } else { (next() % u64::from(top)) as u32 })
                .collect();
            let z_values: Vec<u32> = match scheme.packing {
                // GPTQ's first format stores `z − 1`: a stored 0 is a zero point of 1.
                Packing::Gptq { zero_offset } => z.iter().map(|&z| z.max(zero_offset as u32)).collect(),
                _ => z.clone(),
            };
            // Scales of f16's precision, as checkpoints' are, or of f32's.
            let short = next() % 2 == 0;
            let s: Vec<f32> = (0..matrices * rows * groups)
                .map(|_| (next() % 1000) as f32 / 4096.0 + 1e-3)
                .map(|s| if short { half::f16::from_f32(s).to_f32() } else { s })
                .collect();
            let packed = pack(scheme, matrices, rows, cols, group_cols, &q, with_zeros.then_some(&z_values[..]), &s);
            // Act-order: the columns quantized in a random order, each run of `group_cols` of
            // it a group.
            let mut quantized: Vec<usize> = (0..cols).collect();
            for i in (1..cols).rev() {
                quantized.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            let mut group_of: Vec<usize> = (0..cols).map(|c| c / group_cols).collect();
            if act_order {
                for (at, &c) in quantized.iter().enumerate() {
                    group_of[c] = at / group_cols;
                }
            }
            let listed = group_of.iter().enumerate().any(|(c, &g)| g != c / group_cols);
            let layout = match act_order {
                true => {
                    let index: Vec<i64> = group_of.iter().map(|&g| g as i64).collect();
                    let shapes = PartShapes { group_index: Some(&[cols]), ..packed.shapes() };
                    PackedLayout::of(scheme, &shapes, Some(&index)).expect("a layout")
                }
                false => layout(scheme, &packed),
            };
            prop_assert_eq!(layout.group_index.is_some(), listed);
            prop_assert_eq!(layout.input_order.is_some(), listed && matrices == 1);
            let held_in_order = !listed || matrices == 1;
            // The stored column each held column is.
            let order: Vec<usize> = match &layout.input_order {
                Some(order) => order.iter().map(|&c| c as usize).collect(),
                None => (0..cols).collect(),
            };
            let held = |values: &[f32]| -> Vec<f32> {
                values.chunks_exact(cols).flat_map(|row| order.iter().map(|&c| row[c])).collect()
            };
            prop_assert_eq!(layout.shape(), lead(matrices, vec![rows, cols]));
            let parts = packed.parts();
            let values: Vec<f32> = layout
                .dequantize(&parts, GgmlType::F32)
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let offset = scheme.offset();
            for m in 0..matrices {
                for r in 0..rows {
                    for c in 0..cols {
                        let g = group_of[c];
                        let zero = if with_zeros { z_values[(m * rows + r) * groups + g] as i32 } else { offset };
                        let want = (q[(m * rows + r) * cols + c] as i32 - zero) as f32 * s[(m * rows + r) * groups + g];
                        prop_assert_eq!(values[(m * rows + r) * cols + c].to_bits(), want.to_bits(), "{:?} ({}, {}, {})", scheme, m, r, c);
                    }
                }
            }
            let values = held(&values);
            prop_assert_eq!(layout.fits_blocks_of_32(), held_in_order && scheme.bits <= 4 && group_cols % 32 == 0);
            if layout.fits_blocks_of_32() {
                let blocks = layout.blocks_of_32(&parts);
                let mut widened = vec![0f32; values.len()];
                for (b, out) in blocks.chunks_exact(quant::fp8_blocks::BLOCK_BYTES).zip(widened.chunks_exact_mut(BLOCK_ELEMS)) {
                    quant::fp8_blocks::dequantize_block(b, out);
                }
                prop_assert!(widened.iter().zip(&values).all(|(a, b)| a.to_bits() == b.to_bits()));
            }
            // Blocks of 128 where every 128 columns lie in a group, else of 32 where 32 do.
            let widest = match (scheme.bits <= 4 && held_in_order, cols % 128 == 0 && group_cols % 128 == 0, group_cols % 32 == 0) {
                (true, true, _) => Some(u4_blocks::Size::Of128),
                (true, false, true) => Some(u4_blocks::Size::Of32),
                _ => None,
            };
            prop_assert_eq!(layout.u4_size(), widest);
            let any_long = s.iter().any(|&s| !u4_blocks::exact(s));
            for size in [u4_blocks::Size::Of32, u4_blocks::Size::Of128] {
                if any_long || widest.is_none_or(|w| w.elems() < size.elems()) {
                    continue;
                }
                let blocks = layout.u4_blocks(&parts, size);
                prop_assert_eq!(blocks.len(), values.len() / size.elems() * size.bytes());
                let mut widened = vec![0f32; values.len()];
                size.format().dequantize(&blocks, &mut widened);
                // Equal as numbers: a zero weight may be either zero.
                prop_assert!(widened.iter().zip(&values).all(|(a, b)| a == b));
            }
            // Q8_0 where every 32 columns lie in a group and every `q − z` is a byte: levels of
            // up to 7 bits, or every zero point 128.
            let zeros_at_128 = (0..matrices * rows * groups)
                .all(|i| if with_zeros { z_values[i] == 128 } else { offset == 128 });
            let fits_q8_0 = held_in_order && group_cols % 32 == 0 && (scheme.bits <= 7 || zeros_at_128);
            prop_assert_eq!(layout.fits_q8_0(parts.zeros), fits_q8_0);
            if fits_q8_0 && short {
                let blocks = layout.q8_0_blocks(&parts);
                prop_assert_eq!(Some(blocks.len()), GgmlType::Q8_0.bytes_for(values.len()));
                let mut widened = vec![0f32; values.len()];
                GgmlType::Q8_0.dequantize(&blocks, &mut widened);
                prop_assert!(widened.iter().zip(&values).all(|(a, b)| a == b));
            }
        }
    }

    /// Act-order groups (GPTQ's `desc_act`: the index sends the columns to the groups out of
    /// order, `group_cols` to each) are read from the index: dequantized, each element its own
    /// group's product in its stored place; held in blocks (4-bit, FP8 and Q8_0), the columns
    /// by group, in order within each, each held column `j` the stored column
    /// `input_order[j]`. Groups of other sizes have no order and are dequantized only.
    #[test]
    fn act_order_groups_are_read_from_the_index() {
        let scheme = IntScheme {
            packing: Packing::Gptq { zero_offset: 1 },
            bits: 4,
            group_size: None,
        };
        let (rows, cols, group_cols) = (8, 64, 32);
        let q: Vec<u32> = (0..rows * cols).map(|i| (i * 7 % 16) as u32).collect();
        let z: Vec<u32> = (0..rows * 2).map(|i| 1 + (i % 15) as u32).collect();
        let s: Vec<f32> = (0..rows * 2).map(|i| 0.5 + i as f32).collect();
        let packed = pack(scheme, 1, rows, cols, group_cols, &q, Some(&z), &s);
        // Columns alternate between the two groups.
        let index: Vec<i64> = (0..cols as i64).map(|c| c % 2).collect();
        let parts = PartShapes {
            group_index: Some(&[64]),
            ..packed.shapes()
        };
        let layout = PackedLayout::of(scheme, &parts, Some(&index)).unwrap();
        let bytes = packed.parts();
        let want = |r: usize, c: usize| {
            let g = c % 2;
            (q[r * cols + c] as i32 - z[r * 2 + g] as i32) as f32 * s[r * 2 + g]
        };
        let values = layout.dequantize(&bytes, GgmlType::F32);
        for r in 0..rows {
            for c in 0..cols {
                let at = (r * cols + c) * 4;
                assert_eq!(f32::from_le_bytes(values[at..at + 4].try_into().unwrap()), want(r, c));
            }
        }
        let order = layout.input_order.clone().expect("two groups of 32 columns");
        let evens_then_odds: Vec<u32> = (0..32).map(|c| 2 * c).chain((0..32).map(|c| 2 * c + 1)).collect();
        assert_eq!(order, evens_then_odds);
        assert!(layout.fits_blocks_of_32() && layout.fits_q8_0(bytes.zeros));
        assert_eq!(layout.u4_size(), Some(u4_blocks::Size::Of32));
        for (dtype, blocks) in [
            (GgmlType::U4B32, layout.u4_blocks(&bytes, u4_blocks::Size::Of32)),
            (GgmlType::F8E4M3B32, layout.blocks_of_32(&bytes)),
            (GgmlType::Q8_0, layout.q8_0_blocks(&bytes)),
        ] {
            let mut held = vec![0f32; rows * cols];
            dtype.dequantize(&blocks, &mut held);
            for r in 0..rows {
                for (j, &c) in order.iter().enumerate() {
                    assert_eq!(held[r * cols + j], want(r, c as usize), "{dtype:?} ({r}, {j})");
                }
            }
        }
        // Groups of 40 and 24 columns take no order: dequantized only.
        let uneven: Vec<i64> = (0..cols as i64).map(|c| i64::from(c % 8 >= 5)).collect();
        let layout = PackedLayout::of(scheme, &parts, Some(&uneven)).unwrap();
        assert!(layout.input_order.is_none() && !layout.fits_blocks_of_32() && layout.u4_size().is_none());
        assert!(!layout.fits_q8_0(bytes.zeros));
        // An index in order is no index.
        let in_order: Vec<i64> = (0..cols as i64).map(|c| c / 32).collect();
        let layout = PackedLayout::of(scheme, &parts, Some(&in_order)).unwrap();
        assert!(layout.group_index.is_none() && layout.input_order.is_none() && layout.fits_blocks_of_32());
        let beyond: Vec<i64> = (0..cols as i64).map(|c| c / 16).collect();
        assert!(PackedLayout::of(scheme, &parts, Some(&beyond))
            .unwrap_err()
            .contains("names group 2 of 2"));
    }

    /// A row whose last group is shorter than the config's group size (96 columns in groups of
    /// 64), with GPTQ's index listing them in order: the groups are the config's, held in
    /// blocks, each element its own group's product.
    #[test]
    fn a_rows_last_group_may_be_short() {
        let scheme = IntScheme {
            packing: Packing::Gptq { zero_offset: 1 },
            bits: 4,
            group_size: Some(64),
        };
        let (rows, cols) = (8, 96);
        let q: Vec<u32> = (0..rows * cols).map(|i| (i * 5 % 16) as u32).collect();
        let z: Vec<u32> = (0..rows * 2).map(|i| 1 + (i % 15) as u32).collect();
        let s: Vec<f32> = (0..rows * 2).map(|i| 0.25 + i as f32).collect();
        // Packed as groups of 48 columns, the same two groups' parts; read back as groups of 64.
        let packed = pack(scheme, 1, rows, cols, 48, &q, Some(&z), &s);
        let index: Vec<i64> = (0..cols as i64).map(|c| c / 64).collect();
        let parts = PartShapes {
            group_index: Some(&[96]),
            ..packed.shapes()
        };
        let layout = PackedLayout::of(scheme, &parts, Some(&index)).unwrap();
        assert_eq!((layout.group_cols, layout.group_index.is_none()), (64, true));
        assert!(layout.fits_blocks_of_32());
        let bytes = packed.parts();
        let mut values = vec![0f32; rows * cols];
        assert_eq!(layout.u4_size(), Some(u4_blocks::Size::Of32));
        GgmlType::U4B32.dequantize(&layout.u4_blocks(&bytes, u4_blocks::Size::Of32), &mut values);
        for r in 0..rows {
            for c in 0..cols {
                let g = c / 64;
                let want = (q[r * cols + c] as i32 - z[r * 2 + g] as i32) as f32 * s[r * 2 + g];
                assert_eq!(values[r * cols + c], want, "({r}, {c})");
            }
        }
        // Without the config's size, two groups of 96 columns are 48 each: the index then
        // lists them out of that order, so it is kept and the weight is not held in blocks.
        let unsized_scheme = IntScheme {
            group_size: None,
            ..scheme
        };
        let unsized_layout = PackedLayout::of(unsized_scheme, &parts, Some(&index)).unwrap();
        assert!(unsized_layout.group_index.is_some() && !unsized_layout.fits_blocks_of_32());
    }

    #[test]
    fn parts_that_fit_no_layout_are_refused() {
        let gptq = IntScheme {
            packing: Packing::Gptq { zero_offset: 1 },
            bits: 4,
            group_size: None,
        };
        let ct = IntScheme {
            packing: Packing::CompressedTensors,
            bits: 4,
            group_size: None,
        };
        let of = |scheme, levels: &[usize], zeros: Option<&[usize]>, scales: &[usize], shape: Option<Vec<usize>>| {
            let parts = PartShapes {
                levels,
                zeros,
                scales,
                group_index: None,
                shape,
            };
            PackedLayout::of(scheme, &parts, None).unwrap_err()
        };
        assert!(of(gptq, &[8, 64], None, &[2, 64], None).contains("no zero points"));
        assert!(of(gptq, &[8, 64], Some(&[2, 4]), &[2, 64], None).contains("zero points [2, 4]"));
        assert!(of(gptq, &[8, 64], Some(&[2, 8]), &[2, 32], None).contains("scales [2, 32]"));
        assert!(of(gptq, &[8, 64], Some(&[3, 8]), &[3, 64], None).contains("do not divide"));
        assert!(of(gptq, &[64], None, &[2, 64], None).contains("not a matrix"));
        assert!(of(ct, &[64, 8], None, &[64, 2], None).contains("no `weight_shape`"));
        assert!(of(ct, &[64, 7], None, &[64, 2], Some(vec![64, 64])).contains("not [64, 8]"));
        assert!(of(ct, &[64, 8], None, &[64, 2], Some(vec![64])).contains("not a matrix"));
        assert!(of(ct, &[2, 64, 8], None, &[3, 64, 2], Some(vec![2, 64, 64])).contains("experts"));
        assert!(of(ct, &[64, 8], None, &[64, 128], Some(vec![64, 64])).contains("128 groups"));
    }

    #[test]
    fn schemes_are_read_or_refused_by_name() {
        use serde_json::json;
        let read = |method: &str, quant: serde_json::Value| scheme_of(method, &quant);
        assert_eq!(
            read("gptq", json!({"bits": 4, "group_size": 128})).unwrap().unwrap(),
            IntScheme {
                packing: Packing::Gptq { zero_offset: 1 },
                bits: 4,
                group_size: Some(128),
            }
        );
        assert_eq!(
            read("gptq", json!({"bits": 8, "checkpoint_format": "gptq_v2"}))
                .unwrap()
                .unwrap()
                .packing,
            Packing::Gptq { zero_offset: 0 }
        );
        assert!(read("gptq", json!({"bits": 3})).unwrap().unwrap_err().contains("3-bit"));
        assert!(read("gptq", json!({"bits": 4, "checkpoint_format": "marlin"}))
            .unwrap()
            .unwrap_err()
            .contains("marlin"));
        assert!(read("gptq", json!({"bits": 4, "is_marlin_format": true}))
            .unwrap()
            .is_err());
        assert_eq!(
            read("awq", json!({"bits": 4, "version": "GEMM"}))
                .unwrap()
                .unwrap()
                .packing,
            Packing::Awq
        );
        assert!(read("awq", json!({"bits": 4, "version": "gemv"}))
            .unwrap()
            .unwrap_err()
            .contains("gemv"));
        assert!(read("awq", json!({"bits": 4, "zero_point": false})).unwrap().is_err());
        // AutoRound's packed as GPTQ (by default) or AWQ: their schemes; layers in floats or
        // as the rest may be listed; other packings, types and widths are refused by name.
        let auto_round = |extra: serde_json::Value| {
            let mut quant = json!({"bits": 4, "group_size": 128, "sym": true, "data_type": "int"});
            quant
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            read("auto-round", quant).unwrap()
        };
        assert_eq!(
            auto_round(json!({})),
            read("gptq", json!({"bits": 4, "group_size": 128})).unwrap()
        );
        assert_eq!(
            auto_round(json!({"packing_format": "auto_round:auto_awq"})),
            read("awq", json!({"bits": 4, "group_size": 128})).unwrap()
        );
        let layers = json!({"extra_config": {"lm_head": {"bits": 16}, "model.layers.0.mlp.down_proj": {"bits": 4, "group_size": 128}}});
        assert_eq!(auto_round(layers).unwrap().packing, Packing::Gptq { zero_offset: 1 });
        assert_eq!(
            read("intel/auto-round", json!({"bits": 4, "group_size": 32}))
                .unwrap()
                .unwrap()
                .group_size,
            Some(32)
        );
        for (extra, named) in [
            (json!({"packing_format": "auto_round:gptq"}), "auto_round:gptq"),
            (json!({"data_type": "nv_fp"}), "nv_fp"),
            (json!({"bits": 3}), "3-bit"),
            (
                json!({"extra_config": {"model.layers.3.mlp.down_proj": {"bits": 8}}}),
                "model.layers.3.mlp.down_proj",
            ),
            (
                json!({"extra_config": {"model.layers.0.self_attn.q_proj": {"group_size": 32}}}),
                "groups of 32, the checkpoint's are 4-bit in groups of 128",
            ),
        ] {
            let err = auto_round(extra.clone()).unwrap_err();
            assert!(err.contains(named), "{extra}: {err}");
        }
        let ct = |weights: serde_json::Value| json!({"format": "pack-quantized", "config_groups": {"group_0": {"weights": weights}}});
        assert_eq!(
            read("compressed-tensors", ct(json!({"type": "int", "num_bits": 4})))
                .unwrap()
                .unwrap()
                .bits,
            4
        );
        assert!(read("compressed-tensors", ct(json!({"type": "float", "num_bits": 4})))
            .unwrap()
            .is_err());
        assert!(read("compressed-tensors", json!({"format": "float-quantized"})).is_none());
        let bytes =
            json!({"format": "int-quantized", "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8}}}});
        assert_eq!(
            read("compressed-tensors", bytes).unwrap().unwrap().packing,
            Packing::CompressedTensorsBytes
        );
        assert!(read("fp8", json!({})).is_none());
    }
}
