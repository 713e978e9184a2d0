//! Weight matrices as the CPU kernels consume them, and `x · Wᵀ` over them.
//!
//! A matrix keeps the storage its graph node asks for: f32, bf16, half, a GGML block format,
//! FP8 blocks (widened by the dense tiles as they load them for steps of few tokens, else a
//! few rows at a time for them, `fp8_rows`) or 4-bit blocks (an integer checkpoint's: held as
//! GGUF's Q4_0 or Q5_0 for the integer path where those hold the same weights, else widened by
//! the tiles).
//! The product walks W's rows in parallel runs, so prefill reads the weights once per step and
//! decode is a pass over the weights. Dense rows (f32, bf16) are multiplied in register tiles
//! of rows × tokens (`dense`; where the CPU lacks AVX2 and FMA, each row is widened to f32 once
//! and dotted with every token's activation). Quantized weights take the integer path:
//! activations quantized to int8 once per step (per 32 elements, or per 256-element
//! super-block for K-quant rows), each weight row dotted with them in integers (ggml's
//! scheme). Block-quantized rows are kept interleaved
//! (`crate::cpu::quant::interleaved` for the 32-weight formats, `interleaved_k` for the K-quants:
//! sixteen rows advance together in one register); a format without that layout would be
//! unpacked a row at a time.

use super::dense::{self, DenseKernel, DenseRows};
use super::fp8_rows;
use super::pool;
use super::simd;
use crate::cpu::quant::int8::{ActivationRow, Int8Kernel, Q8KRow, Q8Row, ACT_BLOCK};
use crate::cpu::quant::interleaved::{InterleavedRows, GROUP};
use crate::cpu::quant::interleaved_k::InterleavedSuperRows;
use half::bf16;
use quant::{u4_blocks, GgmlType};
use std::borrow::Cow;
use std::cell::Cell;
use std::thread::LocalKey;

/// The most tokens whose products with FP8 blocks the dense tiles widen as they load (each
/// chunk of a row once a tile of tokens); more, and a few rows at a time are widened to f32
/// once for all of them. `benches/batched_step.rs` on a 0.45 B-weight Llama shape, two
/// cores: 24 and 32 sequences 12% and 6% faster tiled, 64 and a 128-token prompt 5% and 7%
/// slower.
const FP8_TILED_TOKENS: usize = 32;

pub enum Storage {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    /// IEEE halves: a half checkpoint's or GGUF's as stored, or a `--dtype f16` model's.
    F16(Vec<half::f16>),
    /// A 32-weight block format with its rows interleaved for the int8 kernels.
    Interleaved(InterleavedRows),
    /// K-quant rows (Q2_K to Q6_K, IQ4_XS) interleaved for the int8 kernels.
    InterleavedSuper(InterleavedSuperRows),
    /// FP8 weights as held (`quant::fp8_blocks`: 32 codes and their f32 scale a block), each
    /// row widened to f32 as it is multiplied.
    Fp8Blocks(Fp8Blocks),
    /// 4-bit weights as held (`quant::u4_blocks`: 32 or 128 levels, their f32 scale and
    /// offset a block), widened to f32 as they are multiplied.
    U4Blocks(u4_blocks::Size, Vec<u8>),
    /// FP4 weights as held (`quant::fp4_blocks`: 32 codes and an f32 scale for each 16 a
    /// block), widened to f32 as they are multiplied.
    Fp4Blocks(Vec<u8>),
}

/// FP8 blocks, and whether every one widens by halves (`fp8_rows::widens_by_halves`: no NaN
/// code, no scale that overflows 2⁸ times over), so the dense tiles widen them as they load.
pub struct Fp8Blocks {
    bytes: Vec<u8>,
    by_halves: bool,
}

impl Fp8Blocks {
    fn new(bytes: Vec<u8>) -> Self {
        let by_halves = fp8_rows::widens_by_halves(&bytes);
        Self { bytes, by_halves }
    }
}

impl Storage {
    /// GGUF rows of `row_bytes` each, interleaved for the int8 kernels (every block format bbc
    /// reads has a layout; rows of no whole number of blocks are refused); FP8 and FP4 blocks as
    /// they are. 4-bit blocks are interleaved as the Q4_0 or Q5_0 blocks of the same weights
    /// where every block's scale is an f16 and its zero point an integer (GPTQ's, AWQ's and
    /// compressed-tensors' scales are f16 or bf16: `quant::u4_blocks::to_gguf_blocks`), else
    /// held as they are. MXFP4 rows are interleaved where every block's scale is exact in
    /// the layout's f16 (half of it, 2^(e − 128), from 2⁻²⁴ to 2¹⁵: real weights'), else held
    /// as FP4 blocks (the same weights, each block's power of two as an f32:
    /// `quant::mxfp4::to_fp4_blocks`), or widened to f32 where a block's scale is none (an
    /// exponent of 255).
    pub fn block_rows(dtype: GgmlType, bytes: Vec<u8>, row_bytes: usize) -> Result<Self, String> {
        let (_, block_bytes) = dtype.block_layout();
        let whole_blocks =
            row_bytes != 0 && row_bytes.is_multiple_of(block_bytes) && bytes.len().is_multiple_of(row_bytes);
        if (dtype.is_checkpoint_blocks() || dtype == GgmlType::MXFP4) && !whole_blocks {
            return Err(format!(
                "{} rows of {row_bytes} bytes are not whole blocks",
                dtype.name()
            ));
        }
        if let Some(size) = u4_blocks::Size::of(dtype) {
            let interleaved = u4_blocks::to_gguf_blocks(&bytes, size).and_then(|(gguf, blocks)| {
                let gguf_row_bytes = row_bytes / size.bytes() * size.elems() / ACT_BLOCK * gguf.block_layout().1;
                InterleavedRows::new(gguf, &blocks, gguf_row_bytes)
            });
            return Ok(match interleaved {
                Some(rows) => Storage::Interleaved(rows),
                None => Storage::U4Blocks(size, bytes),
            });
        }
        if dtype.is_checkpoint_blocks() {
            return Ok(match dtype {
                GgmlType::F4E2M1B32 => Storage::Fp4Blocks(bytes),
                _ => Storage::Fp8Blocks(Fp8Blocks::new(bytes)),
            });
        }
        if let Some(rows) = InterleavedRows::new(dtype, &bytes, row_bytes) {
            return Ok(Storage::Interleaved(rows));
        }
        if dtype == GgmlType::MXFP4 {
            return Ok(match quant::mxfp4::to_fp4_blocks(&bytes) {
                Some(blocks) => Storage::Fp4Blocks(blocks),
                None => {
                    let mut values = vec![0f32; bytes.len() / block_bytes * quant::mxfp4::BLOCK_ELEMS];
                    dtype.dequantize(&bytes, &mut values);
                    Storage::F32(values)
                }
            });
        }
        if let Some(rows) = InterleavedSuperRows::new(dtype, &bytes, row_bytes) {
            return Ok(Storage::InterleavedSuper(rows));
        }
        Err(format!(
            "{} rows of {row_bytes} bytes have no interleaved layout",
            dtype.name()
        ))
    }

