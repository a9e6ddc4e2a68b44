"""Honest numbers, closed doors: readiness, context overflow in OpenAI's
shape, admission before heavy work, cancellation of long prefills, prompt
shutdown, engine faults, and who may talk to a keyless local server."""

import http.client
import json
import signal
import threading
import time
import urllib.parse
import urllib.request

import openai
import pytest

from conftest import CONTEXT, LONG_CONTEXT, start_scripted


def client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, **kw)


def raw(server, method, path, body=None, headers=None, timeout=30):
    """(status, headers, body bytes) of one request, with headers as given
    (a custom Host included)."""
    u = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    data = json.dumps(body).encode() if body is not None else None
    h = {"content-type": "application/json"} if data is not None else {}
    h.update(headers or {})
    conn.request(method, path, body=data, headers=h)
    r = conn.getresponse()
    out = (r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    conn.close()
    return out


def get_json(server, path):
    status, _, body = raw(server, "GET", path)
    return status, json.loads(body)


# ---- readiness ----


def test_health_is_200_ok_only_when_serving(reference_server):
    status, h = get_json(reference_server, "/health")
    assert status == 200 and h["status"] == "ok", h


# ---- context overflow in OpenAI's shape ----


def test_context_overflow_is_the_openai_error(reference_server):
    c = client(reference_server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 400}])
    err = e.value
    assert err.code == "context_length_exceeded" and err.param == "messages"
    assert err.body["type"] == "invalid_request_error"
    msg = err.body["message"]
    assert msg.startswith(
        f"This model's maximum context length is {CONTEXT} tokens. However, your messages resulted in "
    ), msg
    assert msg.endswith(" tokens. Please reduce the length of the messages."), msg

    # A budget that does not fit beside the prompt is refused, not clamped.
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=CONTEXT)
    assert e.value.code == "context_length_exceeded"
    assert f"in the messages, {CONTEXT} in the completion" in e.value.body["message"]

    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="word " * 400, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"


def test_oversized_prompt_is_refused_fast_while_health_answers(reference_server):
    # ~8 MiB of text: refused from its byte length alone, without tokenizing.
    big = "All work and no play makes Jack a dull boy. " * 190_000
    worst = [0.0]
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            t = time.monotonic()
            status, _ = get_json(reference_server, "/health")
            assert status == 200
            worst[0] = max(worst[0], time.monotonic() - t)
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        c = client(reference_server)
        for call in (
            lambda: c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": big}]),
            lambda: c.completions.create(model="tiny", prompt=big),
        ):
            t = time.monotonic()
            with pytest.raises(openai.BadRequestError) as e:
                call()
            took = time.monotonic() - t
            assert e.value.code == "context_length_exceeded"
            assert "resulted in at least" in e.value.body["message"]
            assert took < 2.0, f"refusing took {took:.2f} s"
    finally:
        stop.set()
        poller.join()
    assert worst[0] < 1.0, f"/health took {worst[0]:.2f} s meanwhile"


# ---- request limits ----


def test_stop_sequences_are_bounded(reference_server):
    c = client(reference_server)
    msgs = [{"role": "user", "content": "hi"}]
    for stop in (["a", "b", "c", "d", "e"], [""], ["x" * 257]):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=msgs, stop=stop, max_tokens=2)
        assert e.value.param == "stop"
    c.chat.completions.create(model="tiny", messages=msgs, stop=["a", "b", "c", "d"], max_tokens=2)


def test_over_limit_body_is_413(reference_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (16 << 20)}]}
    try:
        status, _, data = raw(reference_server, "POST", "/v1/chat/completions", body)
    except (ConnectionError, http.client.HTTPException):
        pytest.skip("the server closed the connection before the client finished sending")
    assert status == 413
    assert json.loads(data)["error"]["code"] == "request_too_large"


def test_sse_declares_utf8(reference_server):
    status, headers, body = raw(
        reference_server, "POST", "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
    )
    assert status == 200
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    assert body.rstrip().endswith(b"data: [DONE]")


# ---- who may talk to a keyless loopback server ----


def test_dns_rebinding_host_is_refused(reference_server):
    port = urllib.parse.urlparse(reference_server.url).port
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        assert raw(reference_server, "GET", "/health", headers={"Host": host})[0] == 200
    for path in ("/health", "/v1/models"):
        status, _, body = raw(reference_server, "GET", path, headers={"Host": f"rebound.example:{port}"})
        assert status == 403
        assert json.loads(body)["error"]["code"] == "invalid_host"


def test_only_loopback_origins_get_cors(reference_server):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    _, headers, _ = raw(reference_server, "OPTIONS", "/v1/chat/completions",
                        headers={"Origin": "http://localhost:3000", **pre})
    assert headers.get("access-control-allow-origin") == "http://localhost:3000"
    _, headers, _ = raw(reference_server, "OPTIONS", "/v1/chat/completions",
                        headers={"Origin": "https://evil.example", **pre})
    assert "access-control-allow-origin" not in headers
    # A simple cross-origin POST (no preflight) is refused, not run.
    status, headers, body = raw(
        reference_server, "POST", "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Origin": "https://evil.example", "content-type": "text/plain"},
    )
    assert status == 403 and "access-control-allow-origin" not in headers
    assert json.loads(body)["error"]["code"] == "origin_not_allowed"


