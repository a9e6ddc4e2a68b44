"""gpt-oss's harmony format through the real server, with the official `openai`
client: the scripted engine (the server library over exact model output)
serves a synthesized `tiny-gpt-oss` checkpoint, so rendering is the
checkpoint's own chat template, tokens are o200k_harmony's (the channel and
call markers are single special tokens) and parsing is the server's harmony
grammar. The replies are what gpt-oss emits: an `analysis` channel, then a
`final` message ended by `<|return|>`, or a `commentary` call to
`functions.NAME` ended by `<|call|>`.
"""

import json

import pytest

from conftest import REPO, start_scripted, synth_with_vocab
from test_openai_client import WEATHER_TOOL, accumulate, client

O200K = REPO / ".cache" / "vocab" / "o200k_base.tiktoken"

ANALYSIS = "<|channel|>analysis<|message|>{}<|end|><|start|>assistant"
CALL = (
    ANALYSIS.format("The user wants the weather; call the tool.")
    + "<|channel|>commentary to=functions.get_weather <|constrain|>json"
    + '<|message|>{"city": "Paris", "days": 2}<|call|>'
)
HARMONY_RULES = [
    # A tool result is rendered as a message from functions.NAME to=assistant.
    {"when": "functions.get_weather to=assistant",
     "reply": "<|channel|>final<|message|>It is sunny in Paris.<|return|>"},
    {"when": "Weather", "reply": CALL},
    # reasoning_effort reaches the template's system message.
    {"when": "Reasoning: high",
     "reply": ANALYSIS.format("Thinking hard.") + "<|channel|>final<|message|>High effort.<|return|>"},
    {"when": "",
     "reply": ANALYSIS.format("Thinking it over.") + "<|channel|>final<|message|>Hello from the script.<|return|>"},
]


@pytest.fixture(scope="session")
def gpt_oss_model(runtime_bin, tmp_path_factory):
    return synth_with_vocab(
        runtime_bin, tmp_path_factory, "tiny-gpt-oss", O200K, "tools/harmony/vocab.sh"
    )


@pytest.fixture(scope="session")
def harmony_server(scripted_bin, gpt_oss_model, tmp_path_factory):
    s = start_scripted(scripted_bin, gpt_oss_model, tmp_path_factory, HARMONY_RULES)
    yield s
    s.stop()


def test_analysis_is_reasoning_and_final_is_content(harmony_server):
    r = client(harmony_server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "hi"}]
    )
    m = r.choices[0].message
    assert m.content == "Hello from the script."
    assert m.model_extra["reasoning_content"] == "Thinking it over."
    assert r.choices[0].finish_reason == "stop"


def test_reasoning_effort_reaches_the_template(harmony_server):
    r = client(harmony_server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "hi"}], reasoning_effort="high"
    )
    assert r.choices[0].message.content == "High effort."
    assert r.choices[0].message.model_extra["reasoning_content"] == "Thinking hard."


def test_commentary_call_is_a_tool_call_and_the_result_round_trips(harmony_server):
    c = client(harmony_server)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = c.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER_TOOL])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}

    msgs.append(choice.message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'})
    r = c.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert r.choices[0].finish_reason == "stop"


def test_streamed_call_accumulates_like_an_agent(harmony_server):
    calls, finish, reasoning = accumulate(client(harmony_server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL], stream=True,
    ))
    assert finish == "tool_calls"
    assert reasoning == "The user wants the weather; call the tool."
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2}
