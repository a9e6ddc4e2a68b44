#!/usr/bin/env python3
"""Regenerates sequences-gpt-oss.json (committed; the witness reads only the ids).

Three sequences, each longer than tiny-gpt-oss's 16-token sliding window so
its sliding layers mask (and shorter than gpt-oss-20b's 128, where the full
and sliding layers then agree):
- `harmony`: a system + developer + user conversation rendered for the
  assistant's completion by OpenAI's own `openai-harmony` package
  (HARMONY_GPT_OSS), i.e. the prompt a gpt-oss server feeds the model;
- `english`: an English sentence as o200k_harmony token ids;
- `random64`: 64 fixed random ids below the vocabulary size 201,088 (special
  and reserved ids included).

openai-harmony needs the o200k_base vocabulary offline: this script runs
tools/harmony/vocab.sh unless TIKTOKEN_ENCODINGS_BASE is set.

  python make_sequences_gpt_oss.py           # rewrite sequences-gpt-oss.json
  python make_sequences_gpt_oss.py --check   # fail if it differs
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "sequences-gpt-oss.json"
VOCAB = 201088
RANDOM_SEED = 20261201
ENGLISH = (
    "The quick brown fox jumps over the lazy dog. Mixture-of-experts models route each token "
    "to a few experts, so most of their weights stay idle for any single token, and a sliding "
    "window lets half of the layers forget what lies far behind."
)
DEVELOPER = "Answer in one short sentence."
USER = "What is the capital of France?"


def encoding():
    if not os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        path = subprocess.run(
            ["bash", str(HERE.parent / "harmony" / "vocab.sh")], check=True, capture_output=True, text=True
        ).stdout.strip()
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(Path(path).parent)
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def harmony_prompt(enc):
    from openai_harmony import (
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
    )

    # Every field fixed (the package's defaults could change between versions).
    system = (
        SystemContent.new()
        .with_model_identity("You are ChatGPT, a large language model trained by OpenAI.")
        .with_knowledge_cutoff("2024-06")
        .with_conversation_start_date("2026-12-01")
        .with_reasoning_effort(ReasoningEffort.LOW)
    )
    convo = Conversation.from_messages(
        [
            Message.from_role_and_content(Role.SYSTEM, system),
            Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(DEVELOPER)),
            Message.from_role_and_content(Role.USER, USER),
        ]
    )
    return [int(t) for t in enc.render_conversation_for_completion(convo, Role.ASSISTANT)]


def build():
    enc = encoding()
    chat = harmony_prompt(enc)
    english = [int(t) for t in enc.encode(ENGLISH, allowed_special=set())]
    rng = np.random.default_rng(RANDOM_SEED)
    seqs = [
        {"name": "harmony", "text": enc.decode_utf8(chat), "ids": chat},
        {"name": "english", "text": ENGLISH, "ids": english},
        {
            "name": "random64",
            "text": f"64 ids from numpy default_rng({RANDOM_SEED}).integers(0, {VOCAB})",
            "ids": [int(x) for x in rng.integers(0, VOCAB, 64)],
        },
    ]
    if enc.decode_utf8(english) != ENGLISH:
        sys.exit("english: o200k round trip failed")
    if chat[0] != 200006 or not enc.decode_utf8(chat).endswith("<|start|>assistant"):
        sys.exit(f"harmony: unexpected rendering {enc.decode_utf8(chat)!r}")
    for s in seqs:
        if not 16 < len(s["ids"]) <= 128:
            sys.exit(f"{s['name']}: {len(s['ids'])} tokens; must cross the 16-token window and stay within 128")
    return {
        "generated_by": "tools/witness/make_sequences_gpt_oss.py (openai-harmony, HARMONY_GPT_OSS / o200k_harmony)",
        "sequences": seqs,
    }


def main():
    text = json.dumps(build(), indent=1, ensure_ascii=False) + "\n"
    if "--check" in sys.argv[1:]:
        if OUT.read_text(encoding="utf-8") != text:
            sys.exit(f"{OUT} differs; rerun tools/witness/make_sequences_gpt_oss.py")
        print(f"{OUT.name}: matches")
        return
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
