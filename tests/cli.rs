//! The `bbc` binary end to end on the real SmolLM2: run (json, streaming, chat, dump-logits),
//! compile then run the artifact, tokenize; and on a tiny Gemma 4 GGUF against llama.cpp.

mod common;

use common::{ids, read_json, real_model};
use sha2::Digest;
use std::process::Command;

fn bbc(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_bbc")).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bbc {args:?} failed: {stderr}");
    String::from_utf8(out.stdout).unwrap()
}

fn json(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&bbc(args)).unwrap()
}

/// What `bbc` says on stderr when it refuses `args` (it must).
fn refused(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_bbc")).args(args).output().unwrap();
    assert!(!out.status.success(), "bbc {args:?} was accepted");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn smollm2() -> String {
    real_model("smollm2").to_str().unwrap().to_string()
}

#[test]
fn run_json_gives_the_reference_greedy_tokens() {
    let reference = read_json("real/smollm2.json");
    let case = &reference["raw"][0];
    let model = smollm2();
    let out = json(&[
        "run",
        &model,
        "--prompt",
        case["prompt"].as_str().unwrap(),
        "--max-tokens",
        "8",
        "--dtype",
        "f32",
        "--json",
    ]);
    assert_eq!(ids(&out["prompt_ids"]), ids(&case["prompt_ids"]));
    assert_eq!(ids(&out["ids"]), ids(&case["greedy_ids"])[..8]);
    assert_eq!(out["text"].as_str().unwrap(), " Paris.\n\nThe answer is:");
}

/// A half KV cache (`--kv-cache-dtype f16`) and an FP8 one (`fp8`, also named `fp8_e4m3`)
/// keep the reference's first greedy tokens; a kind bbc does not store is refused naming the
/// choices.
#[test]
fn half_and_fp8_kv_caches_keep_the_greedy_tokens() {
    let reference = read_json("real/smollm2.json");
    let case = &reference["raw"][0];
    let model = smollm2();
    let prompt = case["prompt"].as_str().unwrap();
    let run = |cache: &str| {
        let args = [
            "run",
            &model,
            "--prompt",
            prompt,
            "--max-tokens",
            "8",
            "--dtype",
            "f32",
            "--json",
        ];
        json(&[&args[..], &["--kv-cache-dtype", cache]].concat())
    };
    for cache in ["f16", "fp8", "fp8_e4m3"] {
        assert_eq!(ids(&run(cache)["ids"]), ids(&case["greedy_ids"])[..8], "{cache}");
    }
    let err = refused(&["run", &model, "--prompt", "x", "--kv-cache-dtype", "fp4"]);
    assert!(err.contains("choose one of auto, f32, bf16, f16, fp8"), "{err}");
}

/// SmolLM2 computed in IEEE half (`--dtype half`, vLLM's spelling, or `float16`; compiled with
/// `--dtype f16`) keeps the reference's first greedy tokens, its artifact the same; a dtype
/// bbc does not compute in is refused naming the choices.
#[test]
fn half_compute_keeps_the_greedy_tokens() {
    let reference = read_json("real/smollm2.json");
    let case = &reference["raw"][0];
    let model = smollm2();
    let run = |m: &str, dtype: &[&str]| {
        let args = [
            "run",
            m,
            "--prompt",
            case["prompt"].as_str().unwrap(),
            "--max-tokens",
            "8",
            "--json",
        ];
        ids(&json(&[&args[..], dtype].concat())["ids"])
    };
    let want = &ids(&case["greedy_ids"])[..8];
    for dtype in ["half", "float16", "f16"] {
        assert_eq!(run(&model, &["--dtype", dtype]), want, "{dtype}");
    }
    let scratch = common::scratch_dir("bbc-half-artifact-");
    let dir = scratch.path().join("artifact");
    let dir = dir.to_str().unwrap();
    bbc(&["compile", &model, "--target", "cpu", "--dtype", "f16", "-o", dir]);
    assert_eq!(
        codegen::read_manifest(std::path::Path::new(dir)).unwrap().dtype,
        models::ComputeDtype::F16
    );
    assert_eq!(run(dir, &[]), want);
    let err = refused(&["run", &model, "--prompt", "x", "--dtype", "fp8"]);
    assert!(err.contains("choose one of f32, bf16, f16, native"), "{err}");
}

/// `--load-format dummy` (vLLM's flag) runs an HF directory with random weights of its shape:
/// what its config.json runs, not what its weights give; its artifact records the seed. A
/// GGUF file, whose shape is no config.json, is refused by name, as is an artifact.
#[test]
fn dummy_load_format_runs_the_shape_with_random_weights() {
    let dir = common::fixture("hf-tiny/llama");
    let dir = dir.to_str().unwrap();
    let config = format!("{dir}/config.json");
    let run = |model: &str, extra: &[&str]| {
        let args = [
            "run",
            model,
            "--prompt-ids",
            "5,6,7",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--json",
        ];
        ids(&json(&[&args[..], extra].concat())["ids"])
    };
    let dummy = run(dir, &["--load-format", "dummy"]);
    assert_eq!(dummy, run(&config, &[]));
    assert_ne!(dummy, run(dir, &[]));
    let scratch = common::scratch_dir("bbc-dummy-artifact-");
    let out = scratch.path().join("artifact");
    let out = out.to_str().unwrap();
    bbc(&["compile", dir, "--target", "cpu", "--load-format", "dummy", "-o", out]);
    let manifest = codegen::read_manifest(std::path::Path::new(out)).unwrap();
    assert!(manifest.random_weights.is_some());
    assert_eq!(run(out, &[]), dummy);
    let err = refused(&["run", &smollm2(), "--prompt", "x", "--load-format", "dummy"]);
    assert!(
        err.contains("--load-format dummy needs the model's config.json"),
        "{err}"
    );
    let err = refused(&["run", out, "--prompt-ids", "1", "--load-format", "dummy"]);
    assert!(
        err.contains("--load-format dummy does not apply to a compiled artifact"),
        "{err}"
    );
}

/// What `bbc compile` fixed (the compute dtype, the caches' element type, the context) is
/// refused by name when `bbc run` is asked to change it on an artifact.
#[test]
fn an_artifact_refuses_what_compile_fixed() {
    let scratch = common::scratch_dir("bbc-fixed-artifact-");
    let dir = scratch.path().join("artifact");
    bbc(&["compile", &smollm2(), "--target", "cpu", "-o", dir.to_str().unwrap()]);
    for (flag, value) in [
        ("--dtype", "f32"),
        ("--kv-cache-dtype", "f16"),
        ("--max-model-len", "64"),
    ] {
        let err = refused(&["run", dir.to_str().unwrap(), "--prompt", "x", flag, value]);
        assert!(
            err.contains(&format!("{flag} does not apply to a compiled artifact")),
            "{flag}: {err}"
        );
    }
}

/// `--max-model-len` caps the context below the model's own: a run that would pass it is
/// refused naming the limit, and one past the model's own context names both.
#[test]
fn max_model_len_caps_the_context() {
    let model = smollm2();
    let prompt = (0..20).map(|i| (100 + 7 * i).to_string()).collect::<Vec<_>>().join(",");
    let run = |limit: &str, tokens: &str| {
        Command::new(env!("CARGO_BIN_EXE_bbc"))
            .args([
                "run",
                &model,
                "--prompt-ids",
                &prompt,
                "--max-tokens",
                tokens,
                "--max-model-len",
                limit,
                "--ignore-eos",
                "--json",
            ])
            .output()
            .unwrap()
    };
    let fits = run("24", "4");
    assert!(fits.status.success(), "{}", String::from_utf8_lossy(&fits.stderr));
    let over = run("24", "5");
    assert!(!over.status.success());
    let err = String::from_utf8_lossy(&over.stderr);
    assert!(err.contains("needs 25 tokens but the context length is 24"), "{err}");
    let past = run("99999", "1");
    let err = String::from_utf8_lossy(&past.stderr);
    assert!(
        err.contains("--max-model-len 99999") && err.contains("exceeds the model's 8192"),
        "{err}"
    );
    let zero = run("0", "1");
    assert!(String::from_utf8_lossy(&zero.stderr).contains("--max-model-len must be at least 1"));
}

/// `--chat-template` renders `--chat` prompts with the template given (inline or from a
/// file) instead of the model's; one that does not parse or render is refused before
/// generating, and the flag without `--chat` is refused.
#[test]
fn a_chat_template_replaces_the_models() {
    let model = smollm2();
    let template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>";
    let scratch = common::scratch_dir("bbc-template-");
    let file = scratch.path().join("chat.jinja");
    std::fs::write(&file, template).unwrap();
    let want: Vec<u32> = serde_json::from_str(&bbc(&["tokenize", &model, "--text", "<user>hi<assistant>"])).unwrap();
    for given in [template, file.to_str().unwrap()] {
        let out = json(&[
            "run",
            &model,
            "--chat",
            "--prompt",
            "hi",
            "--chat-template",
            given,
            "--max-tokens",
            "1",
            "--json",
        ]);
        assert_eq!(ids(&out["prompt_ids"]), want, "{given}");
    }
    let chat = |template: &str| refused(&["run", &model, "--chat", "--prompt", "hi", "--chat-template", template]);
    assert!(chat("{% for m in messages %").contains("does not parse"));
    assert!(chat("{{ raise_exception('no system turns') }}").contains("no system turns"));
    assert!(chat("/no/such/template.jinja").contains("no such file"));
    let err = refused(&["run", &model, "--prompt", "hi", "--chat-template", template]);
    assert!(err.contains("--chat-template applies to --chat prompts"), "{err}");
}

#[test]
fn streaming_prints_the_same_text_as_json() {
    let model = smollm2();
    let args = ["run", &model, "--prompt", "Once upon a time", "--max-tokens", "12"];
    let streamed = bbc(&args);
    let mut with_json = args.to_vec();
    with_json.push("--json");
    let out = json(&with_json);
    assert_eq!(streamed.trim_end_matches('\n'), out["text"].as_str().unwrap());
}

#[test]
fn chat_renders_the_template() {
    let reference = read_json("real/smollm2.json");
    let case = &reference["chat"][0];
    let model = smollm2();
    let out = json(&[
        "run",
        &model,
        "--chat",
        "--prompt",
        "What is 2+2?",
        "--max-tokens",
        "2",
        "--json",
    ]);
    assert_eq!(ids(&out["prompt_ids"]), ids(&case["prompt_ids"]));
    let with_system = json(&[
        "run",
        &model,
        "--chat",
        "--system",
        "Be brief.",
        "--prompt",
        "Hi",
        "--max-tokens",
        "1",
        "--json",
    ]);
    // A system message replaces the template's default one.
    let expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    let expected_ids: Vec<u32> = serde_json::from_str(&bbc(&["tokenize", &model, "--text", expected])).unwrap();
    assert_eq!(ids(&with_system["prompt_ids"]), expected_ids);
}

#[test]
fn dump_logits_writes_one_row_per_generated_token() {
    let model = smollm2();
    let scratch = common::scratch_dir("bbc-logits-");
    let path = scratch.path().join("logits.safetensors");
    let out = json(&[
        "run",
        &model,
        "--prompt-ids",
        "504,3575,282,4649,314",
        "--max-tokens",
        "4",
        "--ignore-eos",
        "--json",
        "--dump-logits",
        path.to_str().unwrap(),
    ]);
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let logits = st.tensor("logits").unwrap();
    assert_eq!(logits.shape(), &[4, 49152]);
    let rows: Vec<f32> = logits
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let chosen: Vec<u32> = rows.chunks_exact(49152).map(runtime::sampling::argmax).collect();
    assert_eq!(chosen, ids(&out["ids"]));
}

#[test]
fn a_compiled_artifact_runs_like_the_model() {
    let model = smollm2();
    let scratch = common::scratch_dir("bbc-artifact-");
    let dir = scratch.path().join("artifact");
    let ir = bbc(&[
        "compile",
        &model,
        "--target",
        "cpu",
        "-o",
        dir.to_str().unwrap(),
        "--emit",
        "fused-ir",
    ]);
    assert!(ir.starts_with("graph llama\n"));
    assert!(
        std::fs::read_to_string(dir.join("graph.ir")).unwrap() == ir,
        "graph.ir is the fused graph"
    );
    assert!(ir.contains("add_rms_norm") && ir.contains("swiglu") && ir.contains("concat_rows"));
    // The manifest names the weights by the file's sha256 (hashed while the kernels compile).
    let manifest = codegen::read_manifest(&dir).unwrap();
    let digest = sha2::Sha256::digest(std::fs::read(&model).unwrap());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(manifest.weights_sha256, hex);
    // A CPU artifact has no GPU plans, so no prefill GEMM or attention, nor decode attention.
    assert_eq!(manifest.prefill_gemm, None);
    assert_eq!(manifest.prefill_attention, None);
    assert_eq!(manifest.decode_attention, None);
    let args = |m: &str| {
        json(&[
            "run",
            m,
            "--prompt",
            "The three primary colors are",
            "--max-tokens",
            "6",
            "--json",
        ])["ids"]
            .clone()
    };
    assert_eq!(args(dir.to_str().unwrap()), args(&model));
    // A tampered graph is refused.
    let graph = dir.join("graph.json");
    let text = std::fs::read_to_string(&graph).unwrap().replacen("1e-5", "2e-5", 1);
    std::fs::write(&graph, text.replacen("\"eps\":", "\"eps\" :", 1)).unwrap();
    assert!(refused(&["run", dir.to_str().unwrap(), "--prompt", "x"]).contains("hash mismatch"));
}

#[test]
fn tokenize_prints_ids() {
    let out = bbc(&["tokenize", &smollm2(), "--text", "Hello, world!"]);
    assert_eq!(out.trim(), "[19556,28,905,17]");
}

/// A Gemma 4 GGUF with its tokenizer (the tiny model with the made-up vocabulary of
/// `gguf-tiny/tiny_gemma4_vocab.py`): `bbc run` on a text prompt gives llama.cpp's prompt ids
/// and greedy ids.
#[test]
fn gemma4_gguf_runs_from_text_like_llama_cpp() {
    let reference = &read_json("gguf-tiny/gemma4-tokenize-llamacpp.json")["generate"];
    let model = common::fixture("gguf-tiny/gemma4_kv_shared.gguf");
    let out = json(&[
        "run",
        model.to_str().unwrap(),
        "--prompt",
        reference["prompt"].as_str().unwrap(),
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--json",
    ]);
    assert_eq!(ids(&out["prompt_ids"]), ids(&reference["prompt_ids"]));
    assert_eq!(ids(&out["ids"]), ids(&reference["greedy_ids"]));
}

/// With a full-precision head, the artifact carries the INT8 head quantized at compile time,
/// and running the artifact gives the model's own greedy tokens.
#[test]
fn an_f32_artifact_carries_its_int8_head() {
    let scratch = common::scratch_dir("bbc-artifact-f32-");
    let dir = scratch.path();
    let toml = dir.join("model.toml");
    std::fs::write(&toml, format!("[model]\nweights = {:?}\ndtype = \"f32\"\n", smollm2())).unwrap();
    let out = dir.join("artifact");
    bbc(&["compile", toml.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(out.join("weights/token_embd.weight.int8.safetensors").is_file());
    assert!(std::fs::read_to_string(out.join("greedy.ir"))
        .unwrap()
        .contains("int8_bound_top_k"));
    let run = |m: &str| {
        json(&[
            "run",
            m,
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "8",
            "--json",
        ])["ids"]
            .clone()
    };
    assert_eq!(run(out.to_str().unwrap()), run(toml.to_str().unwrap()));
}

/// `bbc serve` refuses zero-sized serving settings before loading anything, naming the flag.
#[test]
fn serve_refuses_zero_sized_settings_by_name() {
    let model = smollm2();
    for flag in [
        "--kv-blocks",
        "--token-budget",
        "--state-snapshot-interval",
        "--max-model-len",
    ] {
        let stderr = refused(&["serve", &model, "--port", "0", flag, "0"]);
        assert!(
            stderr.contains(&format!("{flag} must be at least 1")),
            "{flag}: {stderr}"
        );
    }
    // vLLM's name for the token budget is the same setting.
    let stderr = refused(&["serve", &model, "--port", "0", "--max-num-batched-tokens", "0"]);
    assert!(stderr.contains("--token-budget must be at least 1"), "{stderr}");
}

/// `bbc serve --speculative-model`: flags that do not go together are refused before loading
/// anything, and a draft model whose tokenizer is not the target's is refused naming a token
/// they disagree on (Gemma 3's vocabulary for SmolLM2).
#[test]
fn serve_refuses_a_draft_model_it_cannot_use() {
    let model = smollm2();
    let serve = |extra: &[&str]| {
        let mut args = vec!["serve", model.as_str(), "--port", "0"];
        args.extend(extra);
        refused(&args)
    };
    let stderr = serve(&["--speculative-model", &model, "--speculative-ngram", "4"]);
    assert!(stderr.contains("choose one"), "{stderr}");
    let stderr = serve(&["--speculative-model", &model, "--num-speculative-tokens", "0"]);
    assert!(
        stderr.contains("--num-speculative-tokens must be at least 1"),
        "{stderr}"
    );
    let stderr = serve(&["--num-speculative-tokens", "3"]);
    assert!(stderr.contains("there is none"), "{stderr}");
    let gemma = real_model("gemma3-270m");
    let stderr = serve(&["--speculative-model", gemma.to_str().unwrap()]);
    assert!(stderr.contains("must share the target's tokenizer"), "{stderr}");
    // The same draft model named by a model.toml's `[speculative]` section.
    let dir = tempfile::tempdir().unwrap();
    let toml = dir.path().join("model.toml");
    std::fs::write(
        &toml,
        format!(
            "[model]\nweights = {model:?}\n[speculative]\nmethod = \"draft_model\"\nmodel = {:?}\nnum_speculative_tokens = 3\n",
            gemma.to_str().unwrap()
        ),
    )
    .unwrap();
    let stderr = refused(&["serve", toml.to_str().unwrap(), "--port", "0"]);
    assert!(stderr.contains("must share the target's tokenizer"), "{stderr}");
}

/// `bbc run` with a structured output: a JSON schema's answer parses and fits it, a choice
/// gives one of the choices, and an ungrammatical regex or two specs at once are refused.
#[test]
fn run_holds_the_output_to_a_structured_spec() {
    let model = smollm2();
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("schema.json");
    let colours = serde_json::json!({"type": "object", "required": ["colours"], "additionalProperties": false,
        "properties": {"colours": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3}}});
    std::fs::write(&schema, colours.to_string()).unwrap();
    let schema = schema.to_str().unwrap();
    let out = json(&[
        "run",
        &model,
        "--chat",
        "--prompt",
        "Name three colours.",
        "--json-schema",
        schema,
        "--max-tokens",
        "60",
        "--json",
    ]);
    let answer: serde_json::Value = serde_json::from_str(out["text"].as_str().unwrap()).expect("JSON");
    assert_eq!(answer["colours"].as_array().map(Vec::len), Some(3), "{answer}");
    // Sampled too: every seed picks one of the choices.
    for seed in ["1", "2", "3"] {
        let args = [
            "run",
            &model,
            "--prompt",
            "My favourite city is",
            "--temperature",
            "1",
            "--seed",
            seed,
        ];
        let out = json(
            &[
                &args[..],
                &["--choice", " Paris", "--choice", " Lyon, \"the\" other", "--json"],
            ]
            .concat(),
        );
        assert!(
            [" Paris", " Lyon, \"the\" other"].contains(&out["text"].as_str().unwrap()),
            "{out}"
        );
    }
    for bad in [&["--regex", "(("][..], &["--regex", "a", "--choice", "b"]] {
        refused(&[&["run", &model, "--prompt", "x"][..], bad].concat());
    }
}

/// `--top-k 1` leaves sampling the most likely token alone, so a sampled run at any seed
/// gives the greedy tokens; `--top-p` and `--min-p` take effect (a tiny `top_p` is greedy
/// too) and are checked.
#[test]
fn run_takes_top_k_top_p_and_min_p() {
    let model = smollm2();
    let base = [
        "run",
        &model,
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
        "--json",
    ];
    let greedy = json(&base)["ids"].clone();
    for (flag, value) in [("--top-k", "1"), ("--top-p", "0.000001")] {
        for seed in ["1", "2"] {
            let sampled = json(&[&base[..], &["--temperature", "1.5", "--seed", seed, flag, value]].concat());
            assert_eq!(sampled["ids"], greedy, "{flag} {value}");
        }
    }
    let wide = json(&[&base[..], &["--temperature", "1.5", "--seed", "3", "--min-p", "0.01"]].concat());
    assert_eq!(wide["ids"].as_array().map(Vec::len), Some(8));
    for bad in [&["--top-p", "0"][..], &["--top-p", "1.5"], &["--min-p", "2"]] {
        let message = refused(&[&base[..], bad].concat());
        assert!(message.contains(bad[0]), "{message}");
    }
}

/// `bbc perplexity`: windows of `--context` tokens, each scored on its second half (llama.cpp's
/// method): a text that repeats one sentence is all but certain to the model, the same words
/// in a scrambled order are not; bad settings and texts are refused by name.
#[test]
fn perplexity_tells_a_repeated_text_from_a_scrambled_one() {
    let model = smollm2();
    let dir = tempfile::tempdir().unwrap();
    let sentence = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. ";
    let repeated = dir.path().join("repeated.txt");
    std::fs::write(&repeated, sentence.repeat(40)).unwrap();
    let words: Vec<&str> = sentence.split_whitespace().collect();
    let scrambled_text: Vec<&str> = (0..40 * words.len())
        .map(|i| words[(i * 7 + i / 3) % words.len()])
        .collect();
    let scrambled = dir.path().join("scrambled.txt");
    std::fs::write(&scrambled, scrambled_text.join(" ")).unwrap();
    let measure = |file: &std::path::Path| {
        let path = file.to_str().unwrap();
        json(&[
            "perplexity",
            &model,
            "--file",
            path,
            "--context",
            "64",
            "--windows",
            "3",
            "--json",
        ])
    };
    let (low, high) = (measure(&repeated), measure(&scrambled));
    for m in [&low, &high] {
        assert_eq!(m["scored_tokens"], 3 * (64 - 32 - 1), "{m}");
        assert_eq!(m["windows"], 3, "{m}");
    }
    let ppl = |m: &serde_json::Value| m["perplexity"].as_f64().unwrap();
    assert!(ppl(&low) >= 1.0 && ppl(&low) < 2.0, "{low}");
    assert!(ppl(&high) > 10.0, "{high}");
    let path = repeated.to_str().unwrap();
    for (bad, named) in [
        (vec!["--context", "2"], "--context"),
        // SmolLM2's context is 8192, and a window's generated token needs one more.
        (vec!["--context", "8192"], "--context 8192 must be below"),
        (vec!["--windows", "0"], "--windows"),
    ] {
        let message = refused(&[&["perplexity", &model, "--file", path][..], &bad].concat());
        assert!(message.contains(named), "{message}");
    }
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "Too short.").unwrap();
    let message = refused(&["perplexity", &model, "--file", short.to_str().unwrap()]);
    assert!(message.contains("shorter than one window"), "{message}");
    assert!(refused(&["perplexity", &model, "--file", "/nonexistent.txt"]).contains("/nonexistent.txt"));
    // `--quantization` as `bbc run` takes it: the GGUF file's blocks are not FP8's.
    let message = refused(&["perplexity", &model, "--file", path, "-q", "fp8"]);
    assert!(message.contains("quantized as `gguf`"), "{message}");
}

/// Special tokens the answer takes past `--ignore-eos` (SmolLM2 ends its turn with
/// `<|im_end|>`, then starts another with `<|im_start|>`) write no text unless `--special`,
/// in the streamed text and in `--json`'s alike.
#[test]
fn special_tokens_write_text_only_with_special() {
    let model = smollm2();
    let args = [
        "run",
        &model,
        "--chat",
        "--prompt",
        "Say hi.",
        "--max-tokens",
        "30",
        "--ignore-eos",
    ];
    let out = json(&[&args[..], &["--json"]].concat());
    let im_end = 2;
    assert!(
        ids(&out["ids"]).contains(&im_end),
        "the answer goes past its end of turn: {out}"
    );
    let text = out["text"].as_str().unwrap();
    assert!(!text.contains("<|im_end|>") && !text.contains("<|im_start|>"), "{text}");
    assert_eq!(bbc(&args).trim_end(), text.trim_end());
    let special = json(&[&args[..], &["--json", "--special"]].concat());
    let text = special["text"].as_str().unwrap();
    assert!(text.contains("<|im_end|>\n<|im_start|>"), "{text}");
    assert_eq!(bbc(&[&args[..], &["--special"]].concat()).trim_end(), text.trim_end());
}

/// Where NVRTC is nowhere bbc looks (not on the loader path, in `BBC_NVRTC_DIR`, bbc's home
/// or a CUDA toolkit), `bbc compile` for a GPU target installs the PyPI wheel into its home
/// first, as it fetches models, then compiles. Here pip is a stand-in (`BBC_PYTHON`) that puts
/// this machine's NVRTC where `pip install --target` would put the wheel's; where pip fails,
/// the error says what to do.
#[test]
fn compile_for_a_gpu_installs_nvrtc_where_none_is_found() {
    let Some(real) = codegen::nvrtc::candidate_dirs()
        .into_iter()
        .find(|d| d.join("libnvrtc.so.13").is_file())
    else {
        assert!(
            std::env::var_os("BBC_REQUIRE_NVRTC").is_none(),
            "BBC_REQUIRE_NVRTC is set but NVRTC is missing"
        );
        eprintln!("skipped: no NVRTC here to stand in for the wheel");
        return;
    };
    let scratch = common::scratch_dir("bbc-nvrtc-install-");
    let compile = |home: &std::path::Path, pip: &str| {
        std::fs::create_dir_all(home).unwrap();
        let python = home.join("python");
        std::fs::write(
            &python,
            format!("#!/bin/sh\necho \"$@\" > '{}/pip-args'\n{pip}\n", home.display()),
        )
        .unwrap();
        std::fs::set_permissions(&python, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        Command::new(env!("CARGO_BIN_EXE_bbc"))
            .args(["compile", "tests/fixtures/hf-tiny/llama", "--target", "h200", "-o"])
            .arg(home.join("artifact"))
            .env("BBC_HOME", home)
            .env("BBC_PYTHON", &python)
            .env("CUDA_HOME", home.join("no-toolkit"))
            .env_remove("CUDA_PATH")
            .env_remove("BBC_NVRTC_DIR")
            .env_remove("LD_LIBRARY_PATH")
            .output()
            .unwrap()
    };
    // `pip install … --target DIR WHEEL`: the stand-in copies NVRTC's libraries into the
    // wheel's layout under DIR.
    let installs = format!(
        "while [ \"$1\" != --target ]; do shift; done; mkdir -p \"$2/nvidia/cu13/lib\" && cp '{}'/libnvrtc* \"$2/nvidia/cu13/lib/\"",
        real.display()
    );
    let home = scratch.path().join("home");
    let out = compile(&home, &installs);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !stderr.contains("installing") && std::path::Path::new("/usr/local/cuda").exists() {
        eprintln!("skipped: this machine's CUDA toolkit is found first");
        return;
    }
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("installing {}", codegen::nvrtc::WHEEL)),
        "{stderr}"
    );
    let args = std::fs::read_to_string(home.join("pip-args")).unwrap();
    assert!(
        args.starts_with("-m pip install --no-deps") && args.trim_end().ends_with(codegen::nvrtc::WHEEL),
        "{args}"
    );
    assert!(home.join("cuda/nvidia/cu13/lib/libnvrtc.so.13").is_file());
    assert!(home.join("artifact/plan.json").is_file() && home.join("artifact/kernels").is_dir());

    let home = scratch.path().join("offline");
    let out = compile(&home, "exit 1");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("pip could not install") && stderr.contains("BBC_NVRTC_DIR"),
        "{stderr}"
    );
    assert!(!home.join("cuda").exists(), "nothing half-installed is left");
}

