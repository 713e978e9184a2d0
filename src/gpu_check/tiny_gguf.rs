//! Tiny Llama GGUF files made on the spot, with GGUF-block or f16 weights (random, deterministic;
//! no tokenizer): what a GGUF model's GPU plans run, small enough for the emulator. The GPU
//! check runs their plans in lockstep with the emulator, the tests against the CPU backend.

use models::gguf::writer::GgufWriter;
use models::gguf::MetaValue;
use std::path::{Path, PathBuf};

/// Random bytes, deterministic (xorshift).
pub struct Bytes(u64);

impl Bytes {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Makes a matrix of `rows` × `cols` weights as a GGUF tensor: its GGML type id and bytes.
pub type MakeMatrix = dyn FnMut(&mut Bytes, u64, u64) -> (u32, Vec<u8>);
pub type Matrix<'a> = &'a mut MakeMatrix;

/// Blocks of 32 weights laid out as Q8_0 and Q4_0 are: an f16 `scale`, then `payload` random
/// bytes (32 values, or 32 nibbles in 16 bytes).
fn scaled_blocks(bytes: &mut Bytes, rows: u64, cols: u64, scale: f32, payload: usize) -> Vec<u8> {
    let scale = half::f16::from_f32(scale).to_le_bytes();
    (0..rows * cols / 32)
        .flat_map(|_| {
            scale
                .into_iter()
                .chain((0..payload).map(|_| bytes.next_u64() as u8))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Q8_0 blocks: an f16 scale of 0.001 and 32 random values.
pub fn q8_0(bytes: &mut Bytes, rows: u64, cols: u64) -> (u32, Vec<u8>) {
    (8, scaled_blocks(bytes, rows, cols, 0.001, 32))
}

/// Q4_0 blocks: an f16 scale of 0.01 and 32 random nibbles.
pub fn q4_0(bytes: &mut Bytes, rows: u64, cols: u64) -> (u32, Vec<u8>) {
    (2, scaled_blocks(bytes, rows, cols, 0.01, 16))
}

/// IEEE half values within ±0.25.
pub fn f16_values(bytes: &mut Bytes, rows: u64, cols: u64) -> (u32, Vec<u8>) {
    let data = (0..rows * cols)
        .flat_map(|_| half::f16::from_f32((bytes.next_u64() % 1001) as f32 / 2000.0 - 0.25).to_le_bytes())
        .collect();
    (1, data)
}

/// IEEE half values within ±0.25, a pool of 64 Ki random ones repeated: an 8B model's 16 GB
/// made at copying speed (what loading it costs does not depend on the values).
pub fn f16_tiled(bytes: &mut Bytes, rows: u64, cols: u64) -> (u32, Vec<u8>) {
    let (_, pool) = f16_values(bytes, 1, 1 << 16);
    let len = (rows * cols * 2) as usize;
    let data = pool.iter().copied().cycle().take(len).collect();
    (1, data)
}

/// A Llama's shape as a GGUF file states it.
#[derive(Debug, Clone, Copy)]
pub struct LlamaShape {
    pub hidden: u64,
    pub ffn: u64,
    pub layers: u32,
    pub vocab: u64,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u64,
    pub context: u32,
    pub rope_base: f32,
}

impl LlamaShape {
    /// 3 layers, hidden 64 (4 heads of 16, 2 KV heads), MLP 160, 320 tokens.
    pub const TINY: Self = Self {
        hidden: 64,
        ffn: 160,
        layers: 3,
        vocab: 320,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        context: 256,
        rope_base: 10_000.0,
    };

    /// The shape of a Llama `config`.
    pub fn of(config: &models::ModelConfig) -> Self {
        Self {
            hidden: config.hidden as u64,
            ffn: config.intermediate as u64,
            layers: config.layers as u32,
            vocab: config.vocab_size as u64,
            heads: config.heads as u32,
            kv_heads: config.kv_heads as u32,
            head_dim: config.head_dim as u64,
            context: config.context_length as u32,
            rope_base: config.rope_theta as f32,
        }
    }
}

/// A tiny Llama ([`LlamaShape::TINY`]) as a GGUF file at `path`, no tokenizer, norms in f32:
/// attention matrices and the embedding made by `attention`, the MLP's by `mlp`.
pub fn tiny_gguf_llama(path: &Path, attention: Matrix, mlp: Matrix) -> std::io::Result<()> {
    gguf_llama(path, &LlamaShape::TINY, attention, mlp)
}

/// A Llama of `shape` as a GGUF file at `path`, as [`tiny_gguf_llama`] makes it.
pub fn gguf_llama(path: &Path, shape: &LlamaShape, attention: Matrix, mlp: Matrix) -> std::io::Result<()> {
    let (hidden, ffn, vocab) = (shape.hidden, shape.ffn, shape.vocab);
    let (q_rows, kv_rows) = (
        shape.heads as u64 * shape.head_dim,
        shape.kv_heads as u64 * shape.head_dim,
    );
    let mut bytes = Bytes(0x2545_f491_4f6c_dd1d);
    let norm = |len: u64| -> Vec<u8> {
        (0..len)
            .flat_map(|i| (1.0f32 + 0.01 * (i % 7) as f32).to_le_bytes())
            .collect()
    };
    let meta = |k: &str| format!("llama.{k}");
    let (embedding_type, embedding) = attention(&mut bytes, vocab, hidden);
    let mut file = GgufWriter::new()
        .meta("general.architecture", MetaValue::String("llama".into()))
        .meta(&meta("embedding_length"), MetaValue::U32(hidden as u32))
        .meta(&meta("feed_forward_length"), MetaValue::U32(ffn as u32))
        .meta(&meta("block_count"), MetaValue::U32(shape.layers))
        .meta(&meta("attention.head_count"), MetaValue::U32(shape.heads))
        .meta(&meta("attention.head_count_kv"), MetaValue::U32(shape.kv_heads))
        .meta(&meta("attention.key_length"), MetaValue::U32(shape.head_dim as u32))
        .meta(&meta("attention.value_length"), MetaValue::U32(shape.head_dim as u32))
        .meta(&meta("attention.layer_norm_rms_epsilon"), MetaValue::F32(1e-5))
        .meta(&meta("context_length"), MetaValue::U32(shape.context))
        .meta(&meta("vocab_size"), MetaValue::U32(vocab as u32))
        .meta(&meta("rope.freq_base"), MetaValue::F32(shape.rope_base))
        .tensor("token_embd.weight", &[hidden, vocab], embedding_type, embedding)
        .tensor("output_norm.weight", &[hidden], 0, norm(hidden));
    for l in 0..shape.layers {
        let t = |name: &str| format!("blk.{l}.{name}.weight");
        // (name, rows, cols, from the attention's maker or the MLP's)
        let matrices = [
            ("attn_q", q_rows, hidden, true),
            ("attn_k", kv_rows, hidden, true),
            ("attn_v", kv_rows, hidden, true),
            ("attn_output", hidden, q_rows, true),
            ("ffn_gate", ffn, hidden, false),
            ("ffn_up", ffn, hidden, false),
            ("ffn_down", hidden, ffn, false),
        ];
        file =
            file.tensor(&t("attn_norm"), &[hidden], 0, norm(hidden))
                .tensor(&t("ffn_norm"), &[hidden], 0, norm(hidden));
        for (name, rows, cols, is_attention) in matrices {
            let make: &mut MakeMatrix = if is_attention { &mut *attention } else { &mut *mlp };
            let (type_id, data) = make(&mut bytes, rows, cols);
            file = file.tensor(&t(name), &[cols, rows], type_id, data);
        }
    }
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    file.write_to(&mut out)?;
    std::io::Write::flush(&mut out)
}

/// `dir/tiny-quantized-llama.gguf`: Q8_0 attention and embedding, Q4_0 MLP.
pub fn quantized_llama(dir: &Path) -> std::io::Result<PathBuf> {
    let path = dir.join("tiny-quantized-llama.gguf");
    tiny_gguf_llama(&path, &mut q8_0, &mut q4_0)?;
    Ok(path)
}

/// `dir/tiny-f16-llama.gguf`: every matrix in IEEE half.
pub fn f16_llama(dir: &Path) -> std::io::Result<PathBuf> {
    let path = dir.join("tiny-f16-llama.gguf");
    tiny_gguf_llama(&path, &mut f16_values, &mut f16_values)?;
    Ok(path)
}

/// The GGUF file at `src` written to `dst` with its f32 matrices stored as IEEE halves, as
/// llama.cpp's F16 conversion writes a model: tensors of two dimensions or more whose names end
/// in `.weight`, but for norms, convolutions and MoE routers (kept in f32, as llama.cpp keeps
/// them); metadata and every other tensor as they are.
pub fn with_half_matrices(src: &Path, dst: &Path) -> anyhow::Result<()> {
    let file = models::gguf::GgufFile::open(src)?;
    let mut out = GgufWriter::new();
    for (key, value) in &file.metadata {
        out = out.meta(key, value.clone());
    }
    let kept_f32 = ["norm", "conv1d", "ffn_gate_inp"];
    for info in &file.tensors {
        let data = file.tensor_data(info);
        let halved = info.dtype == quant::GgmlType::F32
            && info.dims.len() >= 2
            && info.name.ends_with(".weight")
            && !kept_f32.iter().any(|k| info.name.contains(k));
        out = match halved {
            true => {
                let halves = data
                    .chunks_exact(4)
                    .flat_map(|v| half::f16::from_f32(f32::from_le_bytes([v[0], v[1], v[2], v[3]])).to_le_bytes())
                    .collect();
                out.tensor(&info.name, &info.dims, quant::GgmlType::F16 as u32, halves)
            }
            false => out.tensor(&info.name, &info.dims, info.dtype as u32, data.to_vec()),
        };
    }
    let mut writer = std::io::BufWriter::new(std::fs::File::create(dst)?);
    out.write_to(&mut writer)?;
    std::io::Write::flush(&mut writer)?;
    Ok(())
}
