"""The prefix cache through the official openai client (reference backend:
the same index and rules as the CUDA engine's, over host memory).

Blocks are 64 tokens (`--prefix-block`) and the server prefills in chunks
of 48, so blocks are not whole chunks: a second turn of a conversation
reuses the first turn's whole blocks, reports them in
`usage.prompt_tokens_details.cached_tokens`, and gives the output a cold
prefill gives (greedy); `cache_prompt: false` (llama.cpp's request field)
bypasses the cache. With a first tier of two blocks, another conversation
demotes the first one's blocks to the RAM tier (`--prefix-cache-host`),
from which its next turn restores them, still exact; a RAM tier too small
for everything evicts, and every request is still served. With
`--prefix-cache-file` the cache survives a restart: the server writes it at
SIGTERM and the next one serves the same conversation from it, exactly; a
file written with another block size, or damaged, is refused at startup
with a message that names why, and left as it was.
"""

import json
import subprocess
import time
import urllib.request

import openai
import pytest

from conftest import free_port, start_serve

CONTEXT = 2048
BLOCK = 64
CHUNK = 48
# Bytes of one block of the tiny model's KV: 3 layers x K and V x 64
# positions x 64 values x 4 bytes (reference, f32), the same as the CUDA
# engine's with the e2e head_dim of 64 (128 values x 2 bytes).
BLOCK_BYTES = 3 * 2 * 64 * 64 * 4

SYSTEM = " ".join([
    "You are a careful coding assistant for a repository that holds a Rust inference engine.",
    "It has a CUDA backend and a CPU reference backend, a launcher with a terminal interface,",
    "an OpenAI-compatible HTTP server, a cache of quantized routed experts and a set of",
    "benchmarks. Answer in short sentences, cite file paths, and say when you are unsure.",
    "Prefer the smallest change that fixes a problem; explain why a change is correct;",
    "never invent functions, files or options that the repository does not have; when a",
    "question is about performance, ask for the measurement first and name what it shows.",
    "Tests must fail when the code is wrong; a planted fault shows that they can. Every",
    "unsupported combination of options is refused with a message that names it, and",
    "nothing falls back silently to another engine, format or path. Comments explain why,",
    "not what, and each file should be readable in one sitting by a new contributor.",
])


def server(runtime_bin, tiny_model, pytestconfig, *extra):
    return start_serve(runtime_bin, tiny_model, pytestconfig.getoption("--backend"), CONTEXT,
                       "--prefill-chunk", CHUNK, "--prefix-block", BLOCK, *extra)


@pytest.fixture(scope="module")
def cache_server(runtime_bin, tiny_model, pytestconfig):
    s = server(runtime_bin, tiny_model, pytestconfig, "--prefix-cache", "64MiB",
               "--prefix-cache-host", "off")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tiered_server(runtime_bin, tiny_model, pytestconfig):
    # Two first-tier blocks; the RAM tier holds eight.
    s = server(runtime_bin, tiny_model, pytestconfig, "--prefix-cache", 2 * BLOCK_BYTES,
               "--prefix-cache-host", 8 * BLOCK_BYTES)
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


def conversation(topic):
    # The topic first: conversations share no block.
    return [{"role": "system", "content": topic + " " + SYSTEM},
            {"role": "user", "content": "Where is the prefill loop of the reference engine?"}]


def test_a_second_turn_reuses_the_first_and_answers_as_a_cold_prefill(cache_server):
    c = client(cache_server)
    turn1 = conversation("This session is about prefill.")
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
    assert s["block_tokens"] == BLOCK
    assert [t["location"] for t in s["tiers"]] == [s["location"]]
    logged = [r["cached_tokens"] for r in stats(cache_server)["recent_requests"]]
    assert cached in logged


def test_streaming_usage_and_completions_report_cached_tokens(cache_server):
    c = client(cache_server)
    msgs = conversation("List the crates of the workspace, one per line.")
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


