//! HF model directories: `config.json`, `*.safetensors` (memory-mapped; sharded through
//! `model.safetensors.index.json`), tokenizer files. FP8 weights are read through their
//! scales (`fp8_checkpoint`) in the type asked for, or held as FP8 blocks; float weights can
//! be quantized to FP8 blocks as they load (`fp8_on_load`). Each is converted the first time
//! it is read.

use crate::error::{io_error, ModelError, Result};
use crate::fp8_checkpoint::{self, ScaleGrid};
use crate::fp8_on_load;
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

/// A tensor as a file stores it: in a type bbc reads as it is, or as FP8 E4M3 codes (one byte
/// an element, read through their scales).
enum Stored {
    Ggml(SafetensorsEntry),
    F8E4M3(Fp8Codes),
}

#[derive(Debug, Clone)]
struct Fp8Codes {
    shard: usize,
    shape: Vec<usize>,
    stored_shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// An FP8 weight: its codes, its scales and how they cover it, the type it is read as, and its
/// values once made.
struct Fp8Weight {
    codes: Fp8Codes,
    scales: SafetensorsEntry,
    grid: ScaleGrid,
    read_as: GgmlType,
    values: OnceLock<Vec<u8>>,
}

/// A float weight quantized to FP8 blocks as it loads, once made.
struct QuantizedOnLoad {
    stored: SafetensorsEntry,
    values: OnceLock<Vec<u8>>,
}

pub struct SafetensorsDir {
    pub dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    /// The tensors read as they are stored.
    pub tensors: BTreeMap<String, SafetensorsEntry>,
    /// The FP8 weights (their scale tensors are not listed in `tensors`).
    fp8: BTreeMap<String, Fp8Weight>,
    /// The float weights quantized to FP8 blocks as they load (not listed in `tensors`).
    quantized: BTreeMap<String, QuantizedOnLoad>,
    /// The checkpoint's `quantization_config.quant_method`, lowercased.
    pub quant_method: Option<String>,
}

impl SafetensorsDir {
    /// The directory's tensors, FP8 weights read as `fp8_as` (f32, bf16 or f16), else held as
    /// they are stored (blocks of 32 codes with their scale, where every 32 columns of a row
    /// lie under one scale; else as the checkpoint's `dtype`).
    pub fn open(dir: &Path, fp8_as: Option<GgmlType>) -> Result<Self> {
        let files = shard_files(dir)?;
        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = BTreeMap::new();
        let mut fp8_codes = BTreeMap::new();
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
                }
            }
            shards.push((path, mmap));
        }
        let mut this = Self {
            dir: dir.to_path_buf(),
            shards,
            tensors,
            fp8: BTreeMap::new(),
            quantized: BTreeMap::new(),
            quant_method: None,
        };
        let path = dir.join("config.json");
        let config = match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| ModelError::Config {
                path: path.clone(),
                what: format!("invalid JSON: {e}"),
            })?,
            Err(_) => serde_json::Value::Null,
        };
        let scales = fp8_checkpoint::quantization_of(&config, &path)?;
        let block = scales.as_ref().and_then(|s| s.block);
        this.quant_method = scales.and_then(|s| s.method);
        let checkpoint_dtype = fp8_checkpoint::checkpoint_dtype(&config);
        this.pair_scales(fp8_codes, block, |grid| match fp8_as {
            Some(dtype) => dtype,
            None if grid.fits_blocks_of_32() => GgmlType::F8E4M3B32,
            None => checkpoint_dtype,
        })?;
        Ok(this)
    }

    /// Each FP8 weight `X` with its scales, `X_scale_inv` or `X_scale` (taken out of the
    /// listing), and the grid they make over it.
    fn pair_scales(
        &mut self,
        codes: BTreeMap<String, Fp8Codes>,
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
            if !matches!(scales.dtype, GgmlType::F32 | GgmlType::BF16 | GgmlType::F16) {
                return Err(bad(format!(
                    "its scale `{scale_name}` is {}, not a float",
                    scales.dtype.name()
                )));
            }
            let grid = ScaleGrid::of(&codes.stored_shape, &scales.stored_shape, block).map_err(bad)?;
            self.tensors.remove(&scale_name);
            let weight = Fp8Weight {
                codes,
                scales,
                read_as: read_as(&grid),
                grid,
                values: OnceLock::new(),
            };
            self.fp8.insert(name, weight);
        }
        Ok(())
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
                let values = OnceLock::new();
                self.quantized.insert(name.clone(), QuantizedOnLoad { stored, values });
            }
        }
        self.quant_method = Some(fp8_on_load::METHOD.to_string());
        names.len()
    }

    /// The tensor `name` as bbc reads it: as stored, an FP8 weight as it was opened to, or a
    /// float weight quantized as it loads.
    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        if let Some(entry) = self.tensors.get(name) {
            return Some(TensorView {
                shape: &entry.shape,
                dtype: entry.dtype,
                bytes: self.data(entry),
            });
        }
        if let Some(weight) = self.quantized.get(name) {
            let bytes = weight.values.get_or_init(|| self.quantized_values(weight));
            return Some(TensorView {
                shape: &weight.stored.shape,
                dtype: GgmlType::F8E4M3B32,
                bytes,
            });
        }
        let weight = self.fp8.get(name)?;
        let bytes = weight.values.get_or_init(|| self.fp8_values(weight));
        Some(TensorView {
            shape: &weight.codes.shape,
            dtype: weight.read_as,
            bytes,
        })
    }

    /// The type tensor `name` is read as and its shape, without converting it.
    pub fn describe(&self, name: &str) -> Option<(GgmlType, &[usize])> {
        if let Some(entry) = self.tensors.get(name) {
            return Some((entry.dtype, &entry.shape));
        }
        if let Some(weight) = self.quantized.get(name) {
            return Some((GgmlType::F8E4M3B32, &weight.stored.shape));
        }
        let weight = self.fp8.get(name)?;
        Some((weight.read_as, &weight.codes.shape))
    }

    /// Whether `name` is an FP8 or quantized weight not made yet ([`Self::made_afresh`]).
    pub fn made_as_read(&self, name: &str) -> bool {
        let quantized = self.quantized.get(name).is_some_and(|w| w.values.get().is_none());
        quantized || self.fp8.get(name).is_some_and(|w| w.values.get().is_none())
    }

    /// An FP8 or quantized weight not made yet, made and handed over rather than held (see
    /// `Tensors::made_afresh`); `None` for every other tensor.
    pub fn made_afresh(&self, name: &str) -> Option<MemoryTensor> {
        if let Some(weight) = self.quantized.get(name).filter(|w| w.values.get().is_none()) {
            return Some(MemoryTensor {
                shape: weight.stored.shape.clone(),
                dtype: GgmlType::F8E4M3B32,
                bytes: self.quantized_values(weight),
            });
        }
        let weight = self.fp8.get(name).filter(|w| w.values.get().is_none())?;
        Some(MemoryTensor {
            shape: weight.codes.shape.clone(),
            dtype: weight.read_as,
            bytes: self.fp8_values(weight),
        })
    }

    /// A float weight's FP8 blocks.
    fn quantized_values(&self, weight: &QuantizedOnLoad) -> Vec<u8> {
        let stored = &weight.stored;
        fp8_on_load::quantize(&TensorView {
            shape: &stored.shape,
            dtype: stored.dtype,
            bytes: self.data(stored),
        })
    }

    /// An FP8 weight in the type it is read as.
    fn fp8_values(&self, weight: &Fp8Weight) -> Vec<u8> {
        let mut scales = vec![0f32; weight.grid.scales()];
        weight.scales.dtype.dequantize(self.data(&weight.scales), &mut scales);
        let codes = &self.shards[weight.codes.shard].1[weight.codes.start..weight.codes.end];
        match weight.read_as {
            GgmlType::F8E4M3B32 => fp8_checkpoint::blocks_of_32(codes, &scales, &weight.grid),
            dtype => fp8_checkpoint::dequantize(codes, &scales, &weight.grid, dtype),
        }
    }

    /// The bytes of FP8 weights converted (or quantized) so far and held.
    pub fn converted_bytes(&self) -> usize {
        let fp8 = self.fp8.values().filter_map(|w| w.values.get());
        let quantized = self.quantized.values().filter_map(|w| w.values.get());
        fp8.chain(quantized).map(Vec::len).sum()
    }

    /// Frees the FP8 weights' converted (or quantized) values (a backend that copied them holds
    /// its own); a weight read again is converted again.
    pub fn release_converted(&mut self) {
        for weight in self.fp8.values_mut() {
            weight.values.take();
        }
        for weight in self.quantized.values_mut() {
            weight.values.take();
        }
    }

    /// Every tensor's name, the type it is read as and its shape.
    pub fn listing(&self) -> impl Iterator<Item = (&str, GgmlType, &[usize])> {
        let stored = self.tensors.iter().map(|(n, e)| (n.as_str(), e.dtype, &e.shape[..]));
        let fp8 = self
            .fp8
            .iter()
            .map(|(n, w)| (n.as_str(), w.read_as, &w.codes.shape[..]));
        let quantized = self
            .quantized
            .iter()
            .map(|(n, w)| (n.as_str(), GgmlType::F8E4M3B32, &w.stored.shape[..]));
        stored.chain(fp8).chain(quantized)
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
    let dtype = match info.get("dtype").and_then(|d| d.as_str()) {
        Some("F32") => Some(GgmlType::F32),
        Some("F16") => Some(GgmlType::F16),
        Some("BF16") => Some(GgmlType::BF16),
        Some("F8_E4M3") => None,
        other => {
            return Err(format!(
                "tensor `{name}` has dtype {other:?}; bbc reads F32, F16, BF16 and F8_E4M3 (with its scales)"
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
        None => elements,
    };
    if begin > end || want != Some(end - begin) {
        return Err(format!(
            "tensor `{name}`: shape {shape:?} × {} does not match its byte range {begin}..{end}",
            dtype.map_or("F8_E4M3", GgmlType::name)
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
        None => Stored::F8E4M3(Fp8Codes {
            shard,
            shape: matrix_shape(shape.clone()),
            stored_shape: shape,
            start,
            end,
        }),
    })
}
