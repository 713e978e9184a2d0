//! `bbc gpu-check --sections serve`: a Llama-3-8B-shaped model with random weights (the
//! `llama3-8b` shape, vocabulary 128 256, SmolLM2's tokenizer) compiled for the GPU, served as
//! `bbc serve` serves it (its own process, the KV cache sized to memory), and the InferenceX
//! sweep run against it by `bbc bench`: ISL 1 024 / OSL 1 024 at concurrency 1, 4, 16 and 64,
//! and ISL 8 192 at 1 and 16. The full form measures 10 × C requests a run (InferenceX's); the
//! quick one (`--quick`) one wave of C (at least 2) after a single warm-up, so the whole
//! section fits in about 8 minutes on an H200.

use crate::bench::{BenchArgs, Mode};
use anyhow::{bail, Context, Result};
use std::io::BufRead;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The sweep's runs: (ISL, OSL, concurrencies).
pub const SWEEP: [(usize, usize, &[usize]); 2] = [(1024, 1024, &[1, 4, 16, 64]), (8192, 1024, &[1, 16])];

/// How many requests each run sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepSize {
    /// 10 × C measured, 2 × C warm-ups: InferenceX's.
    Full,
    /// One wave of C (at least 2) measured after one warm-up.
    Quick,
}

/// Compile the `llama3-8b` shape for `target` (tokenizer from `tokenizer`), serve it, and run
/// the sweep against it; the reports and charts go to `results`.
pub fn check(target: codegen::Target, tokenizer: &Path, size: SweepSize, results: &Path) -> Result<()> {
    let scratch = super::scratch_dir("bbc-gpu-check-serve-")?;
    let artifact = compile_shape("llama3-8b", target, tokenizer, scratch.path())?;
    let bbc = std::env::current_exe().context("finding the bbc binary")?;
    serve_and_sweep(&bbc, &artifact, &[], tokenizer, &SWEEP, size, results)
}

/// The speculation runs: ISL 1 024, OSL 256, at concurrency 1 and 16.
pub const SPECULATION_SWEEP: [(usize, usize, &[usize]); 1] = [(1024, 256, &[1, 16])];
/// Drafted tokens a step in the speculation runs (vLLM's and the seeds' MTP setting).
const DRAFTS: &str = "3";

/// `bbc gpu-check --sections speculation`: the `llama3-8b` shape through
/// [`speculation_runs`] at [`SPECULATION_SWEEP`].
pub fn speculation(target: codegen::Target, tokenizer: &Path, results: &Path) -> Result<()> {
    let config = models::config::shapes::config_json("llama3-8b").context("the llama3-8b shape")?;
    let bbc = std::env::current_exe().context("finding the bbc binary")?;
    speculation_runs(&bbc, &config, target, tokenizer, &SPECULATION_SWEEP, results)
}

/// The model of HF `config` (random weights) compiled for `target` and served by `bbc` three
/// ways, `sweep` run against each (one wave a run; `bbc bench` reports the acceptance):
/// without drafts (`no-drafts`); drafting 3 tokens a step for itself, a draft model equal to
/// the target (`drafts-accepted`: every draft accepted, the mechanism's ceiling); and drafted
/// for by the same config cut to its first layer (`drafts-refused`: guesses the target
/// mostly refuses, the mechanism's cost). Reports in `results/speculation-{run}/`.
pub fn speculation_runs(
    bbc: &Path,
    config: &serde_json::Value,
    target: codegen::Target,
    tokenizer: &Path,
    sweep: &[(usize, usize, &[usize])],
    results: &Path,
) -> Result<()> {
    let scratch = super::scratch_dir("bbc-gpu-check-speculation-")?;
    let write = |name: &str, config: &serde_json::Value| -> Result<String> {
        let path = scratch.path().join(name);
        std::fs::write(&path, config.to_string())?;
        Ok(path.display().to_string())
    };
    let model = compile_shape(&write("model.json", config)?, target, tokenizer, scratch.path())?;
    let drafter = compile_shape(
        &write("first-layer.json", &first_layer(config))?,
        target,
        tokenizer,
        scratch.path(),
    )?;
    let (own, cut) = (model.display().to_string(), drafter.display().to_string());
    let runs: [(&str, Vec<&str>); 3] = [
        ("no-drafts", vec![]),
        (
            "drafts-accepted",
            vec!["--speculative-model", &own, "--num-speculative-tokens", DRAFTS],
        ),
        (
            "drafts-refused",
            vec!["--speculative-model", &cut, "--num-speculative-tokens", DRAFTS],
        ),
    ];
    for (name, args) in runs {
        println!("\nspeculation, {name}:");
        let results = results.join(format!("speculation-{name}"));
        serve_and_sweep(bbc, &model, &args, tokenizer, sweep, SweepSize::Quick, &results)?;
    }
    Ok(())
}

/// `config` with only its first layer: a drafter whose embedding, head and first layer are
/// the full model's (random weights come from each tensor's name), so only its depth differs.
fn first_layer(config: &serde_json::Value) -> serde_json::Value {
    let mut cut = config.clone();
    cut["num_hidden_layers"] = 1.into();
    cut
}

