//! Llama-8B-shaped matmuls over Q4_K blocks at prompt sizes: the GEMM that decodes the blocks
//! into its tensor-core tiles over bf16 rows (what plans take up to `BATCH_ROWS` rows, and at
//! any rows for a matrix too large to copy) against the blocks decoded into a bf16 copy and
//! multiplied by the target's TMA GEMM (what they take beyond), each with its K splits'
//! reduction: where the copy starts to pay.

use super::llama_8b::{bind, grid_of, MatmulCase, SHAPES};
use anyhow::{anyhow, Result};
use codegen::gpu::{self, expr};
use codegen::Target;
use kernels_gen::dsl::{Kernel, Ty};
use kernels_gen::templates::gemm_mma::{gemm_mma_after_rows, WeightStaging};
use kernels_gen::templates::gemm_tma_tcgen05::{gemm_tma_tcgen05_bf16, TcgenTile};
use kernels_gen::templates::gemm_tma_wgmma::{gemm_tma_wgmma_bf16, TmaTile};
use kernels_gen::templates::weight_convert::to_bf16_for_prefill;
use kernels_gen::templates::{gemm_mma, gemm_tma_mma, quant, split_k, BLOCK};
use runtime::plan_exec::{DeviceArg, PlanDevice};
use runtime::random_weights::{fill_kernels, fill_on_device, Fill};

/// The block format timed: llama.cpp's usual 4-bit one.
const FORMAT: ir::DType = ir::DType::Q4K;
/// Rows timed: decode batches, and prompt chunks.
const ROWS: [usize; 6] = [16, 64, 128, 256, 512, 2048];

/// The kernels the table times on one target.
struct Timed {
    /// The GEMM decoding the blocks into its tiles, over bf16 rows.
    decoding: Kernel,
    /// The blocks decoded into a bf16 copy.
    convert: Kernel,
    /// The target's plain TMA GEMM (over the copy), with its tiles.
    tma: (Kernel, (usize, usize, usize)),
    /// The K splits' reduction.
    reduce: Kernel,
}

/// The kernels timed on `arch`.
fn kernels(arch: &str) -> Result<Timed> {
    let decoding = gemm_mma_after_rows(
        "gemm_q4_k",
        "gpu-check",
        WeightStaging::Dequantize(FORMAT),
        (None, None),
    );
    let convert = to_bf16_for_prefill(FORMAT, 1, "gpu-check").ok_or_else(|| anyhow!("a block format"))?;
    let tma = match arch {
        "sm_90a" => (
            gemm_tma_wgmma_bf16("gemm_tma", "gpu-check", TmaTile::WIDE),
            TmaTile::WIDE.tiles(),
        ),
        "sm_100a" => (
            gemm_tma_tcgen05_bf16("gemm_tma", "gpu-check", TcgenTile::WIDE),
            TcgenTile::WIDE.tiles(),
        ),
        "sm_120a" => (
            gemm_tma_mma::gemm_tma_mma_bf16("gemm_tma", "gpu-check"),
            gemm_tma_mma::TILES,
        ),
        other => return Err(anyhow!("no TMA GEMM on {other}")),
    };
    let reduce = split_k::reduce("split_k_reduce", "gpu-check", gpu::PREFILL_TOKENS, None, None);
    Ok(Timed {
        decoding,
        convert,
        tma,
        reduce,
    })
}

