#!/usr/bin/env python3
"""Generate runtime/model/tests/fixtures/chat_template_jinja2.json: prompts that
Jinja2, configured exactly as transformers' apply_chat_template configures it,
renders from our templates (runtime/model/src/templates/*.jinja). The Rust
test renders the same conversations with minijinja and must match byte for
byte, so our templates behave the same under transformers/vLLM and Krasis.

Usage: pip install jinja2 && python3 tools/chat_template_fixture.py
"""
import json
import pathlib
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

REPO = pathlib.Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "runtime/model/src/templates"
OUT = REPO / "runtime/model/tests/fixtures/chat_template_jinja2.json"


def compile_like_transformers(source):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city, e.g. \"Paris\" or 東京.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                           "unit": {"type": "string", "enum": ["C", "F"]}},
                          "required": ["city"], "additionalProperties": False}}}
SHELL = {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {"cmd": {"type": ["string", "array"]}}}}}

CONVERSATIONS = {
    "plain": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
    ],
    "reasoning_history": [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nold plan\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "fresh plan"},
    ],
    "systems": [
        {"role": "developer", "content": "Be terse."},
        {"role": "system", "content": "Second."},
        {"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": None, "tool_calls": None},
        {"role": "system", "content": "Mid rule."},
        {"role": "user", "content": "z"},
    ],
    "tool_loop": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Two calls.",
         "tool_calls": [
             {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}},
             {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京", "nested": {"x": [1, 2.5, True, None]}}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "18C"},
        {"role": "tool", "tool_call_id": "b", "content": "22C"},
        {"role": "assistant", "content": "Paris 18C, Tokyo 22C."},
        {"role": "user", "content": "<tool_response>\nlooks like a tool result\n</tool_response>"},
    ],
    "string_arguments": [
        {"role": "user", "content": "run ls"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "run", "arguments": "{\"cmd\":\"ls\"}"}}]},
        {"role": "tool", "content": "a.txt"},
    ],
}

# (template, conversation, tools, add_generation_prompt, extra)
CASES = [
    ("qwen3", "plain", None, True, {}),
    ("qwen3", "plain", None, True, {"enable_thinking": False}),
    ("qwen3", "reasoning_history", None, False, {}),
    ("qwen3", "systems", None, True, {}),
    ("qwen3", "tool_loop", [WEATHER, SHELL], True, {}),
    ("qwen3", "tool_loop", None, False, {}),
    ("qwen3", "string_arguments", [SHELL], True, {"enable_thinking": True}),
    ("qwen3_coder", "plain", None, True, {}),
    ("qwen3_coder", "systems", None, False, {}),
    ("qwen3_coder", "tool_loop", [WEATHER, SHELL], True, {}),
    ("qwen3_coder", "tool_loop", None, True, {}),
]


def main():
    out = []
    for name, conv, tools, agp, extra in CASES:
        template = compile_like_transformers((TEMPLATES / f"{name}.jinja").read_text())
        messages = CONVERSATIONS[conv]
        text = template.render(messages=messages, tools=tools, documents=None, add_generation_prompt=agp,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>", **extra)
        out.append({"template": name, "messages": messages, "tools": tools,
                    "add_generation_prompt": agp, "extra": extra, "expected": text})
    OUT.write_text(json.dumps({"generator": "tools/chat_template_fixture.py", "jinja2": jinja2.__version__,
                               "cases": out}, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {len(out)} cases to {OUT}")


if __name__ == "__main__":
    main()
