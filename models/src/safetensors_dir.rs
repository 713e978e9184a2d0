//! HF model directories: `config.json`, `*.safetensors` (memory-mapped; sharded through
//! `model.safetensors.index.json`), tokenizer files. FP8 weights are read through their
//! scales (`fp8_checkpoint`), packed integer weights through their zero points and scales
//! (`int_checkpoint`) and NVFP4 weights through their two scales (`fp4_checkpoint`), in the
//! type asked for or held as blocks; float weights can be
//! quantized to FP8 blocks as they load (`fp8_on_load`). Each is made the first time it is
//! read.

use crate::checkpoint_quantization;
use crate::error::{io_error, ModelError, Result};
use crate::fp4_checkpoint::{Fp4Layout, Fp4Weight};
use crate::fp8_checkpoint::{self, ScaleGrid};
use crate::fp8_on_load;
use crate::int_checkpoint::{IntScheme, PackedLayout, PackedParts, PartShapes};
use crate::quant::tensor::{MemoryTensor, TensorView};
use crate::quant::GgmlType;
use crate::weights::matrix_shape;
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

#[derive(Debug, Clone)]
pub struct SafetensorsEntry {
    pub shard: usize,
    pub dtype: GgmlType,
    /// As bbc addresses it: a vector or a matrix (`matrix_shape`).
    pub shape: Vec<usize>,
    /// As the file declares it.
    pub stored_shape: Vec<usize>,
    /// Absolute byte range in the shard file.
    pub start: usize,
    pub end: usize,
}

/// A tensor as a file stores it: in a type bbc reads as it is, as FP8 E4M3 codes (one byte an
/// element, read through their scales), or as integers (a packed weight's parts).
enum Stored {
    Ggml(SafetensorsEntry),
    F8E4M3(RawEntry),
    Int(RawEntry),
}

/// A tensor bbc does not read as it is: its place, its declared shape, and its element's bytes
/// (FP8 codes 1; integers 1, 4 or 8 for I8, I32 or I64).
#[derive(Debug, Clone)]
struct RawEntry {
    shard: usize,
    stored_shape: Vec<usize>,
    element_bytes: usize,
    start: usize,
    end: usize,
}

/// A weight made from what the file stores the first time it is read, and held until released:
/// its shape, the type it is read as, what it is made from, and its values once made.
struct MadeWeight {
    shape: Vec<usize>,
    read_as: GgmlType,
    from: MadeFrom,
    values: OnceLock<Vec<u8>>,
}

enum MadeFrom {
    /// FP8 codes through their scales (`fp8_checkpoint`).
    Fp8 {
        codes: RawEntry,
        scales: SafetensorsEntry,
        grid: ScaleGrid,
    },
    /// Packed integer levels through their zero points and scales (`int_checkpoint`).
    Packed {
        layout: PackedLayout,
        levels: RawEntry,
        zeros: Option<RawEntry>,
        scales: SafetensorsEntry,
    },
    /// FP4 codes through their groups' scales (and NVFP4's global one; `fp4_checkpoint`).
    Fp4 {
        weight: Fp4Weight,
        codes: RawEntry,
        scales: RawEntry,
        global: f32,
    },
    /// A float weight quantized to FP8 blocks as it loads (`fp8_on_load`).
    QuantizedOnLoad(SafetensorsEntry),
    /// The order a packed weight's columns are held in (`PackedLayout::input_order`), as i32s.
    ColumnOrder(Vec<u32>),
}

pub struct SafetensorsDir {
    pub dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    /// The tensors read as they are stored.
    pub tensors: BTreeMap<String, SafetensorsEntry>,
    /// The weights made as they are read (their parts are not listed in `tensors`).
    made: BTreeMap<String, MadeWeight>,
    /// The checkpoint's `quantization_config.quant_method`, lowercased.
    pub quant_method: Option<String>,
    /// Integer tensors kept as they are, by name ([`Self::open_with_indices`]).
    indices: BTreeMap<String, RawEntry>,
}

