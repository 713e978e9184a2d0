//! The quantized GEMV, embedding gather and weight conversion, on the emulator, against the
//! `quant` crate's dequantization (itself checked against gguf-py) on the real blocks in the
//! fixtures.

use ir::DType;
use kernels_gen::dsl::Ty;
use kernels_gen::emulator::{run, Array, Scalar};
use kernels_gen::templates::embedding::embedding;
use kernels_gen::templates::gemv::{gemv, GemvSpec, NormPrologue};
use kernels_gen::templates::quant::{block_layout, WeightFormat};
use kernels_gen::templates::weight_convert::{convert_kernel, to_bf16_for_prefill, CONVERTED_TO};
use kernels_gen::templates::QUANT_FORMATS;
use models::quant::GgmlType;
use std::collections::HashMap;
use std::path::PathBuf;

mod common;
use common::{close, ints, residual_reference, run_gemv, run_norm_gemv, try_run_matmul, try_run_residual_matmul};

fn ggml(format: DType) -> GgmlType {
    match format {
        DType::Q4_0 => GgmlType::Q4_0,
        DType::Q4_1 => GgmlType::Q4_1,
        DType::Q5_0 => GgmlType::Q5_0,
        DType::Q5_1 => GgmlType::Q5_1,
        DType::Q8_0 => GgmlType::Q8_0,
        DType::Q4K => GgmlType::Q4K,
        DType::Q5K => GgmlType::Q5K,
        DType::Q6K => GgmlType::Q6K,
        DType::Q2K => GgmlType::Q2K,
        DType::Q3K => GgmlType::Q3K,
        DType::IQ4NL => GgmlType::IQ4NL,
        DType::IQ4XS => GgmlType::IQ4XS,
        DType::MXFP4 => GgmlType::MXFP4,
        DType::F8E4M3B32 => GgmlType::F8E4M3B32,
        DType::U4B32 => GgmlType::U4B32,
        DType::U4B128 => GgmlType::U4B128,
        DType::F4E2M1B32 => GgmlType::F4E2M1B32,
        other => panic!("{other}"),
    }
}

/// The fixture's blocks of a GGUF format; FP8, FP4 and 4-bit blocks (which no GGUF file holds)
/// made here: 64 of them (16 of 128 levels), every finite code or every level, scales of either
/// sign and several magnitudes (the 4-bit blocks' exact, with the offsets of zero points 0 to
/// 16; the FP4 blocks' two scales different). MXFP4's fixture blocks are followed by 8 made
/// here whose exponents take ggml's subnormal scales (0, 1) and the smallest normal one.
fn blocks(format: DType) -> Vec<u8> {
    if format == DType::MXFP4 {
        let mut data = gguf_blocks(format);
        for b in 0..8u8 {
            data.push([0, 1, 2][usize::from(b) % 3]);
            data.extend((0..16u8).map(|j| ((j * 5 + b) % 16) | (((j * 11 + 3 * b) % 16) << 4)));
        }
        return data;
    }
    if matches!(format, DType::U4B32 | DType::U4B128) {
        let elems = block_layout(format).unwrap().0 as usize;
        return (0..2048 / elems)
            .flat_map(|b| {
                let levels: Vec<u8> = (0..elems).map(|i| ((b * elems + i) * 7 / 3 % 16) as u8).collect();
                let scale = (1.0 + b as f32 / 8.0) * 2f32.powi(b as i32 % 9 - 12) * if b % 5 == 0 { -1.0 } else { 1.0 };
                assert!(models::quant::u4_blocks::exact(scale));
                models::quant::u4_blocks::block(scale, -((b % 17) as f32) * scale, &levels)
            })
            .collect();
    }
    if format == DType::F4E2M1B32 {
        return (0..64usize)
            .flat_map(|b| {
                let codes: [u8; 32] = std::array::from_fn(|i| ((b * 32 + i) * 7 / 3 % 16) as u8);
                let scale = |k: usize| (1.0 + (b + k) as f32 / 7.0) * 2f32.powi((b + 3 * k) as i32 % 9 - 12);
                let sign = if b % 5 == 0 { -1.0 } else { 1.0 };
                models::quant::fp4_blocks::block([sign * scale(0), scale(1)], &codes)
            })
            .collect();
    }
    if format == DType::F8E4M3B32 {
        return (0..64usize)
            .flat_map(|b| {
                let codes: [u8; 32] = std::array::from_fn(|i| {
                    let code = ((b * 32 + i) * 167 % 256) as u8;
                    if code & 0x7f == 0x7f {
                        code ^ 1
                    } else {
                        code
                    }
                });
                let scale = (1.0 + b as f32 / 7.0) * 2f32.powi(b as i32 % 9 - 12) * if b % 5 == 0 { -1.0 } else { 1.0 };
                models::quant::fp8_blocks::block(scale, &codes)
            })
            .collect();
    }
    gguf_blocks(format)
}

