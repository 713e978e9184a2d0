//! Which quantization an HF checkpoint's `config.json` names (`quantization_config`), read or
//! refused by name: FP8 codes with scales (`fp8_checkpoint`), packed integers with scales
//! (`int_checkpoint`) or NVFP4 codes with two scales (`fp4_checkpoint`).

use crate::error::{ModelError, Result};
use crate::fp4_checkpoint::{self, Fp4Layout, FP4_METHODS};
use crate::fp8_checkpoint::{self, FP8_METHODS};
use crate::int_checkpoint::{self, IntScheme};
use crate::quant::GgmlType;
use std::path::Path;

/// What a checkpoint's `quantization_config` says of its weights.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointQuantization {
    /// The `quant_method` that named it, lowercased (vLLM's `--quantization` names the same).
    pub method: String,
    /// The block an FP8 weight's 2-D scale covers where the config names one.
    pub block: Option<[usize; 2]>,
    /// How packed integer weights lie, for an integer method.
    pub integers: Option<IntScheme>,
    /// Whose layout NVFP4 weights have, for an NVFP4 method.
    pub fp4: Option<Fp4Layout>,
}

/// The methods whose weights are packed integers with scales.
const INT_METHODS: &str =
    "gptq, awq (GEMM), auto-round (packed as either) and compressed-tensors (pack-quantized, int-quantized)";
/// Where other quantized weights can come from.
const OTHERWISE: &str = "and GGUF files for other quantized weights";

/// The method vLLM's `--quantization` names, lowercased: its names for the Marlin kernels it
/// runs GPTQ's and AWQ's checkpoints with (`gptq_marlin`, `awq_marlin`) name those methods, and
/// `modelopt_fp4` ModelOpt's NVFP4 checkpoints.
pub fn method_named(asked: &str) -> String {
    let named = asked.to_ascii_lowercase();
    match named.as_str() {
        "gptq_marlin" => "gptq".into(),
        "awq_marlin" => "awq".into(),
        "modelopt_fp4" => "modelopt".into(),
        _ => named,
    }
}

/// The `quantization_config` of `config.json` (top level, or its `text_config`'s): `None` where
/// it has none, what it says where it names a method bbc reads, an error naming any other.
pub fn quantization_of(config: &serde_json::Value, path: &Path) -> Result<Option<CheckpointQuantization>> {
    let Some(quant) = config
        .get("quantization_config")
        .or_else(|| config.get("text_config").and_then(|t| t.get("quantization_config")))
    else {
        return Ok(None);
    };
    let refuse = |what: String| ModelError::Config {
        path: path.to_path_buf(),
        what: format!(
            "`quantization_config`: {what}; bbc reads {FP8_METHODS} checkpoints, {INT_METHODS} ones, \
             {FP4_METHODS} ones, {OTHERWISE}"
        ),
    };
    let method = quant
        .get("quant_method")
        .and_then(|v| v.as_str())
        .map(str::to_ascii_lowercase)
        .ok_or_else(|| refuse("has no `quant_method`".into()))?;
    let read = |integers, block, fp4| {
        Ok(Some(CheckpointQuantization {
            method: method.clone(),
            block,
            integers,
            fp4,
        }))
    };
    if let Some(layout) = fp4_checkpoint::scheme_of(&method, quant) {
        return read(None, None, Some(layout.map_err(refuse)?));
    }
    if let Some(scheme) = int_checkpoint::scheme_of(&method, quant) {
        return read(Some(scheme.map_err(refuse)?), None, None);
    }
    match fp8_checkpoint::fp8_block(&method, quant) {
        Some(block) => read(None, block.map_err(refuse)?, None),
        None => Err(refuse(format!("`quant_method` is `{method}`"))),
    }
}