/// What a packed weight's scales (and zero points) allow it to be held as.
#[derive(Debug, Clone, Copy)]
struct PackedScales {
    /// 4-bit blocks are exact under them (`u4_blocks::exact`).
    u4_exact: bool,
    /// They are f16s, and the weight's layout fits Q8_0 blocks (`PackedLayout::fits_q8_0`).
    q8_0_fit: bool,
}

impl PackedScales {
    /// Of the weight laid out as `layout` with `scales` (read as f32) and its zero points as
    /// stored.
    fn of(scales: &[f32], layout: &PackedLayout, zeros: Option<&[u8]>) -> Self {
        Self {
            u4_exact: scales.iter().all(|&s| quant::u4_blocks::exact(s)),
            q8_0_fit: scales.iter().all(|&s| quant::exact_f16(s).is_some()) && layout.fits_q8_0(zeros),
        }
    }
}

impl SafetensorsDir {
    /// The directory's tensors, FP8 and packed integer weights read as `convert_to` (f32, bf16
    /// or f16), else held as blocks of 32 where they fit them (FP8 blocks, or 4-bit blocks for
    /// integer weights whose scales allow them, of 128 where the groups do:
    /// `ScaleGrid::fits_blocks_of_32`, `PackedLayout::u4_size`, `u4_blocks::exact`; wider
    /// integer levels under f16 scales as Q8_0 blocks: `PackedLayout::fits_q8_0`) and as the
    /// checkpoint's `dtype` where not.
    pub fn open(dir: &Path, convert_to: Option<GgmlType>) -> Result<Self> {
        Self::open_with_indices(dir, convert_to, &[])
    }

