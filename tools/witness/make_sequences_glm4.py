#!/usr/bin/env python3
"""Writes sequences-glm4.json (committed; the witness reads only the ids) for
glm4_moe, from a checkpoint written by `krasis-runtime synth --preset
tiny-glm4-moe`: its tokenizer.json and chat template, read by transformers'
AutoTokenizer (so the chat sequence is rendered by transformers' own Jinja
path, not ours):
  python3 make_sequences_glm4.py CHECKPOINT_DIR > sequences-glm4.json
Sequences: an English sentence; a system + user + assistant tool call + tool
result + user conversation rendered with the generation prompt (GLM's
[gMASK]<sop>, role tokens, <think></think>, <tool_call>/<arg_key>/<arg_value>,
<|observation|>/<tool_response>); 64 fixed random ids below 151,552 (the
embedding rows, padding included).
"""

import json
import sys

import numpy as np
from transformers import AutoTokenizer

ENGLISH = (
    "The quick brown fox jumps over the lazy dog. Mixture-of-experts models route "
    "each token to a few experts, so most of their weights stay idle for any single token."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
        ],
    },
    {"role": "tool", "content": "Sunny, 21 C."},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]
RANDOM_SEED = 20251201


def main():
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    chat = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    # The rendered text already starts with [gMASK]<sop>: no special tokens added.
    chat_ids = tok.encode(chat, add_special_tokens=False)
    for marker in ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<tool_call>", "<arg_key>",
                   "<arg_value>", "<|observation|>", "<tool_response>", "<think>"]:
        mid = tok.convert_tokens_to_ids(marker)
        if mid not in chat_ids:
            sys.exit(f"chat: {marker} (id {mid}) is not among the rendered ids")
    rng = np.random.default_rng(RANDOM_SEED)
    seqs = [
        {"name": "english", "text": ENGLISH, "ids": tok.encode(ENGLISH, add_special_tokens=False)},
        {"name": "chat", "text": chat, "ids": list(chat_ids)},
        {
            "name": "random64",
            "text": f"64 ids from numpy default_rng({RANDOM_SEED}).integers(0, 151552)",
            "ids": [int(x) for x in rng.integers(0, 151552, 64)],
        },
    ]
    for s in seqs[:2]:
        back = tok.decode(s["ids"], skip_special_tokens=False)
        if back != s["text"]:
            sys.exit(f"{s['name']}: tokenizer round trip failed: {back!r}")
    json.dump({"generated_by": "tools/witness/make_sequences_glm4.py", "sequences": seqs}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
