"""Structured output (issue 18) through the real server and the official
`openai` client: `response_format` JSON schemas and `json_object`, forced
tool calls (`required`, a named function) with arguments valid against each
tool's schema in every family's grammar (Hermes JSON, Qwen3-Coder XML, GLM-4.5
XML, gpt-oss harmony), streamed calls (name first, then argument fragments),
`response_format` together with tools (the JSON or calls), and
`chat.completions.parse` with a pydantic model.

The model is the tiny synthetic checkpoint with random weights, sampled at
temperature 1: left alone it writes arbitrary tokens, so every valid output
here is the grammar's doing. Outputs are checked with the `jsonschema`
package (an independent validator). With `--backend cuda` the same tests
run against the CUDA engine.
"""

import json

import jsonschema
import openai
import pydantic
import pytest

from conftest import start_serve

# The Qwen3 template with tools writes a long system prompt.
CONTEXT = 2048

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "file": {"type": "string", "maxLength": 16},
            "range": {
                "type": "object",
                "properties": {
                    "start": {"type": "integer", "minimum": 1, "maximum": 999},
                    "end": {"type": "integer", "minimum": 1, "maximum": 999},
                },
                "required": ["start", "end"],
                "additionalProperties": False,
            },
        },
        "required": ["file", "range"],
        "additionalProperties": False,
    },
    "enums_and_arrays": {
        "type": "object",
        "properties": {
            "level": {"enum": ["debug", "info", "warn"]},
            "codes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                      "minItems": 1, "maxItems": 4},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["level", "codes", "ok"],
        "additionalProperties": False,
    },
    # A JSON number has no digit limit: a random model can write 1.0000...
    # until its tokens run out (seen on the CUDA engine), so the fraction is
    # bounded with multipleOf (which allows no trailing zeros).
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
            "count": {"type": "integer", "minimum": -5, "maximum": 5},
            "note": {"type": ["string", "null"], "maxLength": 8},
        },
        "required": ["ratio", "count", "note"],
        "additionalProperties": False,
    },
}

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file",
        "description": "Read part of a file",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "maxLength": 20},
                "lines": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 500},
                          "maxItems": 3},
            },
            "required": ["path"],
            "additionalProperties": False,
        },
    }},
    {"type": "function", "function": {
        "name": "set_mode",
        "description": "Switch the mode",
        "parameters": {
            "type": "object",
            "properties": {
                "mode": {"enum": ["fast", "safe"]},
                "level": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["mode", "level"],
            "additionalProperties": False,
        },
    }},
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(runtime_bin, tiny_model, pytestconfig):
    s = start_serve(runtime_bin, tiny_model, pytestconfig.getoption("--backend"), CONTEXT)
    yield s
    s.stop()


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(server, seed, **kw):
    kw.setdefault("max_tokens", 200)
    return client(server).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Answer in the format you are given."}],
        temperature=1.0,
        seed=seed,
        **kw,
    )


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(server, name):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    for seed in range(36):
        r = chat(server, seed, response_format=fmt)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (seed, choice)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_on_chat_and_completions(server):
    # Any object: its keys and strings are unbounded, so a random model is
    # usually still inside one when its tokens run out (the schema tests
    # bound their strings); whatever ended is an object.
    for seed in range(8):
        r = chat(server, seed, response_format={"type": "json_object"}, max_tokens=40)
        content = r.choices[0].message.content
        assert content.startswith("{"), content
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(content), dict)
    # Text completions take response_format too (vLLM's extension).
    r = client(server).completions.create(
        model="tiny", prompt="{", max_tokens=200, temperature=1.0, seed=3,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": SCHEMAS["nested"]}}},
    )
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["nested"])


def check_call(call, only=None):
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TOOL_SCHEMAS[call.function.name])
    if only:
        assert call.function.name == only


def test_required_tool_calls_are_valid(server):
    for seed in range(40):
        r = chat(server, seed, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])


def test_named_tool_calls_are_valid(server):
    for seed in range(40):
        name = TOOLS[seed % 2]["function"]["name"]
        r = chat(server, seed, tools=TOOLS, parallel_tool_calls=False,
                 tool_choice={"type": "function", "function": {"name": name}})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        check_call(choice.message.tool_calls[0], only=name)


