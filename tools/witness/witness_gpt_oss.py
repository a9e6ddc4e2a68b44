"""The gpt_oss side of witness.py: the dequantized checkpoint copy and its checks.

transformers would dequantize MXFP4 itself only through its triton-kernels
integration, and that decode is the very thing our engines' MXFP4 path is
tested against, so it must not be the witness's. Instead the experts are
decoded by our spec-derived NumPy oracle (mxfp4_oracle.py) and written, with
`quantization_config` removed, as the unquantized GptOssExperts parameters
(gpt_oss_layout.py says which layout and why) into a temporary copy that
transformers loads like a BF16 re-export of the model.

After loading, every parameter of the model is compared with the value it must
hold (the checkpoint's tensor upcast to float32, or the oracle's decode for the
experts), each layer's experts module is run against OpenAI's reference expert
computation on the checkpoint's own orientation, and the features the fixtures
exist to pin (sliding-window layers, sinks, YaRN) are checked to be active.
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_oss_layout as gl  # noqa: E402

SOURCE_RULE = (
    "MXFP4 experts decoded by tools/witness/mxfp4_oracle.py (OCP MX v1.0), laid out as transformers' "
    "GptOssExperts by tools/witness/gpt_oss_layout.py; quantization_config removed"
)


class WitnessError(RuntimeError):
    pass


def expected_params(cfg):
    """Parameter count of a gpt_oss config (biases, sinks, router bias included)."""
    h, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    e, i = cfg["num_local_experts"], cfg["intermediate_size"]
    p = v * h * (1 if cfg.get("tie_word_embeddings") else 2) + h
    attn = (h * q + q) + 2 * (h * kv + kv) + (q * h + h) + cfg["num_attention_heads"]
    moe = (e * h + e) + e * (h * 2 * i + 2 * i) + e * (i * h + h)
    return p + cfg["num_hidden_layers"] * (attn + moe + 2 * h)


def _read_shards(ckpt):
    """{name: torch tensor} and {name: shard file} of every tensor in the checkpoint."""
    from safetensors import safe_open

    tensors, where = {}, {}
    for name in sorted(os.listdir(ckpt)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(ckpt, name), framework="pt") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
                    where[key] = name
    return tensors, where


def _oracle_experts(cfg, tensors):
    packed = {k: t.numpy() for k, t in tensors.items() if gl.PACKED.match(k)}
    want = 4 * cfg["num_hidden_layers"]
    if len(packed) != want:
        raise WitnessError(
            f"{len(packed)} packed MXFP4 expert tensors, the config's {cfg['num_hidden_layers']} layers need {want}"
        )
    return gl.convert(packed, cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"])


def make_copy(src, dst, cfg):
    """Writes the dequantized copy of `src` into `dst`; returns the number of expert tensors replaced."""
    import torch
    from safetensors.torch import save_file

    if (cfg.get("quantization_config") or {}).get("quant_method") != "mxfp4":
        raise WitnessError("a gpt_oss checkpoint must declare quantization_config.quant_method mxfp4")
    tensors, where = _read_shards(src)
    experts = _oracle_experts(cfg, tensors)
    shards = {}
    for key, t in tensors.items():
        if not gl.PACKED.match(key):
            shards.setdefault(where[key], {})[key] = t.contiguous()
    for key, arr in experts.items():  # next to the blocks they replace
        shards.setdefault(where[key + "_blocks"], {})[key] = torch.from_numpy(arr)
    for name, ts in shards.items():
        save_file(ts, os.path.join(dst, name), metadata={"format": "pt"})

    out_cfg = dict(cfg)
    del out_cfg["quantization_config"]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(out_cfg, f, indent=2)
    index = "model.safetensors.index.json"
    if os.path.exists(os.path.join(src, index)):
        with open(os.path.join(src, index)) as f:
            idx = json.load(f)
        idx["weight_map"] = {k: where[k] for k in tensors if not gl.PACKED.match(k)}
        idx["weight_map"].update({k: where[k + "_blocks"] for k in experts})
        with open(os.path.join(dst, index), "w") as f:
            json.dump(idx, f, indent=2)
    for name in sorted(os.listdir(src)):
        if not name.endswith(".safetensors") and name not in ("config.json", index):
            os.symlink(os.path.abspath(os.path.join(src, name)), os.path.join(dst, name))
    return len(experts)


def verify(model, src, cfg, seqs):
    """The loaded model holds exactly the checkpoint, runs the experts as the
    reference does, and has the features the fixtures pin; returns a summary."""
    import torch

    tensors, _ = _read_shards(src)
    experts = _oracle_experts(cfg, tensors)
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    expected = {k: t.to(torch.float32) for k, t in tensors.items() if not gl.PACKED.match(k)}
    expected.update({k: torch.from_numpy(v) for k, v in experts.items()})
    if set(state) != set(expected):
        raise WitnessError(
            f"model parameters and checkpoint tensors differ: only in the model "
            f"{sorted(set(state) - set(expected))[:5]}, only in the checkpoint {sorted(set(expected) - set(state))[:5]}"
        )
    for key, want in expected.items():
        got = state[key]
        if got.shape == want.shape and torch.equal(got, want):
            continue
        # "Both layouts": a load that kept the checkpoint's [E, rows, cols] is named as such.
        if key in experts and got.shape == want.transpose(1, 2).shape and torch.equal(got, want.transpose(1, 2)):
            raise WitnessError(
                f"{key}: loaded transposed ([E, rows, cols] of the checkpoint), not as GptOssExperts uses it"
            )
        raise WitnessError(f"{key}: loaded {tuple(got.shape)} differs from the checkpoint's {tuple(want.shape)} values")

    probed = _probe_experts(model, cfg, tensors)
    window = cfg["sliding_window"]
    kinds = cfg["layer_types"]
    for layer, kind in zip(model.model.layers, kinds):
        want_window = window if kind == "sliding_attention" else None
        if layer.self_attn.sliding_window != want_window:
            raise WitnessError(f"layer {kind}: sliding_window {layer.self_attn.sliding_window}, expected {want_window}")
    if "sliding_attention" not in kinds or "full_attention" not in kinds:
        raise WitnessError(f"layer_types {kinds} must mix sliding and full attention")
    longest = max(len(s["ids"]) for s in seqs)
    if longest <= window:
        raise WitnessError(f"no sequence is longer than the {window}-token window: the sliding layers would not mask")
    rot = model.model.rotary_emb
    if rot.rope_type != "yarn" or not rot.attention_scaling > 1.0:
        raise WitnessError(f"rotary embedding is {rot.rope_type} (scaling {rot.attention_scaling}), expected YaRN")
    if model.config._experts_implementation != "eager":
        raise WitnessError(f"experts implementation {model.config._experts_implementation}, expected eager")
    return (
        f"{len(expected)} tensors equal the checkpoint ({len(experts)} MXFP4 via the oracle), "
        f"{probed} experts probed, window {window} < {longest} tokens, YaRN scaling {rot.attention_scaling:.4f}"
    )


def _probe_experts(model, cfg, tensors):
    """Runs each layer's GptOssExperts for every expert on fixed rows and compares
    with gpt_oss_layout.expert_reference on the checkpoint's orientation: a
    transposed or mis-interleaved load fails here even where shapes are square."""
    import torch

    rng = np.random.default_rng(0)
    h = cfg["hidden_size"]
    n = 0
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        w_gu = gl.dequantize(tensors[p + "gate_up_proj_blocks"].numpy(), tensors[p + "gate_up_proj_scales"].numpy())
        w_dn = gl.dequantize(tensors[p + "down_proj_blocks"].numpy(), tensors[p + "down_proj_scales"].numpy())
        b_gu = tensors[p + "gate_up_proj_bias"].to(torch.float32).numpy()
        b_dn = tensors[p + "down_proj_bias"].to(torch.float32).numpy()
        module = model.model.layers[layer].mlp.experts
        x = (rng.standard_normal((4, h)) * 2.0).astype(np.float32)
        for e in range(cfg["num_local_experts"]):
            with torch.no_grad():
                got = module(
                    torch.from_numpy(x),
                    torch.full((4, 1), e, dtype=torch.long),
                    torch.ones((4, 1), dtype=torch.float32),
                ).numpy()
            want = gl.expert_reference(x, w_gu[e], b_gu[e], w_dn[e], b_dn[e])
            err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
            if not err < 1e-5:
                raise WitnessError(
                    f"layer {layer} expert {e}: GptOssExperts differs from the reference by {err:.3g} (relative)"
                )
            n += 1
    return n


def exercise(model, ids, window):
    """Shows, on one sequence longer than the window, that the features the
    fixtures pin change the logits where they must and nowhere else:
    - widening the window leaves positions < window unchanged (there the
      sliding mask equals the causal one: transformers lets position i see keys
      i-window+1..i) and changes every later one;
    - sinks of -inf (no sink) change every position.
    Returns the largest changes, for case.json."""
    import torch

    def logits():
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits[0].to(torch.float32)

    base = logits()
    saved = model.config.sliding_window
    model.config.sliding_window = 1 << 30  # read by the mask builder at each forward
    try:
        wide = logits()
    finally:
        model.config.sliding_window = saved
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    kept = [s.detach().clone() for s in sinks]
    try:
        with torch.no_grad():
            for s in sinks:
                s.fill_(float("-inf"))
        nosink = logits()
    finally:
        with torch.no_grad():
            for s, k in zip(sinks, kept):
                s.copy_(k)
    # Bit-identical on the CPU; a GPU may pick other kernels for other masks.
    tol = 1e-6 * base.abs().max().item()
    if not (logits() - base).abs().max().item() <= tol:
        raise WitnessError("restoring the window and sinks did not restore the logits")
    early = (wide[:window] - base[:window]).abs().max().item()
    late = (wide[window:] - base[window:]).abs().max(dim=-1).values
    sink = (nosink - base).abs().max(dim=-1).values
    if not early <= tol:
        raise WitnessError(f"a wider window changed positions < {window} by {early}")
    if not late.min().item() > tol or not late.max().item() > 1e-3:
        raise WitnessError(f"the sliding window does not change the logits past position {window} ({late.tolist()})")
    if not sink.min().item() > tol or not sink.max().item() > 1e-3:
        raise WitnessError(f"the sinks do not change the logits ({sink.tolist()})")
    return {
        "sequence_tokens": int(ids.shape[1]),
        "window": window,
        "max_change_widening_window_before_window": early,
        "max_change_widening_window_from_window": late.max().item(),
        "min_change_widening_window_from_window": late.min().item(),
        "max_change_without_sinks": sink.max().item(),
    }