    /// The format, GGUF bytes and bytes a row of block-quantized storage.
    fn gguf_rows(&self) -> Option<(GgmlType, Cow<'_, [u8]>, usize)> {
        match self {
            Storage::Interleaved(rows) => Some((rows.dtype(), Cow::Owned(rows.gguf_bytes()), rows.row_bytes())),
            Storage::InterleavedSuper(rows) => Some((rows.dtype(), Cow::Owned(rows.gguf_bytes()), rows.row_bytes())),
            _ => None,
        }
    }

    /// Bytes a row of FP8 blocks `cols` wide.
    fn fp8_row_bytes(cols: usize) -> usize {
        cols / quant::fp8_blocks::BLOCK_ELEMS * quant::fp8_blocks::BLOCK_BYTES
    }

    /// Bytes a row of FP4 blocks `cols` wide.
    fn fp4_row_bytes(cols: usize) -> usize {
        cols / quant::fp4_blocks::BLOCK_ELEMS * quant::fp4_blocks::BLOCK_BYTES
    }

    /// Bytes a row of 4-bit blocks of `size` `cols` wide.
    fn u4_row_bytes(size: u4_blocks::Size, cols: usize) -> usize {
        cols / size.elems() * size.bytes()
    }

    /// Whether it holds GGUF blocks (in either layout).
    pub fn is_block_quantized(&self) -> bool {
        matches!(self, Storage::Interleaved(_) | Storage::InterleavedSuper(_))
    }
}

pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub storage: Storage,
}

impl Matrix {
    pub fn bytes(&self) -> usize {
        match &self.storage {
            Storage::F32(v) => v.len() * 4,
            Storage::Bf16(v) => v.len() * 2,
            Storage::F16(v) => v.len() * 2,
            Storage::Interleaved(rows) => rows.bytes(),
            Storage::InterleavedSuper(rows) => rows.bytes(),
            Storage::Fp8Blocks(blocks) => blocks.bytes.len(),
            Storage::U4Blocks(_, blocks) | Storage::Fp4Blocks(blocks) => blocks.len(),
        }
    }

    /// Row `r` widened to f32 in `out` (`cols` long).
    pub fn row_f32<'a>(&'a self, r: usize, out: &'a mut [f32]) -> &'a [f32] {
        let c = self.cols;
        match &self.storage {
            Storage::F32(v) => &v[r * c..(r + 1) * c],
            Storage::Bf16(v) => {
                for (o, w) in out.iter_mut().zip(&v[r * c..(r + 1) * c]) {
                    *o = w.to_f32();
                }
                out
            }
            Storage::F16(v) => {
                for (o, w) in out.iter_mut().zip(&v[r * c..(r + 1) * c]) {
                    *o = w.to_f32();
                }
                out
            }
            Storage::Interleaved(rows) => {
                rows.dequantize_row(r, out);
                out
            }
            Storage::InterleavedSuper(rows) => {
                rows.dequantize_row(r, out);
                out
            }
            Storage::Fp8Blocks(blocks) => {
                let row_bytes = Storage::fp8_row_bytes(c);
                GgmlType::F8E4M3B32.dequantize(&blocks.bytes[r * row_bytes..(r + 1) * row_bytes], out);
                out
            }
            Storage::Fp4Blocks(blocks) => {
                let row_bytes = Storage::fp4_row_bytes(c);
                GgmlType::F4E2M1B32.dequantize(&blocks[r * row_bytes..(r + 1) * row_bytes], out);
                out
            }
            Storage::U4Blocks(size, blocks) => {
                let row_bytes = Storage::u4_row_bytes(*size, c);
                size.format()
                    .dequantize(&blocks[r * row_bytes..(r + 1) * row_bytes], out);
                out
            }
        }
    }

