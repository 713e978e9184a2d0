#!/usr/bin/env bash
# One-shot GPU check, for a machine with an NVIDIA GPU (see issue [4] and docs/gpu-results.md):
#   1. builds bbc (release-optimised test profile) and installs NVRTC from PyPI;
#   2. compiles every generated kernel for the GPU's architecture with ptxas's resource report
#      (zero spills required) — `codegen/tests/nvrtc.rs`;
#   3. runs SmolLM2 with bf16 weights on the GPU through the CUDA backend and compares its
#      greedy tokens with the CPU backend's on the same bf16 weights — `tests/gpu_runtime.rs`;
#   4. times SmolLM2 decode on the GPU (bbc run on a GPU artifact) against the CPU;
#   5. `benches/gpu_check.rs`, printed last: device copy bandwidth; every kernel of the tiny
#      Llama/Gemma 3 plans on the GPU in lockstep with the emulator (max relative error per kernel); the
#      matmuls of a Llama-8B-shaped layer and head with random bf16 weights timed at batch 1,
#      16 and 64 (GB/s of weights, % of copy bandwidth, the decode step they add up to);
#      batched decode steps replayed as CUDA graphs against kernel-by-kernel launches (logits
#      bit for bit equal; wall time per step).
# Paste the tables into docs/gpu-results.md with the date, GPU and commit.
set -euo pipefail
cd "$(dirname "$0")/.."
export BBC_HOME="${BBC_HOME:-$HOME/.cache/bbc}"
target="${BBC_GPU_TARGET:-h200}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no NVIDIA GPU here" >&2; exit 1; }
if [ ! -f "$BBC_HOME/cuda/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$BBC_HOME/cuda" nvidia-cuda-nvrtc==13.5.37
fi
export BBC_REQUIRE_NVRTC=1 BBC_GPU_TARGET="$target"
cargo build --release --bin bbc
cargo test -p codegen --test nvrtc -- --nocapture 2>&1 | tee /tmp/bbc-gpu-nvrtc.log | grep -E "registers|test result"
cargo test --test gpu_runtime -- --nocapture 2>&1 | tee /tmp/bbc-gpu-runtime.log | grep -E "test result|panicked|skipped"
model=$(./target/release/bbc fetch smollm2)
work=$(mktemp -d)
printf '[model]\nweights = "%s"\ndtype = "bf16"\n' "$model" > "$work/model.toml"
./target/release/bbc compile "$work/model.toml" --target "$target" -o "$work/gpu" --emit kernel-report
ids=$(python3 -c "print(','.join(str(100 + 7 * i) for i in range(32)))")
echo "| backend | prompt tok/s | decode tok/s |"
echo "|---------|--------------|--------------|"
for art in "$work/gpu" "$work/model.toml"; do
  line=$(./target/release/bbc run "$art" --prompt-ids "$ids" --max-tokens 128 --ignore-eos 2>&1 >/dev/null | tail -1)
  echo "| $( [ "$art" = "$work/gpu" ] && echo "cuda ($target)" || echo cpu ) | $(echo "$line" | sed -E 's/.*in [0-9.]+s \(([0-9.]+) tok\/s\).*/\1/') | $(echo "$line" | sed -E 's/.*decode ([0-9.]+) tok\/s.*/\1/') |"
done
# Last, the kernel errors and the 8B-shaped matmul table (kernel, time, GB/s, % of copy bandwidth).
cargo bench --bench gpu_check 2>&1 | tee /tmp/bbc-gpu-check.log | grep -vE "^\s*(Compiling|Finished|Running)"