# ---- legacy function calling (scripted engine: exact model output) ----


def test_legacy_functions_get_a_legacy_function_call(scripted_server):
    from test_openai_client import WEATHER_TOOL

    r = client(scripted_server).chat.completions.create(
        model="scripted",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        functions=[WEATHER_TOOL["function"]],
    )
    choice = r.choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.function_call.name == "get_weather"
    assert json.loads(choice.message.function_call.arguments) == {"city": "Paris", "days": 2}
    assert not choice.message.tool_calls


# ---- cancellation, shutdown, faults (real processes) ----


def long_prompt():
    # About 4000 tokens: ~6 s of prefill on the tiny model (debug build).
    return "hello world " * 2000


def test_disconnect_during_a_long_prefill_frees_the_engine(long_prefill_server):
    s = long_prefill_server
    with pytest.raises(openai.APITimeoutError):
        client(s, timeout=1.0).completions.create(model="tiny", prompt=long_prompt(), max_tokens=1)
    # The prefill stops at its next chunk, so the next request does not wait for it.
    t = time.monotonic()
    r = client(s).completions.create(model="tiny", prompt="Once upon a time", max_tokens=2)
    took = time.monotonic() - t
    assert r.choices[0].finish_reason in ("stop", "length")
    assert took < 3.0, f"the next request waited {took:.2f} s"
    _, st = get_json(s, "/v1/stats")
    assert st["requests_cancelled"] == 1 and st["requests_completed"] == 1, st


def test_sigterm_with_a_long_prefill_in_flight_exits_within_two_seconds(long_prefill_server):
    s = long_prefill_server
    outcome = {}

    def request():
        try:
            client(s, timeout=30).completions.create(model="tiny", prompt=long_prompt(), max_tokens=50)
            outcome["result"] = "completed"
        except openai.APIStatusError as e:
            outcome["result"] = e.status_code
        except openai.APIConnectionError as e:
            outcome["result"] = type(e).__name__

    th = threading.Thread(target=request)
    th.start()
    time.sleep(1.0)  # well inside the prefill
    t = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    code = s.proc.wait(timeout=10)
    took = time.monotonic() - t
    th.join(timeout=5)
    assert code == 0, s.stderr()
    assert took < 2.5, f"exit took {took:.2f} s"
    # The in-flight request got an answer (503: shutting down), not a hang.
    assert not th.is_alive()
    assert outcome["result"] == 503, outcome


def test_an_engine_fault_answers_then_exits_70(scripted_bin, tiny_model, tmp_path_factory):
    s = start_scripted(
        scripted_bin, tiny_model, tmp_path_factory,
        [{"when": "BOOM", "panic": "scripted engine fault"}, {"when": "", "reply": "fine"}],
    )
    try:
        c = client(s)
        assert c.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "hi"}]
        ).choices[0].message.content == "fine"
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "BOOM"}])
        assert "scripted engine fault" in e.value.body["message"]
        assert s.proc.wait(timeout=5) == 70
    finally:
        s.stop()


def test_stats_show_a_streaming_request_live_then_log_it(long_prefill_server):
    """The launcher's run screen polls /v1/stats: prefill progress, then
    decode progress with a TTFT, then idle with the request in the log."""
    s = long_prefill_server
    done = {}

    def request():
        stream = client(s, timeout=60).completions.create(
            model="tiny", prompt=long_prompt(), max_tokens=48, stream=True,
            stream_options={"include_usage": True},
        )
        done["chunks"] = list(stream)

    th = threading.Thread(target=request)
    th.start()
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        _, st = get_json(s, "/v1/stats")
        seen.append(st)
        if st["recent_requests"]:
            break
        time.sleep(0.05)
    th.join(timeout=10)
    usage = done["chunks"][-1].usage
    live = [st for st in seen if st["running"]]
    prefill = [st["running"][0]["prefilled_tokens"] for st in live if st["activity"] == "prefilling"]
    decode = [st["running"][0] for st in live if st["activity"] == "decoding"]
    # The prefill is seen part-way (chunk by chunk), never going back.
    assert any(0 < p < usage.prompt_tokens for p in prefill), prefill
    assert prefill == sorted(prefill), prefill
    assert decode and all(c["ttft_ms"] is not None for c in decode), decode
    assert all(st["active_sequences"] == 1 for st in live)
    c = live[0]["running"][0]
    assert (c["endpoint"], c["prompt_tokens"], c["max_tokens"]) == (
        "/v1/completions", usage.prompt_tokens, 48)
    assert c["client"].startswith("127.0.0.1:"), c
    end = seen[-1]
    assert end["activity"] == "idle" and end["running"] == [], end
    r = end["recent_requests"][-1]
    assert (r["endpoint"], r["client"]) == ("/v1/completions", c["client"]), r
    assert r["finish_reason"] == done["chunks"][-2].choices[0].finish_reason, r
    assert (r["prompt_tokens"], r["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens), r
    assert r["ttft_ms"] == decode[0]["ttft_ms"] == end["last_ttft_ms"], (r, decode[0])
