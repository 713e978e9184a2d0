//! HF model directories: `config.json`, `*.safetensors` (memory-mapped; sharded through
//! `model.safetensors.index.json`), tokenizer files.

use crate::error::{io_error, ModelError, Result};
use crate::quant::GgmlType;
use crate::weights::matrix_shape;
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct SafetensorsEntry {
    pub shard: usize,
    pub dtype: GgmlType,
    pub shape: Vec<usize>,
    /// Absolute byte range in the shard file.
    pub start: usize,
    pub end: usize,
}

pub struct SafetensorsDir {
    pub dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    pub tensors: BTreeMap<String, SafetensorsEntry>,
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<Self> {
        let files = shard_files(dir)?;
        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = BTreeMap::new();
        for (i, path) in files.into_iter().enumerate() {
            let file = std::fs::File::open(&path).map_err(|e| io_error(&path, e))?;
            // SAFETY: read-only map of a weights file; see GgufFile::open.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| io_error(&path, e))?;
            for (name, entry) in read_header(&mmap, &path, i)? {
                tensors.insert(name, entry);
            }
            shards.push((path, mmap));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            shards,
            tensors,
        })
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
fn read_header(bytes: &[u8], path: &Path, shard: usize) -> Result<Vec<(String, SafetensorsEntry)>> {
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
) -> std::result::Result<SafetensorsEntry, String> {
    let dtype = match info.get("dtype").and_then(|d| d.as_str()) {
        Some("F32") => GgmlType::F32,
        Some("F16") => GgmlType::F16,
        Some("BF16") => GgmlType::BF16,
        other => {
            return Err(format!(
                "tensor `{name}` has dtype {other:?}; bbc reads F32, F16 and BF16"
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
    let want = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .and_then(|e| dtype.bytes_for(e));
    if begin > end || want != Some(end - begin) {
        return Err(format!(
            "tensor `{name}`: shape {shape:?} × {} does not match its byte range {begin}..{end}",
            dtype.name()
        ));
    }
    if end > data_len {
        return Err(format!(
            "tensor `{name}` ends at byte {end} but the file has {data_len} bytes of data"
        ));
    }
    Ok(SafetensorsEntry {
        shard,
        dtype,
        shape: matrix_shape(shape),
        start: data_start + begin,
        end: data_start + end,
    })
}
