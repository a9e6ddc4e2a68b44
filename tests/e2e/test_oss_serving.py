"""gpt-oss served to agents through the official openai client: the prefix
cache and continuous batching on tiny-gpt-oss (sliding-window layers of 16
positions, attention sinks, MXFP4 experts, the harmony chat template and the
o200k vocabulary), on the tests' backend (CI: the reference engine; on a GPU
machine `--backend cuda`, where the sliding layers keep a ring per sequence
and a cached block keeps their window only at a prompt's end).

A conversation's second turn reuses the first turn's whole blocks (the
harmony template renders the first turn's prompt as the start of the
second's), reports them in `usage.prompt_tokens_details.cached_tokens`, and
answers as a cold prefill does (greedy). Requests streamed at the same time
decode together, each with its text alone.
"""

import json
import threading
import time
import urllib.request

import openai
import pytest

from conftest import REPO, start_serve, synth_with_vocab

CONTEXT = 2048
BLOCK = 64
CHUNK = 48
PARALLEL = 4


@pytest.fixture(scope="module")
def oss_server(runtime_bin, tmp_path_factory, pytestconfig):
    model = synth_with_vocab(runtime_bin, tmp_path_factory, "tiny-gpt-oss",
                             REPO / ".cache" / "vocab" / "o200k_base.tiktoken",
                             "tools/harmony/vocab.sh")
    s = start_serve(runtime_bin, model, pytestconfig.getoption("--backend"), CONTEXT,
                    "--prefill-chunk", CHUNK, "--prefix-block", BLOCK, "--prefix-cache", "64MiB",
                    "--prefix-cache-host", "off", "--parallel", PARALLEL)
    yield s
    s.stop()


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def stats(server):
    with urllib.request.urlopen(server.url + "/v1/stats", timeout=10) as r:
        return json.loads(r.read())


SYSTEM = " ".join([
    "You are a coding agent working in a repository with a Rust inference engine, a CUDA",
    "backend, a CPU reference backend, a launcher and an OpenAI-compatible server. Read files",
    "before changing them, run the tests after every change, and report what you measured.",
    "Never invent an option or a file; refuse what the repository does not support, by name.",
])


def chat(c, messages, **kw):
    return c.chat.completions.create(model=c.models.list().data[0].id, messages=messages,
                                     max_tokens=8, temperature=0, **kw)


def test_a_second_turn_reuses_the_first_turns_blocks_and_answers_as_cold(oss_server):
    c = client(oss_server)
    turn1 = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Where does the decode loop sample its tokens?"}]
    r1 = chat(c, turn1)
    u1 = r1.usage
    assert u1.prompt_tokens > 2 * BLOCK
    assert u1.prompt_tokens_details.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content or "ok"},
                     {"role": "user", "content": "And where does prefill store its blocks?"}]
    warm = chat(c, turn2)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    # Every whole block of the first turn's prompt: on the CUDA engine the
    # last of them keeps the sliding layers' window, so the second turn
    # resumes right after it.
    assert cached == BLOCK * (u1.prompt_tokens // BLOCK), (cached, u1.prompt_tokens)
    cold = chat(c, turn2, extra_body={"cache_prompt": False})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.usage.prompt_tokens == warm.usage.prompt_tokens
    assert warm.choices[0].message.content == cold.choices[0].message.content
    s = stats(oss_server)["prefix_cache"]
    assert s["hits"] >= 1 and s["cached_tokens"] >= cached and s["block_tokens"] == BLOCK


PROMPTS = [f"Task {i}: list the files that define the {w} and say what each one holds."
           for i, w in enumerate(["sampler", "scheduler", "expert cache", "chat template"])]


def test_parallel_streams_decode_together_and_each_equals_its_solo_output(oss_server):
    c = client(oss_server)
    model = c.models.list().data[0].id
    solo = [c.completions.create(model=model, prompt=p, max_tokens=24, temperature=0,
                                 extra_body={"cache_prompt": False}).choices[0].text
            for p in PROMPTS]
    out, seen = {}, []

    def stream(i, p):
        s = c.completions.create(model=model, prompt=p, max_tokens=24, temperature=0,
                                 stream=True, extra_body={"cache_prompt": False})
        out[i] = "".join(ch.choices[0].text for ch in s if ch.choices and ch.choices[0].text)

    threads = [threading.Thread(target=stream, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        seen.append(stats(oss_server))
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert [out[i] for i in range(len(PROMPTS))] == solo
    most = max(seen, key=lambda s: len(s["running"]))
    assert len(most["running"]) >= 2, "no two requests ran together"
    assert most["parallel"] == PARALLEL
