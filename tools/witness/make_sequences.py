#!/usr/bin/env python3
"""Regenerates sequences.json (committed; the witness reads only the ids).

Needs the `tokenizers` package and a tokenizer.json written by
`krasis-runtime synth` (built from the real Qwen vocabulary):
  python3 make_sequences.py CHECKPOINT_DIR/tokenizer.json > sequences.json
"""

import json
import sys

import numpy as np
from tokenizers import Tokenizer

ENGLISH = (
    "The quick brown fox jumps over the lazy dog. Mixture-of-experts models route "
    "each token to a few experts, so most of their weights stay idle for any single token."
)
# The Qwen3 chat format of a system + user turn with the generation prompt,
# as our qwen3 template renders it.
CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
RANDOM_SEED = 20251130


def main():
    tok = Tokenizer.from_file(sys.argv[1])
    rng = np.random.default_rng(RANDOM_SEED)
    seqs = [
        {"name": "english", "text": ENGLISH, "ids": tok.encode(ENGLISH, add_special_tokens=False).ids},
        {"name": "chat", "text": CHAT, "ids": tok.encode(CHAT, add_special_tokens=False).ids},
        {
            "name": "random64",
            "text": f"64 ids from numpy default_rng({RANDOM_SEED}).integers(0, 151643)",
            "ids": [int(x) for x in rng.integers(0, 151643, 64)],
        },
    ]
    for s in seqs[:2]:
        back = tok.decode(s["ids"], skip_special_tokens=False)
        if back != s["text"]:
            sys.exit(f"{s['name']}: tokenizer round trip failed: {back!r}")
    json.dump({"generated_by": "tools/witness/make_sequences.py", "sequences": seqs}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
