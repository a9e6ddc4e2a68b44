"""The prefix cache through the official openai client (reference backend:
the same index and rules as the CUDA engine's, over host memory).

The server prefills in chunks of 16 tokens, so its cache blocks are 16
tokens: a second turn of a conversation reuses the first turn's whole
blocks, reports them in `usage.prompt_tokens_details.cached_tokens`, and
gives the output a cold prefill gives (greedy); `cache_prompt: false`
(llama.cpp's request field) bypasses the cache.
"""

import json
import urllib.request

import openai
import pytest

from conftest import start_serve

CONTEXT = 1024
BLOCK = 16

SYSTEM = (
    "You are a careful coding assistant. The repository holds a Rust inference engine with a "
    "CUDA backend and a CPU reference backend; answer in short sentences and cite file paths."
)


@pytest.fixture(scope="module")
def cache_server(runtime_bin, tiny_model, pytestconfig):
    s = start_serve(runtime_bin, tiny_model, pytestconfig.getoption("--backend"), CONTEXT,
                    "--prefill-chunk", BLOCK, "--prefix-cache", "64MiB")
    yield s
    s.stop()


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def stats(server):
    with urllib.request.urlopen(server.url + "/v1/stats", timeout=10) as r:
        return json.loads(r.read())


def chat(c, messages, **kw):
    return c.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                     temperature=0, **kw)


def test_a_second_turn_reuses_the_first_and_answers_as_a_cold_prefill(cache_server):
    c = client(cache_server)
    turn1 = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Where is the prefill loop of the reference engine?"}]
    r1 = chat(c, turn1)
    u1 = r1.usage
    assert u1.prompt_tokens > 2 * BLOCK
    assert u1.prompt_tokens_details.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content or "ok"},
                     {"role": "user", "content": "And the decode loop?"}]
    warm = chat(c, turn2)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    # At least the first turn's whole blocks (the template renders the
    # same text for the earlier messages), in whole blocks.
    assert cached >= (u1.prompt_tokens // BLOCK - 1) * BLOCK > 0
    assert cached % BLOCK == 0 and cached < warm.usage.prompt_tokens
    cold = chat(c, turn2, extra_body={"cache_prompt": False})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.usage.prompt_tokens == warm.usage.prompt_tokens
    assert warm.choices[0].message.content == cold.choices[0].message.content
    s = stats(cache_server)["prefix_cache"]
    assert s["hits"] >= 1 and s["bypassed"] >= 1
    assert s["cached_tokens"] >= cached and s["blocks_held"] > 0
    assert s["block_tokens"] == BLOCK and s["location"] == "host"
    logged = [r["cached_tokens"] for r in stats(cache_server)["recent_requests"]]
    assert cached in logged


def test_streaming_usage_and_completions_report_cached_tokens(cache_server):
    c = client(cache_server)
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "List the crates of the workspace, one per line."}]
    first = chat(c, msgs)
    stream = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage.prompt_tokens == first.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == (first.choices[0].message.content or "")

    prompt = SYSTEM + " The text completion endpoint shares the cache with chat."
    a = c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    b = c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens > 0
    assert a.choices[0].text == b.choices[0].text
    off = c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                               extra_body={"cache_prompt": False})
    assert off.usage.prompt_tokens_details.cached_tokens == 0
    assert off.choices[0].text == a.choices[0].text
