//! GGUF reader (versions 2 and 3): header, typed metadata, tensor infos, aligned tensor data.
//!
//! The file is memory-mapped; every read is bounds-checked so a truncated or hostile file
//! yields [`ModelError::Corrupt`] naming what was being read, never a panic or a huge
//! allocation (counts are checked against the bytes that remain before anything is reserved).

mod metadata;
pub mod writer;

pub use metadata::{MetaValue, Metadata};

use crate::error::{io_error, ModelError, Result};
use crate::quant::GgmlType;
use memmap2::Mmap;
use std::path::{Path, PathBuf};

/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: usize = 4;
const DEFAULT_ALIGNMENT: u64 = 32;

#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions innermost-first, as stored (an HF `[out, in]` weight is `[in, out]`).
    pub dims: Vec<u64>,
    pub dtype: GgmlType,
    /// Offset of the data from the start of the file.
    pub file_offset: usize,
    pub byte_len: usize,
}

impl GgufTensorInfo {
    pub fn elements(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }
    /// Shape outermost-first (row-major), the order the IR uses.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: Metadata,
    pub tensors: Vec<GgufTensorInfo>,
    mmap: Mmap,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
        // SAFETY: the map is read-only; a file changed underneath us while mapped is outside
        // what any reader can defend against, as with every mmap-based model loader.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| io_error(path, e))?;
        let header = parse(&mmap, path)?;
        Ok(Self {
            path: path.to_path_buf(),
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            mmap,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    pub fn tensor_data(&self, info: &GgufTensorInfo) -> &[u8] {
        &self.mmap[info.file_offset..info.file_offset + info.byte_len]
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    fn meta_error(&self, key: &str, problem: &str) -> ModelError {
        ModelError::Metadata {
            path: self.path.clone(),
            key: key.into(),
            problem: problem.into(),
        }
    }

    pub fn require_u64(&self, key: &str) -> Result<u64> {
        let v = self.get(key).ok_or_else(|| self.meta_error(key, "is missing"))?;
        v.as_u64()
            .ok_or_else(|| self.meta_error(key, &format!("should be an unsigned integer, found {}", v.type_name())))
    }

    pub fn require_f64(&self, key: &str) -> Result<f64> {
        let v = self.get(key).ok_or_else(|| self.meta_error(key, "is missing"))?;
        v.as_f64()
            .ok_or_else(|| self.meta_error(key, &format!("should be a number, found {}", v.type_name())))
    }

    pub fn require_str(&self, key: &str) -> Result<&str> {
        let v = self.get(key).ok_or_else(|| self.meta_error(key, "is missing"))?;
        v.as_str()
            .ok_or_else(|| self.meta_error(key, &format!("should be a string, found {}", v.type_name())))
    }

    pub fn optional_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key).map(|_| self.require_u64(key)).transpose()
    }

    pub fn optional_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key).map(|_| self.require_f64(key)).transpose()
    }

    /// An array of strings (e.g. `tokenizer.ggml.tokens`).
    pub fn string_array(&self, key: &str) -> Result<Vec<&str>> {
        let v = self.get(key).ok_or_else(|| self.meta_error(key, "is missing"))?;
        let arr = v.as_array().ok_or_else(|| self.meta_error(key, "should be an array"))?;
        arr.iter()
            .map(|x| x.as_str().ok_or_else(|| self.meta_error(key, "should hold strings")))
            .collect()
    }

    /// An array of numbers (e.g. `tokenizer.ggml.scores`, `token_type`).
    pub fn number_array(&self, key: &str) -> Result<Vec<f64>> {
        let v = self.get(key).ok_or_else(|| self.meta_error(key, "is missing"))?;
        let arr = v.as_array().ok_or_else(|| self.meta_error(key, "should be an array"))?;
        arr.iter()
            .map(|x| x.as_f64().ok_or_else(|| self.meta_error(key, "should hold numbers")))
            .collect()
    }
}

struct Header {
    version: u32,
    metadata: Metadata,
    tensors: Vec<GgufTensorInfo>,
}