    /// The rows as the dense tiles read them whatever the tokens, widening each chunk as they
    /// load it: 4-bit and FP4 blocks.
    fn rows_widened_in_tiles(&self) -> Option<DenseRows<'_>> {
        match &self.storage {
            Storage::U4Blocks(u4_blocks::Size::Of32, blocks) => Some(DenseRows::U4B32(dense::U4Byte::of(blocks))),
            Storage::U4Blocks(u4_blocks::Size::Of128, blocks) => Some(DenseRows::U4B128(dense::U4Byte::of(blocks))),
            Storage::Fp4Blocks(blocks) => Some(DenseRows::Fp4(dense::Fp4Byte::of(blocks))),
            _ => None,
        }
    }

    /// The rows as the dense kernels read them, where they are f32, bf16 or half.
    fn dense_rows(&self) -> Option<DenseRows<'_>> {
        match &self.storage {
            Storage::F32(v) => Some(DenseRows::F32(v)),
            Storage::Bf16(v) => Some(DenseRows::Bf16(v)),
            Storage::F16(v) => Some(DenseRows::F16(v)),
            _ => None,
        }
    }

    /// `out[t, n] = Σ_k x[t, k]·W[n, k]` for `x` of `tokens` rows.
    pub fn matmul(&self, x: &[f32], tokens: usize, out: &mut [f32]) {
        self.matmul_rows(0..self.rows, x, tokens, out);
    }

    /// `matmul` with the rows `rows` of W only (one expert's share of stacked expert weights):
    /// `out[t, n − rows.start]` for `n` in `rows`. A (row, token) product is the same number
    /// as in a product with every row.
    pub fn matmul_rows(&self, rows: std::ops::Range<usize>, x: &[f32], tokens: usize, out: &mut [f32]) {
        let (n, k) = (rows.len(), self.cols);
        let base = rows.start;
        debug_assert!(rows.end <= self.rows);
        debug_assert_eq!(x.len(), tokens * k);
        debug_assert_eq!(out.len(), tokens * n);
        // Each task computes a run of W's rows for every token ([rows, tokens]) and writes its
        // columns of `out` itself (see `for_row_runs`).
        let rows_per_task = rows_per_task(n);
        if let (Some(weights), Some(kernel)) = (self.dense_rows(), DenseKernel::detected()) {
            products_by_runs(rows, out, |run, _, write| {
                dense::products(kernel, weights, k, run, x, tokens, write)
            });
            return;
        }
        if let (Storage::Fp8Blocks(blocks), Some(kernel)) = (&self.storage, DenseKernel::detected()) {
            // Few tokens: the tiles widen the blocks as they load them (each chunk of a row
            // once a tile of tokens, in registers).
            if blocks.by_halves && tokens <= FP8_TILED_TOKENS {
                let weights = DenseRows::Fp8(dense::Fp8Byte::of(&blocks.bytes));
                products_by_runs(rows, out, |run, _, write| {
                    dense::products(kernel, weights, k, run, x, tokens, write)
                });
                return;
            }
            // Else a few rows at a time widened to f32 and multiplied by the dense tiles while
            // they are in cache: the weights stream as FP8, each widened once a step.
            let (by_halves, blocks) = (blocks.by_halves, &blocks.bytes);
            let row_bytes = Storage::fp8_row_bytes(k);
            products_by_runs(rows, out, |run, widened, write| {
                for first in run.clone().step_by(fp8_rows::WIDENED_ROWS) {
                    let chunk = first..(first + fp8_rows::WIDENED_ROWS).min(run.end);
                    widened.resize(chunk.len() * k, 0.0);
                    let chunk_blocks = &blocks[chunk.start * row_bytes..chunk.end * row_bytes];
                    fp8_rows::widen(kernel, chunk_blocks, widened, by_halves);
                    let offset = chunk.start - run.start;
                    let weights = DenseRows::F32(widened);
                    dense::products(kernel, weights, k, 0..chunk.len(), x, tokens, &mut |t, r, values| {
                        write(t, offset + r, values)
                    });
                }
            });
            return;
        }
        if let (Some(weights), Some(kernel)) = (self.rows_widened_in_tiles(), DenseKernel::detected()) {
            // However many tokens: widening 16 levels in registers costs less than a pass that
            // widens rows first (`benches/batched_step.rs`, a 0.45 B-weight Llama shape of 4-bit
            // blocks, two cores: 48 and 64 sequences 10% and 3% faster, a 512-token prompt 5%).
            products_by_runs(rows, out, |run, _, write| {
                dense::products(kernel, weights, k, run, x, tokens, write)
            });
            return;
        }
        match &self.storage {
            Storage::Interleaved(interleaved) => with_quantized_rows(&Q8_ROWS, x, k, |acts| {
                let acts = interleaved.activations(acts).expect("activations cover the rows");
                let kernel = Int8Kernel::detected();
                products_by_runs(rows, out, |run, scratch, write| {
                    interleaved.products(run, &acts, kernel, scratch, write)
                });
            }),
            Storage::InterleavedSuper(interleaved) => with_quantized_rows(&Q8K_ROWS, x, k, |acts| {
                let acts = interleaved.activations(acts).expect("activations cover the rows");
                let kernel = Int8Kernel::detected();
                products_by_runs(rows, out, |run, scratch, write| {
                    interleaved.products(run, &acts, kernel, scratch, write)
                });
            }),
            // FP8 and 4-bit blocks and dense rows on a CPU without AVX2 and FMA: each row
            // widened once and dotted with every token's activation.
            _ => for_row_runs(out, n, tokens, rows_per_task, |row_buf: &mut Vec<f32>, r, dst| {
                row_buf.resize(k, 0.0);
                let w = self.row_f32(base + r, row_buf);
                for (d, xt) in dst.iter_mut().zip(x.chunks_exact(k)) {
                    *d = simd::dot(w, xt);
                }
            }),
        }
    }

    /// Stack matrices of one storage kind and width into one (`ConcatRows`).
    pub fn stack_rows(parts: &[&Matrix]) -> Result<Matrix, String> {
        let first = parts.first().ok_or("nothing to stack")?;
        let cols = first.cols;
        if parts.iter().any(|p| p.cols != cols) {
            return Err("matrices of different widths".into());
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        if let Some(storage) = stacked_4bit(parts)? {
            return Ok(Matrix { rows, cols, storage });
        }
        let storage = match &first.storage {
            Storage::F32(_) => Storage::F32(collect(parts, |s| match s {
                Storage::F32(v) => Some(v),
                _ => None,
            })?),
            Storage::Bf16(_) => Storage::Bf16(collect(parts, |s| match s {
                Storage::Bf16(v) => Some(v),
                _ => None,
            })?),
            Storage::F16(_) => Storage::F16(collect(parts, |s| match s {
                Storage::F16(v) => Some(v),
                _ => None,
            })?),
            Storage::Fp8Blocks(_) => Storage::Fp8Blocks(Fp8Blocks::new(collect(parts, |s| match s {
                Storage::Fp8Blocks(blocks) => Some(&blocks.bytes),
                _ => None,
            })?)),
            Storage::Fp4Blocks(_) => Storage::Fp4Blocks(collect(parts, |s| match s {
                Storage::Fp4Blocks(blocks) => Some(blocks),
                _ => None,
            })?),
            Storage::U4Blocks(size, _) => Storage::U4Blocks(
                *size,
                collect(parts, |s| match s {
                    Storage::U4Blocks(other, blocks) if other == size => Some(blocks),
                    _ => None,
                })?,
            ),
            Storage::Interleaved(_) | Storage::InterleavedSuper(_) => {
                let mut stacked: Option<(GgmlType, Vec<u8>, usize)> = None;
                for part in parts {
                    let Some((dtype, bytes, row_bytes)) = part.storage.gguf_rows() else {
                        return Err("matrices of different storage types".into());
                    };
                    let (first_dtype, all, first_row_bytes) =
                        stacked.get_or_insert_with(|| (dtype, Vec::new(), row_bytes));
                    if (*first_dtype, *first_row_bytes) != (dtype, row_bytes) {
                        return Err("matrices of different storage types".into());
                    }
                    all.extend_from_slice(&bytes);
                }
                let (dtype, bytes, row_bytes) = stacked.expect("at least one part");
                Storage::block_rows(dtype, bytes, row_bytes)?
            }
        };
        Ok(Matrix { rows, cols, storage })
    }

    /// Rows `start..start+len` of every group of `group` rows (`RowGroupSlice`), in any
    /// storage: rows are whole in every storage, so this is a copy of row bytes.
    pub fn row_group_slice(&self, group: usize, start: usize, len: usize) -> Result<Matrix, String> {
        self.check_row_groups(group, start, len)?;
        let picked: Vec<usize> = (0..self.rows / group)
            .flat_map(|g| g * group + start..g * group + start + len)
            .collect();
        let storage = match &self.storage {
            Storage::F32(v) => Storage::F32(gather_rows(v, self.cols, &picked)),
            Storage::Bf16(v) => Storage::Bf16(gather_rows(v, self.cols, &picked)),
            Storage::F16(v) => Storage::F16(gather_rows(v, self.cols, &picked)),
            Storage::Fp8Blocks(blocks) => Storage::Fp8Blocks(Fp8Blocks::new(gather_rows(
                &blocks.bytes,
                Storage::fp8_row_bytes(self.cols),
                &picked,
            ))),
            Storage::Fp4Blocks(blocks) => {
                Storage::Fp4Blocks(gather_rows(blocks, Storage::fp4_row_bytes(self.cols), &picked))
            }
            Storage::U4Blocks(size, blocks) => Storage::U4Blocks(
                *size,
                gather_rows(blocks, Storage::u4_row_bytes(*size, self.cols), &picked),
            ),
            Storage::Interleaved(_) | Storage::InterleavedSuper(_) => {
                let (dtype, bytes, row_bytes) = self.storage.gguf_rows().expect("block storage");
                Storage::block_rows(dtype, gather_rows(&bytes, row_bytes, &picked), row_bytes)?
            }
        };
        Ok(Matrix {
            rows: self.rows / group * len,
            cols: self.cols,
            storage,
        })
    }

    /// Rows `start..start+len` of every group of `group` rows, each group's `[len, cols]` block
    /// transposed (`TransposeRowGroups`): f32, bf16 and half storage keep their values, GGUF and
    /// FP8 blocks (which cannot be cut across rows) are widened to f32.
    pub fn transpose_row_groups(&self, group: usize, start: usize, len: usize) -> Result<Matrix, String> {
        self.check_row_groups(group, start, len)?;
        let cols = self.cols;
        let order = || ir::reference::ops::transposed_row_groups_order(self.rows, cols, group, start, len);
        let storage = match &self.storage {
            Storage::F32(v) => Storage::F32(order().map(|i| v[i]).collect()),
            Storage::Bf16(v) => Storage::Bf16(order().map(|i| v[i]).collect()),
            Storage::F16(v) => Storage::F16(order().map(|i| v[i]).collect()),
            Storage::Interleaved(_)
            | Storage::InterleavedSuper(_)
            | Storage::Fp8Blocks(_)
            | Storage::U4Blocks(..)
            | Storage::Fp4Blocks(_) => {
                let mut row = vec![0f32; cols];
                let widened: Vec<f32> = (0..self.rows)
                    .flat_map(|r| self.row_f32(r, &mut row).to_vec())
                    .collect();
                Storage::F32(order().map(|i| widened[i]).collect())
            }
        };
        Ok(Matrix {
            rows: self.rows / group * cols,
            cols: len,
            storage,
        })
    }

    /// Whether rows `start..start+len` of every group of `group` rows are rows of this matrix.
    fn check_row_groups(&self, group: usize, start: usize, len: usize) -> Result<(), String> {
        match group == 0 || !self.rows.is_multiple_of(group) || len == 0 || start + len > group {
            true => Err(format!(
                "rows {start}..{} of groups of {group} in {} rows",
                start + len,
                self.rows
            )),
            false => Ok(()),
        }
    }

    /// Copy row `r` as f32 into `out` (embedding gather).
    pub fn gather_row(&self, r: usize, out: &mut [f32]) {
        if let Storage::F32(v) = &self.storage {
            out.copy_from_slice(&v[r * self.cols..(r + 1) * self.cols]);
        } else {
            self.row_f32(r, out);
        }
    }
}

