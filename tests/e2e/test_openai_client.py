"""The official openai Python client against krasis servers."""

import json
import threading
import time
import urllib.request

import openai
import pytest

from conftest import CONTEXT

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
            },
            "required": ["city"],
        },
    },
}


def client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", **kw)


def model_id(server):
    return client(server).models.list().data[0].id


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


# ---- the real engine (reference backend, tiny synthetic checkpoint) ----


def test_startup_events_models_and_health(reference_server, pytestconfig):
    kinds = [e["event"] for e in reference_server.events]
    assert kinds[0] == "phase" and reference_server.events[0]["phase"] == "loading"
    assert kinds[-1] == "ready"
    health = get_json(reference_server.url + "/health")
    assert health["status"] == "ok" and "error" not in health
    assert health["phase"] == "ready" and health["model_loaded"] is True
    assert health["backend"] == pytestconfig.getoption("--backend")
    assert model_id(reference_server) == "tiny"


def test_chat_non_streaming_and_streaming_agree_under_greedy(reference_server):
    c = client(reference_server)
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
    ]
    r1 = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    r2 = c.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=12, temperature=0)
    assert r1.choices[0].message.content == r2.choices[0].message.content
    assert r1.choices[0].finish_reason in ("stop", "length")
    u = r1.usage
    assert 0 < u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    stream = c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasoning = "".join(
        getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks if ch.choices
    )
    full = (r1.choices[0].message.content or "")
    full_reasoning = getattr(r1.choices[0].message, "reasoning_content", None) or ""
    assert (text, reasoning) == (full, full_reasoning)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [r1.choices[0].finish_reason]


def test_text_completions(reference_server):
    c = client(reference_server)
    r = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 6
    streamed = "".join(
        ch.choices[0].text for ch in c.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0, stream=True
        ) if ch.choices
    )
    assert streamed == r.choices[0].text


def test_tools_request_renders_through_the_real_template(reference_server):
    c = client(reference_server)
    r = c.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "developer", "content": "Use tools when useful."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
            }]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        max_tokens=4,
        temperature=0.7,
        top_p=0.9,
        seed=7,
        stop=["\n\n"],
        extra_body={"top_k": 20, "min_p": 0.05, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_error_paths(reference_server):
    c = client(reference_server, max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=msgs)
    assert "tiny" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, response_format={"type": "yaml"})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 400}])
    msg = str(e.value)
    assert str(CONTEXT) in msg and "tokens" in msg
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


def test_unknown_fields_are_refused_and_ignore_eos_is_honoured(reference_server):
    c = client(reference_server, max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    # A field the server does not implement is named in a 400, never ignored.
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2,
                                  extra_body={"typical_p": 0.5})
    assert e.value.body["param"] == "typical_p" and e.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"min_tokens": 2})
    assert e.value.body["param"] == "min_tokens"
    # Fields that by definition change nothing are accepted.
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, user="u-1",
                                  store=False, metadata={"run": "e2e"})
    assert r.usage.completion_tokens >= 1
    # ignore_eos: always the whole budget, whatever the model would have ended with.
    for _ in range(3):
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=1.0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"


# ---- scripted engine: exact model output through the real server stack ----


def test_tool_call_round_trip(scripted_server):
    c = client(scripted_server)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = c.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER_TOOL])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}

    msgs.append(choice.message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": "{\"sky\": \"clear\"}"})
    r = c.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert r.choices[0].finish_reason == "stop"


def accumulate(stream):
    """What an agent keeps of a streamed chat completion: tool calls by index
    (id, name, concatenated arguments), the finish reason, and the reasoning
    text."""
    calls, finish, reasoning = {}, None, ""
    for ch in stream:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                slot["id"] = tc.id
            if tc.function and tc.function.name:
                slot["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    return calls, finish, reasoning


def test_streamed_tool_call_accumulates_like_an_agent(scripted_server):
    calls, finish, _ = accumulate(client(scripted_server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL], stream=True,
    ))
    assert finish == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2}


def test_reasoning_is_split_from_content(scripted_server):
    r = client(scripted_server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "hi"}]
    )
    m = r.choices[0].message
    assert m.content == "Hello from the script."
    assert m.model_extra["reasoning_content"] == "Thinking it over.\n"


def test_qwen3_coder_xml_tool_call(coder_server):
    r = client(coder_server).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL]
    )
    call = r.choices[0].message.tool_calls[0]
    assert json.loads(call.function.arguments) == {"city": "San Francisco", "days": 3, "metric": True}


def stats(server):
    return get_json(server.url + "/v1/stats")


def test_cancel_on_disconnect_and_503_when_queue_full(scripted_server):
    c = client(scripted_server, max_retries=0)
    slow = [{"role": "user", "content": "SLOW"}]
    running = c.chat.completions.create(model="scripted", messages=slow, stream=True)
    first = next(iter(running))
    assert first.choices[0].delta.role == "assistant"
    queued = c.chat.completions.create(model="scripted", messages=slow, stream=True)
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model="scripted", messages=slow)
    assert e.value.status_code == 503
    assert e.value.response.headers["retry-after"] == "1"
    before = stats(scripted_server)
    running.close()
    queued.close()
    # Both generations end early, counted as cancelled, not completed: the
    # running one at its next token, the queued one without starting.
    deadline = time.monotonic() + 10
    while (stats(scripted_server)["requests_cancelled"] < before["requests_cancelled"] + 2
           and time.monotonic() < deadline):
        time.sleep(0.05)
    s = stats(scripted_server)
    assert s["requests_cancelled"] == before["requests_cancelled"] + 2, s
    assert s["requests_completed"] == before["requests_completed"], s
    # The running one stopped after some tokens. Read from the request log:
    # `last_generated_tokens` is whichever generation ended last, and the
    # queued one (0 tokens) may end after it.
    cancelled = [r for r in s["recent_requests"][-2:] if r["finish_reason"] == "cancelled"]
    assert len(cancelled) == 2, s["recent_requests"]
    assert any(0 < r["completion_tokens"] < 300 for r in cancelled), cancelled
    assert s["queue_len"] == 0
    r = c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason == "stop"
