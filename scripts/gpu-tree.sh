#!/usr/bin/env bash
# Trims what a device call carries: every tracked file travels with it, and the tracked test
# fixtures (32 MB) with the binary and half of SmolLM2's file pass the 64 MiB a call carries.
# Untracks (in the index only; the files stay, ignored through .git/info/exclude) what a call
# does not read, and puts it back afterwards:
#   scripts/gpu-tree.sh call-1    keeps the tiny HF models the GPU check's kernel and graph
#                                 sections run (src/gpu_check/kernels.rs, GPU_FAMILIES)
#   scripts/gpu-tree.sh call-2    keeps no fixtures (the SmolLM2 and hybrid sections read none)
#   scripts/gpu-tree.sh restore   the index and .git/info/exclude as they were
# Never commit between call-1 and restore: the commit would delete the fixtures. call-1 and
# call-2 install a pre-commit hook that refuses commits until restore removes it (a session
# committed once in between with `git add -A`, and the fixtures went with it).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=.git/info/exclude
begin="# scripts/gpu-tree.sh: begin"
end="# scripts/gpu-tree.sh: end"
gpu_families="llama gemma3 gemma4 gemma4_kv_shared gemma4_moe qwen3_5 glm4_moe qwen3_next glm_moe_dsa"

untrack() {
  git rm -r -q --cached --ignore-unmatch "$@"
  mkdir -p "$(dirname "$exclude")"
  { echo "$begin"; for path in "$@"; do echo "/$path/"; done; echo "$end"; } >> "$exclude"
}

hook="$(git rev-parse --git-path hooks)/pre-commit"
hook_mark="# scripts/gpu-tree.sh: fixtures untracked"

guard_commits() {
  if [ -e "$hook" ] && ! grep -q "^$hook_mark\$" "$hook"; then
    echo "warning: $hook exists; not guarding commits (run restore before any commit)" >&2
    return
  fi
  mkdir -p "$(dirname "$hook")"
  printf '#!/bin/sh\n%s\necho "fixtures are untracked for a device call: scripts/gpu-tree.sh restore first" >&2\nexit 1\n' \
    "$hook_mark" > "$hook"
  chmod +x "$hook"
}

restore() {
  git reset -q -- tests/fixtures
  if [ -f "$exclude" ]; then sed -i "\\|^$begin\$|,\\|^$end\$|d" "$exclude"; fi
  if [ -f "$hook" ] && grep -q "^$hook_mark\$" "$hook"; then rm -f "$hook"; fi
}

case "${1:-}" in
  call-1)
    restore
    others=()
    for dir in tests/fixtures/hf-tiny/*/; do
      name=$(basename "$dir")
      case " $gpu_families " in *" $name "*) ;; *) others+=("tests/fixtures/hf-tiny/$name") ;; esac
    done
    untrack tests/fixtures/gguf-tiny "${others[@]}"
    guard_commits
    ;;
  call-2) restore; untrack tests/fixtures/gguf-tiny tests/fixtures/hf-tiny; guard_commits ;;
  restore) restore ;;
  *) echo "usage: $0 call-1 | call-2 | restore" >&2; exit 2 ;;
esac
git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {printf "tracked files that travel: %.1f MB\n", s / 1e6}'