    /// [`Self::open`] keeping the integer (or boolean) tensors named in `indices` as they are,
    /// for [`Self::index_tensor`]: a table of ids beside the weights, such as an EAGLE head's
    /// `d2t`.
    pub fn open_with_indices(dir: &Path, convert_to: Option<GgmlType>, indices: &[&str]) -> Result<Self> {
        let files = shard_files(dir)?;
        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = BTreeMap::new();
        let mut fp8_codes = BTreeMap::new();
        let mut ints = BTreeMap::new();
        for (i, path) in files.into_iter().enumerate() {
            let file = std::fs::File::open(&path).map_err(|e| io_error(&path, e))?;
            // SAFETY: read-only map of a weights file; see GgufFile::open.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| io_error(&path, e))?;
            for (name, entry) in read_header(&mmap, &path, i)? {
                match entry {
                    Stored::Ggml(entry) => {
                        tensors.insert(name, entry);
                    }
                    Stored::F8E4M3(codes) => {
                        fp8_codes.insert(name, codes);
                    }
                    Stored::Int(entry) => {
                        ints.insert(name, entry);
                    }
                }
            }
            shards.push((path, mmap));
        }
        let mut this = Self {
            dir: dir.to_path_buf(),
            shards,
            tensors,
            made: BTreeMap::new(),
            quant_method: None,
            indices: BTreeMap::new(),
        };
        for name in indices {
            if let Some(entry) = ints.remove(*name) {
                this.indices.insert(name.to_string(), entry);
            }
        }
        let path = dir.join("config.json");
        let config = match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| ModelError::Config {
                path: path.clone(),
                what: format!("invalid JSON: {e}"),
            })?,
            Err(_) => serde_json::Value::Null,
        };
        let quantization = checkpoint_quantization::quantization_of(&config, &path)?;
        let block = quantization.as_ref().and_then(|q| q.block);
        let integers = quantization.as_ref().and_then(|q| q.integers);
        let fp4 = quantization.as_ref().and_then(|q| q.fp4);
        this.quant_method = quantization.map(|q| q.method);
        let checkpoint_dtype = checkpoint_quantization::checkpoint_dtype(&config);
        let read_as = |fits_blocks_of_32: bool| match convert_to {
            Some(dtype) => dtype,
            None if fits_blocks_of_32 => GgmlType::F8E4M3B32,
            None => checkpoint_dtype,
        };
        // FP4 weights first: their codes are bytes, NVFP4's scales FP8 tensors.
        if let Some(layout) = fp4 {
            this.pair_fp4(&mut ints, &mut fp8_codes, layout, |weight| {
                match read_as(weight.fits_blocks()) {
                    GgmlType::F8E4M3B32 => GgmlType::F4E2M1B32,
                    read_as => read_as,
                }
            })?;
        }
        this.pair_scales(fp8_codes, block, |grid| read_as(grid.fits_blocks_of_32()))?;
        // Blocks of an integer checkpoint are 4-bit blocks where its scales allow them, as wide
        // as its groups allow; wider levels under f16 scales are Q8_0 blocks where they fit.
        this.pair_packed(ints, integers, |layout, scales| {
            match (read_as(layout.fits_blocks_of_32()), layout.u4_size()) {
                (GgmlType::F8E4M3B32, Some(size)) if scales.u4_exact => size.format(),
                _ if convert_to.is_none() && scales.q8_0_fit => GgmlType::Q8_0,
                (read_as, _) => read_as,
            }
        })?;
        Ok(this)
    }

    /// Each FP8 weight `X` with its scales, `X_scale_inv` or `X_scale` (taken out of the
    /// listing), and the grid they make over it.
    fn pair_scales(
        &mut self,
        codes: BTreeMap<String, RawEntry>,
        block: Option<[usize; 2]>,
        read_as: impl Fn(&ScaleGrid) -> GgmlType,
    ) -> Result<()> {
        for (name, codes) in codes {
            let scale_name = [format!("{name}_scale_inv"), format!("{name}_scale")]
                .into_iter()
                .find(|s| self.tensors.contains_key(s));
            let bad = |what: String| ModelError::Safetensors {
                path: self.shard_path(codes.shard).to_path_buf(),
                what: format!("tensor `{name}` is FP8 E4M3: {what}"),
            };
            let Some(scale_name) = scale_name else {
                return Err(bad(format!("it has no `{name}_scale_inv` or `{name}_scale` beside it")));
            };
            let scales = self.tensors[&scale_name].clone();
            let grid = ScaleGrid::of(&codes.stored_shape, &scales.stored_shape, block).map_err(bad)?;
            self.tensors.remove(&scale_name);
            let weight = MadeWeight {
                shape: matrix_shape(codes.stored_shape.clone()),
                read_as: read_as(&grid),
                from: MadeFrom::Fp8 { codes, scales, grid },
                values: OnceLock::new(),
            };
            self.made.insert(name, weight);
        }
        Ok(())
    }

    /// Each FP4 weight `X.weight` with its parts beside it (`fp4_checkpoint`: its codes, taken
    /// from `ints`, its groups' scales, taken from `fp8` (NVFP4's E4M3) or `ints` (MXFP4's
    /// E8M0), and NVFP4's global scale), and the activations' scale a W4A4 checkpoint has
    /// beside it (not used), taken out of the listing.
    fn pair_fp4(
        &mut self,
        ints: &mut BTreeMap<String, RawEntry>,
        fp8: &mut BTreeMap<String, RawEntry>,
        layout: Fp4Layout,
        read_as: impl Fn(&Fp4Weight) -> GgmlType,
    ) -> Result<()> {
        let names = layout.part_names();
        let codes_end = format!(".{}", names.codes);
        let weights: Vec<String> = ints.keys().filter(|n| n.ends_with(&codes_end)).cloned().collect();
        for codes_name in weights {
            let prefix = &codes_name[..codes_name.len() - names.codes.len()];
            let part = |end: &str| format!("{prefix}{end}");
            let codes = ints.remove(&codes_name).expect("listed");
            let path = self.shard_path(codes.shard).to_path_buf();
            let bad = |what: String| ModelError::Safetensors {
                path: path.clone(),
                what: format!("FP4 weight `{prefix}weight`: {what}"),
            };
            if codes.element_bytes != 1 {
                return Err(bad(format!("its `{codes_name}` is not bytes (two codes each)")));
            }
            let (scales, kind) = match names.global {
                Some(_) => (fp8.remove(&part(names.scales)), "FP8"),
                None => (ints.remove(&part(names.scales)), "E8M0 (U8)"),
            };
            let scales = scales.ok_or_else(|| bad(format!("it has no {kind} `{}` beside it", part(names.scales))))?;
            if scales.element_bytes != 1 {
                return Err(bad(format!("its `{}` is not bytes", part(names.scales))));
            }
            let global = match names.global {
                Some(name) => Some(
                    self.tensors
                        .remove(&part(name))
                        .filter(|g| g.dtype == GgmlType::F32)
                        .ok_or_else(|| bad(format!("it has no f32 `{}` beside it", part(name))))?,
                ),
                None => None,
            };
            self.tensors.remove(&part(names.activations));
            let global_shape = global.as_ref().map(|g| &g.stored_shape[..]);
            let weight = Fp4Weight::of(layout, &codes.stored_shape, &scales.stored_shape, global_shape).map_err(bad)?;
            let global = global.map_or(1.0, |g| self.floats(&g)[0]);
            if !global.is_finite() || global == 0.0 {
                return Err(bad(format!("its global scale is {global}")));
            }
            let made = MadeWeight {
                shape: vec![weight.rows, weight.cols],
                read_as: read_as(&weight),
                from: MadeFrom::Fp4 {
                    weight,
                    codes,
                    scales,
                    global,
                },
                values: OnceLock::new(),
            };
            self.made.insert(part("weight"), made);
        }
        Ok(())
    }

    /// Each packed integer weight `X.weight` with its parts beside it (`int_checkpoint`: for
    /// GPTQ `X.qweight`, `X.qzeros`, `X.scales`, `X.g_idx`), taken out of the listing. Integer
    /// tensors that are no weight's part are refused.
    fn pair_packed(
        &mut self,
        mut ints: BTreeMap<String, RawEntry>,
        scheme: Option<IntScheme>,
        read_as: impl Fn(&PackedLayout, PackedScales) -> GgmlType,
    ) -> Result<()> {
        if let Some(scheme) = scheme {
            let names = scheme.part_names();
            let levels_end = format!(".{}", names.levels);
            let packed: Vec<String> = ints.keys().filter(|n| n.ends_with(&levels_end)).cloned().collect();
            for levels_name in packed {
                let prefix = &levels_name[..levels_name.len() - names.levels.len()];
                let levels = ints.remove(&levels_name).expect("listed");
                let part = |end: &str| format!("{prefix}{end}");
                let path = self.shard_path(levels.shard).to_path_buf();
                let bad = |what: String| ModelError::Safetensors {
                    path: path.clone(),
                    what: format!("packed weight `{prefix}weight`: {what}"),
                };
                let scales = self
                    .tensors
                    .remove(&part(names.scales))
                    .ok_or_else(|| bad(format!("it has no float `{}` beside it", part(names.scales))))?;
                let zeros = ints.remove(&part(names.zeros));
                let group_index = ints.remove(&part(names.group_index));
                let shape = match names.shape {
                    Some(end) => {
                        let entry = ints
                            .remove(&part(end))
                            .ok_or_else(|| bad(format!("it has no `{}`", part(end))))?;
                        let dims = self.integers(&entry);
                        // A dimension is at most the file's bytes: no product of them overflows.
                        let largest = self.shards[levels.shard].1.len() as i64 * 8;
                        if dims.iter().any(|&d| !(0..=largest).contains(&d)) {
                            return Err(bad(format!("its `{}` {dims:?} is not a weight's shape", part(end))));
                        }
                        Some(dims.iter().map(|&d| d as usize).collect())
                    }
                    None => None,
                };
                let width = scheme.element_bytes();
                for (what, entry) in [("levels", Some(&levels)), ("zero points", zeros.as_ref())] {
                    if entry.is_some_and(|e| e.element_bytes != width) {
                        return Err(bad(format!(
                            "its {what} are not {}",
                            if width == 1 { "bytes" } else { "32-bit words" }
                        )));
                    }
                }
                let listed = group_index.as_ref().map(|g| self.integers(g));
                let shapes = PartShapes {
                    levels: &levels.stored_shape,
                    zeros: zeros.as_ref().map(|z| &z.stored_shape[..]),
                    scales: &scales.stored_shape,
                    group_index: group_index.as_ref().map(|g| &g.stored_shape[..]),
                    shape,
                };
                let mut layout = PackedLayout::of(scheme, &shapes, listed.as_deref()).map_err(bad)?;
                // An expert's input is the routed layer's own: only plain linear layers take
                // theirs in a held order.
                if prefix.contains(".experts.") {
                    layout.input_order = None;
                }
                let zeros_stored = zeros.as_ref().map(|z| self.raw(z));
                let facts = PackedScales::of(&self.floats(&scales), &layout, zeros_stored);
                let held_as = read_as(&layout, facts);
                if let Some(order) = layout.input_order.clone().filter(|_| Self::holds_blocks(held_as)) {
                    let order = MadeWeight {
                        shape: vec![order.len()],
                        read_as: GgmlType::I32,
                        from: MadeFrom::ColumnOrder(order),
                        values: OnceLock::new(),
                    };
                    self.made.insert(crate::input_order_name(&part("weight")), order);
                }
                let weight = MadeWeight {
                    shape: matrix_shape(layout.shape()),
                    read_as: held_as,
                    from: MadeFrom::Packed {
                        layout,
                        levels,
                        zeros,
                        scales,
                    },
                    values: OnceLock::new(),
                };
                self.made.insert(part("weight"), weight);
            }
        }
        match ints.into_iter().next() {
            Some((name, entry)) => Err(ModelError::Safetensors {
                path: self.shard_path(entry.shard).to_path_buf(),
                what: format!(
                    "tensor `{name}` holds integers; bbc reads them only as the parts of integer weights beside \
                     the scales a GPTQ, AWQ or compressed-tensors (`pack-quantized`, `int-quantized`) checkpoint \
                     names{}",
                    match scheme {
                        Some(_) => "",
                        None => " (this one's config.json names no such quantization)",
                    }
                ),
            }),
            None => Ok(()),
        }
    }

    /// A float tensor's values, widened to f32.
    fn floats(&self, entry: &SafetensorsEntry) -> Vec<f32> {
        let mut values = vec![0f32; entry.stored_shape.iter().product()];
        entry.dtype.dequantize(self.data(entry), &mut values);
        values
    }

    /// The values of an integer tensor kept by [`Self::open_with_indices`], and its shape as
    /// stored.
    pub fn index_tensor(&self, name: &str) -> Option<(Vec<i64>, &[usize])> {
        let entry = self.indices.get(name)?;
        Some((self.integers(entry), &entry.stored_shape))
    }

    /// An integer tensor's values.
    fn integers(&self, entry: &RawEntry) -> Vec<i64> {
        let bytes = &self.shards[entry.shard].1[entry.start..entry.end];
        match entry.element_bytes {
            1 => bytes.iter().map(|&b| i64::from(b as i8)).collect(),
            4 => bytes
                .chunks_exact(4)
                .map(|b| i64::from(i32::from_le_bytes(b.try_into().expect("4 bytes"))))
                .collect(),
            _ => bytes
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect(),
        }
    }

    /// Quantizes the linear layers' float weights to FP8 blocks as they are read
    /// (`fp8_on_load`), and names the checkpoint's method `fp8`; the count of weights.
    pub fn quantize_fp8_on_load(&mut self) -> usize {
        let names: Vec<String> = self
            .tensors
            .iter()
            .filter(|(name, e)| fp8_on_load::quantizes(name, e.dtype, &e.shape))
            .map(|(name, _)| name.clone())
            .collect();
        for name in &names {
            if let Some(stored) = self.tensors.remove(name) {
                let weight = MadeWeight {
                    shape: stored.shape.clone(),
                    read_as: GgmlType::F8E4M3B32,
                    from: MadeFrom::QuantizedOnLoad(stored),
                    values: OnceLock::new(),
                };
                self.made.insert(name.clone(), weight);
            }
        }
        self.quant_method = Some(fp8_on_load::METHOD.to_string());
        names.len()
    }

    /// The tensor `name` as bbc reads it: as stored, or made (once) and held.
    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        if let Some(entry) = self.tensors.get(name) {
            return Some(TensorView {
                shape: &entry.shape,
                dtype: entry.dtype,
                bytes: self.data(entry),
            });
        }
        let weight = self.made.get(name)?;
        Some(TensorView {
            shape: &weight.shape,
            dtype: weight.read_as,
            bytes: weight.values.get_or_init(|| self.make(weight)),
        })
    }

    /// The type tensor `name` is read as and its shape, without converting it.
    pub fn describe(&self, name: &str) -> Option<(GgmlType, &[usize])> {
        if let Some(entry) = self.tensors.get(name) {
            return Some((entry.dtype, &entry.shape));
        }
        let weight = self.made.get(name)?;
        Some((weight.read_as, &weight.shape))
    }

    /// Whether `name` is a weight made as it is read and not made yet ([`Self::made_afresh`]).
    pub fn made_as_read(&self, name: &str) -> bool {
        self.made.get(name).is_some_and(|w| w.values.get().is_none())
    }

    /// A weight made as it is read and not made yet, made and handed over rather than held
    /// (see `Tensors::made_afresh`); `None` for every other tensor.
    pub fn made_afresh(&self, name: &str) -> Option<MemoryTensor> {
        let weight = self.made.get(name).filter(|w| w.values.get().is_none())?;
        Some(MemoryTensor {
            shape: weight.shape.clone(),
            dtype: weight.read_as,
            bytes: self.make(weight),
        })
    }

    /// A weight's values in the type it is read as.
    fn make(&self, weight: &MadeWeight) -> Vec<u8> {
        match &weight.from {
            MadeFrom::Fp8 { codes, scales, grid } => {
                let scales = self.floats(scales);
                let codes = self.raw(codes);
                match weight.read_as {
                    GgmlType::F8E4M3B32 => fp8_checkpoint::blocks_of_32(codes, &scales, grid),
                    dtype => fp8_checkpoint::dequantize(codes, &scales, grid, dtype),
                }
            }
            MadeFrom::Packed {
                layout,
                levels,
                zeros,
                scales,
            } => {
                let scales = self.floats(scales);
                let parts = PackedParts {
                    levels: self.raw(levels),
                    zeros: zeros.as_ref().map(|z| self.raw(z)),
                    scales: &scales,
                };
                match weight.read_as {
                    GgmlType::Q8_0 => layout.q8_0_blocks(&parts),
                    GgmlType::U4B32 | GgmlType::U4B128 => {
                        let size = quant::u4_blocks::Size::of(weight.read_as).expect("a 4-bit block format");
                        layout.u4_blocks(&parts, size)
                    }
                    GgmlType::F8E4M3B32 => layout.blocks_of_32(&parts),
                    dtype => layout.dequantize(&parts, dtype),
                }
            }
            MadeFrom::Fp4 {
                weight: fp4,
                codes,
                scales,
                global,
            } => {
                let (codes, scales) = (self.raw(codes), self.raw(scales));
                match weight.read_as {
                    GgmlType::F4E2M1B32 => fp4.blocks(codes, scales, *global),
                    dtype => fp4.dequantize(codes, scales, *global, dtype),
                }
            }
            MadeFrom::ColumnOrder(order) => order.iter().flat_map(|&c| (c as i32).to_le_bytes()).collect(),
            MadeFrom::QuantizedOnLoad(stored) => fp8_on_load::quantize(&TensorView {
                shape: &stored.shape,
                dtype: stored.dtype,
                bytes: self.data(stored),
            }),
        }
    }

    /// Whether weights read as `dtype` are a checkpoint's blocks held as they are: bbc's own
    /// block formats, and Q8_0 (8-bit integer weights); every other type is floats.
    pub fn holds_blocks(dtype: GgmlType) -> bool {
        dtype.is_checkpoint_blocks() || dtype == GgmlType::Q8_0
    }

    /// The bytes of weights made so far and held (column orders, four bytes a column that
    /// lowering reads, are no weight's copy and are not counted).
    pub fn converted_bytes(&self) -> usize {
        let weights = self
            .made
            .values()
            .filter(|w| !matches!(w.from, MadeFrom::ColumnOrder(_)));
        weights.filter_map(|w| w.values.get()).map(Vec::len).sum()
    }

    /// Frees the values of weights made so far (a backend that copied them holds its own); a
    /// weight read again is made again.
    pub fn release_converted(&mut self) {
        for weight in self.made.values_mut() {
            weight.values.take();
        }
    }

    /// Every tensor's name, the type it is read as and its shape.
    pub fn listing(&self) -> impl Iterator<Item = (&str, GgmlType, &[usize])> {
        let stored = self.tensors.iter().map(|(n, e)| (n.as_str(), e.dtype, &e.shape[..]));
        let made = self.made.iter().map(|(n, w)| (n.as_str(), w.read_as, &w.shape[..]));
        stored.chain(made)
    }

    fn raw(&self, entry: &RawEntry) -> &[u8] {
        &self.shards[entry.shard].1[entry.start..entry.end]
    }

    pub fn data(&self, entry: &SafetensorsEntry) -> &[u8] {
        &self.shards[entry.shard].1[entry.start..entry.end]
    }

    pub fn shard_path(&self, shard: usize) -> &Path {
        &self.shards[shard].0
    }
}

