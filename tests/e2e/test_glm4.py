"""GLM-4.5's output format through the real server, with the official `openai`
client: the scripted engine (the server library over exact model output)
serves a synthesized `tiny-glm4-moe` checkpoint, so rendering is GLM's own
chat template, tokens are the checkpoint's (`<think>`, `<tool_call>`,
`<arg_key>`, `<arg_value>`, `<|observation|>` are single added tokens) and
parsing is the server's GLM XML grammar. The replies are what GLM emits after
`<|assistant|>`: `\\n<think>…</think>\\n`, then the answer ended by `<|user|>`,
or a `<tool_call>NAME` block with argument pairs ended by `<|observation|>`
(both are end-of-turn ids in the checkpoint's generation config).
"""

import json

import pytest

from conftest import REPO, start_scripted, synth_with_vocab
from test_openai_client import WEATHER_TOOL, accumulate, client

QWEN_VOCAB = REPO / ".cache" / "vocab" / "qwen.tiktoken"

CALL = (
    "\n<think>The user wants the weather; call the tool.</think>\n"
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n"
    "<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n</tool_call><|observation|>"
)
GLM_RULES = [
    # A tool result is rendered as <|observation|> + <tool_response>.
    {"when": "<tool_response>", "reply": "\n<think>Got the result.</think>\nIt is sunny in Paris.<|user|>"},
    {"when": "Weather", "reply": CALL},
    {"when": "", "reply": "\n<think>Thinking it over.</think>\nHello from the script.<|user|>"},
]


@pytest.fixture(scope="session")
def glm_model(runtime_bin, tmp_path_factory):
    return synth_with_vocab(
        runtime_bin, tmp_path_factory, "tiny-glm4-moe", QWEN_VOCAB, "tools/vocab.sh"
    )


@pytest.fixture(scope="session")
def glm_server(scripted_bin, glm_model, tmp_path_factory):
    s = start_scripted(scripted_bin, glm_model, tmp_path_factory, GLM_RULES)
    yield s
    s.stop()


def test_think_is_reasoning_and_the_turn_ends_at_user(glm_server):
    r = client(glm_server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "hi"}]
    )
    m = r.choices[0].message
    assert m.content == "Hello from the script."
    assert m.model_extra["reasoning_content"] == "Thinking it over."
    assert r.choices[0].finish_reason == "stop"


def test_xml_call_is_a_typed_tool_call_and_the_result_round_trips(glm_server):
    c = client(glm_server)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = c.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER_TOOL])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather; call the tool."
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    # Typed by the tool's schema: days an integer, metric a boolean.
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2, "metric": True}

    msgs.append(choice.message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'})
    r = c.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert r.choices[0].finish_reason == "stop"


def test_streamed_call_accumulates_like_an_agent(glm_server):
    calls, finish, reasoning = accumulate(client(glm_server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL], stream=True,
    ))
    assert finish == "tool_calls"
    assert reasoning == "The user wants the weather; call the tool."
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2, "metric": True}