def test_streamed_required_call_arrives_as_deltas(server):
    check_streamed_call(server)


class Step(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    title: str = pydantic.Field(max_length=12)
    priority: int = pydantic.Field(ge=1, le=5)
    done: bool


def test_parse_with_a_pydantic_model(server):
    for seed in range(5):
        r = client(server).chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": "A step."}],
            response_format=Step, temperature=1.0, seed=seed, max_tokens=200,
        )
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Step), r.choices[0].message.content
        assert 1 <= parsed.priority <= 5


def test_refusals_name_what_is_wrong(server):
    c = client(server)
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}})
    assert e.value.body["param"] == "response_format"
    assert "uniqueItems" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, response_format={"type": "json_object"},
                                  extra_body={"ignore_eos": True})
    assert e.value.body["param"] == "ignore_eos"


def check_answer_or_calls(server, seeds, **extra):
    """`response_format` with tools under `auto`: every answer that ended is
    the schema's JSON or valid calls. Returns how many of each."""
    schema = SCHEMAS["nested"]
    fmt = {"type": "json_schema", "json_schema": {"name": "nested", "schema": schema}}
    c = client(server)
    answers = calls = 0
    for seed in seeds:
        r = c.chat.completions.create(
            model=c.models.list().data[0].id, messages=[{"role": "user", "content": "go"}],
            temperature=1.0, seed=seed, max_tokens=200, tools=TOOLS, response_format=fmt, **extra,
        )
        ch = r.choices[0]
        assert ch.finish_reason in ("stop", "tool_calls", "length"), (seed, ch)
        assert "error" not in (ch.model_extra or {}), (seed, ch)
        if ch.finish_reason == "tool_calls":
            calls += 1
            for call in ch.message.tool_calls:
                check_call(call)
        elif ch.finish_reason == "stop":
            answers += 1
            assert not ch.message.tool_calls
            jsonschema.validate(json.loads(ch.message.content), schema)
    return answers, calls


def test_response_format_with_tools_is_the_json_or_calls(server):
    # Which branch a random model takes depends on its weights (the CUDA run's
    # head_dim 64 model always answered); both are drawn in constrained_tests.rs.
    answers, calls = check_answer_or_calls(server, range(16))
    assert answers + calls > 0, (answers, calls)


# Qwen3-Coder's XML calls (`<tool_call>` + `<function=NAME>` + `<parameter=KEY>` values typed by
# each tool's schema) through the coder template, on the same backend as the other tests.
@pytest.fixture(scope="module")
def coder_server(runtime_bin, tmp_path_factory, pytestconfig):
    from conftest import synth_preset

    extra = ["--chat-template", "qwen3-coder"]
    for kv in pytestconfig.getoption("--synth-set"):
        extra += ["--set", kv]
    if pytestconfig.getoption("--vocab"):
        extra += ["--vocab", pytestconfig.getoption("--vocab")]
    model = synth_preset(runtime_bin, tmp_path_factory, "tiny", *extra)
    s = start_serve(runtime_bin, model, pytestconfig.getoption("--backend"), CONTEXT)
    yield s
    s.stop()


def test_qwen3_coder_xml_calls_are_valid(coder_server):
    # One call each: with parallel calls a random model may go on calling
    # until max_tokens cuts the last call off.
    check_forced_calls(coder_server, parallel_tool_calls=False)


def test_qwen3_coder_xml_call_streams_name_then_arguments(coder_server):
    check_streamed_call(coder_server)


def check_streamed_call(server, **extra):
    """A forced call streams as it is written: the name in the first tool-call
    delta, then the arguments in several fragments that join into valid
    arguments."""
    c = client(server)
    stream = c.chat.completions.create(
        model=c.models.list().data[0].id, messages=[{"role": "user", "content": "go"}],
        temperature=1.0, seed=5, max_tokens=200, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, stream=True, **extra,
    )
    deltas, finish = [], None
    for chunk in stream:
        deltas += chunk.choices[0].delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    name = deltas[0].function.name
    assert name in TOOL_SCHEMAS and not deltas[0].function.arguments
    fragments = [d.function.arguments for d in deltas[1:] if d.function.arguments]
    assert len(fragments) >= 2, deltas
    jsonschema.validate(json.loads("".join(fragments)), TOOL_SCHEMAS[name])


