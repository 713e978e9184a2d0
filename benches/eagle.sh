#!/usr/bin/env bash
# EAGLE drafting on this machine, side by side: the Llama-shaped model of
# `benches/eagle-heads.py` served plain, drafted for by an EAGLE-1 head that guesses exactly
# what it chooses (every draft accepted: the mechanism's ceiling), and by a random EAGLE-3
# head (every draft refused: its cost), also with drafting paused above two sequences
# (`disable_by_batch_size`). `bbc bench` per server: ISL 128, OSL 128, greedy, at concurrency
# 1 and 4. Needs python3 with torch and safetensors (PYTHON to pick one).
#   benches/eagle.sh [drafted-tokens]
set -euo pipefail
cd "$(dirname "$0")/.."
drafts=${1:-3}
port=18798
dir=$(mktemp -d /tmp/bbc-eagle-bench.XXXXXX)
server=
trap '[ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$dir"' EXIT
cargo build --release --bin bbc >/dev/null
"${PYTHON:-python3}" benches/eagle-heads.py "$dir" >/dev/null
for head in none eagle-exact eagle3-random eagle3-random-paused; do
  flags=()
  case $head in
    eagle-exact) flags=(--speculative-config "{\"method\": \"eagle\", \"model\": \"$dir/$head\", \"num_speculative_tokens\": $drafts}") ;;
    eagle3-random) flags=(--speculative-config "{\"method\": \"eagle3\", \"model\": \"$dir/$head\", \"num_speculative_tokens\": $drafts}") ;;
    eagle3-random-paused) flags=(--speculative-config "{\"method\": \"eagle3\", \"model\": \"$dir/eagle3-random\", \"num_speculative_tokens\": $drafts, \"disable_by_batch_size\": 2}") ;;
  esac
  ./target/release/bbc serve "$dir/target" --tokenizer smollm2 --port "$port" "${flags[@]}" \
    >/tmp/bbc-eagle-bench.log 2>&1 &
  server=$!
  until curl -s "localhost:$port/health" >/dev/null; do
    kill -0 "$server" 2>/dev/null || { cat /tmp/bbc-eagle-bench.log; exit 1; }
    sleep 0.5
  done
  for c in 1 4; do
    echo "== $head, concurrency $c"
    ./target/release/bbc bench --url "http://127.0.0.1:$port" --tokenizer smollm2 --input-len 128 \
      --output-len 128 --range-ratio 1 --concurrency "$c" --num-prompts $((4 * c)) --warmups 1 --temperature 0 \
      | grep -Ei "output throughput|TPOT|accept|draft" || true
  done
  kill "$server"; wait "$server" 2>/dev/null || true; server=
done