/// `bbc compile MODEL --target T` of a shape (a name or a `config.json`) into `dir`, its
/// tokenizer from `tokenizer`, timed; the artifact's path.
pub(super) fn compile_shape(
    model: &str,
    target: codegen::Target,
    tokenizer: &Path,
    dir: &Path,
) -> Result<std::path::PathBuf> {
    let stem = Path::new(model)
        .file_stem()
        .map_or(model.into(), |s| s.to_string_lossy());
    let artifact = dir.join(format!("{stem}.artifact"));
    let started = Instant::now();
    crate::commands::compile::compile(&crate::commands::compile::CompileArgs {
        model,
        target: target.name(),
        output: &artifact,
        emit: None,
        emit_after: None,
        verify: false,
        tokenizer: tokenizer.to_str(),
        draft_head: crate::serve::DraftHead::Full,
        speculative_config: None,
        prefill_gemm: Default::default(),
        prefill_attention: Default::default(),
        decode_attention: Default::default(),
        prefill_delta_rule: Default::default(),
        prefill_experts: Default::default(),
        kv_cache_dtype: None,
        dtype: None,
        load_format: Default::default(),
        quantization: None,
    })?;
    println!("compiled {stem} in {:.1} s", started.elapsed().as_secs_f64());
    Ok(artifact)
}

/// Serve `model` with the `bbc` binary at `bbc` (and `serve_args`), run `sweep` against it
/// with `tokenizer`'s prompts, and stop the server; each (ISL, OSL)'s runs written to
/// `results` as JSON and SVG.
pub fn serve_and_sweep(
    bbc: &Path,
    model: &Path,
    serve_args: &[&str],
    tokenizer: &Path,
    sweep: &[(usize, usize, &[usize])],
    size: SweepSize,
    results: &Path,
) -> Result<()> {
    std::fs::create_dir_all(results).with_context(|| format!("creating {}", results.display()))?;
    let started = Instant::now();
    let server = ServerProcess::start(bbc, model, serve_args)?;
    println!(
        "serving {} at {} after {:.1} s (from starting the server to its first answerable request)",
        model.display(),
        server.address,
        started.elapsed().as_secs_f64()
    );
    for &(input_len, output_len, concurrencies) in sweep {
        let name = format!("sweep-isl{input_len}-osl{output_len}");
        let (num_prompts, warmups) = match size {
            SweepSize::Full => (None, None),
            SweepSize::Quick => (Some(concurrencies.iter().copied().max().unwrap_or(1).max(2)), Some(1)),
        };
        let args = BenchArgs {
            url: format!("http://{}", server.address),
            model: None,
            tokenizer: Some(tokenizer.display().to_string()),
            endpoint: "completions".into(),
            mode: Mode::Sweep,
            input_len: vec![input_len],
            output_len: vec![output_len],
            range_ratio: 0.8,
            concurrency: concurrencies.to_vec(),
            num_prompts,
            warmups,
            request_rate: None,
            duration: 60.0,
            burst_size: 16,
            bursts: 4,
            burst_interval: 10.0,
            api_key: None,
            seed: None,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            json: Some(results.join(format!("{name}.json"))),
            plot: Some(results.join(format!("{name}.svg"))),
        };
        let run = Instant::now();
        crate::bench::bench(&args)?;
        println!("({name}: {:.0} s)", run.elapsed().as_secs_f64());
    }
    Ok(())
}

/// `bbc serve` as a child process on a free port, stopped when dropped.
pub(super) struct ServerProcess {
    child: Child,
    pub address: String,
}

impl ServerProcess {
    /// Start it and wait (at most 10 minutes: an 8B model's weights are made and uploaded
    /// first) until it listens; its output goes on to this process's stderr.
    pub fn start(bbc: &Path, model: &Path, extra: &[&str]) -> Result<Self> {
        let mut child = Command::new(bbc)
            .arg("serve")
            .arg(model)
            .args(["--port", "0"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting bbc serve")?;
        let stderr = child.stderr.take().context("the server's stderr")?;
        let mut lines = std::io::BufReader::new(stderr).lines();
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in lines.by_ref().map_while(|l| l.ok()) {
                eprintln!("  server: {line}");
                if !sent {
                    if let Some((_, address)) = line.trim().rsplit_once("http://") {
                        let _ = sender.send(address.to_string());
                        sent = true;
                    }
                }
            }
        });
        let mut server = Self {
            child,
            address: String::new(),
        };
        match receiver.recv_timeout(Duration::from_secs(600)) {
            Ok(address) => server.address = address,
            Err(_) => match server.child.try_wait()? {
                Some(status) => bail!("bbc serve exited ({status}) before listening"),
                None => bail!("bbc serve did not listen within 10 minutes"),
            },
        }
        Ok(server)
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The drafter's config reads as the full shape's but for its depth.
    #[test]
    fn the_cut_drafter_is_the_shape_with_one_layer() {
        let read = |value| models::ModelConfig::from_hf_json(value, Path::new("config.json")).unwrap();
        let shape = models::config::shapes::config_json("llama3-8b").unwrap();
        let (full, cut) = (read(shape.clone()), read(first_layer(&shape)));
        assert_eq!((full.layers, cut.layers), (32, 1));
        assert_eq!(
            (cut.vocab_size, cut.hidden, cut.intermediate, cut.heads),
            (full.vocab_size, full.hidden, full.intermediate, full.heads)
        );
    }
}