/// The weight files of a directory: the shards named by the index, else `model.safetensors`.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| io_error(&index, e))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Config {
            path: index.clone(),
            what: format!("invalid JSON: {e}"),
        })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::Config {
                path: index.clone(),
                what: "has no `weight_map` object".into(),
            })?;
        let mut files: Vec<String> = map.values().filter_map(|v| v.as_str().map(String::from)).collect();
        files.sort();
        files.dedup();
        if files
            .iter()
            .any(|f| f.contains('/') || f.contains('\\') || f.contains(".."))
        {
            return Err(ModelError::Config {
                path: index,
                what: "`weight_map` names a file outside the model directory".into(),
            });
        }
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    // PyTorch's pickles can run code as they load: converted once by the user, not read here.
    if ["pytorch_model.bin", "pytorch_model.bin.index.json"]
        .iter()
        .any(|f| dir.join(f).exists())
    {
        return Err(ModelError::Config {
            path: dir.to_path_buf(),
            what: "its weights are PyTorch pickles (pytorch_model.bin), which bbc does not read (loading them can \
                   run code); convert them to safetensors first, e.g. `python -c \"import torch; from \
                   safetensors.torch import save_file; save_file(torch.load('pytorch_model.bin'), \
                   'model.safetensors')\"`"
                .into(),
        });
    }
    Err(ModelError::Config {
        path: dir.to_path_buf(),
        what: "no model.safetensors or model.safetensors.index.json in this directory".into(),
    })
}

