//! Weights as every backend reads them: a borrowed view of a tensor (its shape, storage type
//! and bytes), looked up by name from any source ([`Tensors`]): a GGUF file, safetensors, or
//! tensors made in memory.

use crate::GgmlType;
use ir::Tensor;

/// A borrowed weight: row-major `shape`, stored as `dtype` in `bytes` (rows are contiguous and
/// each row is a whole number of blocks).
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub shape: &'a [usize],
    pub dtype: GgmlType,
    pub bytes: &'a [u8],
}

impl TensorView<'_> {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
    pub fn rows(&self) -> usize {
        self.elements() / self.row_len().max(1)
    }
    pub fn row_bytes(&self) -> usize {
        self.dtype.bytes_for(self.row_len()).expect("rows are whole blocks")
    }
    pub fn to_f32(&self) -> Tensor {
        let mut data = vec![0f32; self.elements()];
        self.dtype.dequantize(self.bytes, &mut data);
        Tensor::new(self.shape.to_vec(), data)
    }
}

/// Where weights come from, by name.
pub trait Tensors: Sync {
    fn tensor(&self, name: &str) -> Option<TensorView<'_>>;

    /// The tensor `name` made afresh and handed over, where the source makes it as it is read
    /// (a weight converted or quantized as it loads) rather than holding it: a reader that
    /// keeps its own copy takes it so, and the source never holds a second one. `None` where
    /// [`tensor`](Self::tensor) is the way to read it.
    fn made_afresh(&self, _name: &str) -> Option<MemoryTensor> {
        None
    }

    /// Whether [`made_afresh`](Self::made_afresh) would make `name` (without making it).
    fn made_as_read(&self, _name: &str) -> bool {
        false
    }
}

/// A tensor held in memory: row-major `shape`, stored as `dtype` in `bytes`.
#[derive(Debug, Clone)]
pub struct MemoryTensor {
    pub shape: Vec<usize>,
    pub dtype: GgmlType,
    pub bytes: Vec<u8>,
}

/// Tensors made in memory, by name (a model's random weights where it has no file).
pub type MemoryTensors = std::collections::BTreeMap<String, MemoryTensor>;

impl Tensors for MemoryTensors {
    fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.get(name).map(|t| TensorView {
            shape: &t.shape,
            dtype: t.dtype,
            bytes: &t.bytes,
        })
    }
}

/// The IR's name for a storage type.
pub fn ir_dtype(t: GgmlType) -> ir::DType {
    match t {
        GgmlType::F32 => ir::DType::F32,
        GgmlType::F16 => ir::DType::F16,
        GgmlType::BF16 => ir::DType::BF16,
        GgmlType::Q4_0 => ir::DType::Q4_0,
        GgmlType::Q4_1 => ir::DType::Q4_1,
        GgmlType::Q5_0 => ir::DType::Q5_0,
        GgmlType::Q5_1 => ir::DType::Q5_1,
        GgmlType::Q8_0 => ir::DType::Q8_0,
        GgmlType::Q4K => ir::DType::Q4K,
        GgmlType::Q5K => ir::DType::Q5K,
        GgmlType::Q6K => ir::DType::Q6K,
        GgmlType::Q2K => ir::DType::Q2K,
        GgmlType::Q3K => ir::DType::Q3K,
        GgmlType::IQ4NL => ir::DType::IQ4NL,
        GgmlType::IQ4XS => ir::DType::IQ4XS,
        GgmlType::MXFP4 => ir::DType::MXFP4,
        GgmlType::F8E4M3B32 => ir::DType::F8E4M3B32,
        GgmlType::U4B32 => ir::DType::U4B32,
        GgmlType::U4B128 => ir::DType::U4B128,
        GgmlType::F4E2M1B32 => ir::DType::F4E2M1B32,
        GgmlType::I32 => ir::DType::I32,
    }
}