/// The fixture's blocks of a GGUF format (`tests/fixtures/gguf-blocks`).
fn gguf_blocks(format: DType) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../tests/fixtures/gguf-blocks/{}.bin", ggml(format).name()));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The fixture's blocks of `format` as a matrix of rows of two blocks (ragged for the
/// 32-element formats: k = 64): the bytes, `k` and the rows `n`.
fn two_block_rows(format: DType) -> (Vec<u8>, usize, usize) {
    let data = blocks(format);
    let (be, bb) = block_layout(format).unwrap();
    let n = data.len() / bb as usize / 2;
    (data, 2 * be as usize, n)
}

#[test]
fn quantized_gemv_matches_dequantize_then_matmul() {
    for format in QUANT_FORMATS {
        let (data, k, n) = two_block_rows(format);
        let mut w = vec![0f32; n * k];
        ggml(format).dequantize(&data, &mut w);
        let tokens = 2;
        let x: Vec<f32> = (0..tokens * k).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
        let mut want = vec![0f32; tokens * n];
        ir::reference::ops::matmul(&x, &w, k, &mut want);
        let decode = GemvSpec::decode(WeightFormat::Blocks(format), k);
        for spec in [decode, decode.prefill(), decode.with_x_vectors()] {
            let out = run_gemv(&gemv("gemv_q", "test", spec), &x, Array::u8(&data), (tokens, n, k, k));
            close(&out.to_f32().unwrap(), &want, 1e-4, &format!("{format}"));
        }
        // With the RMSNorm prologue.
        let g: Vec<f32> = (0..k).map(|i| ((i * 13 % 17) as f32 - 8.0) / 9.0).collect();
        let mut normed = vec![0f32; x.len()];
        ir::reference::ops::rms_norm(&x, &g, 1e-6, 1.0, &mut normed);
        ir::reference::ops::matmul(&normed, &w, k, &mut want);
        let normed_spec = decode.with_norm(NormPrologue::new(1e-6, 1.0));
        for spec in [normed_spec, normed_spec.prefill(), normed_spec.with_x_vectors()] {
            let kernel = gemv("norm_gemv_q", "test", spec);
            let out = run_norm_gemv(&kernel, &x, Some(&g), Array::u8(&data), (tokens, n, k, k));
            close(&out.to_f32().unwrap(), &want, 1e-4, &format!("{format} with norm"));
        }
    }
}

#[test]
fn quantized_tensor_core_gemm_matches_dequantize_then_matmul() {
    use kernels_gen::templates::gemm_mma::{gemm_mma, WeightStaging};
    let round = |v: &[f32]| v.iter().map(|&a| half::bf16::from_f32(a).to_f32()).collect::<Vec<_>>();
    for format in QUANT_FORMATS {
        let (data, k, n) = two_block_rows(format);
        let mut w = vec![0f32; n * k];
        ggml(format).dequantize(&data, &mut w);
        let kernel = gemm_mma("gemm_q", "test", WeightStaging::Dequantize(format));
        // One ragged token tile, and two.
        for tokens in [20, 70] {
            let x: Vec<f32> = (0..tokens * k).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
            let mut want = vec![0f32; tokens * n];
            ir::reference::ops::matmul(&round(&x), &round(&w), k, &mut want);
            let out = try_run_matmul(&kernel, Array::f32(&x), None, Array::u8(&data), (tokens, n, k, k)).unwrap();
            close(
                &out.to_f32().unwrap(),
                &want,
                1e-5,
                &format!("{format} × {tokens} tokens"),
            );
        }
    }
}

/// The decoding GEMM's tiles take each row's run as two 16-byte stores a lane, rows 80 bytes
/// apart: no shared-memory bank conflicts, stores or `ldmatrix` reads (the emulator counts
/// them), for a 32-element format and a K-quant.
#[test]
fn quantized_tensor_core_gemm_stages_its_tiles_without_bank_conflicts() {
    use kernels_gen::templates::gemm_mma::{gemm_mma, WeightStaging};
    for format in [DType::Q8_0, DType::Q4K] {
        let (data, k, n) = two_block_rows(format);
        let tokens = 20;
        let x: Vec<f32> = (0..tokens * k).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
        let kernel = gemm_mma("gemm_q", "test", WeightStaging::Dequantize(format));
        let traffic = common::profile_matmul(&kernel, Array::f32(&x), Array::u8(&data), (tokens, n, k, k)).unwrap();
        assert!(traffic.0.contains_key("ws"), "{format}: {traffic:?}");
        for (array, t) in &traffic.0 {
            assert_eq!(t.worst, 1, "{format}, {array}: {t:?}");
        }
    }
}

