#!/usr/bin/env python3
"""Hugging Face transformers witness: reference logits for a checkpoint.

Loads a checkpoint directory with transformers in float32 (eager attention,
TF32 off), runs each token sequence as one forward pass without a KV cache,
and writes a fixture directory:

  case.json       synth options, generator version, transformers/torch
                  versions, device, variant, the sequences
  seqN.json       per position: argmax, top_ids, top_vals (top 20, largest first)
  seqN.last.f32   raw little-endian float32 logits of the last position

Variant `source` runs the checkpoint's weights. Variant `int4` first rewrites
every routed expert's gate/up/down weight with its INT4 round trip (int4.py,
the rule of runtime/cache/src/layout.rs) into a temporary copy of the
checkpoint, because transformers 5 fuses experts at load time and the
dequantized values are not representable in bf16.

gpt_oss checkpoints (MXFP4 experts) run variant `source` only: their experts
are decoded by our NumPy oracle into a temporary unquantized copy
(witness_gpt_oss.py), since transformers' own MXFP4 path needs triton kernels
and would share the format decode under test.

Usage: witness.py --checkpoint DIR --sequences FILE.json --out DIR
                  [--variant source|int4] [--device auto|cpu|cuda]
"""

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_oss_layout  # noqa: E402
import witness_gpt_oss  # noqa: E402
from int4 import int4_roundtrip  # noqa: E402

TOP = 20
ROUTED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def fail(msg):
    print(f"witness: error: {msg}", file=sys.stderr)
    sys.exit(1)


def load_sequences(path):
    with open(path) as f:
        data = json.load(f)
    seqs = data["sequences"] if isinstance(data, dict) else data
    out = []
    for i, s in enumerate(seqs):
        if isinstance(s, dict):
            out.append({"name": s.get("name", f"seq{i}"), "ids": [int(t) for t in s["ids"]]})
        else:
            out.append({"name": f"seq{i}", "ids": [int(t) for t in s]})
    if not out or any(len(s["ids"]) == 0 for s in out):
        fail(f"{path}: needs at least one non-empty sequence")
    return out


def cpu_name():
    """The CPU model (for case.json when the witness ran on the CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def mlp_kinds(cfg):
    step = cfg.get("decoder_sparse_step", 1)
    only = set(cfg.get("mlp_only_layers", []))
    return [
        "moe" if (i not in only and cfg["num_experts"] > 0 and (i + 1) % step == 0) else "dense"
        for i in range(cfg["num_hidden_layers"])
    ]


def expected_params_glm4_moe(cfg):
    """glm4_moe's parameter count, from the published layout: q/k/v with
    biases (attention_bias), o_proj without; q/k norms when use_qk_norm; the
    first `first_k_dense_replace` layers dense; MoE layers with the router
    and n_shared_experts ungated shared experts. The e_score_correction_bias
    is a buffer in transformers (not a parameter); the MTP layer is not
    built."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    p = v * h * (1 if cfg.get("tie_word_embeddings") else 2) + h
    attn = h * q + 2 * h * kv + q * h + 2 * h
    if cfg.get("attention_bias"):
        attn += q + 2 * kv
    if cfg.get("use_qk_norm"):
        attn += 2 * hd
    im, e = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        p += attn
        if layer < cfg.get("first_k_dense_replace", 1):
            p += 3 * h * cfg["intermediate_size"]
        else:
            p += e * 3 * h * im + e * h + 3 * h * im * cfg.get("n_shared_experts", 0)
    return p


def expected_params(cfg):
    """Parameter count of the geometry (mirrors Geometry::total_params)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    p = v * h * (1 if cfg.get("tie_word_embeddings") else 2) + h
    attn = h * q + 2 * h * kv + q * h + 2 * hd + 2 * h
    if cfg.get("attention_bias"):
        attn += q + 2 * kv + h  # q, k, v and o_proj biases
    for kind in mlp_kinds(cfg):
        p += attn
        if kind == "moe":
            p += cfg["num_experts"] * (3 * h * cfg["moe_intermediate_size"] + h)
        else:
            p += 3 * h * cfg["intermediate_size"]
    return p


def make_int4_copy(src, dst):
    """Copy of `src` with every routed expert weight INT4 round-tripped (f32)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    replaced = 0
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if not name.endswith(".safetensors"):
            os.symlink(os.path.abspath(path), os.path.join(dst, name))
            continue
        tensors = {}
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if ROUTED.match(key):
                    t = torch.from_numpy(int4_roundtrip(t.to(torch.float32).numpy()))
                    replaced += 1
                tensors[key] = t.contiguous()
        save_file(tensors, os.path.join(dst, name), metadata={"format": "pt"})
    return replaced


