//! Every GGML block format dequantizes exactly as gguf-py does, on 8 blocks of each format
//! (taken from the real files, random, or quantized by ggml), and `dot` agrees with
//! dequantize-then-multiply; a format read as another (Q3_K) keeps gguf-py's values.

mod common;

use common::{fixture, read_json};
use models::quant::GgmlType;

#[test]
fn dequantization_matches_gguf_py() {
    let index = read_json("gguf-blocks/index.json");
    let formats = index.as_object().unwrap();
    assert_eq!(
        formats.len(),
        12,
        "Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS"
    );
    for (name, info) in formats {
        let dtype = GgmlType::from_id(info["type_id"].as_u64().unwrap() as u32).unwrap();
        assert_eq!(dtype.name(), name.as_str());
        let (elems, bytes) = dtype.block_layout();
        assert_eq!(elems as u64, info["block_elems"].as_u64().unwrap());
        assert_eq!(bytes as u64, info["block_bytes"].as_u64().unwrap());
        let raw = std::fs::read(fixture(&format!("gguf-blocks/{name}.bin"))).unwrap();
        let want: Vec<f32> = std::fs::read(fixture(&format!("gguf-blocks/{name}.f32")))
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let mut got = vec![f32::NAN; want.len()];
        dtype.dequantize(&raw, &mut got);
        assert!(want.iter().any(|&v| v != 0.0), "{name}: the reference is not all zeros");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // gguf-py multiplies in a different order than ggml for some formats: one ulp apart.
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1e-3), "{name}[{i}]: {g} vs {w}");
        }
        let x: Vec<f32> = (0..want.len()).map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0).collect();
        let reference: f64 = want.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
        let dot = dtype.dot(&raw, &x) as f64;
        assert!(
            (dot - reference).abs() <= 1e-4 * reference.abs().max(1.0),
            "{name}: dot {dot} vs {reference}"
        );
    }
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// A GGUF file's Q3_K tensors are read as Q6_K whose values are gguf-py's (the fixture blocks as
/// two rows), and its other tensors as they are.
#[test]
fn formats_read_as_another_keep_their_values() {
    let scratch = common::scratch_dir("gguf-rewritten");
    let path = scratch.path().join("rewritten.gguf");
    let mut writer = models::gguf::writer::GgufWriter::new();
    for (name, dtype) in [("Q3_K", GgmlType::Q3K), ("IQ4_NL", GgmlType::IQ4NL)] {
        let raw = std::fs::read(fixture(&format!("gguf-blocks/{name}.bin"))).unwrap();
        let elements = (raw.len() / dtype.block_layout().1 * dtype.block_layout().0) as u64;
        writer = writer.tensor(name, &[elements / 2, 2], dtype as u32, raw);
    }
    std::fs::write(&path, writer.to_bytes()).unwrap();
    let source = models::WeightSource::from_gguf(models::gguf::GgufFile::open(&path).unwrap());
    for (name, runs_as) in [("Q3_K", GgmlType::Q6K), ("IQ4_NL", GgmlType::IQ4NL)] {
        let want = f32s(&std::fs::read(fixture(&format!("gguf-blocks/{name}.f32"))).unwrap());
        let view = source.require(name).unwrap();
        assert_eq!(view.dtype, runs_as, "{name}");
        assert_eq!(view.shape, [2, want.len() / 2]);
        assert_eq!(view.bytes().len(), runs_as.bytes_for(want.len()).unwrap());
        assert_eq!(view.row_bytes() * 2, view.bytes().len());
        let mut got = vec![f32::NAN; want.len()];
        runs_as.dequantize(&view.bytes(), &mut got);
        assert_eq!(got, want, "{name} read as {}", runs_as.name());
        assert_eq!(view.to_f32().data, want, "{name}");
    }
}