/// The decoding GEMM as plans launch it after the rows' launch: bf16 rows (`xb`, rows
/// `xb_stride` apart) times the blocks, for every format, one ragged token tile and two;
/// under a residual-and-norm form the products land after each row's sum, which it leaves
/// as the rows' launch wrote it, unscaled (the rows come normed).
#[test]
fn quantized_tensor_core_gemm_multiplies_rows_made_before_it() {
    use kernels_gen::templates::gemm_mma::{gemm_mma_after_rows, WeightStaging};
    let round = |v: &[f32]| v.iter().map(|&a| half::bf16::from_f32(a).to_f32()).collect::<Vec<_>>();
    let residual = NormPrologue::new(1e-6, 1.0).with_residual();
    for format in QUANT_FORMATS {
        let (data, k, n) = two_block_rows(format);
        let mut w = vec![0f32; n * k];
        ggml(format).dequantize(&data, &mut w);
        for (norm, tokens) in [(None, 20), (None, 70), (Some(residual), 20)] {
            let kernel = gemm_mma_after_rows("gemm_q_rows", "test", WeightStaging::Dequantize(format), (norm, None));
            let xb_stride = k + 8;
            let xb: Vec<f32> = (0..tokens * xb_stride)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
                .collect();
            let rows: Vec<f32> = (0..tokens)
                .flat_map(|t| xb[t * xb_stride..t * xb_stride + k].to_vec())
                .collect();
            let mut want = vec![0f32; tokens * n];
            ir::reference::ops::matmul(&round(&rows), &round(&w), k, &mut want);
            // Under the residual form a row is `[sum | product]`: the sums stay as they were.
            let (out_stride, product_col) = if norm.is_some() { (k + n, k) } else { (n, 0) };
            let untouched = -12345.0f32;
            let xb16: Vec<half::bf16> = xb.iter().map(|&v| half::bf16::from_f32(v)).collect();
            let mut bufs = HashMap::from([
                ("x".into(), Array::poisoned(Ty::F32, 1)),
                ("b".into(), Array::poisoned(Ty::F32, 1)),
                ("g".into(), Array::poisoned(Ty::F32, 1)),
                ("w".into(), Array::u8(&data)),
                ("out".into(), Array::f32(&vec![untouched; tokens * out_stride])),
                ("partial".into(), Array::poisoned(Ty::F32, 1)),
                ("xb".into(), Array::bf16(&xb16)),
            ]);
            let scalars = ints(&[
                ("tokens", tokens as i64),
                ("n", n as i64),
                ("k", k as i64),
                ("x_stride", k as i64),
                ("b_stride", k as i64),
                ("splits", 1),
                ("xb_stride", xb_stride as i64),
            ]);
            run(&kernel, &mut bufs, &scalars).unwrap();
            let out = bufs["out"].to_f32().unwrap();
            let what = format!("{format} × {tokens} tokens, {norm:?}");
            let products: Vec<f32> = (0..tokens)
                .flat_map(|t| out[t * out_stride + product_col..t * out_stride + product_col + n].to_vec())
                .collect();
            close(&products, &want, 1e-5, &what);
            let sums_kept = (0..tokens).all(|t| {
                out[t * out_stride..t * out_stride + product_col]
                    .iter()
                    .all(|&v| v == untouched)
            });
            assert!(sums_kept, "{what}: wrote a sum");
        }
    }
}

/// The GEMVs with the residual add and norm before them (`add_rms_norm_matmul` over GGUF
/// weights at one and a few rows, as plans now fuse GGUF models too): `[x + b | product]` rows.
#[test]
fn quantized_gemv_takes_the_residual_norm_prologue() {
    let norm = NormPrologue::new(1e-6, 1.0).with_residual();
    let mut rng = common::Rng(43);
    for format in QUANT_FORMATS {
        let (data, k, n) = two_block_rows(format);
        let tokens = 3;
        let mut inputs = common::Residual::random(&mut rng, (tokens, n, k), (k, k + 4));
        ggml(format).dequantize(&data, &mut inputs.w);
        let want = residual_reference(&inputs, (tokens, n, k), |v| v, 1.0, 1e-6);
        let decode = GemvSpec::decode(WeightFormat::Blocks(format), k).with_norm(norm);
        for spec in [decode, decode.prefill(), decode.with_x_vectors().prefill()] {
            let kernel = gemv("add_norm_gemv_q", "test", spec);
            let out =
                try_run_residual_matmul((&kernel, None), &inputs, Array::u8(&data), (tokens, n, k, n), 1).unwrap();
            close(&out.to_f32().unwrap(), &want, 1e-4, &format!("{format} {spec:?}"));
        }
    }
}