/// A bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn corrupt(&self, what: impl Into<String>) -> ModelError {
        ModelError::Corrupt {
            path: self.path.to_path_buf(),
            what: what.into(),
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| {
            self.corrupt(format!(
                "file ends while reading {what} (needs {n} bytes at offset {}, file has {})",
                self.pos,
                self.bytes.len()
            ))
        })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// A count that must not exceed what the remaining bytes could hold at `min_item_bytes` each.
    fn count(&mut self, version: u32, min_item_bytes: usize, what: &str) -> Result<usize> {
        let n = if version == 1 {
            self.u32(what)? as u64
        } else {
            self.u64(what)?
        };
        let limit = (self.remaining() / min_item_bytes.max(1)) as u64;
        if n > limit {
            return Err(self.corrupt(format!(
                "{what} is {n}, more than the {} remaining bytes can hold",
                self.remaining()
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, version: u32, what: &str) -> Result<String> {
        let len = self.count(version, 1, &format!("length of {what}"))?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.corrupt(format!("{what} is not valid UTF-8")))
    }

    fn value(&mut self, version: u32, type_id: u32, key: &str, depth: usize) -> Result<MetaValue> {
        let what = format!("value of `{key}`");
        Ok(match type_id {
            0 => MetaValue::U8(self.array::<1>(&what)?[0]),
            1 => MetaValue::I8(self.array::<1>(&what)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => MetaValue::U32(self.u32(&what)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => match self.array::<1>(&what)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(self.corrupt(format!("{what}: bool byte is {b}"))),
            },
            8 => MetaValue::String(self.string(version, &what)?),
            9 => {
                if depth > 0 {
                    return Err(self.corrupt(format!("{what}: nested arrays are not allowed")));
                }
                let item_type = self.u32(&what)?;
                let n = self.count(version, min_value_bytes(item_type), &format!("length of {what}"))?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(version, item_type, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(&what)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(&what)?)),
            t => return Err(self.corrupt(format!("{what} has unknown metadata type {t}"))),
        })
    }
}

fn min_value_bytes(type_id: u32) -> usize {
    match type_id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        _ => 1,
    }
}

fn parse(bytes: &[u8], path: &Path) -> Result<Header> {
    let mut c = Cursor { bytes, pos: 0, path };
    let magic: [u8; 4] = c.array("magic")?;
    if &magic != b"GGUF" {
        return Err(ModelError::BadMagic {
            path: path.to_path_buf(),
            found: magic,
        });
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(ModelError::UnsupportedVersion {
            path: path.to_path_buf(),
            version,
        });
    }
    // Each tensor info takes at least 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset).
    let n_tensors = c.count(version, 24, "tensor count")?;
    let n_kv = c.count(version, 12, "metadata count")?;
    let mut metadata = Metadata::new();
    for i in 0..n_kv {
        let key = c.string(version, &format!("metadata key #{i}"))?;
        let type_id = c.u32(&format!("type of `{key}`"))?;
        let value = c.value(version, type_id, &key, 0)?;
        metadata.insert(key, value);
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => v
            .as_u64()
            .filter(|a| a.is_power_of_two())
            .ok_or_else(|| c.corrupt("general.alignment must be a power of two"))?,
    };
    let mut raw = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        raw.push(read_tensor_info(&mut c, version, i)?);
    }
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let tensors = raw
        .into_iter()
        .map(|r| r.place(data_start, alignment, bytes.len(), path))
        .collect::<Result<Vec<_>>>()?;
    Ok(Header {
        version,
        metadata,
        tensors,
    })
}

struct RawTensorInfo {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    offset: u64,
}

fn read_tensor_info(c: &mut Cursor, version: u32, index: usize) -> Result<RawTensorInfo> {
    let name = c.string(version, &format!("name of tensor #{index}"))?;
    let n_dims = c.u32(&format!("dimension count of `{name}`"))? as usize;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(c.corrupt(format!("tensor `{name}` has {n_dims} dimensions (1..=4 allowed)")));
    }
    let mut dims = Vec::with_capacity(n_dims);
    for _ in 0..n_dims {
        dims.push(c.u64(&format!("dimensions of `{name}`"))?);
    }
    let type_id = c.u32(&format!("type of `{name}`"))?;
    let offset = c.u64(&format!("offset of `{name}`"))?;
    Ok(RawTensorInfo {
        name,
        dims,
        type_id,
        offset,
    })
}

