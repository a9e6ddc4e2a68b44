#!/usr/bin/env python3
"""Writes tests/fixtures/harmony/token_ids.json: the token ids OpenAI's own
gpt-oss tokenizer (the `openai-harmony` PyPI package, HARMONY_GPT_OSS encoding,
i.e. o200k_harmony) gives a set of texts, with every special token allowed,
plus a conversation rendered by the package itself.

The Rust tokenizer built from the same ranks by
`krasis_model::tokenizer::build_harmony_tokenizer_json` (what `krasis-runtime
synth` writes into gpt-oss checkpoints) is tested against this file
(runtime/model/tests/tokenizer_harmony.rs), so ids, split pattern and special
tokens come from an independent implementation.

  python tools/harmony/token_ids.py           # rewrite the fixture
  python tools/harmony/token_ids.py --check   # fail if the fixture differs

Needs the o200k_base vocabulary offline: it runs tools/harmony/vocab.sh
(through oracle.py's vocab_dir) and points TIKTOKEN_ENCODINGS_BASE at it.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle import ROOT, vocab_dir  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "harmony" / "token_ids.json"

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's John's, we've seen 'em; you'd KNOW'S I'LL",
    "HTTPServer parseJSONResponse camelCaseWords XMLHttpRequest",
    "  \n\n",
    "   leading and trailing spaces   ",
    "tabs\tand\t\tmore\ttabs\n\tindented",
    "line one\r\nline two\r\n\r\nline four",
    "1234567890 3.14159 -42 1e10 0x1F 1,000,000 12 123 1234",
    "path/to/file.rs\nhttps://example.com/a/b?c=d\n//comment\n",
    "你好，世界！今天天气很好。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장도 테스트합니다.",
    "Привет, мир! Ёжик в тумане.",
    "مرحبا بالعالم",
    "हिन्दी पाठ",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "Accents: café naïve résumé Zürich São Paulo",
    "Decomposed: cafe\u0301 and A\u030a (no normalizer: they stay decomposed)",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n}\n",
    "{\"key\": [1, 2, {\"nested\": null}], \"s\": \"v\\n\"}",
    "!!!???... --- ___ *** ### @@@ ~~~",
    "a\n\n\n\nb\n \n  \nc",
    "Zero\u200bwidth\u00a0nbsp\u3000ideographic space",
    "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant",
    "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final"
    "<|message|>4<|return|>",
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location":"Tokyo"}<|call|>',
    "<|startoftext|><|endoftext|><|reserved_200000|><|reserved_200018|><|reserved_201087|>",
    "not special here: <|endofprompt|> <|im_start|> <|reserved_201089|> <|chan nel|>",
    "",
]


def conversation(enc):
    from openai_harmony import (
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
    )

    convo = Conversation.from_messages(
        [
            Message.from_role_and_content(
                Role.SYSTEM,
                SystemContent.new()
                .with_reasoning_effort(ReasoningEffort.LOW)
                .with_conversation_start_date("2025-08-05"),
            ),
            Message.from_role_and_content(
                Role.DEVELOPER,
                DeveloperContent.new().with_instructions("Answer briefly."),
            ),
            Message.from_role_and_content(Role.USER, "What is the capital of France?"),
            Message.from_role_and_content(Role.ASSISTANT, "Paris.").with_channel("final"),
            Message.from_role_and_content(Role.USER, "And of Japan? Answer in 日本語."),
        ]
    )
    return enc.render_conversation_for_completion(convo, Role.ASSISTANT)


def build():
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = vocab_dir()
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    # openai-harmony 0.0.8 also makes `<|reserved_201088|>` special, an id
    # past gpt-oss's vocab_size (201,088 embedding rows, ids 0..=201087);
    # tiktoken's o200k_harmony and tiktoken-rs stop at 201087, and so does
    # the Rust tokenizer, so no case here uses it. Fail if that changes.
    ids = sorted(enc.encode(t, allowed_special="all")[0] for t in enc.special_tokens_set)
    assert ids == list(range(199998, 201089)), "openai-harmony's special ids changed"
    cases = [
        {"text": t, "ids": list(enc.encode(t, allowed_special="all"))} for t in TEXTS
    ]
    rendered = list(conversation(enc))
    cases.append({"text": enc.decode_utf8(rendered), "ids": rendered, "rendered": True})
    return cases


def main():
    cases = build()
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    head = {
        "generator": "tools/harmony/token_ids.py",
        "oracle": "openai-harmony (PyPI) HARMONY_GPT_OSS encode(allowed_special='all'); "
        "the last case is render_conversation_for_completion",
    }
    text = json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [\n' + body + "\n]}\n"
    if "--check" in sys.argv[1:]:
        if FIXTURE.read_text(encoding="utf-8") != text:
            sys.exit(f"{FIXTURE} differs from the oracle's ids; rerun tools/harmony/token_ids.py")
        print(f"{FIXTURE.name}: matches the oracle")
        return
    FIXTURE.write_text(text, encoding="utf-8")
    print(f"wrote {len(cases)} cases to {FIXTURE}")


if __name__ == "__main__":
    main()