/// Rows `picked` (each `row_len` elements) of `v`, in that order.
fn gather_rows<T: Copy>(v: &[T], row_len: usize, picked: &[usize]) -> Vec<T> {
    picked
        .iter()
        .flat_map(|&r| &v[r * row_len..(r + 1) * row_len])
        .copied()
        .collect()
}

/// An integer checkpoint's 4-bit matrices are each held in what holds their weights exactly
/// (Q4_0, Q5_0 or 4-bit blocks: [`Storage::block_rows`]), so the parts of one joined
/// projection may differ: interleaved ones stack as Q5_0 (Q4_0's weights are Q5_0's), others
/// widened to f32. `None` where the parts are not such a mix.
fn stacked_4bit(parts: &[&Matrix]) -> Result<Option<Storage>, String> {
    let form = |m: &Matrix| match &m.storage {
        Storage::U4Blocks(size, _) => Some(size.format()),
        Storage::Interleaved(rows) if matches!(rows.dtype(), GgmlType::Q4_0 | GgmlType::Q5_0) => Some(rows.dtype()),
        _ => None,
    };
    let forms: Option<Vec<GgmlType>> = parts.iter().map(|p| form(p)).collect();
    let Some(forms) = forms.filter(|f| f.iter().any(|&form| form != f[0])) else {
        return Ok(None);
    };
    let cols = parts[0].cols;
    if forms.iter().all(|f| matches!(f, GgmlType::Q4_0 | GgmlType::Q5_0)) {
        let mut q5 = Vec::new();
        for part in parts {
            let (dtype, bytes, _) = part.storage.gguf_rows().expect("interleaved rows");
            match dtype {
                GgmlType::Q4_0 => q5.extend(quant::q5_0::from_q4_0(&bytes)),
                _ => q5.extend_from_slice(&bytes),
            }
        }
        let row_bytes = GgmlType::Q5_0.bytes_for(cols).ok_or("rows of no whole blocks")?;
        return Storage::block_rows(GgmlType::Q5_0, q5, row_bytes).map(Some);
    }
    let mut row = vec![0f32; cols];
    let widened = parts
        .iter()
        .flat_map(|m| {
            (0..m.rows)
                .flat_map(|r| m.row_f32(r, &mut row).to_vec())
                .collect::<Vec<_>>()
        })
        .collect();
    Ok(Some(Storage::F32(widened)))
}

