#!/usr/bin/env bash
# Side by side on this machine: `bbc serve` without and with speculative decoding (prompt
# lookup, or a draft model where SPECULATIVE_MODEL names one), on a task that repeats its
# context (copying a list), one that does not (a story), and questions sharing a long system
# prompt (`rules`: 1371 tokens of rules, a different question each time, as a chat
# application's requests are). Greedy chat requests, 10 in turn after a warm-up, per server;
# two rounds alternated (ROUNDS="1" for one). DTYPE sets the target's compute dtype.
#   [SPECULATIVE_MODEL=draft] [DTYPE=f32] benches/speculation.sh [model-name] [drafted-tokens]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-smollm2}
drafts=${2:-4}
port=18799
cargo build --release --bin bbc >/dev/null
copy='{"model":"'"$model"'","messages":[{"role":"user","content":"Copy this list exactly, one per line: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango, nectarine, orange, papaya, quince, raspberry, strawberry, tangerine."}],"max_tokens":96,"temperature":0}'
story='{"model":"'"$model"'","messages":[{"role":"user","content":"Write a short story about a robot who learns to paint."}],"max_tokens":96,"temperature":0}'
# The `rules` task's ten bodies (and its warm-up), one per line.
rules_bodies=$(python3 - "$model" <<'PY'
import json, sys
colours = ["red", "green", "blue", "amber", "violet"]
system = " ".join(f"Rule {i}: the colour of item {i} is {colours[i % 5]} and its weight is {i * 7 % 31} grams." for i in range(60))
for q in range(11):
    what = "colours" if q % 2 else "weights"
    question = f"List the {what} of items {q * 4} to {q * 4 + 7}, one per line."
    print(json.dumps({"model": sys.argv[1], "max_tokens": 64, "temperature": 0,
                      "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}))
PY
)
server=
trap '[ -n "$server" ] && kill "$server" 2>/dev/null' EXIT
metric() { curl -s "localhost:$port/metrics" | awk -v m="$1" '$1 == m {print $2}'; }
for round in ${ROUNDS:-1 2}; do
  for n in 0 "$drafts"; do
    flags=(--speculative-ngram "$n")
    if [ -n "${SPECULATIVE_MODEL:-}" ] && [ "$n" != 0 ]; then
      flags=(--speculative-model "$SPECULATIVE_MODEL" --num-speculative-tokens "$n")
    fi
    ./target/release/bbc serve "$model" --port "$port" ${DTYPE:+--dtype "$DTYPE"} "${flags[@]}" \
      >/tmp/bbc-speculation-bench.log 2>&1 &
    server=$!
    until curl -s "localhost:$port/health" >/dev/null; do
      kill -0 "$server" 2>/dev/null || { cat /tmp/bbc-speculation-bench.log; exit 1; }
      sleep 0.5
    done
    for task in copy story rules; do
      if [ "$task" = rules ]; then
        mapfile -t bodies <<<"$rules_bodies"
      else
        bodies=()
        for _ in $(seq 11); do bodies+=("${!task}"); done
      fi
      curl -s "localhost:$port/v1/chat/completions" -H 'content-type: application/json' -d "${bodies[0]}" >/dev/null
      start=$(date +%s.%N)
      for body in "${bodies[@]:1}"; do
        out=$(curl -s "localhost:$port/v1/chat/completions" -H 'content-type: application/json' -d "$body")
      done
      end=$(date +%s.%N)
      tokens=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['usage']['completion_tokens'])" "$out")
      printf 'round %s  drafts %-2s %-6s %3s tokens  %6.3f s  accepted %s of %s drafted\n' "$round" "$n" "$task" "$tokens" \
        "$(echo "$end - $start" | bc)" "$(metric bbc_spec_decode_accepted_tokens_total)" "$(metric bbc_spec_decode_draft_tokens_total)"
    done
    kill "$server"; wait "$server" 2>/dev/null || true; server=
  done
done
