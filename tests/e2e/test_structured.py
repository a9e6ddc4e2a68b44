"""Structured output (issue 18) through the real server and the official
`openai` client: `response_format` JSON schemas and `json_object`, forced
tool calls (`required`, a named function) with arguments valid against each
tool's schema, and `chat.completions.parse` with a pydantic model.

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
    """The call streams as the model writes it: the name in the first
    tool-call delta, then the arguments in several fragments."""
    stream = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "go"}], temperature=1.0, seed=5,
        max_tokens=200, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, stream=True,
    )
    deltas, finish = [], None
    for chunk in stream:
        deltas += chunk.choices[0].delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    name = deltas[0].function.name
    assert name in TOOL_SCHEMAS and deltas[0].function.arguments == ""
    fragments = [d.function.arguments for d in deltas[1:] if d.function.arguments]
    assert len(fragments) >= 2, deltas
    jsonschema.validate(json.loads("".join(fragments)), TOOL_SCHEMAS[name])


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
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, response_format={"type": "json_object"},
                                  tools=TOOLS)
    assert e.value.body["param"] == "response_format"


def reference_server_of(runtime_bin, tmp_path_factory, preset, vocab, fetch):
    """`serve --backend reference` over a synthesized `preset` with its family's vocabulary."""
    from conftest import REPO, synth_with_vocab

    model = synth_with_vocab(runtime_bin, tmp_path_factory, preset,
                             REPO / ".cache" / "vocab" / vocab, fetch)
    return start_serve(runtime_bin, model, "reference", CONTEXT)


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
# tokens) on the reference engine over the tiny-glm4-moe checkpoint.
@pytest.fixture(scope="module")
def glm_server(runtime_bin, tmp_path_factory):
    s = reference_server_of(runtime_bin, tmp_path_factory, "tiny-glm4-moe", "qwen.tiktoken",
                            "tools/vocab.sh")
    yield s
    s.stop()


def test_glm_xml_calls_are_valid(glm_server):
    check_forced_calls(glm_server, parallel_tool_calls=False)


# gpt-oss's harmony calls (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
# + arguments + `<|call|>`, special tokens of o200k_harmony) on the reference engine over
# tiny-gpt-oss: forced calls are constrained (auto calls are parsed as written).
@pytest.fixture(scope="module")
def gpt_oss_server(runtime_bin, tmp_path_factory):
    s = reference_server_of(runtime_bin, tmp_path_factory, "tiny-gpt-oss", "o200k_base.tiktoken",
                            "tools/harmony/vocab.sh")
    yield s
    s.stop()


def test_harmony_forced_calls_are_valid(gpt_oss_server):
    check_forced_calls(gpt_oss_server)