def test_blocks_demoted_to_the_ram_tier_are_restored_exactly(tiered_server):
    c = client(tiered_server)
    a1 = conversation("Conversation A is about the expert cache.")
    ra = chat(c, a1)
    assert ra.usage.prompt_tokens > 3 * BLOCK
    # Conversation B fills the two first-tier blocks: A's go to the RAM tier.
    chat(c, conversation("Conversation B is about the launcher."))
    s = stats(tiered_server)["prefix_cache"]
    assert s["demotions"] > 0, s
    first, ram = s["tiers"]
    assert first["capacity_blocks"] == 2 and ram["capacity_blocks"] == 8
    assert s["location"] == first["location"] + "+" + ram["location"]
    before = ram["blocks_restored"]
    # A's next turn restores its blocks from the RAM tier.
    a2 = a1 + [{"role": "assistant", "content": ra.choices[0].message.content or "ok"},
               {"role": "user", "content": "Which file builds it?"}]
    warm = chat(c, a2)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= (ra.usage.prompt_tokens // BLOCK - 1) * BLOCK > 0
    cold = chat(c, a2, extra_body={"cache_prompt": False})
    assert warm.choices[0].message.content == cold.choices[0].message.content
    s = stats(tiered_server)["prefix_cache"]
    ram = s["tiers"][1]
    assert ram["hits"] >= 1 and ram["blocks_restored"] > before, s
    assert ram["bytes_restored"] == ram["blocks_restored"] * BLOCK_BYTES
    assert ram["restore_ms"] > 0


def test_a_full_cache_evicts_and_every_request_is_served(tiered_server):
    c = client(tiered_server)
    # Ten blocks of room, four conversations of more than three blocks each.
    for i in range(4):
        r = chat(c, conversation(f"Conversation {i} of many asks about topic number {i}."))
        assert r.choices[0].finish_reason in ("stop", "length")
    s = stats(tiered_server)["prefix_cache"]
    assert s["evictions"] > 0, s
    assert s["blocks_held"] <= 10


def logged(server, text, timeout=10):
    """Whether `text` reaches the server's stderr within `timeout` seconds
    (its lines are read by another thread)."""
    deadline = time.monotonic() + timeout
    while text not in "".join(server.stderr_lines):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_cache_survives_a_restart_through_its_file(runtime_bin, tiny_model, pytestconfig,
                                                        tmp_path):
    path = tmp_path / "prefix.krspc"
    tiers = ("--prefix-cache", 2 * BLOCK_BYTES, "--prefix-cache-host", 8 * BLOCK_BYTES,
             "--prefix-cache-file", path)
    msgs = conversation("This conversation outlives its server.")
    s = server(runtime_bin, tiny_model, pytestconfig, *tiers)
    try:
        first = chat(client(s), msgs)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert not path.exists(), "written only at shutdown"
    finally:
        s.stop()
    assert s.proc.returncode == 0, s.stderr()
    assert logged(s, "prefix cache saved"), s.stderr()
    saved = path.read_bytes()

    s = server(runtime_bin, tiny_model, pytestconfig, *tiers)
    try:
        assert logged(s, "blocks loaded"), s.stderr()
        again = chat(client(s), msgs)
        want = (first.usage.prompt_tokens - 1) // BLOCK * BLOCK
        assert again.usage.prompt_tokens_details.cached_tokens == want > 0
        cold = chat(client(s), msgs, extra_body={"cache_prompt": False})
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert again.choices[0].message.content == cold.choices[0].message.content
        assert again.choices[0].message.content == first.choices[0].message.content
    finally:
        s.stop()

    # Refused at startup, the file left as it was: another block size, and
    # a damaged file.
    def refused(block, contents):
        path.write_bytes(contents)
        p = subprocess.run(
            [str(a) for a in [runtime_bin, "serve", "--model", tiny_model,
                              "--backend", pytestconfig.getoption("--backend"),
                              "--port", free_port(), "--context-length", CONTEXT,
                              "--prefill-chunk", CHUNK, "--prefix-block", block, *tiers]],
            capture_output=True, text=True, timeout=300)
        assert p.returncode != 0, p.stderr[-3000:]
        assert path.read_bytes() == contents
        return p.stderr
    err = refused(2 * BLOCK, saved)
    assert "written for a different block tokens (--prefix-block)" in err, err[-3000:]
    damaged = bytearray(saved)
    damaged[len(saved) // 2] ^= 1
    err = refused(BLOCK, bytes(damaged))
    assert "is damaged" in err and "checksum" in err, err[-3000:]
