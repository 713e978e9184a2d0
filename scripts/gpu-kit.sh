#!/usr/bin/env bash
# Prepares, on a machine with cargo and a network, what `scripts/gpu-check.sh` needs on a GPU
# machine that has neither a Rust toolchain nor a network:
#   .gpu-kit/bbc            the release binary, stripped
#   .gpu-kit/smollm2.gguf   SmolLM2-135M-Instruct (Q4_1), with its sha256 beside it
# Copy `.gpu-kit/`, `scripts/` and `tests/fixtures/` (hf-tiny, gguf-tiny, eagle) there and run
#   BBC_BIN=.gpu-kit/bbc BBC_MODEL=.gpu-kit/smollm2.gguf scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bin bbc
model=$(./target/release/bbc fetch smollm2)
rm -rf .gpu-kit && mkdir -p .gpu-kit
strip -o .gpu-kit/bbc target/release/bbc
cp "$model" .gpu-kit/smollm2.gguf
(cd .gpu-kit && sha256sum smollm2.gguf > smollm2.sha256)
du -b .gpu-kit/*
