#!/usr/bin/env python3
"""Writes tests/fixtures/harmony/completions.json: how OpenAI's own harmony
parser (the `openai-harmony` PyPI package) reads a set of gpt-oss completions.

The Rust harmony parser (runtime/server/src/output/harmony.rs) is tested
against this file, so the expected channels, recipients and contents come from
an independent implementation rather than from our reading of the spec.

The package needs the o200k_base vocabulary offline: run
`tools/harmony/vocab.sh` (fetches it from crates.io through cargo) and point
TIKTOKEN_ENCODINGS_BASE at its folder, or just run this script, which does both.

  python tools/harmony/oracle.py           # rewrite the fixture
  python tools/harmony/oracle.py --check   # fail if the fixture differs
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "harmony" / "completions.json"

# Each completion is what the model writes after the prompt's
# `<|start|>assistant`, the stop token (`<|return|>` or `<|call|>`) included.
CASES = [
    (
        "reasoning_then_final",
        "<|channel|>analysis<|message|>User asks 2+2. Simple: 4.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
    ),
    (
        "final_only",
        "<|channel|>final<|message|>Just the answer, no analysis.<|return|>",
    ),
    (
        "reasoning_then_tool_call",
        "<|channel|>analysis<|message|>Need the weather; call get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"location":"Tokyo"}<|call|>',
    ),
    (
        "recipient_before_channel",
        "<|channel|>analysis<|message|>Check Paris.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"location": "Paris", "unit": "celsius"}<|call|>',
    ),
    (
        "two_tool_calls",
        "<|channel|>analysis<|message|>Two lookups.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"location":"Oslo"}<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.get_time "
        '<|constrain|>json<|message|>{"tz":"Europe/Oslo"}<|call|>',
    ),
    (
        "commentary_preamble_then_call",
        "<|channel|>analysis<|message|>Plan: search.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>I'll look that up for you.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.search "
        '<|constrain|>json<|message|>{"query":"rust async"}<|call|>',
    ),
    (
        "unicode",
        "<|channel|>analysis<|message|>Die Frage ist auf Deutsch — 日本語も 🙂<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Grüße! こんにちは 🌍 ½ café<|return|>",
    ),
    (
        "json_with_nested_braces_and_special_looking_text",
        "<|channel|>analysis<|message|>Write the file; mind <| and |> and <|im_end|>.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.write_file "
        "<|constrain|>json<|message|>"
        '{"path":"src/a.rs","content":"fn main() { let s = \\"<|im_end|> <|chan |>\\"; }",'
        '"meta":{"nested":{"list":[1,{"k":"}"},[]],"empty":{}}}}<|call|>',
    ),
    (
        "multiline_reasoning_and_answer",
        "<|channel|>analysis<|message|>Line one.\n\nLine two with `code`.\n<|end|>"
        "<|start|>assistant<|channel|>final<|message|>**Answer**\n\n- a\n- b\n<|return|>",
    ),
]


def vocab_dir() -> str:
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        return os.environ["TIKTOKEN_ENCODINGS_BASE"]
    path = subprocess.run(
        ["bash", str(ROOT / "tools" / "harmony" / "vocab.sh")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return str(Path(path).parent)


def parse_all():
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = vocab_dir()
    from openai_harmony import HarmonyEncodingName, Role, load_harmony_encoding

    enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    out = []
    for name, completion in CASES:
        tokens = enc.encode(completion, allowed_special="all")
        messages = []
        for m in enc.parse_messages_from_completion_tokens(tokens, Role.ASSISTANT):
            d = m.to_dict()
            messages.append(
                {
                    "channel": d.get("channel"),
                    "recipient": d.get("recipient"),
                    "content_type": d.get("content_type"),
                    "content": "".join(
                        c["text"] for c in d["content"] if c.get("type") == "text"
                    ),
                }
            )
        out.append({"name": name, "completion": completion, "messages": messages})
    return {
        "source": "openai-harmony (PyPI) parse_messages_from_completion_tokens, "
        "HARMONY_GPT_OSS encoding, role assistant; written by tools/harmony/oracle.py",
        "cases": out,
    }


def main():
    text = json.dumps(parse_all(), indent=2, ensure_ascii=False) + "\n"
    if "--check" in sys.argv[1:]:
        if FIXTURE.read_text(encoding="utf-8") != text:
            sys.exit(f"{FIXTURE} differs from the oracle's parse; rerun tools/harmony/oracle.py")
        print(f"{FIXTURE.name}: matches the oracle")
        return
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(text, encoding="utf-8")
    print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    main()
