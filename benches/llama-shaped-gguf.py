#!/usr/bin/env python3
"""A Llama-shaped GGUF file of random F16 weights carrying SmolLM2's tokenizer, to time the CPU
backend (and llama.cpp beside it) on models larger than the last-level cache, which no model
bbc fetches is. Speed depends on shapes and formats, not on the weights' values.

    python3 benches/llama-shaped-gguf.py OUT.gguf [1b|3b] [TYPE]
    llama-quantize OUT.gguf OUT-q4_k_m.gguf Q4_K_M     # llama.cpp's tool: the file's format

With TYPE (a gguf-py quantization type: MXFP4, Q4_0, Q8_0, ...) every matrix but the
embedding (Q8_0) is written in it, quantized by gguf-py from the same F16 values: formats
`llama-quantize` would not give a dense model (its MXFP4_MOE quantizes experts only).

Needs numpy and llama.cpp's gguf-py (`PYTHONPATH=llama.cpp/gguf-py`, or `pip install gguf`).
Shapes: Llama 3.2 1B's and 3B's (hidden size, layers, FFN width, heads, KV heads) with
SmolLM2's vocabulary of 49152 and a tied embedding.
"""
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

SHAPES = {  # hidden, layers, ffn, heads, kv heads
    "1b": (2048, 16, 8192, 32, 8),
    "3b": (3072, 28, 8192, 24, 8),
}


def smollm2_path():
    out = subprocess.run(["cargo", "run", "--release", "--quiet", "--bin", "bbc", "--", "fetch", "smollm2"],
                         check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    return out.stdout.strip().splitlines()[-1]


def main():
    out, shape = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "1b")
    qtype = gguf.GGMLQuantizationType[sys.argv[3]] if len(sys.argv) > 3 else None
    hidden, layers, ffn, heads, kv_heads = SHAPES[shape]
    head_dim = hidden // heads
    src = gguf.GGUFReader(smollm2_path())
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(out, "llama")
    dims = {"llama.block_count": layers, "llama.embedding_length": hidden,
            "llama.feed_forward_length": ffn, "llama.attention.head_count": heads,
            "llama.attention.head_count_kv": kv_heads, "llama.rope.dimension_count": head_dim,
            "general.file_type": 1 if qtype is None else gguf.LlamaFileType.GUESSED}
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in dims:
            w.add_uint32(key, dims[key])
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    rng = np.random.default_rng(0)

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def add_matrix(name, m):
        if qtype is None:
            w.add_tensor(name, m)
            return
        q = gguf.GGMLQuantizationType.Q8_0 if name == "token_embd.weight" else qtype
        w.add_tensor(name, gguf.quants.quantize(m.astype(np.float32), q), raw_dtype=q)

    add_matrix("token_embd.weight", matrix(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        add_matrix(p + "attn_q.weight", matrix(hidden, hidden))
        add_matrix(p + "attn_k.weight", matrix(kv_heads * head_dim, hidden))
        add_matrix(p + "attn_v.weight", matrix(kv_heads * head_dim, hidden))
        add_matrix(p + "attn_output.weight", matrix(hidden, hidden))
        add_matrix(p + "ffn_gate.weight", matrix(ffn, hidden))
        add_matrix(p + "ffn_up.weight", matrix(ffn, hidden))
        add_matrix(p + "ffn_down.weight", matrix(hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
