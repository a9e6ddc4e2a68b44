"""Continuous batching through the official openai client (reference
backend: the same step interface and scheduler as the CUDA engine's).

Requests streamed at the same time decode together: their chunks arrive
interleaved, `/v1/stats` lists them all running, and each one's text is
its text alone (greedy; the reference engine computes every row by
itself). Then the reliability run of issue 15: 16 clients x 20 requests
(fewer here, to keep CI short) read to the end, disconnected mid-stream,
closed at once or timed out, against a KV budget that makes requests wait;
afterwards nothing runs or waits and the KV in use is back to 0.
"""

import json
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest

from conftest import REPO, Server, free_port

CONTEXT = 512
PARALLEL = 4
# Room for about three of the reliability run's requests at once (prompt
# up to ~80 tokens with the template, + 12 new): the others wait for KV.
KV_TOKENS = 300


@pytest.fixture(scope="module")
def batch_server(runtime_bin, tiny_model, pytestconfig):
    if pytestconfig.getoption("--backend") != "reference":
        pytest.skip("the reference engine's KV budget (--kv-tokens)")
    # Queue 16 + 4 running: the reliability run's 16 clients are admitted.
    s = Server([runtime_bin, "serve", "--model", tiny_model, "--backend", "reference",
                "--port", free_port(), "--context-length", CONTEXT, "--progress-json",
                "--parallel", PARALLEL, "--kv-tokens", KV_TOKENS, "--queue-depth", 16,
                "--prefill-chunk", 16])
    yield s
    s.stop()


def stats(server):
    with urllib.request.urlopen(server.url + "/v1/stats", timeout=10) as r:
        return json.loads(r.read())


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


PROMPTS = [f"Request {i}: count the doors, the windows and the {w} of the house."
           for i, w in enumerate(["chairs", "lamps", "stairs", "clocks"])]


def stream(c, prompt, times, out, i):
    s = c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                             stream=True)
    text = []
    for ch in s:
        if ch.choices and ch.choices[0].text:
            times.append((time.monotonic(), i))
            text.append(ch.choices[0].text)
    out[i] = "".join(text)


def test_parallel_streams_interleave_and_each_equals_its_solo_output(batch_server):
    c = client(batch_server)
    solo = [c.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0)
            .choices[0].text for p in PROMPTS]
    times, out, seen = [], {}, []
    threads = [threading.Thread(target=stream, args=(c, p, times, out, i))
               for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        seen.append(stats(batch_server))
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert [out[i] for i in range(len(PROMPTS))] == solo
    # The chunks of different requests arrive interleaved: ordered by time,
    # the request changes many times (one after another would change 3).
    order = [i for _, i in sorted(times)]
    switches = sum(a != b for a, b in zip(order, order[1:]))
    assert switches >= 2 * len(PROMPTS), order
    spans = {i: (min(t for t, j in times if j == i), max(t for t, j in times if j == i))
             for i in range(len(PROMPTS))}
    first_end = min(end for _, end in spans.values())
    assert all(start < first_end for start, _ in spans.values()), spans
    # /v1/stats saw them running together, each with its own figures.
    most = max(seen, key=lambda s: len(s["running"]))
    assert len(most["running"]) >= 2 and most["active_sequences"] == len(most["running"])
    assert len({r["id"] for r in most["running"]}) == len(most["running"])
    assert most["parallel"] == PARALLEL
    assert most["kv"]["total_tokens"] == KV_TOKENS and most["kv"]["used_tokens"] > 0


def test_clients_that_come_and_go_leave_no_kv_no_request_and_no_crash(batch_server, tmp_path):
    js, md = tmp_path / "chaos.json", tmp_path / "chaos.md"
    p = subprocess.run(
        [sys.executable, REPO / "benchmarks" / "agent_load.py", "chaos", "--url", batch_server.url,
         "--chaos-clients", "16", "--chaos-requests", "4", "--chaos-prompt-tokens", "64",
         "--chaos-max-tokens", "12", "--chars-per-token", "4", "--gauge", "kv.used_tokens", "--gauge", "active_sequences",
         "--gauge", "queue_len", "--strict", "--json", js, "--markdown", md],
        capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ch = json.loads(js.read_text())["scenarios"]["chaos"]
    assert sum(ch["actions"].values()) == 64
    failed = [c for c in ch["checks"] if not c["pass"]]
    assert not failed, failed
    s = stats(batch_server)
    assert s["running"] == [] and s["queue_len"] == 0 and s["active_sequences"] == 0, s
    assert s["kv"]["used_tokens"] == 0, s["kv"]
    assert s["activity"] == "idle"
    with urllib.request.urlopen(batch_server.url + "/health", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"