def family_server_of(runtime_bin, tmp_path_factory, pytestconfig, preset, vocab, fetch):
    """`serve` (on the tests' backend) over a synthesized `preset` with its family's vocabulary."""
    from conftest import REPO, synth_with_vocab

    model = synth_with_vocab(runtime_bin, tmp_path_factory, preset,
                             REPO / ".cache" / "vocab" / vocab, fetch)
    return start_serve(runtime_bin, model, pytestconfig.getoption("--backend"), CONTEXT)


def check_forced_calls(server, **extra):
    """12 forced calls, `required` and named alternately: each a valid call."""
    c = client(server)
    for seed in range(12):
        choice = {"type": "function", "function": {"name": "set_mode"}} if seed % 2 else "required"
        r = c.chat.completions.create(
            model=c.models.list().data[0].id, messages=[{"role": "user", "content": "go"}],
            temperature=1.0, seed=seed, max_tokens=200, tools=TOOLS, tool_choice=choice, **extra,
        )
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", (seed, ch)
        check_call(ch.message.tool_calls[0], only="set_mode" if seed % 2 else None)


# GLM-4.5's XML calls (`<tool_call>NAME` + `<arg_key>`/`<arg_value>` pairs, GLM's added
# tokens) over the tiny-glm4-moe checkpoint.
@pytest.fixture(scope="module")
def glm_server(runtime_bin, tmp_path_factory, pytestconfig):
    s = family_server_of(runtime_bin, tmp_path_factory, pytestconfig, "tiny-glm4-moe",
                         "qwen.tiktoken", "tools/vocab.sh")
    yield s
    s.stop()


def test_glm_xml_calls_are_valid(glm_server):
    check_forced_calls(glm_server, parallel_tool_calls=False)


# gpt-oss's harmony calls (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
# + arguments + `<|call|>`, special tokens of o200k_harmony) over tiny-gpt-oss; under `auto` and
# with `response_format` the whole turn is constrained, its reasoning free.
@pytest.fixture(scope="module")
def gpt_oss_server(runtime_bin, tmp_path_factory, pytestconfig):
    s = family_server_of(runtime_bin, tmp_path_factory, pytestconfig, "tiny-gpt-oss",
                         "o200k_base.tiktoken", "tools/harmony/vocab.sh")
    yield s
    s.stop()


def test_harmony_forced_calls_are_valid(gpt_oss_server):
    check_forced_calls(gpt_oss_server)


def test_harmony_forced_call_streams_name_then_arguments(gpt_oss_server):
    check_streamed_call(gpt_oss_server)


def test_harmony_auto_and_response_format_keep_harmony_messages(gpt_oss_server):
    """`auto` and `response_format` constrain the whole harmony turn, the
    reasoning free (the grammars' answers and calls are checked with random
    draws in `constrained_tests.rs`: a random model rarely ends its analysis
    within the budget). Without the grammar this model's random tokens come
    back as content; with it they are an analysis message: reasoning, no
    content, no error."""
    c = client(gpt_oss_server)
    model = c.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "nested", "schema": SCHEMAS["nested"]}}
    for seed, extra in [(0, {"tools": TOOLS}), (1, {"response_format": fmt}),
                        (2, {"tools": TOOLS, "response_format": fmt})]:
        r = c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "go"}], temperature=1.0,
            seed=seed, max_tokens=40, **extra,
        )
        ch = r.choices[0]
        assert "error" not in (ch.model_extra or {}), (seed, ch)
        if ch.finish_reason == "length":
            assert not ch.message.content and (ch.message.model_extra or {}).get("reasoning_content"), ch
        elif ch.finish_reason == "stop" and "response_format" in extra:
            jsonschema.validate(json.loads(ch.message.content), SCHEMAS["nested"])
        elif ch.finish_reason == "tool_calls":
            check_call(ch.message.tool_calls[0])
    plain = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "go"}], temperature=1.0, seed=0,
        max_tokens=40,
    )
    assert plain.choices[0].message.content, "the unconstrained model writes content"
