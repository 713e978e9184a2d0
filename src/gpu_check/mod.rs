//! `bbc gpu-check`: the CUDA backend checked and timed on this machine's GPU (run by
//! `scripts/gpu-check.sh`, see `docs/gpu-check.md`). It is part of the `bbc` binary so that a
//! GPU machine without a Rust toolchain can run it from a binary built elsewhere. Sections,
//! in order:
//! 1. device copy bandwidth;
//! 2. every kernel of the tiny models' plans (f32 and bf16, every family), and of tiny Llama
//!    GGUF files' (GGUF blocks, f16), and the kernels no plan launches yet (Hopper's TMA GEMMs,
//!    the tensor-core prefill attention), in lockstep with the emulator, each kernel's max
//!    relative error (`kernels`);
//! 3. SmolLM2 bf16 greedy tokens on the GPU (logits and greedy plans) against the CPU backend's,
//!    and both timed (`smollm2`);
//! 4. batched decode steps replayed from CUDA graphs against kernel-by-kernel launches, and
//!    the tiny Qwen3.5 served from snapshots of recurrent states in device memory against the
//!    CPU backend (`graphs`);
//! 5. a Llama-8B-shaped model with random bf16 weights: its matmuls alone, each beside
//!    cuBLASLt's time for the shape (the QKV and gate/up decode GEMVs also as the serving plan
//!    fuses them, with and without their L2 prefetch; the tensor-core GEMMs at 16 to 2 048
//!    rows), then whole decode steps at batch 1, 4, 16 and 64 with each kernel's share
//!    (`llama_8b`);
//! 6. attention alone in a Llama-8B-shaped layer: one sequence's prefill at 512 to 8 192
//!    tokens on the tensor cores and as the plans run it, and a paged decode step of 64
//!    sequences at 4 096 positions against the copy bandwidth (`attention`);
//! 7. a Qwen3.5-27B-shaped hybrid the same way at batch 1 and 16, and an 8 192-token prefill
//!    with the delta rule in chunks and a row at a time (`hybrid`);
//! 8. a GLM-4.5-Air-shaped MoE model (8 of its layers) prefilling 512 and 2 048 tokens with
//!    its experts on the tensor cores and on the CUDA cores, each kernel's share, and decoding
//!    at batch 1, 16 and 64 (`experts`, [`experts`]);
//! 9. a drafter's vocabulary projection: the full bf16 head against the 4-bit shortlist, at
//!    three vocabularies (`draft-heads`, [`draft_head`]);
//! 10. the Llama-3-8B shape with random weights served as `bbc serve` serves it, and the
//!     InferenceX sweep run against it (`serve`, [`serve`]).
//! 11. outside the default sections: the Llama-3-8B shape served with a draft model drafting
//!     3 tokens a step, itself (every draft accepted) and its first layer (drafts refused),
//!     against no drafts (`speculation`, [`serve::speculation`]);
//! 12. outside the default sections: the Llama-3-8B shape written as a bf16 safetensors
//!     checkpoint and as an f16 GGUF, each compiled and served, timed from `bbc serve` to its
//!     first answer (`load`, [`load`]).
//!
//! Every section runs even when an earlier one fails (a GPU run is rare: it should say all it
//! can); the command fails if any did.

pub mod attention;
pub mod block_gemms;
pub mod decode;
pub mod draft_head;
pub mod experts;
pub mod kernels;
pub mod llama_8b;
pub mod load;
pub mod serve;
pub mod smollm2;
pub mod tiny_gguf;

use anyhow::{anyhow, bail, Result};
use codegen::Target;
use runtime_cuda::CudaDevice;
use std::path::{Path, PathBuf};

/// A scratch directory, removed with everything in it when dropped: on every way out of the
/// section that made it, errors included.
fn scratch_dir(prefix: &str) -> Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new().prefix(prefix).tempdir()?)
}

#[derive(clap::Args, Debug)]
pub struct GpuCheckArgs {
    /// The GPU's target: h200, b200 or rtx-pro-6000.
    #[arg(long, default_value = "h200")]
    pub target: String,
    /// SmolLM2's GGUF file (or a known model name, fetched on first use).
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// The tiny HF models the per-kernel check runs (the repository's test fixtures).
    #[arg(long, default_value = "tests/fixtures/hf-tiny")]
    pub fixtures: PathBuf,
    /// The sections to run (the copy bandwidth is always measured), so a run may do some
    /// sections now and the rest later.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kernels,smollm2,graphs,matmuls,attention,decode,hybrid,experts,draft-heads,serve"
    )]
    pub sections: Vec<Section>,
    /// Prompt rows per prefill step of the decode sections (at most 512); under 16 the
    /// prompts avoid the tensor-core GEMM, for a rerun where it failed.
    #[arg(long, default_value_t = 512)]
    pub decode_prefill_chunk: usize,
    /// The serve section's quick form: one wave of requests a run (about 8 minutes on an
    /// H200) instead of InferenceX's 10 × concurrency.
    #[arg(long)]
    pub quick: bool,
    /// Where the serve section writes its reports (JSON) and charts (SVG).
    #[arg(long, default_value = "gpu-check-results")]
    pub results: PathBuf,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Section {
    Kernels,
    Smollm2,
    Graphs,
    Matmuls,
    Attention,
    Decode,
    Hybrid,
    Experts,
    DraftHeads,
    Serve,
    Speculation,
    Load,
}

