#!/usr/bin/env bash
# Prepares, on a machine with cargo, what a lent GPU machine (no Rust toolchain, no network,
# at most 64 MiB carried per call with the repository) needs for scripts/gpu-check.sh:
#   .gpu-kit/bin/bbc.xz     the release binary, stripped and xz-compressed (12 MB -> 4)
#   .gpu-kit/model-a/part   the first 44 MB of SmolLM2's GGUF file
#   .gpu-kit/model-b/part   the rest (the file is 98 MB: one call cannot carry it whole)
#   .gpu-kit/bin/smollm2.sha256
# docs/gpu-results.md gives the two device calls that use them.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bin bbc
model=$(./target/release/bbc fetch smollm2)
rm -rf .gpu-kit && mkdir -p .gpu-kit/bin .gpu-kit/model-a .gpu-kit/model-b
strip -o .gpu-kit/bin/bbc target/release/bbc
xz -9 -T2 .gpu-kit/bin/bbc
(cd "$(dirname "$model")" && sha256sum "$(basename "$model")") | awk '{print $1"  smollm2.gguf"}' > .gpu-kit/bin/smollm2.sha256
head -c 44000000 "$model" > .gpu-kit/model-a/part
tail -c +44000001 "$model" > .gpu-kit/model-b/part
du -b .gpu-kit/bin/bbc.xz .gpu-kit/model-a/part .gpu-kit/model-b/part
