//! Malformed model files and bad arguments give errors that name the problem, never a panic.

mod common;

use bbc::gpu_check::tiny_gguf;
use common::real_model;
use models::gguf::writer::GgufWriter;
use models::gguf::{GgufFile, MetaValue};
use models::{Model, ModelSpec};
use proptest::prelude::*;
use std::path::Path;
use std::process::Command;

/// A file holding `bytes`, its name ending in `name` (extensions matter), removed when dropped.
fn temp(name: &str, bytes: &[u8]) -> tempfile::TempPath {
    let file = tempfile::Builder::new()
        .prefix("bbc-malformed-")
        .suffix(&format!("-{name}"))
        .tempfile()
        .unwrap();
    std::fs::write(file.path(), bytes).unwrap();
    file.into_temp_path()
}

fn open_error(path: &Path) -> String {
    match Model::open(ModelSpec::for_weights(path)) {
        Ok(_) => panic!("{} should not open", path.display()),
        Err(e) => e.to_string(),
    }
}

fn tiny_gguf(type_id: u32) -> Vec<u8> {
    GgufWriter::new()
        .meta("general.architecture", MetaValue::String("llama".into()))
        .tensor("token_embd.weight", &[32, 2], type_id, vec![0u8; 256])
        .to_bytes()
}

#[test]
fn truncated_gguf_names_what_was_cut() {
    let bytes = std::fs::read(real_model("smollm2")).unwrap();
    for cut in [10, 1000, 2_000_000, bytes.len() - 1] {
        let path = temp(&format!("truncated-{cut}.gguf"), &bytes[..cut]);
        let err = open_error(&path);
        assert!(
            err.contains("truncated") && err.contains(path.to_str().unwrap()),
            "cut {cut}: {err}"
        );
    }
}

#[test]
fn wrong_magic_is_named() {
    let mut bytes = tiny_gguf(0);
    bytes[..4].copy_from_slice(b"GGML");
    let err = open_error(&temp("magic.gguf", &bytes));
    assert!(err.contains("not a GGUF file") && err.contains("GGUF"), "{err}");
}

#[test]
fn unknown_tensor_type_is_named() {
    let err = open_error(&temp("type.gguf", &tiny_gguf(99)));
    assert!(err.contains("token_embd.weight") && err.contains("type id 99"), "{err}");
    assert!(err.contains("unknown to ggml") && err.contains("IQ4_XS"), "{err}");
    let err = open_error(&temp("iq2.gguf", &tiny_gguf(16)));
    assert!(err.contains("GGML type IQ2_XXS (type id 16)"), "{err}");
}

#[test]
fn missing_architecture_metadata_is_named() {
    let err = open_error(&temp("arch.gguf", &tiny_gguf(0)));
    assert!(
        err.contains("llama.embedding_length") && err.contains("missing"),
        "{err}"
    );
}

fn safetensors_bytes(header: &str, data_len: usize) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(vec![0u8; data_len]);
    out
}