/// The concatenation of each part's storage, which `pick` must recognise as the same kind.
fn collect<'a, T: Clone + 'a>(
    parts: &[&'a Matrix],
    pick: impl Fn(&'a Storage) -> Option<&'a Vec<T>>,
) -> Result<Vec<T>, String> {
    let mut out = Vec::new();
    for p in parts {
        out.extend_from_slice(pick(&p.storage).ok_or("matrices of different storage types")?);
    }
    Ok(out)
}

/// `out[t, n − rows.start] = x[t] · W[n]` for `n` in `rows`, by `products(run, scratch, write)`
/// over parallel runs of rows, each writing its own columns of `out` (`write(t, i, values)`:
/// the products of token `t` with the run's rows from its `i`th on). Runs cover whole groups
/// of interleaved rows (a run's first and last group may lie partly outside `rows`; their
/// other rows are computed and dropped); dense rows need no such alignment and take it anyway.
fn products_by_runs(
    rows: std::ops::Range<usize>,
    out: &mut [f32],
    products: impl Fn(std::ops::Range<usize>, &mut Vec<f32>, &mut dyn FnMut(usize, usize, &[f32])) + Sync,
) {
    let n = rows.len();
    let groups = rows.start / GROUP..rows.end.div_ceil(GROUP);
    let groups_per_task = rows_per_task(n).div_ceil(GROUP);
    let columns = OutColumns(out.as_mut_ptr());
    let tasks = groups.len().div_ceil(groups_per_task);
    pool::global().for_each(tasks, Vec::new, |scratch, task| {
        let first = groups.start + task * groups_per_task;
        let end = (first + groups_per_task).min(groups.end);
        let run = (first * GROUP).max(rows.start)..(end * GROUP).min(rows.end);
        let offset = run.start - rows.start;
        products(run, scratch, &mut |t, r, values| {
            // SAFETY: t < tokens and offset + r + values.len() ≤ n (the values are rows of
            // `rows`), so the elements are inside `out`; runs cover disjoint rows, so no two
            // tasks write the same element, and `out` is borrowed mutably for the whole call.
            unsafe { columns.write_all(t * n + offset + r, values) }
        });
    });
}

thread_local! {
    /// Activation rows kept from one product to the next on the thread that asked for them:
    /// a serving step runs a few hundred products of up to a chunk's rows each, and rows that
    /// already hold their buffers quantize without allocating (a fresh row a product cost
    /// three allocations a row, about 5% of a served CPU step with their frees).
    static Q8_ROWS: Cell<Vec<Q8Row>> = const { Cell::new(Vec::new()) };
    static Q8K_ROWS: Cell<Vec<Q8KRow>> = const { Cell::new(Vec::new()) };
}

/// `use_rows` over each of `x`'s rows of `k` quantized, in rows taken from `kept` and given
/// back after (a product started inside `use_rows` on this thread finds none kept and makes
/// its own). Many rows are worth spreading over the pool, a few (decode) are not.
fn with_quantized_rows<R: ActivationRow, T>(
    kept: &'static LocalKey<Cell<Vec<R>>>,
    x: &[f32],
    k: usize,
    use_rows: impl FnOnce(&[R]) -> T,
) -> T {
    let tokens = x.len() / k;
    let mut rows = kept.take();
    if rows.len() < tokens {
        rows.resize_with(tokens, R::default);
    }
    let quantize = |(row, x): (&mut R, &[f32])| row.quantize_into(x);
    if tokens < super::rows::PARALLEL_FROM_ROWS {
        rows.iter_mut().zip(x.chunks_exact(k)).for_each(quantize);
    } else {
        let rows_a_task = tokens.div_ceil(2 * pool::global().threads());
        pool::global().for_chunks_mut(
            &mut rows[..tokens],
            rows_a_task,
            || (),
            |_, run, chunk| {
                let first = run * rows_a_task;
                chunk.iter_mut().zip(x[first * k..].chunks_exact(k)).for_each(quantize);
            },
        );
    }
    let out = use_rows(&rows[..tokens]);
    kept.set(rows);
    out
}

/// Rows per parallel task: a few tasks per thread (for balance) of at least 16 rows (so the
/// scheduling cost stays small next to the work).
fn rows_per_task(rows: usize) -> usize {
    let tasks = pool::global().threads() * 4;
    rows.div_ceil(tasks).max(16)
}

/// Run `row_fn(scratch, row, dst)` for every row of W (`n` rows) in parallel runs of
/// `rows_per_task` rows, `dst` being that row's `tokens` results; each run then writes its
/// columns of `out` (`[tokens, n]`), one contiguous stretch per token, while its results are
/// still in cache: no whole-matrix transpose after the parallel part.
fn for_row_runs<S: Default + Send>(
    out: &mut [f32],
    n: usize,
    tokens: usize,
    rows_per_task: usize,
    row_fn: impl Fn(&mut S, usize, &mut [f32]) + Sync,
) {
    assert_eq!(out.len(), n * tokens);
    if tokens == 1 {
        // One token: `[rows, 1]` is `out`'s own layout.
        pool::global().for_chunks_mut(out, rows_per_task, S::default, |scratch, run, dst| {
            for (i, row_dst) in dst.chunks_exact_mut(1).enumerate() {
                row_fn(scratch, run * rows_per_task + i, row_dst);
            }
        });
        return;
    }
    let columns = OutColumns(out.as_mut_ptr());
    pool::global().for_each(
        n.div_ceil(rows_per_task),
        || (S::default(), Vec::new()),
        |(scratch, local), run| {
            let (r0, rows) = (run * rows_per_task, rows_per_task.min(n - run * rows_per_task));
            local.resize(rows * tokens, 0.0);
            for (i, row_dst) in local.chunks_exact_mut(tokens).enumerate() {
                row_fn(scratch, r0 + i, row_dst);
            }
            for t in 0..tokens {
                for i in 0..rows {
                    // SAFETY: t < tokens and r0 + i < n, so the index is inside `out`; runs
                    // cover disjoint rows of W, so no two tasks write the same element, and
                    // `out` is borrowed mutably for the whole call.
                    unsafe { columns.write(t * n + r0 + i, local[i * tokens + t]) };
                }
            }
        },
    );
}

/// `out`'s storage, written by the row tasks of `for_row_runs` at disjoint columns.
#[derive(Clone, Copy)]
struct OutColumns(*mut f32);

impl OutColumns {
    /// # Safety
    /// `at` is inside `out`, and no other task writes it.
    unsafe fn write(&self, at: usize, value: f32) {
        // SAFETY: as the caller promises.
        unsafe { *self.0.add(at) = value };
    }

    /// # Safety
    /// `at..at + values.len()` is inside `out`, and no other task writes it.
    unsafe fn write_all(&self, at: usize, values: &[f32]) {
        // SAFETY: as the caller promises (`values` is another task's or local memory, never
        // `out`'s: tasks only write `out`).
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), self.0.add(at), values.len()) };
    }
}