/// What `bbc serve` says as it starts, up to the line with its address (then stopped).
fn serve_start(extra: &[&str]) -> String {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_bbc"))
        .args(["serve", &smollm2(), "--port", "0"])
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut said = String::new();
    for line in std::io::BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        said += &line;
        said.push('\n');
        if line.contains("http://") {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    said
}

/// The KV cache a CPU server keeps unless told: every running sequence's full context, at most
/// half the memory available, said at start as positions and as requests of the context; the
/// steps' token budget the CPU's 128. `--kv-blocks` and `--token-budget` override them.
#[test]
fn serve_sizes_its_kv_cache_and_steps_unless_told() {
    let said = serve_start(&["--max-num-seqs", "4"]);
    let line = said
        .lines()
        .find(|l| l.starts_with("KV cache:"))
        .unwrap_or_else(|| panic!("{said}"));
    // SmolLM2's context of 8192 positions is 512 blocks of 16: four sequences', or what half
    // the available memory holds, but at least one context's.
    let blocks: usize = line["KV cache: ".len()..].split(' ').next().unwrap().parse().unwrap();
    assert!((512..=4 * 512).contains(&blocks), "{line}");
    assert!(line.contains("requests of the full context (8192 positions)"), "{line}");
    assert!(said.contains("steps of up to 128 tokens"), "{said}");
    let said = serve_start(&["--kv-blocks", "64", "--token-budget", "32"]);
    assert!(
        said.contains("KV cache: 64 blocks of 16 positions: 1024 positions, 0.1 requests of the full context"),
        "{said}"
    );
    assert!(said.contains("steps of up to 32 tokens"), "{said}");
}

/// A model's shape without weights (a `config.json`) runs with random weights made from a
/// fixed seed (vLLM's `--load-format dummy`), with the tokenizer `--tokenizer` names: run
/// directly or compiled into an artifact (which records the seed), it gives the same tokens.
/// A tokenizer with more tokens than the model's vocabulary is refused, and an unknown name
/// lists the named shapes.
#[test]
fn a_config_without_weights_runs_with_random_weights() {
    let scratch = common::scratch_dir("bbc-random-weights-");
    let path = common::fixture("hf-tiny/qwen3_5/config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["vocab_size"] = 49152.into();
    let config_path = scratch.path().join("config.json");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let config_arg = config_path.to_str().unwrap();
    let run = |model: &str, tokenizer: &[&str]| {
        let args = [
            &[
                "run",
                model,
                "--prompt",
                "The capital of France is",
                "--max-tokens",
                "6",
                "--json",
            ],
            tokenizer,
        ]
        .concat();
        json(&args)["ids"].clone()
    };
    let direct = run(config_arg, &["--tokenizer", &smollm2()]);
    assert_eq!(direct.as_array().unwrap().len(), 6);
    assert_eq!(
        run(config_arg, &["--tokenizer", &smollm2()]),
        direct,
        "the same seed, the same weights"
    );
    let artifact = scratch.path().join("artifact");
    bbc(&[
        "compile",
        config_arg,
        "--tokenizer",
        &smollm2(),
        "-o",
        artifact.to_str().unwrap(),
    ]);
    let manifest = read_json_file(&artifact.join("manifest.json"));
    assert_eq!(manifest["random_weights"], 7, "{manifest}");
    assert_eq!(run(artifact.to_str().unwrap(), &[]), direct);

    let tiny = common::fixture("hf-tiny/qwen3_5/config.json");
    let wider = refused(&[
        "run",
        tiny.to_str().unwrap(),
        "--tokenizer",
        &smollm2(),
        "--prompt",
        "hi",
    ]);
    assert!(wider.contains("more than the model's vocabulary of 320"), "{wider}");
    let unknown = refused(&["run", "llama3-70b", "--prompt", "hi"]);
    assert!(
        unknown.contains("llama3-8b") && unknown.contains("glm-4.5-air"),
        "{unknown}"
    );
}

fn read_json_file(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `bbc run MODEL` (with `extra` arguments) over `reference`'s prompt ids for as many tokens
/// as its greedy ids, greedy and past end of sequence: the ids it generates.
fn greedy_over_reference_prompt(model: &str, reference: &common::hf_reference::Reference, extra: &[&str]) -> Vec<u32> {
    let prompt: Vec<String> = reference.input_ids.iter().map(u32::to_string).collect();
    let (prompt, steps) = (prompt.join(","), reference.greedy_ids.len().to_string());
    let args = [
        "run",
        model,
        "--prompt-ids",
        &prompt,
        "--max-tokens",
        &steps,
        "--ignore-eos",
        "--json",
    ];
    ids(&json(&[&args[..], extra].concat())["ids"])
}

/// An FP8 checkpoint runs from the command line as transformers runs it (its greedy ids over
/// the reference's prompt); vLLM's `--quantization` checks what quantized files hold: it passes
/// where it names their method, and is refused naming what they hold otherwise. Over a
/// checkpoint of floats `fp8` quantizes it as it loads (transformers' greedy ids over the same
/// weights quantized by torch), as model.toml's `quantization` asks too, kept by an artifact
/// compiled so; other methods are refused.
#[test]
fn fp8_checkpoints_run_and_quantization_names_what_the_files_hold() {
    let dir = common::fixture("hf-tiny/llama_fp8");
    let dir = dir.to_str().unwrap();
    let reference = common::hf_reference::Reference::of("llama_fp8");
    let run = |model: &str, extra: &[&str]| greedy_over_reference_prompt(model, &reference, extra);
    let want: Vec<u32> = reference.greedy_ids.clone();
    assert_eq!(run(dir, &[]), want);
    assert_eq!(run(dir, &["--quantization", "fp8"]), want);
    assert_eq!(run(dir, &["-q", "FP8"]), want);
    let err = refused(&["run", dir, "--prompt-ids", "1", "--quantization", "gguf"]);
    assert!(err.contains("quantized as `fp8`"), "{err}");
    let gguf = smollm2();
    let err = refused(&["run", &gguf, "--prompt-ids", "1", "--quantization", "awq"]);
    assert!(err.contains("quantized as `gguf`"), "{err}");

    let plain = common::fixture("hf-tiny/llama");
    let plain = plain.to_str().unwrap();
    let on_load = common::hf_reference::Reference::of("llama_fp8_on_load");
    assert_eq!(on_load.input_ids, reference.input_ids);
    assert_eq!(run(plain, &["--quantization", "fp8"]), on_load.greedy_ids);
    assert_eq!(run(plain, &["-q", "fp8", "--dtype", "bfloat16"]), on_load.greedy_ids);
    let err = refused(&["run", plain, "--prompt-ids", "1", "--quantization", "awq"]);
    assert!(err.contains("not quantized") && err.contains("`fp8` only"), "{err}");

    let scratch = common::scratch_dir("bbc-fp8-on-load-");
    // model.toml's `quantization` asks the same, `--quantization` over it.
    let toml = scratch.path().join("model.toml");
    std::fs::write(&toml, format!("[model]\nweights = {plain:?}\nquantization = \"fp8\"\n")).unwrap();
    let toml = toml.to_str().unwrap();
    assert_eq!(run(toml, &[]), on_load.greedy_ids);
    let err = refused(&["run", toml, "--prompt-ids", "1", "-q", "awq"]);
    assert!(err.contains("quantization `awq`"), "{err}");
    let artifact = scratch.path().join("fp8");
    let out = artifact.to_str().unwrap();
    bbc(&["compile", plain, "--target", "cpu", "-q", "fp8", "-o", out]);
    let manifest = codegen::read_manifest(&artifact).unwrap();
    assert_eq!(manifest.quantization.as_deref(), Some("fp8"));
    assert!(std::fs::read_to_string(artifact.join("graph.ir"))
        .unwrap()
        .contains("f8_e4m3_b32"));
    assert_eq!(run(out, &[]), on_load.greedy_ids);
    assert_eq!(run(out, &["-q", "fp8"]), on_load.greedy_ids);
    let err = refused(&["run", out, "--prompt-ids", "1", "-q", "gguf"]);
    assert!(err.contains("quantized as `fp8`"), "{err}");
    let floats = scratch.path().join("floats");
    bbc(&["compile", plain, "--target", "cpu", "-o", floats.to_str().unwrap()]);
    let err = refused(&["run", floats.to_str().unwrap(), "--prompt-ids", "1", "-q", "fp8"]);
    assert!(err.contains("not quantized"), "{err}");
}

/// Random weights in the 4-bit blocks of a GPTQ, AWQ or compressed-tensors checkpoint
/// (`--load-format dummy -q awq`, as vLLM takes it): every projection is the random bf16
/// matrix rounded to nearest into 4-bit blocks, of 128 where its rows are whole blocks of 128
/// (a width-128 Llama's attention and gate/up projections) and of 32 where not (its 160-wide
/// down projection), everything else as unquantized; an artifact compiled so records the
/// method, its graph reads both sizes, and it runs as the model loaded so. Over a checkpoint
/// of floats the method is refused.
#[test]
fn dummy_weights_take_the_integer_methods_as_4_bit_blocks() {
    let scratch = common::scratch_dir("bbc-u4-dummy-");
    let config = scratch.path().join("config.json");
    let mut wide: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(common::fixture("hf-tiny/llama/config.json")).unwrap()).unwrap();
    wide["hidden_size"] = 128.into();
    wide["head_dim"] = 32.into();
    std::fs::write(&config, wide.to_string()).unwrap();
    let config = config.to_str().unwrap();
    let load = |quantization: Option<&str>| load_quantized(config, quantization);
    let plain = load(None);
    for method in ["awq", "gptq_marlin", "compressed-tensors"] {
        let quantized = load(Some(method));
        let (mut of_32, mut of_128) = (0, 0);
        for name in plain.model.weights.names() {
            let (was, is) = (
                plain.model.weights.require(name).unwrap(),
                quantized.model.weights.require(name).unwrap(),
            );
            if let Some(size) = quant::u4_blocks::Size::of(is.dtype) {
                let cols = was.shape[1];
                assert_eq!(Some(size), quant::u4_blocks::Size::widest(cols, None), "{name}");
                assert_eq!(is.bytes, quant::u4_blocks::quantize_matrix(&was, size), "{name}");
                match size {
                    quant::u4_blocks::Size::Of32 => of_32 += 1,
                    quant::u4_blocks::Size::Of128 => of_128 += 1,
                }
            } else {
                assert!(is.dtype == was.dtype && is.bytes == was.bytes, "{name}");
            }
        }
        assert_eq!((of_32, of_128), (3, 18), "{method}: 7 projections a layer");
    }
    quantized_artifact_runs_as_loaded(scratch.path(), config, "awq", &["u4_b32", "u4_b128"]);
    let plain_dir = common::fixture("hf-tiny/llama");
    let err = refused(&["run", plain_dir.to_str().unwrap(), "--prompt-ids", "1", "-q", "awq"]);
    assert!(
        err.contains("not quantized") && err.contains("random weights also"),
        "{err}"
    );
}

/// Random weights in the FP4 blocks of an NVFP4 checkpoint (`--load-format dummy -q
/// modelopt_fp4`, as vLLM takes it): every projection is the random bf16 matrix quantized into
/// FP4 blocks, everything else as unquantized; a CPU artifact compiled so records the method,
/// reads FP4 blocks and runs as the model loaded so.
#[test]
fn dummy_weights_take_modelopt_fp4_as_fp4_blocks() {
    let scratch = common::scratch_dir("bbc-fp4-dummy-");
    let config = scratch.path().join("config.json");
    std::fs::copy(common::fixture("hf-tiny/llama/config.json"), &config).unwrap();
    let config = config.to_str().unwrap();
    let load = |quantization: Option<&str>| load_quantized(config, quantization);
    let (plain, quantized) = (load(None), load(Some("modelopt_fp4")));
    let mut blocks = 0;
    for name in plain.model.weights.names() {
        let (was, is) = (
            plain.model.weights.require(name).unwrap(),
            quantized.model.weights.require(name).unwrap(),
        );
        if is.dtype == quant::GgmlType::F4E2M1B32 {
            assert_eq!(is.bytes, quant::fp4_blocks::quantize_matrix(&was), "{name}");
            blocks += 1;
        } else {
            assert!(is.dtype == was.dtype && is.bytes == was.bytes, "{name}");
        }
    }
    assert_eq!(blocks, 21, "7 projections a layer");
    quantized_artifact_runs_as_loaded(scratch.path(), config, "modelopt_fp4", &["f4_e2m1_b32"]);
}

/// The model `config` names (random weights), quantized as `quantization` asks, unfused.
fn load_quantized(config: &str, quantization: Option<&str>) -> bbc::model_ref::Loaded {
    let options = bbc::model_ref::LoadOptions {
        quantization: quantization.map(str::to_string),
        quiet: true,
        fuse: false,
        ..Default::default()
    };
    bbc::model_ref::load(config, options).unwrap()
}

/// `config` compiled for the CPU with `-q method` into `dir/artifact`: its manifest records
/// the method, its graph reads weights of each of `dtypes`, and it generates what `config`
/// run with `-q method` generates.
fn quantized_artifact_runs_as_loaded(dir: &std::path::Path, config: &str, method: &str, dtypes: &[&str]) {
    let artifact = dir.join("artifact");
    let out = artifact.to_str().unwrap();
    bbc(&["compile", config, "--target", "cpu", "-q", method, "-o", out]);
    assert_eq!(
        codegen::read_manifest(&artifact).unwrap().quantization.as_deref(),
        Some(method)
    );
    let graph = std::fs::read_to_string(artifact.join("graph.ir")).unwrap();
    for dtype in dtypes {
        assert!(graph.contains(dtype), "{method}: no {dtype} in the graph");
    }
    let run = |model: &str, extra: &[&str]| {
        let args = ["run", model, "--prompt-ids", "1,5,9", "--max-tokens", "4", "--json"];
        json(&[&args[..], extra].concat())["ids"].clone()
    };
    assert_eq!(run(out, &[]), run(config, &["-q", method]));
}

/// GPTQ and AWQ checkpoints run from the command line as the reference runs their products
/// (its greedy ids over its prompt), also under vLLM's names for their kernels and with a bf16
/// model around their blocks; another method is refused naming theirs. A CPU artifact of one
/// records the method asked for, reads 4-bit blocks, runs the same, and takes the method by
/// either name.
#[test]
fn integer_checkpoints_run_and_compile() {
    for (name, method, marlin) in [
        ("llama_gptq", "gptq", "gptq_marlin"),
        ("llama_awq", "awq", "awq_marlin"),
    ] {
        let dir = common::fixture(&format!("hf-tiny/{name}"));
        let dir = dir.to_str().unwrap();
        let reference = common::hf_reference::Reference::of(name);
        let run = |model: &str, extra: &[&str]| greedy_over_reference_prompt(model, &reference, extra);
        let want = reference.greedy_ids.clone();
        assert_eq!(run(dir, &[]), want, "{name}");
        assert_eq!(run(dir, &["-q", marlin]), want, "{name}");
        assert_eq!(run(dir, &["-q", method, "--dtype", "bfloat16"]), want, "{name}");
        let err = refused(&["run", dir, "--prompt-ids", "1", "-q", "fp8"]);
        assert!(err.contains(&format!("quantized as `{method}`")), "{err}");

        let scratch = common::scratch_dir("bbc-int-artifact-");
        let artifact = scratch.path().join(name);
        let out = artifact.to_str().unwrap();
        bbc(&["compile", dir, "--target", "cpu", "-q", marlin, "-o", out]);
        let manifest = codegen::read_manifest(&artifact).unwrap();
        assert_eq!(manifest.quantization.as_deref(), Some(marlin));
        assert!(std::fs::read_to_string(artifact.join("graph.ir"))
            .unwrap()
            .contains("u4_b32"));
        assert_eq!(run(out, &[]), want, "{name} artifact");
        assert_eq!(run(out, &["-q", method]), want, "{name} artifact");
        let err = refused(&["run", out, "--prompt-ids", "1", "-q", "fp8"]);
        assert!(err.contains(&format!("quantized as `{method}`")), "{err}");
    }
}

/// Random weights (`--load-format dummy`) quantize as a checkpoint's do: every tensor is that
/// of a checkpoint holding the same random weights, quantized as it loads; an artifact
/// compiled so records it and its graph reads FP8 blocks.
#[test]
fn dummy_weights_quantize_as_they_load() {
    let scratch = common::scratch_dir("bbc-fp8-dummy-");
    let config = scratch.path().join("config.json");
    std::fs::copy(common::fixture("hf-tiny/llama/config.json"), &config).unwrap();
    let load = |model: &std::path::Path, dtype: Option<models::ComputeDtype>| {
        let options = bbc::model_ref::LoadOptions {
            quantization: Some("fp8".into()),
            dtype,
            quiet: true,
            fuse: false,
            ..Default::default()
        };
        bbc::model_ref::load(model.to_str().unwrap(), options).unwrap()
    };
    let dummy = load(&config, None);
    let dir = scratch.path().join("checkpoint");
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(&config, dir.join("config.json")).unwrap();
    let seed = bbc::model_ref::RANDOM_WEIGHTS_SEED;
    runtime::random_weights::write_checkpoint(&dummy.graph, seed, &dir.join("model.safetensors")).unwrap();
    let checkpoint = load(&dir, Some(models::ComputeDtype::Bf16));
    let mut names = dummy.model.weights.names();
    names.sort_unstable();
    let mut fp8 = 0;
    for name in names {
        let (a, b) = (
            dummy.model.weights.require(name).unwrap(),
            checkpoint.model.weights.require(name).unwrap(),
        );
        assert!(a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes, "{name}");
        fp8 += usize::from(a.dtype == quant::GgmlType::F8E4M3B32);
    }
    assert_eq!(fp8, 21, "7 projections a layer");
    quantized_artifact_runs_as_loaded(scratch.path(), config.to_str().unwrap(), "fp8", &["f8_e4m3_b32"]);
}