#[test]
fn safetensors_header_lying_about_sizes_is_named() {
    let scratch = common::scratch_dir("bbc-malformed-st-");
    let dir = scratch.path();
    std::fs::copy(common::fixture("hf-tiny/llama/config.json"), dir.join("config.json")).unwrap();
    let cases = [
        // Claims 64 bytes, the file holds 16.
        (r#"{"w":{"dtype":"F32","shape":[4,4],"data_offsets":[0,64]}}"#, 16, "w"),
        // Shape says 64 bytes, offsets say 32.
        (r#"{"w":{"dtype":"F32","shape":[4,4],"data_offsets":[0,32]}}"#, 32, "w"),
        (r#"{"w":{"dtype":"F32","shape":[4,4]"#, 64, "header"),
    ];
    for (header, data_len, needle) in cases {
        std::fs::write(dir.join("model.safetensors"), safetensors_bytes(header, data_len)).unwrap();
        let err = open_error(dir);
        assert!(err.contains("safetensors") && err.contains(needle), "{header}: {err}");
    }
}

/// A directory whose weights are PyTorch pickles (as some checkpoints and EAGLE heads ship
/// them) says so and how to convert them, as a model and as an EAGLE head; one with no weights
/// at all says what it lacks.
#[test]
fn pickled_weights_are_named_with_their_conversion() {
    let scratch = common::scratch_dir("bbc-malformed-pickle-");
    let dir = scratch.path();
    std::fs::copy(common::fixture("hf-tiny/llama/config.json"), dir.join("config.json")).unwrap();
    let err = open_error(dir);
    assert!(err.contains("no model.safetensors"), "{err}");
    std::fs::write(dir.join("pytorch_model.bin"), b"PK\x03\x04").unwrap();
    let err = open_error(dir);
    assert!(
        err.contains("PyTorch pickles") && err.contains("safetensors.torch import save_file"),
        "{err}"
    );
    let head = dir.join("head");
    std::fs::create_dir(&head).unwrap();
    std::fs::copy(common::fixture("eagle/eagle3/config.json"), head.join("config.json")).unwrap();
    std::fs::write(head.join("pytorch_model.bin"), b"PK\x03\x04").unwrap();
    let target = models::Model::open(models::ModelSpec::for_weights(&common::fixture("hf-tiny/llama"))).unwrap();
    let err = models::eagle::EagleHead::open(&head, models::eagle::EagleMethod::Eagle3, &target.config)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("PyTorch pickles"), "{err}");
}

/// A GLM-4.5 MoE `config.json` whose routing cannot work, or whose experts do not match the
/// weights, is refused naming the setting or the tensor that disagrees.
#[test]
fn bad_moe_configs_are_named() {
    check_bad_configs(
        "glm4_moe",
        &[
            ("n_group", 3.into(), "n_group 3"),
            ("topk_group", 3.into(), "topk_group 3"),
            ("num_experts_per_tok", 5.into(), "num_experts_per_tok 5"),
            ("n_routed_experts", serde_json::Value::Null, "n_routed_experts"),
            ("use_qk_norm", "yes".into(), "use_qk_norm"),
            ("n_routed_experts", 10.into(), "the config implies [10, 64]"),
        ],
    );
}

/// The same for Qwen3.5's Gated DeltaNet settings.
#[test]
fn bad_hybrid_configs_are_named() {
    check_bad_configs(
        "qwen3_5",
        &[
            ("linear_num_value_heads", 3.into(), "3 linear value heads"),
            ("linear_key_head_dim", serde_json::Value::Null, "linear_key_head_dim"),
            ("linear_conv_kernel_dim", 0.into(), "conv kernel must be positive"),
            ("linear_conv_kernel_dim", 3.into(), "conv1d.weight"),
            ("layer_types", serde_json::json!(["linear_attention", "mamba"]), "mamba"),
        ],
    );
}

/// Bad Gemma 4 configs are refused by name: head overrides for layers the model does not
/// have, KV sharing no earlier layer can serve, caps that are not positive, a MoE block without
/// its experts.
#[test]
fn unsupported_gemma4_configs_are_named() {
    check_bad_configs(
        "gemma4",
        &[
            ("enable_moe_block", true.into(), "`num_experts` is missing"),
            ("num_kv_shared_layers", 7.into(), "more than the model's 6 layers"),
            // The last layer is the only full-attention one: no earlier one to read.
            ("num_kv_shared_layers", 1.into(), "none of the first 5"),
            ("final_logit_softcapping", (-30.0).into(), "positive"),
            (
                "per_layer_config",
                serde_json::json!({"9": {"head_dim": 64}}),
                "layer \"9\"",
            ),
            (
                "per_layer_config",
                serde_json::json!({"5": {"head_dim": 64}}),
                "self_attn.q_proj",
            ),
        ],
    );
}

/// RoPE scalings bbc does not compute, and YaRN parameters no checkpoint can have, are
/// refused by name: dynamic NTK, a negative factor, a `truncate` that is not a boolean, a beta
/// that is not a number, YaRN on Gemma 4 (whose full-attention layers are proportional).
#[test]
fn bad_rope_scalings_are_named() {
    let yarn = |key: &str, value: serde_json::Value| {
        let mut p = serde_json::json!({
            "rope_theta": 100000.0,
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        });
        p[key] = value;
        p
    };
    let dynamic = serde_json::json!({"rope_theta": 100000.0, "rope_type": "dynamic", "factor": 2.0});
    check_bad_configs(
        "llama",
        &[
            ("rope_parameters", dynamic, "rope_type \"dynamic\""),
            (
                "rope_parameters",
                yarn("factor", (-1.0).into()),
                "rope_parameters.factor",
            ),
            (
                "rope_parameters",
                yarn("truncate", "no".into()),
                "rope_parameters.truncate",
            ),
            (
                "rope_parameters",
                yarn("beta_fast", "fast".into()),
                "rope_parameters.beta_fast",
            ),
        ],
    );
    check_bad_configs(
        "gemma4",
        &[(
            "rope_parameters",
            yarn("factor", 4.0.into()),
            "rope_type \"yarn\" for gemma4",
        )],
    );
}

/// `gguf-tiny/{name}.gguf` rewritten with `edits` (a key set, or removed where `None`) and
/// each tensor's data through `data`.
fn rewritten_gguf(name: &str, edits: &[(&str, Option<MetaValue>)], data: impl Fn(&str, &[u8]) -> Vec<u8>) -> Vec<u8> {
    rewritten(&common::fixture(&format!("gguf-tiny/{name}.gguf")), edits, data)
}

/// The GGUF file at `path` rewritten with `edits`, its tensors as they are.
fn rewritten_gguf_at(path: &Path, edits: &[(&str, Option<MetaValue>)]) -> Vec<u8> {
    rewritten(path, edits, |_, d| d.to_vec())
}

fn rewritten(path: &Path, edits: &[(&str, Option<MetaValue>)], data: impl Fn(&str, &[u8]) -> Vec<u8>) -> Vec<u8> {
    let file = GgufFile::open(path).unwrap();
    let mut metadata = file.metadata.clone();
    for (key, value) in edits {
        match value {
            Some(v) => metadata.insert(key.to_string(), v.clone()),
            None => metadata.remove(*key),
        };
    }
    let mut writer = GgufWriter::new();
    for (key, value) in metadata {
        writer = writer.meta(&key, value);
    }
    for t in &file.tensors {
        writer = writer.tensor(&t.name, &t.dims, t.dtype as u32, data(&t.name, file.tensor_data(t)));
    }
    writer.to_bytes()
}

/// A Gemma 4 GGUF whose keys do not describe a model bbc can run is refused, naming the key:
/// flags not one per layer, MLP widths neither uniform nor doubled in the KV-shared layers,
/// values narrower than keys, partial rotation outside `rope_freqs`, more shared layers than
/// layers, a KV head count that is neither a number nor a list; and `rope_freqs` factors that
/// are not proportional RoPE's.
#[test]
fn bad_gemma4_gguf_metadata_is_named() {
    let list = |v: &[u64]| Some(MetaValue::Array(v.iter().map(|&x| MetaValue::U32(x as u32)).collect()));
    let cases: [(&str, Option<MetaValue>, &str); 6] = [
        (
            "gemma4.attention.sliding_window_pattern",
            Some(MetaValue::Array(vec![MetaValue::Bool(true); 2])),
            "list of 6 flags",
        ),
        (
            "gemma4.feed_forward_length",
            list(&[96, 96, 96, 192, 96, 192]),
            "neither",
        ),
        (
            "gemma4.attention.value_length",
            Some(MetaValue::U32(32)),
            "as wide as its keys",
        ),
        (
            "gemma4.rope.dimension_count_swa",
            Some(MetaValue::U32(16)),
            "whole head",
        ),
        (
            "gemma4.attention.shared_kv_layers",
            Some(MetaValue::U32(9)),
            "more than the model's 6 layers",
        ),
        (
            "gemma4.attention.head_count_kv",
            Some(MetaValue::String("one".into())),
            "one per layer",
        ),
    ];
    let unchanged = |_: &str, d: &[u8]| d.to_vec();
    for (key, value, want) in cases {
        let bytes = rewritten_gguf("gemma4_kv_shared", &[(key, value)], unchanged);
        let err = open_error(&temp("gemma4-meta.gguf", &bytes));
        assert!(err.contains(key) && err.contains(want), "{key}: {err}");
    }
    let every_pair_doubled = |name: &str, d: &[u8]| match name {
        "rope_freqs.weight" => d.chunks(4).flat_map(|_| 2f32.to_le_bytes()).collect(),
        _ => d.to_vec(),
    };
    let bytes = rewritten_gguf("gemma4_kv_shared", &[], every_pair_doubled);
    let err = open_error(&temp("gemma4-rope.gguf", &bytes));
    assert!(err.contains("rope_freqs") && err.contains("proportional"), "{err}");
}

/// A GLM-5 GGUF whose first layer shares an indexer (there is none before it to share), or
/// that leaves the indexer types unsaid at a context where llama.cpp assumes GLM-5.2's
/// pattern of them, or whose per-head key is narrower than its rotated part, or that scales
/// its RoPE by YaRN (which llama.cpp's versions apply to latent attention differently), is
/// refused, naming what is wrong.
#[test]
fn unsupported_glm5_gguf_metadata_is_named() {
    let flags = |v: &[bool]| Some(MetaValue::Array(v.iter().map(|&b| MetaValue::Bool(b)).collect()));
    // Each case: the edits, and two things its error must name.
    type Case<'a> = (&'a [(&'a str, Option<MetaValue>)], &'a str, &'a str);
    let cases: [Case; 4] = [
        (
            &[("glm-dsa.attention.indexer.types", flags(&[false, true, true]))],
            "indexer types",
            "the first shared",
        ),
        (
            &[
                ("glm-dsa.attention.indexer.types", None),
                ("glm-dsa.context_length", Some(MetaValue::U32(1 << 20))),
            ],
            "glm-dsa.attention.indexer.types",
            "GLM-5.2",
        ),
        (
            &[("glm-dsa.attention.key_length_mla", Some(MetaValue::U32(8)))],
            "glm-dsa.attention.key_length_mla",
            "less than the rotated",
        ),
        (
            &[("glm-dsa.rope.scaling.type", Some(MetaValue::String("yarn".into())))],
            "glm-dsa.rope.scaling.type",
            "latent attention",
        ),
    ];
    let unchanged = |_: &str, d: &[u8]| d.to_vec();
    for (edits, key, want) in cases {
        let bytes = rewritten_gguf("glm_moe_dsa", edits, unchanged);
        let err = open_error(&temp("glm5-meta.gguf", &bytes));
        assert!(err.contains(key) && err.contains(want), "{key}: {err}");
    }
}

/// Llama 3.1's RoPE scaling from a GGUF file, whose only trace is `rope_freqs` (what each
/// pair's frequency is divided by, as llama.cpp's converter computes it): read as
/// `RopeScaling::Llama3` where Llama 3.1's rule over a context of 8192 gives the file's
/// divisors (the tiny Llama's 8 pairs fall in every regime), refused naming the tensor where
/// it does not; an unknown `rope.scaling.type` is refused naming the key.
#[test]
fn llama3_rope_scaling_from_gguf_is_read_or_refused() {
    let dir = common::scratch_dir("bbc-rope-freqs-");
    let plain = dir.path().join("llama.gguf");
    bbc::gpu_check::tiny_gguf::tiny_gguf_llama(&plain, &mut tiny_gguf::f16_values, &mut tiny_gguf::f16_values).unwrap();
    let file = GgufFile::open(&plain).unwrap();
    // llama.cpp's `LlamaModel.generate_extra_tensors`, factor 8 (head_dim 16, θ 10 000).
    let llama3_divisors: Vec<f32> = (0..8)
        .map(|i| {
            let freq = 1.0 / 10_000f32.powf(2.0 * i as f32 / 16.0);
            let wavelength = 2.0 * std::f32::consts::PI / freq;
            match wavelength {
                w if w < 2048.0 => 1.0,
                w if w > 8192.0 => 8.0,
                w => {
                    let smooth = (8192.0 / w - 1.0) / 3.0;
                    1.0 / ((1.0 - smooth) / 8.0 + smooth)
                }
            }
        })
        .collect();
    assert!(llama3_divisors.iter().any(|&d| d != 1.0 && d != 8.0), "a blended pair");
    let with_divisors = |divisors: &[f32]| {
        let mut writer = GgufWriter::new();
        for (key, value) in &file.metadata {
            writer = writer.meta(key, value.clone());
        }
        for t in &file.tensors {
            writer = writer.tensor(&t.name, &t.dims, t.dtype as u32, file.tensor_data(t).to_vec());
        }
        let bytes = divisors.iter().flat_map(|d| d.to_le_bytes()).collect();
        temp(
            "rope-freqs.gguf",
            &writer.tensor("rope_freqs.weight", &[8], 0, bytes).to_bytes(),
        )
    };
    let model = Model::open(ModelSpec::for_weights(&with_divisors(&llama3_divisors))).unwrap();
    assert_eq!(
        model.config.rope_scaling,
        ir::RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192.0
        }
    );
    let unscaled = Model::open(ModelSpec::for_weights(&plain)).unwrap();
    assert_eq!(unscaled.config.rope_scaling, ir::RopeScaling::None);
    let err = open_error(&with_divisors(&[1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 3.0, 4.0]));
    assert!(err.contains("rope_freqs.weight") && err.contains("Llama 3.1"), "{err}");
    let yarn = rewritten_gguf_at(
        &plain,
        &[("llama.rope.scaling.type", Some(MetaValue::String("longrope".into())))],
    );
    let err = open_error(&temp("yarn.gguf", &yarn));
    assert!(
        err.contains("llama.rope.scaling.type") && err.contains("longrope"),
        "{err}"
    );
}

/// A GLM-5 config whose first layer shares an indexer, or with an indexer type bbc does not
/// know, is refused, as are bad sizes.
#[test]
fn unsupported_glm5_configs_are_named() {
    check_bad_configs(
        "glm_moe_dsa",
        &[
            (
                "indexer_types",
                serde_json::json!(["shared", "full", "full"]),
                "the first shared",
            ),
            (
                "indexer_types",
                serde_json::json!(["full", "sliding", "full"]),
                "sliding",
            ),
            ("index_topk", 0.into(), "latent attention"),
            ("mlp_layer_types", serde_json::json!(["dense", "moe", "sparse"]), "moe"),
        ],
    );
}

/// Each case sets one key of the family's tiny `config.json`; opening and lowering the model
/// must fail with a message containing the case's text.
fn check_bad_configs(family: &str, cases: &[(&str, serde_json::Value, &str)]) {
    let src = common::fixture(&format!("hf-tiny/{family}"));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    for (i, (key, value, needle)) in cases.iter().enumerate() {
        let scratch = common::scratch_dir(&format!("bbc-bad-{family}-{i}-"));
        let dir = scratch.path();
        std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
        let mut bad = config.clone();
        bad[*key] = value.clone();
        std::fs::write(dir.join("config.json"), bad.to_string()).unwrap();
        let message = match Model::open(ModelSpec::for_weights(dir)).and_then(|m| {
            m.lower(models::LogitsFor::LastToken)?;
            Ok(())
        }) {
            Ok(()) => panic!("{family}: {key} = {value} should be refused"),
            Err(e) => e.to_string(),
        };
        assert!(message.contains(needle), "{family}: {key} = {value}: {message}");
    }
}

fn bbc(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_bbc")).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!stderr.contains("panicked"), "bbc {args:?} panicked: {stderr}");
    (out.status.success(), stderr)
}

#[test]
fn model_toml_with_unknown_key_is_named_by_the_cli() {
    let path = temp("model.toml", b"[model]\nweights = \"x.gguf\"\ncontext_len = 5\n");
    let (ok, stderr) = bbc(&["run", path.to_str().unwrap(), "--prompt", "hi"]);
    assert!(!ok);
    assert!(
        stderr.contains("context_len") && stderr.contains("model.toml"),
        "{stderr}"
    );
}

#[test]
fn bad_cli_input_is_an_error() {
    let model = real_model("smollm2");
    let model = model.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["run", model, "--prompt-ids", "999999"], "outside the vocabulary"),
        (
            &["run", model, "--prompt", "hi", "--max-tokens", "9000"],
            "context length",
        ),
        (&["run", model, "--prompt", "hi", "--temperature", "-1"], "temperature"),
        (&["run", model, "--prompt", "hi", "--dtype", "f8"], "f8"),
        (&["run", model], "give a prompt"),
        (&["run", "no-such-model", "--prompt", "hi"], "no-such-model"),
        (&["compile", model, "--target", "tpu", "-o", "/tmp/x"], "unknown target"),
        (
            &[
                "serve",
                model,
                "--speculative-ngram",
                "4",
                "--prompt-lookup-min",
                "3",
                "--prompt-lookup-max",
                "2",
            ],
            "prompt_lookup_min",
        ),
    ];
    for (args, needle) in cases {
        let (ok, stderr) = bbc(args);
        assert!(!ok, "{args:?} should fail");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

/// An artifact directory that cannot be made (its parent is a file): the OS's reason, said
/// once after the path.
#[test]
fn an_output_that_cannot_be_written_is_named_once() {
    let file = temp("not-a-directory", b"x");
    let out = file.join("artifact");
    let model = real_model("smollm2");
    let (ok, stderr) = bbc(&["compile", model.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(!ok);
    let reason = "Not a directory";
    assert!(stderr.contains(out.to_str().unwrap()), "{stderr}");
    assert_eq!(stderr.matches(reason).count(), 1, "{stderr}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Random corruption of a valid GGUF header either loads or is an error; never a panic.
    #[test]
    fn corrupted_gguf_never_panics(flips in proptest::collection::vec((0usize..4096, any::<u8>()), 1..8)) {
        let mut bytes = GgufWriter::new()
            .meta("general.architecture", MetaValue::String("llama".into()))
            .meta("llama.embedding_length", MetaValue::U32(32))
            .meta("tokenizer.ggml.tokens", MetaValue::Array(vec![MetaValue::String("a".into()), MetaValue::String("b".into())]))
            .tensor("token_embd.weight", &[32, 2], 0, vec![0u8; 256])
            .to_bytes();
        for (at, value) in flips {
            let i = at % bytes.len();
            bytes[i] = value;
        }
        let path = temp(&format!("fuzz-{}.gguf", bytes.iter().map(|&b| b as usize).sum::<usize>()), &bytes);
        let _ = GgufFile::open(&path);
        let _ = Model::open(ModelSpec::for_weights(&path));
    }
}

/// FP8 weights that cannot be read are refused naming the tensor and what is wrong: no scale
/// beside them, a scale whose shape fits no layout, a block grid the config does not size, an
/// FP8 type other than E4M3; so is a checkpoint quantized by a method bbc does not read.
#[test]
fn unreadable_fp8_checkpoints_are_named() {
    let scratch = common::scratch_dir("bbc-malformed-fp8-");
    let dir = scratch.path();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(common::fixture("hf-tiny/llama/config.json")).unwrap()).unwrap();
    let fp8 = serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]});
    let w = |dtype: &str, shape: &str, at: usize, len: usize| {
        format!(
            r#""w.weight":{{"dtype":"{dtype}","shape":{shape},"data_offsets":[{at},{}]}}"#,
            at + len
        )
    };
    // An FP8 weight of `shape` (`len` codes) and its f32 `weight_scale_inv` of `scales`.
    let scaled = |shape: &str, len: usize, scales: &str, count: usize| {
        let scale = format!(
            r#""w.weight_scale_inv":{{"dtype":"F32","shape":{scales},"data_offsets":[{len},{}]}}"#,
            len + 4 * count
        );
        format!("{{{},{scale}}}", w("F8_E4M3", shape, 0, len))
    };
    let cases = [
        (
            fp8.clone(),
            format!("{{{}}}", w("F8_E4M3", "[4,8]", 0, 32)),
            "no `w.weight_scale_inv`",
        ),
        (fp8.clone(), scaled("[4,8]", 32, "[3]", 3), "[3] fits no layout"),
        (
            fp8.clone(),
            scaled("[4,8]", 32, "[3,1]", 3),
            "grid 3 × 1 does not divide 4 × 8",
        ),
        (
            serde_json::json!({"quant_method": "fp8"}),
            scaled("[4,8]", 32, "[2,2]", 4),
            "`weight_block_size`",
        ),
        (
            fp8.clone(),
            scaled("[200,256]", 51200, "[1,2]", 2),
            "the config's 128 × 128",
        ),
        (fp8.clone(), format!("{{{}}}", w("F8_E5M2", "[4,8]", 0, 32)), "F8_E5M2"),
        (
            serde_json::json!({"quant_method": "bitsandbytes", "load_in_4bit": true}),
            format!("{{{}}}", w("F32", "[4,8]", 0, 128)),
            "`quant_method` is `bitsandbytes`",
        ),
    ];
    for (quantization, header, needle) in cases {
        let mut config = config.clone();
        config["quantization_config"] = quantization;
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let data_len = serde_json::from_str::<serde_json::Value>(&header)
            .unwrap()
            .as_object()
            .unwrap()
            .values()
            .map(|t| t["data_offsets"][1].as_u64().unwrap() as usize)
            .max()
            .unwrap();
        std::fs::write(dir.join("model.safetensors"), safetensors_bytes(&header, data_len)).unwrap();
        let err = open_error(dir);
        assert!(err.contains(needle), "{header}: {err}");
    }
}

/// Packed integer weights that cannot be read are refused naming the weight and what is wrong:
/// integers in a checkpoint whose config names no integer method, or beside no weight; a
/// weight without its scales or zero points, levels that are not 32-bit words (or, in
/// compressed-tensors' `int-quantized`, bytes), a group index
/// naming a group the scales lack, compressed-tensors' levels without their shape or of
/// another; and a GPTQ width bbc does not unpack.
#[test]
fn unreadable_integer_checkpoints_are_named() {
    let scratch = common::scratch_dir("bbc-malformed-int-");
    let dir = scratch.path();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(common::fixture("hf-tiny/llama/config.json")).unwrap()).unwrap();
    let gptq = serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": 32});
    let packed = serde_json::json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32}}}});
    use safetensors::Dtype::{F16, I32, I64};
    // A 16 × 64 weight in GPTQ's layout: 8 × 16 words of levels, two groups of 16 scales and
    // of zero points (two words a group), and each column's group.
    let qweight = ("w.qweight", I32, vec![8, 16], vec![0u8; 8 * 16 * 4]);
    let scales = ("w.scales", F16, vec![2, 16], vec![0u8; 2 * 16 * 2]);
    let qzeros = ("w.qzeros", I32, vec![2, 2], vec![0u8; 2 * 2 * 4]);
    // A 16 × 64 weight in compressed-tensors' layout: 16 rows of 8 words, two groups' scales.
    let ct_levels = ("w.weight_packed", I32, vec![16, 8], vec![0u8; 16 * 8 * 4]);
    let ct_scales = ("w.weight_scale", F16, vec![16, 2], vec![0u8; 64]);
    let g_idx = |group: i32| {
        let values: Vec<u8> = (0..64).flat_map(|c| (c / 32 * group).to_le_bytes()).collect();
        ("w.g_idx", I32, vec![64], values)
    };
    let cases: Vec<(serde_json::Value, Vec<Tensor>, &str)> = vec![
        (
            serde_json::Value::Null,
            vec![qweight.clone()],
            "names no such quantization",
        ),
        (
            gptq.clone(),
            vec![qweight.clone()],
            "packed weight `w.weight`: it has no float `w.scales`",
        ),
        (gptq.clone(), vec![qweight.clone(), scales.clone()], "no zero points"),
        (
            gptq.clone(),
            vec![
                ("w.qweight", I64, vec![8, 16], vec![0u8; 8 * 16 * 8]),
                scales.clone(),
                qzeros.clone(),
            ],
            "levels are not 32-bit words",
        ),
        (
            gptq.clone(),
            vec![qweight.clone(), scales.clone(), qzeros.clone(), g_idx(2)],
            "names group 2 of 2",
        ),
        (
            gptq.clone(),
            vec![
                qweight.clone(),
                scales.clone(),
                qzeros.clone(),
                g_idx(1),
                ("stray", I32, vec![2], vec![0u8; 8]),
            ],
            "tensor `stray` holds integers",
        ),
        (
            serde_json::json!({"quant_method": "gptq", "bits": 3}),
            vec![qweight.clone(), scales.clone(), qzeros.clone()],
            "3-bit GPTQ",
        ),
        (
            serde_json::json!({"quant_method": "compressed-tensors", "format": "int-quantized",
                "config_groups": {"group_0": {"weights": {"type": "int", "num_bits": 8}}}}),
            vec![
                ("w.weight", I32, vec![16, 64], vec![0u8; 16 * 64 * 4]),
                ("w.weight_scale", F16, vec![16, 1], vec![0u8; 32]),
            ],
            "its levels are not bytes",
        ),
        (
            packed.clone(),
            vec![ct_levels.clone(), ct_scales.clone()],
            "it has no `w.weight_shape`",
        ),
        (
            packed.clone(),
            vec![
                ct_levels.clone(),
                ct_scales.clone(),
                (
                    "w.weight_shape",
                    I64,
                    vec![2],
                    [16i64, 96].iter().flat_map(|d| d.to_le_bytes()).collect(),
                ),
            ],
            "not [16, 12] for a weight of [16, 96]",
        ),
        (
            packed.clone(),
            vec![
                ct_levels.clone(),
                ct_scales.clone(),
                (
                    "w.weight_shape",
                    I64,
                    vec![2],
                    [16i64, -64].iter().flat_map(|d| d.to_le_bytes()).collect(),
                ),
            ],
            "[16, -64] is not a weight's shape",
        ),
    ];
    for (quantization, tensors, needle) in cases {
        assert_quantized_refused(dir, &config, quantization, &tensors, needle);
    }
}

