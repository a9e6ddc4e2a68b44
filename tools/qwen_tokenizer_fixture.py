#!/usr/bin/env python3
"""Generate runtime/model/tests/fixtures/qwen_tiktoken_ids.json: token ids the
reference `tiktoken` library produces for the Qwen ranks over a tricky corpus.
The Rust test encodes the same texts through our generated tokenizer.json and
must get identical ids.

Usage: pip install tiktoken && bash tools/vocab.sh &&
       python3 tools/qwen_tokenizer_fixture.py
"""
import base64
import json
import pathlib
import sys
import unicodedata

import tiktoken

REPO = pathlib.Path(__file__).resolve().parent.parent
VOCAB = REPO / ".cache/vocab/qwen.tiktoken"
OUT = REPO / "runtime/model/tests/fixtures/qwen_tiktoken_ids.json"

PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's John's, we've seen 'em; you'd KNOW'S I'LL",
    "  \n\n",
    "   leading and trailing spaces   ",
    "tabs\tand\t\tmore\ttabs\n\tindented",
    "line one\r\nline two\r\n\r\nline four",
    "1234567890 3.14159 -42 1e10 0x1F 1,000,000",
    "你好，世界！今天天气很好。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장도 테스트합니다.",
    "Привет, мир! Ёжик в тумане.",
    "مرحبا بالعالم",
    "עברית עם ניקוד",
    "हिन्दी पाठ",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "Accents: café naïve résumé Zürich São Paulo",
    "Decomposed: cafe\u0301 and A\u030a (NFC must compose them)",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "<html><body class=\"x\">&nbsp;&lt;tag&gt;</body></html>",
    "{\"key\": [1, 2, {\"nested\": null}], \"s\": \"v\\n\"}",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
    "$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$ ∑∏√∞ ≤≥≠",
    "!!!???... --- ___ *** ### @@@ ~~~",
    "a\n\n\n\nb\n \n  \nc",
    "    ",
    "mixedCASEWordsAndSnake_case_identifiers42x",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning\n</think>\n\nanswer <tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "Zero\u200bwidth\u00a0nbsp\u3000ideographic space",
    "",
]


def main() -> None:
    if not VOCAB.is_file():
        sys.exit(f"{VOCAB} missing; run tools/vocab.sh first")
    ranks = {}
    for line in VOCAB.read_text().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    specials = {s: len(ranks) + i for i, s in enumerate(SPECIALS)}
    enc = tiktoken.Encoding("qwen", pat_str=PAT, mergeable_ranks=ranks, special_tokens=specials)
    cases = []
    for text in TEXTS:
        ids = enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        cases.append({"text": text, "ids": ids})
    # One case per line keeps the fixture reviewable in diffs.
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    head = {"generator": "tools/qwen_tokenizer_fixture.py", "tiktoken": tiktoken.__version__}
    OUT.write_text(json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [\n' + body + "\n]}\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
