#!/usr/bin/env bash
# The GPU check on a machine with an NVIDIA GPU (docs/gpu-check.md): checks and times the CUDA
# backend; docs/performance.md keeps the current tables, with the date, GPU and commit.
#
# Where cargo is present it builds bbc itself; elsewhere it runs the binary and SmolLM2 file
# that `scripts/gpu-kit.sh` prepared (BBC_BIN, BBC_MODEL).
#   1. finds NVRTC: the system CUDA toolkit's first, then the PyPI wheel's (kernels load as
#      cubins, which a driver older than the NVRTC accepts where it would refuse its PTX),
#      and cuBLASLt, which the matmul table times beside bbc's GEMMs;
#   2. `bbc compile --emit kernel-report`: SmolLM2 (bf16) compiled for the GPU's architecture,
#      each kernel's registers and spills as ptxas reports them;
#   3. `bbc gpu-check`, one process per section (`--sections a,b` picks them; see
#      `src/gpu_check/mod.rs`), so that a kernel fault, which spoils its process's CUDA
#      context, costs only its own section: copy bandwidth, every kernel of the tiny models
#      against the emulator, SmolLM2 bf16 greedy tokens against the CPU backend and both timed,
#      CUDA graphs against kernel-by-kernel launches, the 8B-shaped matmuls and attention, the
#      Llama-8B-shaped decode table (run again with its prompts through the GEMV if it fails,
#      in case the tensor-core GEMM is what failed), the Qwen3.5-27B-shaped hybrid's, draft
#      heads (the full bf16 head against the 4-bit shortlist), and last
#      the Llama-3-8B shape served with random weights under the InferenceX sweep (quick unless
#      BBC_FULL_SWEEP=1; reports and charts in gpu-check-results/).
set -euo pipefail
cd "$(dirname "$0")/.."
sections="kernels,smollm2,graphs,matmuls,attention,decode,hybrid,experts,draft-heads,serve"
if [ "${1:-}" = "--sections" ]; then sections="$2"; fi
export BBC_HOME="${BBC_HOME:-$HOME/.cache/bbc}"
target="${BBC_GPU_TARGET:-h200}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no NVIDIA GPU here" >&2; exit 1; }

if [ -z "${BBC_NVRTC_DIR:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc.so.13'; then
  sites=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           $(for s in $sites; do echo "$s/nvidia/cu13/lib $s/nvidia/cuda_nvrtc/lib"; done); do
    if [ -f "$d/libnvrtc.so.13" ]; then export BBC_NVRTC_DIR="$d"; break; fi
  done
fi
if [ -z "${BBC_NVRTC_DIR:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc.so.13'; then
  found=$(find /usr/local /opt -name libnvrtc.so.13 2>/dev/null | head -1 || true)
  if [ -n "$found" ]; then export BBC_NVRTC_DIR="$(dirname "$found")"; fi
fi
if [ -z "${BBC_NVRTC_DIR:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc.so.13' \
   && [ ! -f "$BBC_HOME/cuda/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$BBC_HOME/cuda" nvidia-cuda-nvrtc==13.5.37 \
    || echo "no NVRTC here and none could be installed" >&2
fi
echo "NVRTC: ${BBC_NVRTC_DIR:-the loader path or $BBC_HOME/cuda}"
# cuBLASLt, the matmul table's yardstick: the toolkit's, or PyTorch's wheel's.
if [ -z "${BBC_CUBLASLT_DIR:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libcublasLt.so.13'; then
  sites=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           $(for s in $sites; do echo "$s/nvidia/cu13/lib $s/nvidia/cublas/lib"; done); do
    if [ -f "$d/libcublasLt.so.13" ]; then export BBC_CUBLASLT_DIR="$d"; break; fi
  done
fi
echo "cuBLASLt: ${BBC_CUBLASLT_DIR:-the loader path (or none: the matmul table then has no yardstick)}"

bbc="${BBC_BIN:-}"
if [ -z "$bbc" ]; then
  cargo build --release --bin bbc
  bbc=./target/release/bbc
fi
model="${BBC_MODEL:-$("$bbc" fetch smollm2)}"
# Sections that need no SmolLM2 run without it.
if [ -f "$model" ]; then
  work=$(mktemp -d)
  printf '[model]\nweights = "%s"\ndtype = "bf16"\n' "$model" > "$work/model.toml"
  "$bbc" compile "$work/model.toml" --target "$target" -o "$work/gpu" --emit kernel-report \
    || echo "the kernel report failed (the sections still run)" >&2
fi
failed=""
# Each section says what it took.
for section in ${sections//,/ }; do
  echo; echo "== $section"
  started=$SECONDS
  extra=()
  if [ "$section" = serve ] && [ "${BBC_FULL_SWEEP:-0}" != 1 ]; then extra=(--quick); fi
  if "$bbc" gpu-check --target "$target" --model "$model" --sections "$section" "${extra[@]}"; then
    echo "($section: $((SECONDS - started)) s; $SECONDS s since the script started)"
    continue
  fi
  echo "($section failed after $((SECONDS - started)) s)"
  failed="$failed $section"
  if [ "$section" = decode ]; then
    echo; echo "== decode again, prompts through the GEMV (15 rows a step)"
    "$bbc" gpu-check --target "$target" --model "$model" --sections decode --decode-prefill-chunk 15 \
      || failed="$failed decode-with-gemv-prefill"
  fi
done
if [ -n "$failed" ]; then echo; echo "FAILED:$failed"; exit 1; fi
