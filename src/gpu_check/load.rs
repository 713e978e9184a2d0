//! `bbc gpu-check --sections load`: how long a user waits from `bbc serve` to a first answer
//! with an 8B model loaded from files. The `llama3-8b` shape's random weights are written as a
//! bf16 safetensors checkpoint (an HF directory, 16 GB) and as an f16 GGUF file; each is
//! compiled for the target into bf16 plans (timed; the GGUF's values are converted on the
//! device as they load) and served by `bbc serve` in its own process: the time until it
//! listens, and until one completion has been answered (its first token, then 16).

use super::serve::{compile_shape, ServerProcess};
use super::tiny_gguf::{f16_tiled, gguf_llama, LlamaShape};
use anyhow::{Context, Result};
use std::path::Path;
use std::time::Instant;

/// Tokens the first answer generates.
const ANSWER_TOKENS: usize = 16;

/// The `llama3-8b` shape through [`load_runs`] with this binary; `tokenizer` gives the
/// prompt's tokens (SmolLM2's: ids inside Llama 3's vocabulary).
pub fn check(target: codegen::Target, tokenizer: &Path) -> Result<()> {
    let config = models::config::shapes::config_json("llama3-8b").context("the llama3-8b shape")?;
    let bbc = std::env::current_exe().context("finding the bbc binary")?;
    load_runs(&bbc, &config, target, tokenizer).map(drop)
}

/// What one file's load measured, in seconds from starting `bbc serve`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadRun {
    pub what: &'static str,
    pub compile: f64,
    pub listening: f64,
    pub answered: f64,
}

/// The Llama of HF `config` with random weights, written as a bf16 safetensors checkpoint and
/// as an f16 GGUF into a scratch directory, each compiled for `target` into bf16 plans and
/// served by `bbc` until its first completion has answered.
pub fn load_runs(
    bbc: &Path,
    config: &serde_json::Value,
    target: codegen::Target,
    tokenizer: &Path,
) -> Result<Vec<LoadRun>> {
    let scratch = super::scratch_dir("bbc-gpu-check-load-")?;
    let dir = scratch.path();
    let shape = models::ModelConfig::from_hf_json(config.clone(), Path::new("config.json"))?;

    let checkpoint = dir.join("model-bf16");
    std::fs::create_dir_all(&checkpoint)?;
    std::fs::write(checkpoint.join("config.json"), config.to_string())?;
    let started = Instant::now();
    let options = models::LowerOptions {
        logits: models::LogitsFor::LastToken,
        compute: models::ComputeDtype::Bf16,
        kv_cache: models::KvCacheDtype::Auto,
    };
    let graph = models::lower_without_weights(&shape, options)?;
    runtime::random_weights::write_checkpoint(&graph, 1, &checkpoint.join("model.safetensors"))?;
    println!("wrote the bf16 checkpoint in {:.1} s", started.elapsed().as_secs_f64());

    let gguf = dir.join("model-f16.gguf");
    let started = Instant::now();
    gguf_llama(&gguf, &LlamaShape::of(&shape), &mut f16_tiled, &mut f16_tiled)?;
    println!("wrote the f16 GGUF in {:.1} s", started.elapsed().as_secs_f64());
    // Compiled to bf16 plans: on a GPU the device converts the halves.
    let gguf_model = dir.join("model-f16.toml");
    std::fs::write(
        &gguf_model,
        format!(
            "[model]\nweights = {:?}\ndtype = \"bf16\"\n",
            gguf.display().to_string()
        ),
    )?;

    let mut runs = Vec::new();
    for (what, model) in [("bf16 safetensors", &checkpoint), ("f16 GGUF to bf16", &gguf_model)] {
        println!("\n{what}:");
        let started = Instant::now();
        let artifact = compile_shape(&model.display().to_string(), target, tokenizer, dir)?;
        let compile = started.elapsed().as_secs_f64();
        let (listening, answered) = first_answer(bbc, &artifact)?;
        runs.push(LoadRun {
            what,
            compile,
            listening,
            answered,
        });
    }
    Ok(runs)
}

/// Serve `artifact` and time, from starting the server, when it listens and when its first
/// completion has answered (seconds).
fn first_answer(bbc: &Path, artifact: &Path) -> Result<(f64, f64)> {
    let started = Instant::now();
    let server = ServerProcess::start(bbc, artifact, &[])?;
    let listening = started.elapsed().as_secs_f64();
    let url = format!("http://{}", server.address);
    let prompt = "The three primary colors are";
    let (first_token, all) = crate::bench::one_completion(&url, prompt, ANSWER_TOKENS)?;
    let answered = started.elapsed().as_secs_f64();
    println!(
        "  from `bbc serve`: listening after {listening:.1} s, first answer after {answered:.1} s \
         (that request: first token {:.0} ms, {ANSWER_TOKENS} tokens {:.0} ms)",
        first_token.as_secs_f64() * 1e3,
        all.as_secs_f64() * 1e3
    );
    Ok((listening, answered))
}