pub fn gpu_check(args: &GpuCheckArgs) -> Result<()> {
    let target = Target::parse(&args.target).ok_or_else(|| anyhow!("unknown target `{}`", args.target))?;
    let arch = target
        .cuda_arch()
        .ok_or_else(|| anyhow!("`{}` is not a GPU target", args.target))?;
    if !runtime_cuda::driver_present() {
        return Err(runtime::RuntimeError::NoCudaDriver.into());
    }
    let (major, minor) = crate::fetch::ensure_nvrtc(false)?;
    println!("NVRTC {major}.{minor}, target {} ({arch})", target.name());
    let bandwidth = compile_device(&[], arch)?.copy_bandwidth(1 << 30)?;
    println!(
        "device copy bandwidth: {:.0} GB/s (bytes read + written)",
        bandwidth / 1e9
    );
    let mut failures = Vec::new();
    for &section in &args.sections {
        let result = match section {
            Section::Kernels => kernels::kernel_errors(target, arch, &args.fixtures)
                .and_then(|worst| Ok(worst.max(kernels::unplanned_kernel_errors(arch)?)))
                .and_then(|worst| match worst > 2e-2 {
                    true => Err(anyhow!("a kernel's error ({worst:.2e}) is over 2e-2")),
                    false => Ok(()),
                }),
            Section::Smollm2 => smollm2_weights(&args.model).and_then(|model| smollm2::check(&model, target)),
            Section::Graphs => {
                // All run; the first failure is the section's, later ones are printed.
                let checks = [
                    ("graphs", kernels::graph_check(target, arch, &args.fixtures)),
                    ("state snapshots", kernels::snapshot_check(target, arch, &args.fixtures)),
                    (
                        "draft rewinds",
                        kernels::draft_rewind_check(target, arch, &args.fixtures),
                    ),
                ];
                let mut failed = checks.into_iter().filter_map(|(name, r)| r.err().map(|e| (name, e)));
                match failed.next() {
                    None => Ok(()),
                    Some((_, first)) => {
                        for (name, e) in failed {
                            println!("\n{name} FAILED too: {}", crate::report::error_report(&e));
                        }
                        Err(first)
                    }
                }
            }
            Section::Matmuls => llama_8b::matmul_timings(target, arch, bandwidth).and_then(|table| {
                println!("\n{table}");
                let blocks = block_gemms::block_matmul_timings(target, arch)?;
                println!("\nQ4_K matrices at prompt sizes (plans take the decoding GEMM up to 64 rows):\n\n{blocks}");
                Ok(())
            }),
            Section::Attention => attention::attention_timings(arch, bandwidth).map(|table| println!("\n{table}")),
            Section::Decode => llama_8b::decode(target, arch, bandwidth, args.decode_prefill_chunk),
            Section::Hybrid => decode::hybrid(target, arch, bandwidth, args.decode_prefill_chunk),
            Section::Experts => experts::experts(target, arch, bandwidth, args.decode_prefill_chunk),
            Section::DraftHeads => draft_head::draft_head_timings(arch).map(|table| println!("\n{table}")),
            Section::Serve => smollm2_weights(&args.model).and_then(|tokenizer| {
                let size = match args.quick {
                    true => serve::SweepSize::Quick,
                    false => serve::SweepSize::Full,
                };
                serve::check(target, &tokenizer, size, &args.results)
            }),
            Section::Speculation => {
                smollm2_weights(&args.model).and_then(|tokenizer| serve::speculation(target, &tokenizer, &args.results))
            }
            Section::Load => smollm2_weights(&args.model).and_then(|tokenizer| load::check(target, &tokenizer)),
        };
        if let Err(e) = result {
            println!("\n{section:?} FAILED: {}", crate::report::error_report(&e));
            failures.push(format!("{section:?}"));
        }
    }
    if !failures.is_empty() {
        bail!("failed: {}", failures.join(", "));
    }
    Ok(())
}

/// DSL `kernels` compiled with NVRTC for `arch` (e.g. `sm_90a`) as artifacts build them
/// (avoiding spills where ptxas can), loaded on GPU 0.
pub fn compile_device(kernels: &[kernels_gen::dsl::Kernel], arch: &str) -> Result<CudaDevice> {
    let cubins = kernels
        .iter()
        .map(|k| {
            let source = kernels_gen::cuda::emit(k);
            codegen::spill_free::build(&k.name, &source, k.block_dim, arch).map(|built| built.cubin)
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(CudaDevice::from_cubins(kernels, cubins)?)
}

/// SmolLM2's GGUF file: `arg` as a path, or the cached (or fetched) `smollm2`.
fn smollm2_weights(arg: &str) -> Result<PathBuf> {
    use crate::model_ref::ModelRef;
    match ModelRef::parse(arg)? {
        ModelRef::Weights(path) if Path::new(&path).is_file() => Ok(path),
        ModelRef::Known(known) if known.name == "smollm2" => crate::fetch::ensure(known, false),
        _ => bail!("--model takes SmolLM2's GGUF file or `smollm2`"),
    }
}