/// Parse and check the header: `u64 n`, then `n` bytes of JSON `{name: {dtype, shape,
/// data_offsets: [begin, end]}}`; offsets are relative to the end of the header and must
/// match shape × dtype size and lie inside the file. Each tensor is checked here first so an
/// error names it; the safetensors crate then checks the layout as a whole.
fn read_header(bytes: &[u8], path: &Path, shard: usize) -> Result<Vec<(String, Stored)>> {
    let bad = |what: String| ModelError::Safetensors {
        path: path.to_path_buf(),
        what,
    };
    let header_len = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .ok_or_else(|| bad(format!("file is {} bytes, too short for a header", bytes.len())))?;
    let data_start = usize::try_from(header_len)
        .ok()
        .and_then(|n| n.checked_add(8))
        .filter(|&s| s <= bytes.len())
        .ok_or_else(|| {
            bad(format!(
                "header claims {header_len} bytes but the file has {}",
                bytes.len()
            ))
        })?;
    let header: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..data_start]).map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
    let data_len = bytes.len() - data_start;
    let mut out = Vec::new();
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        out.push((
            name.clone(),
            header_entry(&name, &info, data_start, data_len, shard).map_err(bad)?,
        ));
    }
    safetensors::SafeTensors::read_metadata(bytes).map_err(|e| bad(format!("invalid layout: {e}")))?;
    Ok(out)
}