/// A tensor of a checkpoint written by a test: its name, type, shape and bytes.
type Tensor = (&'static str, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// The model of `config` with `quantization` as its `quantization_config` (none where null)
/// and `tensors` as its weights, written to `dir`, is refused with an error containing
/// `needle`.
fn assert_quantized_refused(
    dir: &std::path::Path,
    config: &serde_json::Value,
    quantization: serde_json::Value,
    tensors: &[Tensor],
    needle: &str,
) {
    let mut config = config.clone();
    if quantization.is_null() {
        config.as_object_mut().unwrap().remove("quantization_config");
    } else {
        config["quantization_config"] = quantization;
    }
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let views = tensors.iter().map(|(name, dtype, shape, data)| {
        (
            name.to_string(),
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
        )
    });
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let err = open_error(dir);
    assert!(err.contains(needle), "{needle}: {err}");
}

/// FP4 weights that cannot be read are refused naming the weight and what is wrong: NVFP4
/// codes without their FP8 scales or their global scale, codes that are not bytes, scales of
/// another shape, a global scale of zero, MXFP4 codes without their exponents; and a config of
/// groups other than 16.
#[test]
fn unreadable_fp4_checkpoints_are_named() {
    let scratch = common::scratch_dir("bbc-malformed-fp4-");
    let dir = scratch.path();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(common::fixture("hf-tiny/llama/config.json")).unwrap()).unwrap();
    let modelopt = serde_json::json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16});
    use safetensors::Dtype::{F32, F8_E4M3, I32, U8};
    // A 16 × 64 weight in ModelOpt's layout: 16 rows of 32 code bytes, four groups' scales.
    let codes: Tensor = ("w.weight", U8, vec![16, 32], vec![0u8; 16 * 32]);
    let scales: Tensor = ("w.weight_scale", F8_E4M3, vec![16, 4], vec![0x38u8; 64]);
    let global = |value: f32| -> Tensor { ("w.weight_scale_2", F32, vec![], value.to_le_bytes().to_vec()) };
    let cases: Vec<(serde_json::Value, Vec<Tensor>, &str)> = vec![
        (
            modelopt.clone(),
            vec![codes.clone(), global(1.0)],
            "FP4 weight `w.weight`: it has no FP8 `w.weight_scale`",
        ),
        (
            modelopt.clone(),
            vec![codes.clone(), scales.clone()],
            "it has no f32 `w.weight_scale_2`",
        ),
        (
            modelopt.clone(),
            vec![
                ("w.weight", I32, vec![16, 8], vec![0u8; 16 * 8 * 4]),
                scales.clone(),
                global(1.0),
            ],
            "is not bytes",
        ),
        (
            modelopt.clone(),
            vec![
                codes.clone(),
                ("w.weight_scale", F8_E4M3, vec![16, 2], vec![0x38u8; 32]),
                global(1.0),
            ],
            "not [16, 4]",
        ),
        (
            modelopt.clone(),
            vec![codes.clone(), scales.clone(), global(0.0)],
            "its global scale is 0",
        ),
        (
            serde_json::json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}),
            vec![codes.clone(), scales.clone(), global(1.0)],
            "groups of 32",
        ),
        (
            serde_json::json!({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                "config_groups": {"group_0": {"weights": {"type": "float", "num_bits": 4, "group_size": 32}}}}),
            vec![("w.weight_packed", U8, vec![16, 32], vec![0u8; 16 * 32])],
            "it has no E8M0 (U8) `w.weight_scale`",
        ),
    ];
    for (quantization, tensors, needle) in cases {
        assert_quantized_refused(dir, &config, quantization, &tensors, needle);
    }
}

