//! Copies of hf-tiny checkpoints changed as other releases of them would be.

use std::path::Path;

/// A copy of the checkpoint at `src` (one `model.safetensors`) with its f32 `weight_scale`
/// tensors rounded to bf16 and stored so, as llm-compressor saves a bf16 model's scales; the
/// copy lives as long as the directory returned.
pub fn with_bf16_scales(src: &Path) -> tempfile::TempDir {
    let scratch = super::scratch_dir("bbc-bf16-scales-");
    let dir = scratch.path();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let is_scale = |n: &str| n.ends_with("weight_scale");
    let rounded: Vec<(String, Vec<u8>, Vec<usize>)> = st
        .names()
        .into_iter()
        .filter(|n| is_scale(n))
        .map(|n| {
            let view = st.tensor(n).unwrap();
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{n}");
            let bf16: Vec<u8> = view
                .data()
                .chunks_exact(4)
                .flat_map(|b| half::bf16::from_f32(f32::from_le_bytes(b.try_into().unwrap())).to_le_bytes())
                .collect();
            (n.to_string(), bf16, view.shape().to_vec())
        })
        .collect();
    assert!(!rounded.is_empty(), "{}: no scales", src.display());
    let mut views: Vec<(String, safetensors::tensor::TensorView)> = st
        .names()
        .into_iter()
        .filter(|n| !is_scale(n))
        .map(|n| (n.to_string(), st.tensor(n).unwrap()))
        .collect();
    for (name, data, shape) in &rounded {
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), data).unwrap();
        views.push((name.clone(), view));
    }
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    scratch
}

/// A copy of the checkpoint at `src` (its `config.json` and `model.safetensors`) whose
/// `quantization_config` is `quantization`, as another tool labels the same tensors; the copy
/// lives as long as the directory returned.
pub fn with_quantization_config(src: &Path, quantization: serde_json::Value) -> tempfile::TempDir {
    let scratch = super::scratch_dir("bbc-relabelled-");
    let dir = scratch.path();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["quantization_config"] = quantization;
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    scratch
}