/// `case`'s argument for parameter `param`, and the activations as bf16 rows `k` apart (`xb`,
/// its bytes), which the decoding GEMM reads (the TMA GEMM's `x` is bf16 already).
fn with_rows<'a, B>(case: &MatmulCase<'a, B>, xb: (&'a B, usize), param: &str) -> Option<DeviceArg<'a, B>> {
    match param {
        "xb" => Some(DeviceArg::Buffer(xb.0, 0..xb.1)),
        "xb_stride" => Some(DeviceArg::I32(case.k as i32)),
        _ => case.value(param),
    }
}

/// The table: for each shape but the head (whose prompts compute a row or two a sequence) and
/// each of [`ROWS`], the decoding GEMM's time, the conversion's, the TMA GEMM's over the copy,
/// and the decoding GEMM's time over the copy's two together.
pub fn block_matmul_timings(target: Target, arch: &str) -> Result<String> {
    let Timed {
        decoding,
        convert,
        tma: (tma, tma_tiles),
        reduce,
    } = kernels(arch)?;
    let kernels = vec![decoding.clone(), convert.clone(), tma.clone(), reduce.clone()];
    let mut device = super::compile_device(&[kernels, fill_kernels()].concat(), arch)?;
    device.set_programmatic_launch(false);
    let sms = target.multiprocessors();
    let (elements, bytes) = quant::block_layout(FORMAT).ok_or_else(|| anyhow!("a block format"))?;
    let mut table = String::from(
        "| matmul | rows | decoding GEMM µs | conversion µs | TMA GEMM µs | conversion + TMA µs | decoding / (conversion + TMA) |\n|---|---|---|---|---|---|---|\n",
    );
    for &(name, n, k, _) in SHAPES.iter().filter(|(name, ..)| *name != "lm_head") {
        let rows = ROWS[ROWS.len() - 1];
        let block_bytes = n * k / elements as usize * bytes as usize;
        // Random bytes for the blocks (as bf16 values: the scales are finite halves).
        let wq = device.alloc(block_bytes)?;
        fill_on_device(
            &mut device,
            &wq,
            0,
            block_bytes / 2,
            Ty::Bf16,
            Fill::of(1, name, &[n, k]),
        )?;
        let wb = device.alloc(n * k * 2)?;
        let (x, x_bf16) = super::llama_8b::random_activations(&mut device, name, rows, k)?;
        let out = device.alloc(rows * n * 4)?;
        let partial_len = [gemm_mma::TILES, tma_tiles]
            .map(|tiles| split_k::partial_len(n, k, tiles, sms))
            .into_iter()
            .max()
            .unwrap_or(1);
        let partial = device.alloc(partial_len * 4)?;
        for batch in ROWS {
            let splits = |tiles| -> Result<usize> {
                let vars = [("tokens", expr::Value::Int(batch as i64))].into_iter().collect();
                Ok(expr::eval(&split_k::splits_expr("tokens", n, k, tiles, sms), &vars)?.as_i64() as usize)
            };
            // One GEMM launch and, with several splits, the reduction after it.
            let mut gemm = |program: &Kernel, (xs, x_bytes), (w, w_bytes), tiles| -> Result<f64> {
                let splits = splits(tiles)?;
                let case = MatmulCase {
                    x: (xs, x_bytes),
                    b: (&x, rows * k * 4),
                    g: (&x, k * 4),
                    w: (w, w_bytes),
                    out: (&out, rows * n * 4),
                    partial: (&partial, partial_len * 4),
                    batch,
                    n,
                    k,
                    splits,
                };
                let args = bind(program, |p| with_rows(&case, (&x_bf16, rows * k * 2), p))?;
                let reduce_args = bind(&reduce, |p| case.value(p))?;
                let grid = grid_of(program, batch, n, k, splits)?;
                let reduce_grid = (batch * n).div_ceil(BLOCK as usize) as u32;
                let seconds = device.time(20, |d| {
                    d.launch(&program.name, grid, program.block_dim, &args)?;
                    match splits > 1 {
                        true => d.launch(&reduce.name, reduce_grid, BLOCK, &reduce_args),
                        false => Ok(()),
                    }
                })?;
                Ok(seconds)
            };
            let decoded = gemm(&decoding, (&x, rows * k * 4), (&wq, block_bytes), gemm_mma::TILES)?;
            let over_copy = gemm(&tma, (&x_bf16, rows * k * 2), (&wb, n * k * 2), tma_tiles)?;
            let convert_args = [
                DeviceArg::Buffer(&wq, 0..block_bytes),
                DeviceArg::Buffer(&wb, 0..n * k * 2),
                DeviceArg::I32(n as i32),
                DeviceArg::I32(k as i32),
                DeviceArg::I32(batch as i32),
            ];
            let convert_grid = grid_of(&convert, batch, n, k, 1)?;
            let converted = device.time(20, |d| {
                d.launch(&convert.name, convert_grid, convert.block_dim, &convert_args)
            })?;
            table += &format!(
                "| {name} {n}×{k} | {batch} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |\n",
                decoded * 1e6,
                converted * 1e6,
                over_copy * 1e6,
                (converted + over_copy) * 1e6,
                decoded / (converted + over_copy)
            );
        }
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the table times finds its arguments on every GPU target, and the
    /// conversion's parameters are what the table passes, in order.
    #[test]
    fn the_block_table_binds_every_kernel() {
        let buffer = 0usize;
        let case = MatmulCase::every_buffer(&buffer, 512);
        for arch in ["sm_90a", "sm_100a", "sm_120a"] {
            let timed = kernels(arch).unwrap();
            for kernel in [&timed.decoding, &timed.tma.0, &timed.reduce] {
                if let Err(e) = bind(kernel, |p| with_rows(&case, (&buffer, 512), p)) {
                    panic!("{arch}: {e}");
                }
            }
            let params: Vec<&str> = timed.convert.launch_params().map(|p| p.name()).collect();
            assert_eq!(params, ["w", "wb", "n", "k", "tokens"]);
        }
        assert!(kernels("sm_80").is_err());
    }
}