def expected_experts(ckpt_dir):
    """{(layer, expert): {"gate"|"up"|"down": f32 tensor}} from the shards."""
    import torch
    from safetensors import safe_open

    experts = {}
    for name in sorted(os.listdir(ckpt_dir)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(ckpt_dir, name), framework="pt") as f:
            for key in f.keys():
                m = ROUTED.match(key)
                if m:
                    l, e, which = int(m.group(1)), int(m.group(2)), m.group(3)
                    experts.setdefault((l, e), {})[which] = f.get_tensor(key).to(torch.float32)
    return experts


def contains(param, target):
    """Is `target` (2-D) a block of rows of `param` or of its transpose?"""
    import torch

    for c in (param, param.t()):
        if c.dim() != 2 or c.shape[1] != target.shape[1] or c.shape[0] % target.shape[0]:
            continue
        for off in range(0, c.shape[0], target.shape[0]):
            if torch.equal(c[off : off + target.shape[0]], target):
                return True
    return False


def verify_experts(model, experts):
    """Every routed expert's weights must appear unchanged in the loaded model,
    whether transformers keeps per-expert Linears or fuses them."""
    params = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    for (l, e), w in sorted(experts.items()):
        prefix = f"model.layers.{l}.mlp.experts."
        per = {which: params.get(f"{prefix}{e}.{which}_proj.weight") for which in w}
        fused = [p[e] for k, p in params.items() if k.startswith(prefix) and p.dim() == 3]
        for which, target in w.items():
            cands = ([per[which]] if per[which] is not None else []) + fused
            if not any(contains(c, target) for c in cands):
                fail(
                    f"layer {l} expert {e} {which}_proj: the loaded model does not hold the "
                    "expected weights (a loader conversion changed them?)"
                )
    return len(experts)