// SAFETY: the tasks sharing it write disjoint elements, and the borrow it comes from outlives
// them (`for_row_runs` returns only after every task has finished).
unsafe impl Send for OutColumns {}
unsafe impl Sync for OutColumns {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_matches_reference_for_every_storage() {
        // 3 tokens, and 40: more than one transpose tile each way (n = 70 is ragged too).
        for t in [3, 40] {
            let (n, k) = (70, 64);
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 97) as f32 - 48.0) / 32.0).collect();
            let x: Vec<f32> = (0..t * k).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
            let mut want = vec![0f32; t * n];
            ir::reference::ops::matmul(&x, &w, k, &mut want);
            let storages = [
                Storage::F32(w.clone()),
                Storage::Bf16(w.iter().map(|&v| bf16::from_f32(v)).collect()),
                Storage::F16(w.iter().map(|&v| half::f16::from_f32(v)).collect()),
            ];
            for storage in storages {
                let m = Matrix {
                    rows: n,
                    cols: k,
                    storage,
                };
                let mut got = vec![f32::NAN; t * n];
                m.matmul(&x, t, &mut got);
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() < 1e-3 * w.abs().max(1.0), "{g} vs {w}");
                }
            }
        }
    }

    /// FP8 blocks: every (row, token) product is the dot product of the row's f32 weights
    /// (code × scale) with the token, bit for bit (`simd::dot`), whichever rows a step asks for
    /// (runs cut across the widened chunks of rows), for few tokens (widened by the tiles) and
    /// many (widened a few rows at a time), and with a NaN code among them (its row's products
    /// NaN, the others the same); stacking, picking and transposing rows keep the weights.
    #[test]
    fn fp8_block_rows_multiply_their_products() {
        let (rows, cols) = (40, 96);
        let blocks: Vec<u8> = (0..rows * cols / 32)
            .flat_map(|b| {
                let codes: [u8; 32] = std::array::from_fn(|i| (((b * 32 + i) * 2654435761usize) >> 11) as u8 & 0xf7);
                quant::fp8_blocks::block(0.01 + b as f32 * 0.003, &codes)
            })
            .collect();
        let row_bytes = cols / 32 * 36;
        assert!(Storage::block_rows(GgmlType::F8E4M3B32, blocks.clone(), row_bytes - 1).is_err());
        let mut with_nan = blocks.clone();
        with_nan[5 * row_bytes + 36 + 7] = 0xff;
        for (blocks, by_halves) in [(&blocks, true), (&with_nan, false)] {
            let storage = Storage::block_rows(GgmlType::F8E4M3B32, blocks.clone(), row_bytes).unwrap();
            assert!(matches!(&storage, Storage::Fp8Blocks(b) if b.by_halves == by_halves));
            let m = Matrix { rows, cols, storage };
            assert_eq!(m.bytes(), blocks.len());
            let mut weights = vec![0f32; rows * cols];
            GgmlType::F8E4M3B32.dequantize(blocks, &mut weights);
            // Row 5's NaN code makes its products NaN, whose bits may differ.
            let nan_row = (!by_halves).then_some(5);
            check_products(&m, &weights, &[1, 5, FP8_TILED_TOKENS, FP8_TILED_TOKENS + 3], nan_row);
        }
        let storage = Storage::block_rows(GgmlType::F8E4M3B32, blocks.clone(), row_bytes).unwrap();
        let mut weights = vec![0f32; rows * cols];
        GgmlType::F8E4M3B32.dequantize(&blocks, &mut weights);
        check_rows_kept(&Matrix { rows, cols, storage }, &weights);
    }

    /// Rows 3..37 of `m` (weights `weights`) times each count of tokens in `token_counts`: every
    /// product `simd::dot`'s bits over the row's f32 weights, but NaNs on `nan_row`, where
    /// both are NaN.
    fn check_products(m: &Matrix, weights: &[f32], token_counts: &[usize], nan_row: Option<usize>) {
        let cols = m.cols;
        for &tokens in token_counts {
            let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
            let picked = 3..37;
            let mut got = vec![f32::NAN; tokens * picked.len()];
            m.matmul_rows(picked.clone(), &x, tokens, &mut got);
            for t in 0..tokens {
                for (i, r) in picked.clone().enumerate() {
                    let want = simd::dot(&weights[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                    let got = got[t * picked.len() + i];
                    assert!(
                        got.to_bits() == want.to_bits() || (nan_row == Some(r) && got.is_nan() && want.is_nan()),
                        "{tokens} tokens: token {t}, row {r}: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// Stacking `m` (40 rows of block storage) on itself, picking rows 1 and 2 of its groups
    /// of 20, and transposing groups of 4 keep its weights `weights` (the transpose in f32).
    fn check_rows_kept(m: &Matrix, weights: &[f32]) {
        let cols = m.cols;
        let widened = |m: &Matrix| -> Vec<f32> {
            let mut row = vec![0f32; m.cols];
            (0..m.rows).flat_map(|r| m.row_f32(r, &mut row).to_vec()).collect()
        };
        assert_eq!(widened(m), weights);
        let stacked = Matrix::stack_rows(&[m, m]).unwrap();
        assert_eq!(widened(&stacked), [weights, weights].concat());
        let picked = m.row_group_slice(20, 1, 2).unwrap();
        let want: Vec<f32> = [1, 2, 21, 22]
            .iter()
            .flat_map(|&r| weights[r * cols..(r + 1) * cols].to_vec())
            .collect();
        assert_eq!(widened(&picked), want);
        let transposed = m.transpose_row_groups(4, 0, 3).unwrap();
        assert!(matches!(transposed.storage, Storage::F32(_)));
        assert_eq!(widened(&transposed)[1], weights[cols]);
    }

    /// `rows` × `cols` 4-bit blocks of `size`, block `b` under `scale(b)` with zero point
    /// `zero(b)` and levels spread over 0..16: the matrix `Storage::block_rows` makes of them,
    /// its bytes, and its weights as the 4-bit format dequantizes them.
    fn u4_matrix(
        size: u4_blocks::Size,
        rows: usize,
        cols: usize,
        scale: impl Fn(usize) -> f32,
        zero: impl Fn(usize) -> u8,
    ) -> (Matrix, Vec<u8>, Vec<f32>) {
        let elems = size.elems();
        let blocks: Vec<u8> = (0..rows * cols / elems)
            .flat_map(|b| {
                let levels: Vec<u8> = (0..elems)
                    .map(|i| ((((b * elems + i) * 2654435761usize) >> 11) % 16) as u8)
                    .collect();
                u4_blocks::block(scale(b), -f32::from(zero(b)) * scale(b), &levels)
            })
            .collect();
        let row_bytes = cols / elems * size.bytes();
        assert!(Storage::block_rows(size.format(), blocks.clone(), row_bytes - 1).is_err());
        let storage = Storage::block_rows(size.format(), blocks.clone(), row_bytes).unwrap();
        let mut weights = vec![0f32; rows * cols];
        size.format().dequantize(&blocks, &mut weights);
        (Matrix { rows, cols, storage }, blocks, weights)
    }

    /// A scale with more significant bits than an f16's (but [`u4_blocks::exact`]).
    fn f32_scale(b: usize) -> f32 {
        f32::from_bits((0.01 + b as f32 * 0.003).to_bits() & !0xF)
    }

    /// 4-bit blocks whose scales are no f16s stay 4-bit blocks: every (row, token) product is
    /// the dot product of the row's f32 weights (level × scale + offset) with the token, bit for
    /// bit (`simd::dot`), whichever rows a step asks for and however many tokens; stacking,
    /// picking and transposing rows keep the weights.
    #[test]
    fn u4_block_rows_multiply_their_products() {
        use u4_blocks::Size::{Of128, Of32};
        for (size, rows, cols) in [(Of32, 40, 96), (Of128, 40, 256)] {
            let (m, blocks, weights) = u4_matrix(size, rows, cols, f32_scale, |b| (b % 17) as u8);
            assert!(matches!(m.storage, Storage::U4Blocks(held, _) if held == size));
            assert_eq!(m.bytes(), blocks.len());
            check_products(&m, &weights, &[1, 5, 36], None);
            check_rows_kept(&m, &weights);
        }
    }

    /// 4-bit blocks under f16 scales with integer zero points (GPTQ's, AWQ's) are held as the
    /// GGUF blocks of the same weights for the int8 kernels: Q4_0 where every zero point is 8,
    /// else Q5_0. Their rows are the 4-bit weights exactly, their products those of int8
    /// activations, and stacking, picking and transposing keep the weights.
    #[test]
    fn u4_blocks_with_f16_scales_are_held_as_gguf_blocks() {
        use u4_blocks::Size::{Of128, Of32};
        let f16_scale = |b: usize| half::f16::from_f32(0.01 + b as f32 * 0.003).to_f32();
        for (size, cols) in [(Of32, 96), (Of128, 256)] {
            // Zero points of 8 alone, or of 0 to 16.
            for (spread, want) in [(false, GgmlType::Q4_0), (true, GgmlType::Q5_0)] {
                let zero = |b: usize| if spread { (b % 17) as u8 } else { 8 };
                for rows in [40, 70] {
                    let (m, _, weights) = u4_matrix(size, rows, cols, f16_scale, zero);
                    let Storage::Interleaved(interleaved) = &m.storage else {
                        panic!("{size:?}: not interleaved")
                    };
                    assert_eq!(interleaved.dtype(), want, "{size:?}");
                    match rows {
                        40 => check_rows_kept(&m, &weights),
                        _ => products_do_not_depend_on_the_step(m),
                    }
                }
            }
        }
    }

    /// The parts of one projection held in different 4-bit forms stack: Q4_0 with Q5_0 as Q5_0,
    /// 4-bit blocks with either (or blocks of the two sizes) widened to f32; each row's
    /// weights kept.
    #[test]
    fn matrices_of_different_4bit_forms_stack() {
        use u4_blocks::Size::{Of128, Of32};
        let f16_scale = |b: usize| half::f16::from_f32(0.02 + b as f32 * 0.001).to_f32();
        let (q4, _, q4_weights) = u4_matrix(Of128, 20, 128, f16_scale, |_| 8);
        let (q5, _, q5_weights) = u4_matrix(Of32, 7, 128, f16_scale, |b| (b % 3) as u8);
        let (of32, _, of32_weights) = u4_matrix(Of32, 5, 128, f32_scale, |b| (b % 5) as u8);
        let (of128, _, of128_weights) = u4_matrix(Of128, 3, 128, f32_scale, |_| 8);
        let widened = |m: &Matrix| -> Vec<f32> {
            let mut row = vec![0f32; m.cols];
            (0..m.rows).flat_map(|r| m.row_f32(r, &mut row).to_vec()).collect()
        };
        for (parts, weights, want) in [
            (vec![&q4, &q5], vec![&q4_weights, &q5_weights], Some(GgmlType::Q5_0)),
            (
                vec![&q5, &q4, &q5],
                vec![&q5_weights, &q4_weights, &q5_weights],
                Some(GgmlType::Q5_0),
            ),
            (vec![&q4, &of32], vec![&q4_weights, &of32_weights], None),
            (vec![&of128, &q5], vec![&of128_weights, &q5_weights], None),
            (vec![&of32, &of128], vec![&of32_weights, &of128_weights], None),
        ] {
            let stacked = Matrix::stack_rows(&parts).unwrap();
            match (&stacked.storage, want) {
                (Storage::Interleaved(rows), Some(want)) => assert_eq!(rows.dtype(), want),
                (Storage::F32(_), None) => {}
                _ => panic!("stacked as {want:?}: another storage"),
            }
            let weights: Vec<f32> = weights.into_iter().flatten().copied().collect();
            assert_eq!(stacked.rows * 128, weights.len());
            assert_eq!(widened(&stacked), weights);
        }
        assert_eq!(Matrix::stack_rows(&[&q4, &q4]).unwrap().rows, 40);
        assert!(matches!(
            Matrix::stack_rows(&[&q4, &q4]).unwrap().storage,
            Storage::Interleaved(ref r) if r.dtype() == GgmlType::Q4_0
        ));
    }

    /// FP4 blocks: every (row, token) product is the dot product of the row's f32 weights (code
    /// value × its group's scale) with the token, bit for bit (`simd::dot`), whichever rows a
    /// step asks for and however many tokens; stacking, picking and transposing rows keep the
    /// weights.
    #[test]
    fn fp4_block_rows_multiply_their_products() {
        let (rows, cols) = (40, 96);
        let blocks: Vec<u8> = (0..rows * cols / 32)
            .flat_map(|b| {
                let codes: [u8; 32] = std::array::from_fn(|i| ((((b * 32 + i) * 2654435761usize) >> 11) % 16) as u8);
                let scale = |k: usize| half::f16::from_f32(0.01 + (b + k) as f32 * 0.003).to_f32();
                quant::fp4_blocks::block([scale(0), -scale(7)], &codes)
            })
            .collect();
        let row_bytes = cols / 32 * 24;
        assert!(Storage::block_rows(GgmlType::F4E2M1B32, blocks.clone(), row_bytes - 1).is_err());
        let storage = Storage::block_rows(GgmlType::F4E2M1B32, blocks.clone(), row_bytes).unwrap();
        let m = Matrix { rows, cols, storage };
        assert_eq!(m.bytes(), blocks.len());
        let mut weights = vec![0f32; rows * cols];
        GgmlType::F4E2M1B32.dequantize(&blocks, &mut weights);
        check_products(&m, &weights, &[1, 5, 36], None);
        check_rows_kept(&m, &weights);
    }

    /// MXFP4 rows are interleaved for the int8 kernels where every scale fits the layout (the
    /// kernels are checked in `interleaved`), else held as FP4 blocks, their products those of
    /// the file's weights (ggml's dequantization) bit for bit; rows with an exponent of 255 (no
    /// f32 scale) as f32 of the same weights; rows of no whole blocks refused.
    #[test]
    fn mxfp4_rows_multiply_the_files_weights() {
        let (rows, cols) = (40, 64);
        let mut blocks: Vec<u8> = (0..rows * cols / 32)
            .flat_map(|b| {
                let exponent = [0u8, 1, 2, 118, 127, 131][b % 6];
                std::iter::once(exponent).chain((0..16).map(move |j| (((b * 16 + j) * 2654435761usize) >> 9) as u8))
            })
            .collect();
        let row_bytes = cols / 32 * quant::mxfp4::BLOCK_BYTES;
        assert!(Storage::block_rows(GgmlType::MXFP4, blocks.clone(), row_bytes + 1).is_err());
        let mut weights = vec![0f32; rows * cols];
        GgmlType::MXFP4.dequantize(&blocks, &mut weights);
        let mut held = blocks.clone();
        held.chunks_exact_mut(quant::mxfp4::BLOCK_BYTES)
            .for_each(|b| b[0] = b[0].clamp(104, 143));
        let storage = Storage::block_rows(GgmlType::MXFP4, held.clone(), row_bytes).unwrap();
        let Storage::Interleaved(interleaved) = &storage else {
            panic!("real weights' scales are interleaved")
        };
        assert_eq!(interleaved.gguf_bytes(), held);
        let m = Matrix {
            rows,
            cols,
            storage: Storage::block_rows(GgmlType::MXFP4, blocks.clone(), row_bytes).unwrap(),
        };
        assert!(
            matches!(m.storage, Storage::Fp4Blocks(_)),
            "exponents 0, 1 and 2 are not"
        );
        check_products(&m, &weights, &[1, 5, 36], None);
        blocks[3 * quant::mxfp4::BLOCK_BYTES] = 255;
        GgmlType::MXFP4.dequantize(&blocks, &mut weights);
        assert!(weights.iter().any(|w| w.is_infinite()));
        let storage = Storage::block_rows(GgmlType::MXFP4, blocks, row_bytes).unwrap();
        let Storage::F32(held) = &storage else {
            panic!("an exponent of 255 is held as f32")
        };
        assert_eq!(
            held.iter().map(|w| w.to_bits()).collect::<Vec<_>>(),
            weights.iter().map(|w| w.to_bits()).collect::<Vec<_>>()
        );
    }

    /// `rows` rows of `cols` weights of `dtype` (Q5_1, a K-quant or IQ4_XS): random quants,
    /// finite scales and minimums (in the first four bytes, Q2_K's last four, or Q3_K's and
    /// Q6_K's last two).
    fn block_rows(dtype: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
        let (elements, bytes) = dtype.block_layout();
        let row_bytes = cols / elements * bytes;
        let mut data: Vec<u8> = (0..rows * row_bytes)
            .map(|i| ((i * 2654435761usize) >> 9) as u8)
            .collect();
        for (i, block) in data.chunks_exact_mut(bytes).enumerate() {
            let d = half::f16::from_f32(0.01 * (1 + i % 5) as f32).to_le_bytes();
            let at = match dtype {
                GgmlType::Q6K | GgmlType::Q3K => {
                    block[bytes - 2..].copy_from_slice(&d);
                    continue;
                }
                GgmlType::Q2K => 80,
                _ => 0,
            };
            block[at..at + 2].copy_from_slice(&d);
            block[at + 2..at + 4].copy_from_slice(&half::f16::from_f32(0.02 * (1 + i % 3) as f32).to_le_bytes());
        }
        data
    }

    fn interleaved_as(dtype: GgmlType, rows: usize, cols: usize) -> Matrix {
        let (elements, bytes) = dtype.block_layout();
        let storage = Storage::block_rows(dtype, block_rows(dtype, rows, cols), cols / elements * bytes).unwrap();
        assert!(matches!(
            storage,
            Storage::Interleaved(_) | Storage::InterleavedSuper(_)
        ));
        assert!(storage.is_block_quantized());
        Matrix { rows, cols, storage }
    }

    fn interleaved(rows: usize, cols: usize) -> Matrix {
        interleaved_as(GgmlType::Q5_1, rows, cols)
    }

    /// Over interleaved rows a (row, token) product is the same number however many tokens
    /// share the step and whichever rows are asked for (parallel runs, groups cut by the
    /// range), and close to the f32 product of the dequantized rows.
    #[test]
    fn interleaved_products_do_not_depend_on_the_step() {
        for (dtype, k) in [
            (GgmlType::Q5_1, 96),
            (GgmlType::Q4K, 512),
            (GgmlType::Q5K, 512),
            (GgmlType::Q6K, 512),
            (GgmlType::Q2K, 512),
            (GgmlType::Q3K, 512),
            (GgmlType::IQ4XS, 512),
        ] {
            products_do_not_depend_on_the_step(interleaved_as(dtype, 70, k));
        }
    }

    fn products_do_not_depend_on_the_step(m: Matrix) {
        let (n, k) = (m.rows, m.cols);
        let x: Vec<f32> = (0..40 * k).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
        let mut all = vec![f32::NAN; 40 * n];
        m.matmul(&x, 40, &mut all);
        for t in [0, 3, 39] {
            let mut one = vec![f32::NAN; n];
            m.matmul(&x[t * k..(t + 1) * k], 1, &mut one);
            assert_eq!(one, all[t * n..(t + 1) * n], "token {t} alone");
        }
        let rows = 13..61;
        let mut some = vec![f32::NAN; 5 * rows.len()];
        m.matmul_rows(rows.clone(), &x[..5 * k], 5, &mut some);
        for t in 0..5 {
            assert_eq!(
                some[t * rows.len()..(t + 1) * rows.len()],
                all[t * n + rows.start..t * n + rows.end]
            );
        }
        let mut dequantized = vec![0f32; n * k];
        for (r, row) in dequantized.chunks_exact_mut(k).enumerate() {
            m.row_f32(r, &mut vec![0f32; k])
                .iter()
                .zip(row)
                .for_each(|(v, o)| *o = *v);
        }
        let (mut want, mut magnitude) = (vec![0f32; 40 * n], vec![0f32; 40 * n]);
        ir::reference::ops::matmul(&x, &dequantized, k, &mut want);
        let abs = |v: &[f32]| v.iter().map(|a| a.abs()).collect::<Vec<_>>();
        ir::reference::ops::matmul(&abs(&x), &abs(&dequantized), k, &mut magnitude);
        for ((g, w), m) in all.iter().zip(&want).zip(&magnitude) {
            // The activations' int8 rounding: at most half a step (1/254 of a block's largest
            // value) per element.
            assert!((g - w).abs() <= 0.01 * m, "{g} vs {w} (magnitude {m})");
        }
    }

    /// Rows that are not a whole number of blocks have no layout: refused, not kept as bytes.
    #[test]
    fn block_rows_of_partial_blocks_are_refused() {
        let dtype = GgmlType::Q3K;
        let row_bytes = dtype.bytes_for(512).unwrap();
        let bytes = block_rows(dtype, 4, 512);
        assert!(Storage::block_rows(dtype, bytes.clone(), row_bytes).is_ok());
        let error = Storage::block_rows(dtype, bytes, row_bytes - 1).err().expect("refused");
        assert!(error.contains("Q3_K"), "{error}");
    }

    /// Stacking and picking rows of interleaved matrices keeps each row's bytes.
    #[test]
    fn interleaved_rows_stack_and_slice_whole() {
        let (a, b) = (interleaved(20, 64), interleaved(7, 64));
        let stacked = Matrix::stack_rows(&[&a, &b]).unwrap();
        assert_eq!(stacked.rows, 27);
        let row = |m: &Matrix, r: usize| m.row_f32(r, &mut vec![0f32; 64]).to_vec();
        assert_eq!(row(&stacked, 3), row(&a, 3));
        assert_eq!(row(&stacked, 25), row(&b, 5));
        let picked = stacked.row_group_slice(9, 2, 3).unwrap();
        assert_eq!(picked.rows, 9);
        assert_eq!(row(&picked, 4), row(&stacked, 9 + 3));
        assert!(matches!(picked.storage, Storage::Interleaved(_)));
        let other = Matrix {
            rows: 1,
            cols: 64,
            storage: Storage::F32(vec![0.0; 64]),
        };
        assert!(Matrix::stack_rows(&[&a, &other]).is_err());
    }

    /// Picked rows with each group's block transposed are the reference's, in f32, bf16 and
    /// half storage alike (values move, nothing rounds).
    #[test]
    fn transposed_row_groups_match_the_reference() {
        let (rows, cols) = (6, 4);
        let w: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5).collect();
        let want = ir::reference::ops::transpose_row_groups(&w, cols, 3, 1, 2);
        let storages = [
            Storage::F32(w.clone()),
            Storage::Bf16(w.iter().map(|&v| bf16::from_f32(v)).collect()),
            Storage::F16(w.iter().map(|&v| half::f16::from_f32(v)).collect()),
        ];
        for storage in storages {
            let m = Matrix { rows, cols, storage };
            let t = m.transpose_row_groups(3, 1, 2).unwrap();
            assert_eq!((t.rows, t.cols), (2 * cols, 2));
            let mut row = vec![0f32; 2];
            let got: Vec<f32> = (0..t.rows).flat_map(|r| t.row_f32(r, &mut row).to_vec()).collect();
            assert_eq!(got, want);
        }
        let m = Matrix {
            rows,
            cols,
            storage: Storage::F32(w),
        };
        assert!(m.transpose_row_groups(4, 0, 2).is_err(), "6 rows are not groups of 4");
    }
}
