#!/usr/bin/env python3
"""A Llama-shaped model of random bf16 weights and two EAGLE heads for it, to time EAGLE
drafting (`benches/eagle.sh`). Speed depends on shapes, not values, except for how many drafts
are accepted, which the weights are drawn to fix:

- `target/`: hidden 2048, 8 layers (FFN 5632, 16 heads of 128, 8 KV heads), SmolLM2's
  vocabulary of 49152, tied embedding. Its attention and MLP outputs are zero and its final
  norm is the identity, so its next token is a function of its last (every layer still runs);
- `eagle-exact/`: an EAGLE-1 head whose `fc` keeps the token's embedding and whose layer adds
  nothing (it still runs): its greedy guess is the target's choice, so every draft is
  accepted — the mechanism's ceiling;
- `eagle3-random/`: an EAGLE-3 head of random weights (draft vocabulary 32000): its drafts are
  refused — the mechanism's cost.

    python3 benches/eagle-heads.py OUT_DIR

Needs torch and safetensors.
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

H, LAYERS, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 8, 5632, 16, 8, 128, 49152
DRAFT_VOCAB = 32000
g = torch.Generator().manual_seed(0)


def rand(*shape, scale=0.02):
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def layer(prefix, inputs, zero_outputs):
    out = lambda *s: torch.zeros(*s, dtype=torch.bfloat16) if zero_outputs else rand(*s)
    return {
        f"{prefix}self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, inputs),
        f"{prefix}self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, inputs),
        f"{prefix}self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, inputs),
        f"{prefix}self_attn.o_proj.weight": out(H, HEADS * HEAD_DIM),
        f"{prefix}post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        f"{prefix}mlp.gate_proj.weight": rand(FFN, H),
        f"{prefix}mlp.up_proj.weight": rand(FFN, H),
        f"{prefix}mlp.down_proj.weight": out(H, FFN),
    }


def config(layers, **extra):
    return dict(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H, intermediate_size=FFN,
        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        rms_norm_eps=1e-5, max_position_embeddings=8192, rope_theta=500000.0, vocab_size=VOCAB,
        tie_word_embeddings=layers > 1, torch_dtype="bfloat16"), **extra)


def write(dir, tensors, cfg):
    dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, dir / "model.safetensors")
    (dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


out = Path(sys.argv[1])
target = {"model.embed_tokens.weight": rand(VOCAB, H, scale=1.0), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
for i in range(LAYERS):
    target.update(layer(f"model.layers.{i}.", H, zero_outputs=True))
    target[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
write(out / "target", target, config(LAYERS))

exact = layer("layers.0.", H, zero_outputs=True)
exact["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1).to(torch.bfloat16)
exact["fc.bias"] = torch.zeros(H, dtype=torch.bfloat16)
write(out / "eagle-exact", exact, config(1))

eagle3 = layer("midlayer.", 2 * H, zero_outputs=False)
eagle3.update({
    "midlayer.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
    "midlayer.hidden_norm.weight": torch.ones(H, dtype=torch.bfloat16),
    "fc.weight": rand(H, 3 * H),
    "norm.weight": torch.ones(H, dtype=torch.bfloat16),
    "lm_head.weight": rand(DRAFT_VOCAB, H),
    "d2t": torch.zeros(DRAFT_VOCAB, dtype=torch.int64),
    "t2d": torch.cat([torch.ones(DRAFT_VOCAB, dtype=torch.bool), torch.zeros(VOCAB - DRAFT_VOCAB, dtype=torch.bool)]),
})
write(out / "eagle3-random", eagle3, config(1, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB))
print(out)
