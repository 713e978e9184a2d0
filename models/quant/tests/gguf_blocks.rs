//! Every GGML block format dequantizes exactly as gguf-py does, on 8 blocks of each format
//! (taken from the real files, random, or quantized by ggml), and `dot` agrees with
//! dequantize-then-multiply.

use quant::GgmlType;
use std::path::PathBuf;

/// A file of the repository's test fixtures.
fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel)
}

fn read_json(rel: &str) -> serde_json::Value {
    let path = fixture(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn dequantization_matches_gguf_py() {
    let index = read_json("gguf-blocks/index.json");
    let formats = index.as_object().unwrap();
    assert_eq!(
        formats.len(),
        13,
        "Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS MXFP4"
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