/// Bytes of an element of `dtype` where it is a float type a checkpoint's quantized weights
/// are read into (f32, bf16, f16); `None` for any other.
pub fn float_bytes(dtype: GgmlType) -> Option<usize> {
    match dtype {
        GgmlType::F32 => Some(4),
        GgmlType::BF16 | GgmlType::F16 => Some(2),
        _ => None,
    }
}

/// `value` rounded to `dtype` (f32, bf16 or f16: see [`float_bytes`]) into `out`, its bytes.
pub fn write_float(value: f32, dtype: GgmlType, out: &mut [u8]) {
    match dtype {
        GgmlType::F32 => out.copy_from_slice(&value.to_le_bytes()),
        GgmlType::BF16 => out.copy_from_slice(&half::bf16::from_f32(value).to_le_bytes()),
        GgmlType::F16 => out.copy_from_slice(&half::f16::from_f32(value).to_le_bytes()),
        other => panic!("{} is not a float type weights are read into", other.name()),
    }
}

/// The float matrix `view` (f32, bf16 or f16, `[rows, cols]`, `cols` a multiple of the
/// block) quantized into `format`, one of [`GgmlType::MADE_FROM_FLOATS`], as floats are made
/// such blocks where no file gave them (each format's `quantize_matrix`); `None` for any other
/// format.
pub fn quantize_matrix(view: &TensorView<'_>, format: GgmlType) -> Option<Vec<u8>> {
    Some(match format {
        GgmlType::F8E4M3B32 => crate::fp8_blocks::quantize_matrix(view),
        GgmlType::F4E2M1B32 => crate::fp4_blocks::quantize_matrix(view),
        GgmlType::MXFP4 => crate::mxfp4::quantize_matrix(view),
        GgmlType::Q8_0 => crate::q8_0::quantize_matrix(view),
        GgmlType::U4B32 | GgmlType::U4B128 => {
            let size = crate::u4_blocks::Size::of(format).expect("a 4-bit block format");
            crate::u4_blocks::quantize_matrix(view, size)
        }
        _ => return None,
    })
}

/// The float matrix `view` (f32, bf16 or f16, `[rows, cols]`, `cols` a multiple of 32) in
/// blocks of 32 weights, each `quantize_block`'s `N` bytes, row by row on the pool.
pub(crate) fn quantize_blocks_of_32<const N: usize>(
    view: &TensorView<'_>,
    quantize_block: impl Fn(&[f32]) -> [u8; N] + Sync,
) -> Vec<u8> {
    quantize_blocks(view, 32, N, |x, out| out.copy_from_slice(&quantize_block(x)))
}

/// The float matrix `view` (f32, bf16 or f16, `[rows, cols]`, `cols` a multiple of `elems`)
/// in blocks of `elems` weights, `bytes` each, written by `quantize_block(weights, block)`,
/// row by row on the pool.
pub(crate) fn quantize_blocks(
    view: &TensorView<'_>,
    elems: usize,
    bytes: usize,
    quantize_block: impl Fn(&[f32], &mut [u8]) + Sync,
) -> Vec<u8> {
    use rayon::prelude::*;
    let [rows, cols] = view.shape[..] else {
        panic!("a matrix to quantize has two dims, not {:?}", view.shape)
    };
    assert!(view.dtype.block_layout().0 == 1 && cols % elems == 0);
    let row_bytes = view.dtype.block_layout().1 * cols;
    let mut out = vec![0u8; rows * cols / elems * bytes];
    out.par_chunks_mut(cols / elems * bytes)
        .zip(view.bytes.par_chunks(row_bytes))
        .for_each_init(
            || vec![0f32; cols],
            |row, (blocks, stored)| {
                view.dtype.dequantize(stored, row);
                for (x, out) in row.chunks_exact(elems).zip(blocks.chunks_exact_mut(bytes)) {
                    quantize_block(x, out);
                }
            },
        );
    out
}
