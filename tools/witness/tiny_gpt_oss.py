#!/usr/bin/env python3
"""A tiny gpt-oss checkpoint in the published layout, without krasis-runtime.

For developing and testing the gpt_oss witness on a machine without the Rust
build; the fixtures themselves come from `krasis-runtime synth --preset
tiny-gpt-oss` (run_device.sh). The geometry is the tiny-gpt-oss preset's
(runtime/model/src/arch/gpt_oss/presets.rs): openai/gpt-oss-20b's config.json
with 4 layers (sliding window 16 / full), hidden 128, 8 experts top-2, FFN 64,
4 query / 2 KV heads of 64, YaRN, the full 201,088 vocabulary. Tensors are as
in openai/gpt-oss-20b: BF16 everywhere except the experts' MXFP4 `*_blocks` /
`*_scales` (U8). No tokenizer is written (the witness reads token ids).

  python tiny_gpt_oss.py OUT_DIR [--seed N]
Needs torch, safetensors and NumPy.
"""

import argparse
import json
import os

import numpy as np


def config():
    layers = 4
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": layers,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 16,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 201088,
    }


def tensors(cfg, rng):
    """{name: (numpy array, "bf16" | "u8")} of the whole checkpoint."""
    h, v, i_ = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    hd, nq, nkv, e = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_local_experts"]

    def normal(shape, std):
        return ((rng.standard_normal(shape) * std).astype(np.float32), "bf16")

    def mxfp4(rows, cols):
        blocks = rng.integers(0, 256, size=(e, rows, cols // 32, 16), dtype=np.uint8)
        # Scales 2^-7..2^-4: weights up to 6 * 2^-4, the magnitudes of a trained checkpoint.
        scales = rng.integers(120, 124, size=(e, rows, cols // 32), dtype=np.uint8)
        return (blocks, "u8"), (scales, "u8")

    out = {
        "model.embed_tokens.weight": normal((v, h), 1.0),
        "lm_head.weight": normal((v, h), 0.05),
        "model.norm.weight": ((1.0 + rng.standard_normal(h) * 0.1).astype(np.float32), "bf16"),
    }
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + norm + ".weight"] = ((1.0 + rng.standard_normal(h) * 0.1).astype(np.float32), "bf16")
        for proj, rows, cols in (("q", nq * hd, h), ("k", nkv * hd, h), ("v", nkv * hd, h), ("o", h, nq * hd)):
            out[f"{p}self_attn.{proj}_proj.weight"] = normal((rows, cols), cols**-0.5)
            out[f"{p}self_attn.{proj}_proj.bias"] = normal((rows,), 0.1)
        # Sinks near the attention logits' scale, so they take a real share of the softmax.
        out[p + "self_attn.sinks"] = normal((nq,), 1.0)
        out[p + "mlp.router.weight"] = normal((e, h), 0.3)
        out[p + "mlp.router.bias"] = normal((e,), 0.5)
        x = p + "mlp.experts."
        out[x + "gate_up_proj_blocks"], out[x + "gate_up_proj_scales"] = mxfp4(2 * i_, h)
        out[x + "gate_up_proj_bias"] = normal((e, 2 * i_), 0.1)
        out[x + "down_proj_blocks"], out[x + "down_proj_scales"] = mxfp4(h, i_)
        out[x + "down_proj_bias"] = normal((e, h), 0.1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    cfg = config()
    rng = np.random.default_rng(args.seed)
    os.makedirs(args.out, exist_ok=False)
    ts = {}
    for name, (arr, kind) in tensors(cfg, rng).items():
        t = torch.from_numpy(arr)
        ts[name] = t.to(torch.bfloat16) if kind == "bf16" else t
    save_file(ts, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    print(f"wrote {args.out} ({len(ts)} tensors)")


if __name__ == "__main__":
    main()