/// The decoding GEMM with the residual add and norm before it (`add_rms_norm_matmul` over GGUF
/// weights at many rows): `[x + b | product]` rows, in one piece and with K split.
#[test]
fn quantized_tensor_core_gemm_takes_the_residual_norm_prologue() {
    use kernels_gen::templates::gemm_mma::{gemm_mma_with, WeightStaging};
    use kernels_gen::templates::split_k::reduce;
    let round = |v: f32| half::bf16::from_f32(v).to_f32();
    let norm = NormPrologue::new(1e-6, 1.0).with_residual();
    let mut rng = common::Rng(41);
    for format in QUANT_FORMATS {
        let (data, k, n) = two_block_rows(format);
        let kernel = gemm_mma_with("gemm_q", "test", WeightStaging::Dequantize(format), Some(norm), None);
        let reduce = reduce("reduce", "test", 16, None, Some(norm));
        let tokens = 20;
        let mut inputs = common::Residual::random(&mut rng, (tokens, n, k), (k + 4, k));
        // The reference multiplies the dequantized weights.
        ggml(format).dequantize(&data, &mut inputs.w);
        let want = residual_reference(&inputs, (tokens, n, k), round, 1.0, 1e-6);
        for splits in [1, 2] {
            let out = try_run_residual_matmul(
                (&kernel, Some(&reduce)),
                &inputs,
                Array::u8(&data),
                (tokens, n, k, n),
                splits,
            )
            .unwrap();
            close(
                &out.to_f32().unwrap(),
                &want,
                1e-5,
                &format!("{format}, {splits} splits"),
            );
        }
    }
}

#[test]
fn quantized_embedding_gathers_dequantized_rows() {
    for format in QUANT_FORMATS {
        let data = blocks(format);
        let (be, bb) = block_layout(format).unwrap();
        let d = be as usize;
        let rows = data.len() / bb as usize;
        let mut table = vec![0f32; rows * d];
        ggml(format).dequantize(&data, &mut table);
        let ids = [rows as i64 - 1, 0, 3];
        let kernel = embedding("embedding_q", "test", WeightFormat::Blocks(format));
        let mut bufs = HashMap::from([
            ("w".into(), Array::u8(&data)),
            ("ids".into(), Array::ints(Ty::I32, &ids)),
            ("out".into(), Array::poisoned(Ty::F32, ids.len() * d)),
        ]);
        let mut scalars = ints(&[("tokens", ids.len() as i64), ("d", d as i64)]);
        scalars.insert("scale".into(), Scalar::F32(1.0));
        run(&kernel, &mut bufs, &scalars).unwrap();
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&i| table[i as usize * d..(i as usize + 1) * d].to_vec())
            .collect();
        assert_eq!(bufs["out"].to_f32().unwrap(), want, "{format}");
    }
}

/// A value's bits, every NaN as one: the emulator holds values, not bit patterns, so a NaN's
/// payload is not compared (the CUDA rounding keeps it as the host's does: `bbc_f32_to_bf16`).
fn bits(v: f32) -> u32 {
    if v.is_nan() {
        f32::NAN.to_bits()
    } else {
        v.to_bits()
    }
}

/// The values a converted weight holds: `values` rounded to `to` as the host rounds them.
fn held_as(to: DType, values: &[f32]) -> Vec<u32> {
    values
        .iter()
        .map(|&v| match to {
            DType::BF16 => bits(half::bf16::from_f32(v).to_f32()),
            DType::F16 => bits(half::f16::from_f32(v).to_f32()),
            _ => bits(v),
        })
        .collect()
}

/// Run the conversion from `from` to `to` over `w`, `n` elements; the values as bits.
fn converted(from: DType, to: DType, w: Array, n: usize) -> Vec<u32> {
    let kernel = convert_kernel(from, to).unwrap();
    let out_ty = match to {
        DType::BF16 => Ty::Bf16,
        DType::F16 => Ty::F16,
        _ => Ty::F32,
    };
    let mut bufs = HashMap::from([("w".into(), w), ("out".into(), Array::poisoned(out_ty, n))]);
    run(&kernel, &mut bufs, &ints(&[("n", n as i64)])).unwrap();
    bufs["out"].to_f32().unwrap().into_iter().map(bits).collect()
}

