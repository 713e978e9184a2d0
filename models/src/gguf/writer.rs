//! A minimal GGUF writer: builds files for tests (malformed-input checks, round trips) and
//! for tools that emit small models. Layout as the reader expects (see `mod.rs`).

use super::MetaValue;

#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn meta(mut self, key: &str, value: MetaValue) -> Self {
        self.metadata.push((key.into(), value));
        self
    }

    /// A tensor with dims innermost-first, a GGML type id and its raw bytes.
    pub fn tensor(mut self, name: &str, dims: &[u64], type_id: u32, data: Vec<u8>) -> Self {
        self.tensors.push((name.into(), dims.to_vec(), type_id, data));
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_to(&mut out).expect("writing to memory cannot fail");
        out
    }

    /// The file written to `to` as it is made: a large model's tensors are not copied into
    /// one buffer first.
    pub fn write_to(&self, to: &mut impl std::io::Write) -> std::io::Result<()> {
        const ALIGN: usize = 32;
        let mut head = b"GGUF".to_vec();
        head.extend(3u32.to_le_bytes());
        head.extend((self.tensors.len() as u64).to_le_bytes());
        head.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut head, key);
            head.extend(value_type(value).to_le_bytes());
            put_value(&mut head, value);
        }
        let mut offset = 0usize;
        for (name, dims, type_id, data) in &self.tensors {
            put_string(&mut head, name);
            head.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                head.extend(d.to_le_bytes());
            }
            head.extend(type_id.to_le_bytes());
            head.extend((offset as u64).to_le_bytes());
            offset += data.len().div_ceil(ALIGN) * ALIGN;
        }
        head.resize(head.len().div_ceil(ALIGN) * ALIGN, 0);
        to.write_all(&head)?;
        let padding = [0u8; ALIGN];
        for (_, _, _, data) in &self.tensors {
            to.write_all(data)?;
            to.write_all(&padding[..data.len().div_ceil(ALIGN) * ALIGN - data.len()])?;
        }
        Ok(())
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn value_type(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend(x.to_le_bytes()),
        MetaValue::I16(x) => out.extend(x.to_le_bytes()),
        MetaValue::U32(x) => out.extend(x.to_le_bytes()),
        MetaValue::I32(x) => out.extend(x.to_le_bytes()),
        MetaValue::F32(x) => out.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(*x as u8),
        MetaValue::String(s) => put_string(out, s),
        MetaValue::Array(items) => {
            let item_type = items.first().map_or(0, value_type);
            out.extend(item_type.to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
        MetaValue::U64(x) => out.extend(x.to_le_bytes()),
        MetaValue::I64(x) => out.extend(x.to_le_bytes()),
        MetaValue::F64(x) => out.extend(x.to_le_bytes()),
    }
}