impl RawTensorInfo {
    fn place(self, data_start: u64, alignment: u64, file_len: usize, path: &Path) -> Result<GgufTensorInfo> {
        let corrupt = |what: String| ModelError::Corrupt {
            path: path.to_path_buf(),
            what,
        };
        let name = self.name;
        let dtype = GgmlType::from_id(self.type_id).ok_or_else(|| ModelError::UnsupportedTensorType {
            path: path.to_path_buf(),
            tensor: name.clone(),
            type_id: self.type_id,
        })?;
        let elements = self
            .dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&e| e <= usize::MAX as u64 / 4)
            .ok_or_else(|| corrupt(format!("tensor `{name}` dimensions {:?} overflow", self.dims)))?;
        let (block_elems, _) = dtype.block_layout();
        if !self.dims[0].is_multiple_of(block_elems as u64) {
            return Err(corrupt(format!(
                "tensor `{name}`: row length {} is not a multiple of the {} block size {block_elems}",
                self.dims[0],
                dtype.name()
            )));
        }
        let byte_len = dtype
            .bytes_for(elements as usize)
            .ok_or_else(|| corrupt(format!("tensor `{name}` size overflows")))?;
        if !self.offset.is_multiple_of(alignment) {
            return Err(corrupt(format!(
                "tensor `{name}` offset {} is not aligned to {alignment}",
                self.offset
            )));
        }
        let start = data_start
            .checked_add(self.offset)
            .filter(|s| s.checked_add(byte_len as u64).is_some_and(|end| end <= file_len as u64))
            .ok_or_else(|| {
                corrupt(format!(
                    "tensor `{name}` ({byte_len} bytes at data offset {}) runs past the end of the file ({file_len} bytes)",
                    self.offset
                ))
            })?;
        Ok(GgufTensorInfo {
            name,
            dims: self.dims,
            dtype,
            file_offset: start as usize,
            byte_len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::writer::GgufWriter;
    use super::*;

    /// A file holding `bytes`, removed when dropped.
    fn write_temp(bytes: &[u8], name: &str) -> tempfile::TempPath {
        let file = tempfile::Builder::new()
            .prefix(&format!("bbc-gguf-{name}-"))
            .tempfile()
            .unwrap();
        std::fs::write(file.path(), bytes).unwrap();
        file.into_temp_path()
    }

    fn sample() -> GgufWriter {
        GgufWriter::new()
            .meta("general.architecture", MetaValue::String("llama".into()))
            .meta("general.alignment", MetaValue::U32(32))
            .meta("a.list", MetaValue::Array(vec![MetaValue::I32(-1), MetaValue::I32(2)]))
            .meta("a.f64", MetaValue::F64(0.5))
            .meta("a.bool", MetaValue::Bool(true))
            .tensor("w", &[4, 2], 0, (0..8).flat_map(|i| (i as f32).to_le_bytes()).collect())
            .tensor("q", &[32], 8, vec![0u8; 34])
    }

    #[test]
    fn round_trips_metadata_and_tensors() {
        let path = write_temp(&sample().to_bytes(), "ok");
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.version, 3);
        assert_eq!(f.require_str("general.architecture").unwrap(), "llama");
        assert_eq!(f.number_array("a.list").unwrap(), vec![-1.0, 2.0]);
        assert_eq!(f.require_f64("a.f64").unwrap(), 0.5);
        let w = f.tensor("w").unwrap();
        assert_eq!(w.shape(), vec![2, 4]);
        assert_eq!(f.tensor_data(w).len(), 32);
        assert_eq!(f.tensor("q").unwrap().dtype, GgmlType::Q8_0);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = sample().to_bytes();
        let full = GgufFile::open(&write_temp(&bytes, "full")).unwrap();
        // Only the alignment padding after the last tensor may go missing.
        let data_end = full.tensors.iter().map(|t| t.file_offset + t.byte_len).max().unwrap();
        for cut in 0..data_end {
            let path = write_temp(&bytes[..cut], "cut");
            let err = GgufFile::open(&path).expect_err("a truncated file must not load");
            let msg = err.to_string();
            assert!(msg.contains("truncated") || msg.contains("magic"), "cut {cut}: {msg}");
        }
    }
}