/// The dtype a checkpoint's `config.json` names for its weights (`dtype`, or transformers 4's
/// `torch_dtype`; a multimodal config's `text_config`'s): bf16 unless it names f32 or f16.
pub fn checkpoint_dtype(config: &serde_json::Value) -> GgmlType {
    let named = |c: &serde_json::Value| {
        ["dtype", "torch_dtype"]
            .into_iter()
            .find_map(|key| c.get(key).and_then(|d| d.as_str()).map(str::to_string))
    };
    let name = named(config).or_else(|| config.get("text_config").and_then(named));
    match name.as_deref() {
        Some("float32") => GgmlType::F32,
        Some("float16") => GgmlType::F16,
        _ => GgmlType::BF16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::int_checkpoint::Packing;
    use serde_json::json;

    #[test]
    fn a_checkpoints_dtype_is_its_configs() {
        assert_eq!(checkpoint_dtype(&json!({"dtype": "float32"})), GgmlType::F32);
        assert_eq!(checkpoint_dtype(&json!({"torch_dtype": "float16"})), GgmlType::F16);
        assert_eq!(
            checkpoint_dtype(&json!({"text_config": {"dtype": "float32"}})),
            GgmlType::F32
        );
        assert_eq!(checkpoint_dtype(&json!({"dtype": "bfloat16"})), GgmlType::BF16);
        assert_eq!(checkpoint_dtype(&json!({})), GgmlType::BF16);
    }

    #[test]
    fn quantization_methods_are_read_or_refused_by_name() {
        let path = Path::new("config.json");
        let of = |q: serde_json::Value| quantization_of(&json!({ "quantization_config": q }), path);
        assert_eq!(quantization_of(&json!({}), path).unwrap(), None);
        let fp8 = of(json!({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}));
        assert_eq!(fp8.unwrap().unwrap().block, Some([128, 128]));
        let nested = quantization_of(
            &json!({"text_config": {"quantization_config": {"quant_method": "fp8"}}}),
            path,
        );
        assert_eq!(nested.unwrap().unwrap().method, "fp8");
        assert!(of(json!({"quant_method": "fbgemm_fp8"})).unwrap().is_some());
        assert!(of(json!({"quant_method": "modelopt", "quant_algo": "FP8"}))
            .unwrap()
            .is_some());
        let blocks = of(
            json!({"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"weights": {"type": "float", "num_bits": 8,
            "strategy": "block", "block_structure": [128, 128]}}}}),
        );
        assert_eq!(blocks.unwrap().unwrap().block, Some([128, 128]));
        let gptq = of(json!({"quant_method": "GPTQ", "bits": 4, "group_size": 128}))
            .unwrap()
            .unwrap();
        assert_eq!((gptq.method.as_str(), gptq.integers.map(|s| s.bits)), ("gptq", Some(4)));
        let awq = of(json!({"quant_method": "awq", "bits": 4, "version": "gemm"}))
            .unwrap()
            .unwrap();
        assert_eq!(awq.integers.map(|s| s.packing), Some(Packing::Awq));
        let packed = of(json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}}}}));
        assert_eq!(
            packed.unwrap().unwrap().integers.map(|s| s.packing),
            Some(Packing::CompressedTensors)
        );
        let modelopt = of(json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}));
        assert_eq!(modelopt.unwrap().unwrap().fp4, Some(Fp4Layout::ModelOptNvfp4));
        let nvfp4 = of(
            json!({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"weights": {"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16}}}}),
        );
        assert_eq!(nvfp4.unwrap().unwrap().fp4, Some(Fp4Layout::CompressedTensorsNvfp4));
        for (q, named) in [
            (json!({"quant_method": "gptq", "bits": 3}), "3-bit"),
            (
                json!({"quant_method": "awq", "bits": 4, "version": "exllama"}),
                "exllama",
            ),
            (json!({"quant_method": "bitsandbytes"}), "bitsandbytes"),
            (json!({"quant_method": "fp8", "fmt": "e5m2"}), "e5m2"),
            (
                json!({"quant_method": "fp8", "weight_block_size": [128]}),
                "weight_block_size",
            ),
            (
                json!({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}),
                "w4a8_awq",
            ),
            (
                json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}),
                "groups of 32",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "pack-quantized"}),
                "no group of weights",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "marlin-24"}),
                "marlin-24",
            ),
            (
                json!({"quant_method": "compressed-tensors", "config_groups":
                    {"g": {"weights": {"type": "int", "num_bits": 4}}}}),
                "4 bits",
            ),
            (json!({"bits": 4}), "quant_method"),
        ] {
            let err = of(q).unwrap_err().to_string();
            assert!(
                err.contains(named) && err.contains("fp8") && err.contains("gptq"),
                "{err}"
            );
        }
    }
}