def glm4_verify_buffers(model, ckpt_dir, cfg):
    """Each MoE layer's e_score_correction_bias (a buffer, so no parameter
    count sees it) must hold the checkpoint's f32 values: a loader that left
    it at zeros would route without the bias and still run."""
    import torch
    from safetensors import safe_open

    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    seen = 0
    for name in sorted(os.listdir(ckpt_dir)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(ckpt_dir, name), framework="pt") as f:
            for key in f.keys():
                m = re.match(r"^model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$", key)
                if not m or int(m.group(1)) >= cfg["num_hidden_layers"]:
                    continue
                want = f.get_tensor(key)
                if want.dtype != torch.float32:
                    fail(f"{key}: stored as {want.dtype}, the published checkpoints keep it in f32")
                got = state.get(key)
                if got is None or not torch.equal(got.to(torch.float32), want):
                    fail(f"{key}: the loaded model does not hold the checkpoint's values")
                seen += 1
    moe = cfg["num_hidden_layers"] - cfg.get("first_k_dense_replace", 1)
    if seen != moe:
        fail(f"{seen} e_score_correction_bias tensors checked, {moe} MoE layers")
    print(f"witness: {seen} e_score_correction_bias buffers verified (f32)", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--sequences", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", choices=["source", "int4"], default="source")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    print(f"witness: transformers {transformers.__version__}, torch {torch.__version__}", file=sys.stderr)

    ckpt = os.path.abspath(args.checkpoint)
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    synth = None
    rec_path = os.path.join(ckpt, "krasis_synth.json")
    if os.path.exists(rec_path):
        with open(rec_path) as f:
            synth = json.load(f)
        if synth.get("routed_experts_omitted"):
            fail(f"{ckpt} was synthesized with --experts-in-cache-only; transformers needs the experts")
    seqs = load_sequences(args.sequences)
    for s in seqs:
        bad = [t for t in s["ids"] if not 0 <= t < cfg["vocab_size"]]
        if bad:
            fail(f"sequence {s['name']}: ids {bad[:5]} outside vocab_size {cfg['vocab_size']}")
    if os.path.exists(args.out) and os.listdir(args.out):
        fail(f"{args.out} exists and is not empty")
    os.makedirs(args.out, exist_ok=True)

    if args.device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device = args.device
        if device == "cuda" and not torch.cuda.is_available():
            fail("--device cuda but torch sees no CUDA device")

    gpt_oss = cfg.get("model_type") == "gpt_oss"
    glm4_moe = cfg.get("model_type") == "glm4_moe"
    if gpt_oss and args.variant != "source":
        fail("gpt_oss experts are MXFP4 in the checkpoint itself: only variant source exists")
    tmp = None
    load_dir = ckpt
    extra = {}
    if gpt_oss:
        tmp = tempfile.mkdtemp(prefix="witness-gpt-oss-")
        try:
            n = witness_gpt_oss.make_copy(ckpt, tmp, cfg)
        except (witness_gpt_oss.WitnessError, gpt_oss_layout.LayoutError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            fail(f"{ckpt}: {e}")
        print(f"witness: dequantized {n} MXFP4 expert tensors with the NumPy oracle", file=sys.stderr)
        load_dir = tmp
        # The transcribed per-expert loop of GptOssExperts, not grouped_mm.
        extra["experts_implementation"] = "eager"
    elif args.variant == "int4":
        tmp = tempfile.mkdtemp(prefix="witness-int4-")
        n = make_int4_copy(ckpt, tmp)
        if n == 0:
            fail(f"{ckpt} has no routed expert tensors to quantize")
        print(f"witness: INT4 round-tripped {n} routed expert weights", file=sys.stderr)
        load_dir = tmp
    try:
        # transformers >= 4.56 names the argument `dtype`; older ones `torch_dtype`.
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
        model = AutoModelForCausalLM.from_pretrained(
            load_dir, attn_implementation="eager", **{dtype_kw: torch.float32}, **extra
        )
        model.eval()
        n_params = sum(p.numel() for p in model.parameters())
        if gpt_oss:
            want = witness_gpt_oss.expected_params(cfg)
        elif glm4_moe:
            want = expected_params_glm4_moe(cfg)
            # Some transformers versions hold the selection bias as a
            # parameter rather than a buffer.
            if any(k.endswith("e_score_correction_bias") for k, _ in model.named_parameters()):
                moe = cfg["num_hidden_layers"] - cfg.get("first_k_dense_replace", 1)
                want += moe * cfg["n_routed_experts"]
        else:
            want = expected_params(cfg)
        if n_params != want:
            fail(f"loaded model has {n_params} parameters, the config's geometry has {want}")
        wrong = {str(p.dtype) for p in model.parameters() if p.dtype != torch.float32}
        if wrong:
            fail(f"model parameters are not all float32 ({sorted(wrong)})")
        if gpt_oss:
            try:
                summary = witness_gpt_oss.verify(model, ckpt, cfg, seqs)
            except (witness_gpt_oss.WitnessError, gpt_oss_layout.LayoutError) as e:
                fail(str(e))
            print(f"witness: {n_params} parameters; {summary}", file=sys.stderr)
        else:
            # The MTP layer's experts (glm4_moe, layer num_hidden_layers)
            # are in the checkpoint but not in the model transformers builds.
            experts = {
                k: w for k, w in expected_experts(load_dir).items() if k[0] < cfg["num_hidden_layers"]
            }
            checked = verify_experts(model, experts)
            print(f"witness: {n_params} parameters, {checked} routed experts verified", file=sys.stderr)
            if glm4_moe:
                glm4_verify_buffers(model, load_dir, cfg)
        model.to(device)
        exercised = None
        if gpt_oss:
            longest = max(seqs, key=lambda s: len(s["ids"]))
            ids = torch.tensor([longest["ids"]], dtype=torch.long, device=device)
            try:
                exercised = witness_gpt_oss.exercise(model, ids, cfg["sliding_window"])
            except witness_gpt_oss.WitnessError as e:
                fail(str(e))
            exercised["sequence"] = longest["name"]
            print(f"witness: window and sinks exercised: {exercised}", file=sys.stderr)

        for i, s in enumerate(seqs):
            ids = torch.tensor([s["ids"]], dtype=torch.long, device=device)
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits[0].to(torch.float32)
            if not torch.isfinite(logits).all():
                fail(f"sequence {s['name']}: non-finite logits")
            top_v, top_i = torch.topk(logits, TOP, dim=-1)
            rec = {
                "name": s["name"],
                "tokens": len(s["ids"]),
                "argmax": logits.argmax(dim=-1).cpu().tolist(),
                "top_ids": top_i.cpu().tolist(),
                "top_vals": [[float(x) for x in row] for row in top_v.cpu().numpy()],
            }
            with open(os.path.join(args.out, f"seq{i}.json"), "w") as f:
                json.dump(rec, f)
            last = logits[-1].cpu().numpy().astype("<f4")
            last.tofile(os.path.join(args.out, f"seq{i}.last.f32"))
            print(f"witness: seq{i} ({s['name']}, {len(s['ids'])} tokens) done", file=sys.stderr)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    case = {
        "synth": None
        if synth is None
        else {k: synth.get(k) for k in ("preset", "seed", "dtype", "overrides", "router_skew")},
        "generator_version": None if synth is None else synth.get("generator_version"),
        "config": cfg,
        "variant": args.variant,
        "int4_rule": "runtime/cache/src/layout.rs format 1, re-implemented in tools/witness/int4.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else cpu_name(),
        "tf32": False,
        "attn_implementation": "eager",
        "param_count": n_params,
        "top": TOP,
        "sequences": [s["ids"] for s in seqs],
        "sequence_names": [s["name"] for s in seqs],
    }
    if gpt_oss:
        case["int4_rule"] = None
        case["mxfp4_rule"] = witness_gpt_oss.SOURCE_RULE
        case["experts_implementation"] = model.config._experts_implementation
        case["exercised"] = exercised
    with open(os.path.join(args.out, "case.json"), "w") as f:
        json.dump(case, f, indent=1)
    print(f"witness: wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