fn header_entry(
    name: &str,
    info: &serde_json::Value,
    data_start: usize,
    data_len: usize,
    shard: usize,
) -> std::result::Result<Stored, String> {
    // Floats bbc reads as they are, or the bytes of an element read otherwise.
    let (dtype, element_bytes) = match info.get("dtype").and_then(|d| d.as_str()) {
        Some("F32") => (Some(GgmlType::F32), 4),
        Some("F16") => (Some(GgmlType::F16), 2),
        Some("BF16") => (Some(GgmlType::BF16), 2),
        Some("F8_E4M3") => (None, 1),
        Some("I8" | "U8" | "BOOL") => (None, 1),
        Some("I32") => (None, 4),
        Some("I64") => (None, 8),
        other => {
            return Err(format!(
                "tensor `{name}` has dtype {other:?}; bbc reads F32, F16, BF16, F8_E4M3 (with its scales) \
                 and I8, U8, I32, I64 and BOOL (an integer or NVFP4 weight's parts, or a table of ids)"
            ))
        }
    };
    let shape: Vec<usize> = info
        .get("shape")
        .and_then(|s| s.as_array())
        .and_then(|dims| dims.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
        .ok_or_else(|| format!("tensor `{name}` has no valid shape"))?;
    let offsets: Vec<usize> = info
        .get("data_offsets")
        .and_then(|s| s.as_array())
        .and_then(|o| o.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
        .filter(|o: &Vec<usize>| o.len() == 2)
        .ok_or_else(|| format!("tensor `{name}` has no valid data_offsets"))?;
    let (begin, end) = (offsets[0], offsets[1]);
    let elements = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let want = match dtype {
        Some(dtype) => elements.and_then(|e| dtype.bytes_for(e)),
        None => elements.and_then(|e| e.checked_mul(element_bytes)),
    };
    if begin > end || want != Some(end - begin) {
        return Err(format!(
            "tensor `{name}`: shape {shape:?} × {} does not match its byte range {begin}..{end}",
            dtype.map_or_else(
                || info["dtype"].as_str().unwrap_or("?").to_string(),
                |d| d.name().to_string()
            )
        ));
    }
    if end > data_len {
        return Err(format!(
            "tensor `{name}` ends at byte {end} but the file has {data_len} bytes of data"
        ));
    }
    let (start, end) = (data_start + begin, data_start + end);
    Ok(match dtype {
        Some(dtype) => Stored::Ggml(SafetensorsEntry {
            shard,
            dtype,
            shape: matrix_shape(shape.clone()),
            stored_shape: shape,
            start,
            end,
        }),
        None => {
            let raw = RawEntry {
                shard,
                stored_shape: shape,
                element_bytes,
                start,
                end,
            };
            match info.get("dtype").and_then(|d| d.as_str()) {
                Some("F8_E4M3") => Stored::F8E4M3(raw),
                _ => Stored::Int(raw),
            }
        }
    })
}
