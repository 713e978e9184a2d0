//! HF model directories: `config.json`, `*.safetensors` (memory-mapped; sharded through
//! `model.safetensors.index.json`), tokenizer files.

use crate::error::{io_error, ModelError, Result};
use crate::quant::GgmlType;
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
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ModelError::Config {
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
        let mut files: Vec<String> = map
            .values()
            .filter_map(|v| v.as_str().map(String::from))
            .collect();
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
/// match shape × dtype size and lie inside the file.
fn read_header(bytes: &[u8], path: &Path, shard: usize) -> Result<Vec<(String, SafetensorsEntry)>> {
    let bad = |what: String| ModelError::Safetensors {
        path: path.to_path_buf(),
        what,
    };
    let (_, metadata) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| bad(format!("invalid header: {e}")))?;
    let header_len = u64::from_le_bytes(
        bytes[..8]
            .try_into()
            .expect("read_metadata checked the length"),
    ) as usize;
    let data_start = 8 + header_len;
    let data_len = bytes.len() - data_start;
    let mut out = Vec::new();
    for (name, info) in metadata.tensors() {
        let dtype = match info.dtype {
            safetensors::Dtype::F32 => GgmlType::F32,
            safetensors::Dtype::F16 => GgmlType::F16,
            safetensors::Dtype::BF16 => GgmlType::BF16,
            other => {
                return Err(bad(format!(
                    "tensor `{name}` has dtype {other:?}; bbc reads F32, F16 and BF16"
                )))
            }
        };
        let (begin, end) = info.data_offsets;
        let elements = info.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let want = elements.and_then(|e| dtype.bytes_for(e));
        if want != Some(end.wrapping_sub(begin)) || begin > end {
            return Err(bad(format!(
                "tensor `{name}`: shape {:?} × {} does not match its byte range {begin}..{end}",
                info.shape,
                dtype.name()
            )));
        }
        if end > data_len {
            return Err(bad(format!(
                "tensor `{name}` ends at byte {end} but the file has {data_len} bytes of data"
            )));
        }
        out.push((
            name,
            SafetensorsEntry {
                shard,
                dtype,
                shape: info.shape.clone(),
                start: data_start + begin,
                end: data_start + end,
            },
        ));
    }
    Ok(out)
}