#[test]
fn block_weights_convert_on_the_device_to_the_hosts_values() {
    for format in QUANT_FORMATS {
        // The fixture's blocks as one run of rows: blocks lie back to back across rows.
        let data = blocks(format);
        let (be, bb) = block_layout(format).unwrap();
        let n = data.len() / bb as usize * be as usize;
        let mut want = vec![0f32; n];
        ggml(format).dequantize(&data, &mut want);
        for to in CONVERTED_TO {
            let got = converted(format, to, Array::u8(&data), n);
            assert_eq!(got, held_as(to, &want), "{format} to {to}");
        }
    }
}

/// The bf16 copy a step of many rows multiplies by holds what a bf16 plan's weights hold (the
/// host's values, rounded alike), for every block format; a step of fewer rows converts
/// nothing (its GEMM decodes the blocks).
#[test]
fn block_weights_convert_for_a_prefill_step_to_the_hosts_bf16_values() {
    let min_tokens = 65;
    for format in QUANT_FORMATS {
        let (data, k, n) = two_block_rows(format);
        let mut want = vec![0f32; n * k];
        ggml(format).dequantize(&data, &mut want);
        let kernel = to_bf16_for_prefill(format, min_tokens, "test").unwrap();
        for tokens in [min_tokens - 1, min_tokens, 300] {
            // A value no block decodes to, so an element left alone shows.
            let untouched = half::bf16::from_f32(1e30);
            let mut bufs = HashMap::from([
                ("w".into(), Array::u8(&data)),
                ("wb".into(), Array::bf16(&vec![untouched; n * k])),
            ]);
            let sizes = [("n", n as i64), ("k", k as i64), ("tokens", tokens as i64)];
            run(&kernel, &mut bufs, &ints(&sizes)).unwrap();
            let got = bufs["wb"].to_f32().unwrap();
            match tokens < min_tokens {
                true => assert!(
                    got.iter().all(|&v| v == untouched.to_f32()),
                    "{format}: converted at {tokens} rows"
                ),
                false => assert_eq!(
                    got.into_iter().map(bits).collect::<Vec<_>>(),
                    held_as(DType::BF16, &want),
                    "{format} at {tokens} rows"
                ),
            }
        }
    }
    for other in [DType::BF16, DType::F16] {
        assert!(to_bf16_for_prefill(other, min_tokens, "test").is_none());
    }
}

#[test]
fn half_weights_convert_on_the_device_as_the_host_rounds() {
    // Every f16 and bf16 value: zeros of both signs, subnormals, infinities, NaNs.
    let f16s: Vec<half::f16> = (0..=u16::MAX).map(half::f16::from_bits).collect();
    let bf16s: Vec<half::bf16> = (0..=u16::MAX).map(half::bf16::from_bits).collect();
    for to in CONVERTED_TO {
        // The other half type only (a weight already in the plan's type is not converted).
        if to != DType::F16 {
            let want: Vec<f32> = f16s.iter().map(|v| v.to_f32()).collect();
            let got = converted(DType::F16, to, Array::f16(&f16s), f16s.len());
            assert_eq!(got, held_as(to, &want), "f16 to {to}");
        }
        if to != DType::BF16 {
            let want: Vec<f32> = bf16s.iter().map(|v| v.to_f32()).collect();
            let got = converted(DType::BF16, to, Array::bf16(&bf16s), bf16s.len());
            assert_eq!(got, held_as(to, &want), "bf16 to {to}");
        }
    }
}

/// The DSL's 4-bit tables (what `UnOp::Iq4Value` and `UnOp::Mxfp4Value` stand for, on the
/// emulator and in the CUDA helpers) are the `quant` crate's, which the host decodes with.
#[test]
fn the_dsl_tables_are_the_hosts() {
    assert_eq!(kernels_gen::dsl::IQ4_VALUES, models::quant::iq4::KVALUES);
    assert_eq!(kernels_gen::dsl::MXFP4_VALUES, models::quant::mxfp4::KVALUES);
}

#[test]
fn only_stored_formats_have_conversions() {
    for from in [DType::F32, DType::I32, DType::F8E4M3] {
        assert!(convert_kernel(from, DType::BF16).is_none(), "{from}");
    }
    for (from, to) in [
        (DType::F16, DType::F16),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::Q4_0),
    ] {
        assert!(convert_kernel(from, to).is_none(), "{from} to {to}");
    }
}