/// A column order that names a column twice, or one past the row's end, is refused when the CPU
/// backend loads the graph, naming the node; one naming each column once loads.
#[test]
fn column_orders_that_are_no_permutation_are_refused_on_load() {
    use ir::{DType, Graph, InputKind, Op};
    use models::quant::{tensor::MemoryTensor, tensor::MemoryTensors, GgmlType};
    let mut graph = Graph::new("ordered");
    let _ids = graph.input(InputKind::TokenIds);
    let hidden = graph.hidden_states_input(4);
    let order = graph.weight("order", &[4], DType::I32);
    let taken = graph.add(Op::PermuteColumns, &[hidden, order]).unwrap();
    graph.set_output("taken", taken);
    let _positions = graph.input(InputKind::Positions);
    for (values, refused) in [([3, 2, 1, 0], false), ([0, 1, 1, 3], true), ([0, 1, 2, 4], true)] {
        let mut weights = MemoryTensors::new();
        let order = MemoryTensor {
            shape: vec![4],
            dtype: GgmlType::I32,
            bytes: values.iter().flat_map(|c: &i32| c.to_le_bytes()).collect(),
        };
        weights.insert("order".into(), order);
        match runtime::cpu::CpuBackend::new(graph.clone(), &weights, 16) {
            Ok(_) => assert!(!refused, "{values:?} loaded"),
            Err(e) => {
                let e = e.to_string();
                assert!(
                    refused && e.contains("permute_columns %3") && e.contains("column order"),
                    "{e}"
                );
            }
        }
    }
}
