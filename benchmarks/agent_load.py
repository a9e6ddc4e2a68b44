#!/usr/bin/env python3
"""Load generator for a running `krasis-runtime serve`, through the official
`openai` client: what coding agents and parallel users see (issue 15).

Scenarios (subcommands; `all` runs the three):
  parallel  N concurrent streaming clients (N in --clients), each sending
            --requests chat completions of a --prompt-tokens prompt.
  agent     one coding-agent loop: a long shared context (--context-tokens of
            real text as the system message), then --turns turns, each
            appending the previous assistant reply and a new user message
            carrying "tool output" (--append-tokens of text), as agents do.
  chaos     --chaos-clients x --chaos-requests requests, each at random read
            to the end, disconnected mid-stream, cancelled before its first
            token or cut by a client read timeout; then checks that
            /v1/stats returns to its baseline, the server still answers, and
            every response read to the end was well-formed.

Definitions (client side, perf_counter):
  TTFT       request sent -> first chunk carrying generated text. The server
             sends the role chunk before the prefill, so the first chunk is
             not the first token.
  ITL        gaps between chunks carrying text (a chunk may carry more than
             one token); TPOT = (last text - first text) / (tokens - 1).
  tok/s      per request: usage.completion_tokens / request time; aggregate:
             all completion tokens of a run / the run's wall time.
  cached     usage.prompt_tokens_details.cached_tokens ("not reported" when
             the server leaves it out).
Every prompt starts with a unique line, so no request can reuse another's
prefix unless the scenario means it to (the agent's turns).

Statistics: every measurement is one discarded warm-up run then --repeats
(>= 3) runs; each figure is reported as median (min-max) over the runs.
Target checks print PASS/FAIL lines; the exit status is 1 on a FAIL or a
request error only with --strict (2 when the run itself cannot be made).
Usage and examples: benchmarks/agent_load.md.
"""

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parents[1]
# Public-domain text (assets/text/PROVENANCE.md): prompts from the first,
# the chars-per-token calibration from the second, so the calibration
# shares no prefix with any measured prompt.
PROMPT_TEXT = REPO / "assets/text/kjv-genesis-exodus.txt"
CALIBRATION_TEXT = REPO / "assets/text/kjv-psalms-matthew.txt"
FINISH_REASONS = ("stop", "length", "tool_calls", "function_call")
NOT_REPORTED = "not reported"


class Fatal(Exception):
    """The run cannot be made (server unreachable, bad arguments)."""


# ---------------------------------------------------------------- server


class Server:
    def __init__(self, url, api_key, timeout):
        url = url.rstrip("/")
        self.base = url[:-3] if url.endswith("/v1") else url
        self.api_key = api_key
        self.timeout = timeout
        self.model = None

    def get(self, path, timeout=10):
        """(status, JSON body) of a GET; /v1 paths carry the API key."""
        req = urllib.request.Request(self.base + path)
        if self.api_key and path.startswith("/v1"):
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                return e.code, json.loads(body)
            except ValueError:
                return e.code, {"raw": body.decode(errors="replace")[:500]}

    def stats(self):
        status, body = self.get("/v1/stats")
        if status != 200:
            raise Fatal(f"GET /v1/stats answered {status}: {body}")
        return body

    def client(self, timeout=None):
        # No retries: a 503 is a measured outcome, not something to hide.
        return openai.OpenAI(
            base_url=self.base + "/v1",
            api_key=self.api_key or "unused",
            max_retries=0,
            timeout=timeout or self.timeout,
        )

    def wait_idle(self, deadline_s=120):
        """Waits until the engine runs and queues nothing; returns the stats."""
        end = time.monotonic() + deadline_s
        while True:
            s = self.stats()
            if idle(s) or time.monotonic() > end:
                return s
            time.sleep(0.05)


def idle(s):
    return (s.get("activity") == "idle" and not s.get("running")
            and s.get("active_sequences", 0) == 0 and s.get("queue_len", 0) == 0)


def read_api_key(path):
    if path:
        key = Path(path).expanduser().read_text().rstrip("\r\n")
        if not key.strip():
            raise Fatal(f"{path} is empty")
        return key
    return os.environ.get("KRASIS_API_KEY") or None


def identity(server, args):
    """What was measured: the server's own account, the GPU, this generator."""
    ident = {"url": server.base, "model": server.model}
    status, ident["health"] = server.get("/health")
    if status != 200:
        raise Fatal(f"{server.base}/health answered {status}: {ident['health']}")
    s = server.stats()
    ident["hcs"], ident["vram"] = s.get("hcs"), s.get("vram")
    ident["pinned_host_bytes"] = s.get("pinned_host_bytes")
    # The server reports no version or commit; the caller may name them.
    ident["server_commit"] = args.commit or NOT_REPORTED
    if args.runtime_bin:
        ident["runtime_version"] = run_text([args.runtime_bin, "--version"])
    if shutil.which("nvidia-smi"):
        ident["gpu"] = run_text(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                 "--format=csv,noheader"])
    rev = run_text(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = run_text(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])
    ident["generator_commit"] = rev + ("+dirty" if dirty else "")
    ident["client"] = {"host": platform.node(), "python": platform.python_version(),
                       "openai": openai.__version__}
    ident["started_unix"] = int(time.time())
    return ident


def run_text(argv):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError as e:
        return f"unavailable: {e}"


# ---------------------------------------------------------------- prompts


class Text:
    """Slices of real text of about a number of tokens, taken in order
    (wrapping around) so prompts differ, each behind a unique first line.
    A prompt's text is `overhead` tokens shorter than asked for, so that
    with the chat template it comes to about the tokens asked for."""

    def __init__(self, chars_per_token, overhead):
        self.body = " ".join(PROMPT_TEXT.read_text().split())
        self.cpt = chars_per_token
        self.overhead = overhead
        self.pos = 0
        self.lock = threading.Lock()

    def take(self, tokens):
        n = max(1, round(tokens * self.cpt))
        with self.lock:
            start = self.pos
            self.pos = (start + n) % len(self.body)
        return (self.body * (2 + n // len(self.body)))[start:start + n]

    def prompt(self, tokens, what="Continue this text"):
        return f"[{uuid.uuid4().hex}] {what}:\n\n{self.take(tokens - self.overhead)}"


def calibrate(server):
    """Characters per token of the served model's tokenizer on this kind of
    text, and the tokens a one-message prompt has besides its text (chat
    template, the unique first line), from the prompt_tokens of two
    non-streaming one-token requests."""
    sample = " ".join(CALIBRATION_TEXT.read_text().split())[:2000]
    c = server.client()

    def count(content):
        r = c.chat.completions.create(model=server.model, max_tokens=1, temperature=0,
                                      messages=[{"role": "user", "content": content}])
        return r.usage.prompt_tokens

    nonce = uuid.uuid4().hex
    head = f"[{nonce}] Continue this text:\n\n"
    bare = count(head)
    tokens = count(head + sample) - bare
    if tokens <= 0:
        raise Fatal(f"calibration failed: {len(sample)} characters counted as {tokens} tokens")
    return len(sample) / tokens, bare


# ---------------------------------------------------------------- one request


class _Recorder:
    """Wraps the openai stream's SSE decoder to keep every event's raw data
    and arrival time: the client parses and raises as it always does, and
    the events are checked independently ([DONE] included, which the client
    swallows)."""

    def __init__(self, inner, events):
        self.inner, self.events = inner, events

    def iter_bytes(self, iterator):
        for sse in self.inner.iter_bytes(iterator):
            self.events.append((time.perf_counter(), sse.data))
            yield sse

    def __getattr__(self, name):
        return getattr(self.inner, name)


def record_events(stream, events):
    if not hasattr(stream, "_decoder"):
        raise Fatal(f"openai {openai.__version__}: Stream has no _decoder to record raw events "
                    "from (tested with the version in tests/requirements.txt)")
    stream._decoder = _Recorder(stream._decoder, events)


def has_text(delta):
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                or delta.get("tool_calls") or delta.get("function_call"))


def check_stream(events, model, max_tokens, complete):
    """Problems with a chat completion stream (raw SSE data strings, in
    order), the text-bearing event indices, the finish reason and usage.
    A stream the client cut (`complete` false) is only checked for what
    was read."""
    problems, text_idx, finish, usage, ids = [], [], None, None, set()
    chunks, done = [], False
    for i, data in enumerate(events):
        if done:
            problems.append(f"event {i} after [DONE]")
            break
        if data == "[DONE]":
            done = True
            continue
        try:
            c = json.loads(data)
        except ValueError:
            problems.append(f"event {i} is not JSON: {data[:80]!r}")
            continue
        if not isinstance(c, dict):
            problems.append(f"event {i} is not a JSON object")
            continue
        chunks.append((i, c))
    for i, c in chunks:
        ids.add(c.get("id"))
        if c.get("object") != "chat.completion.chunk":
            problems.append(f"event {i}: object is {c.get('object')!r}")
        if c.get("model") != model:
            problems.append(f"event {i}: model is {c.get('model')!r}, not {model!r}")
        choices = c.get("choices")
        if c.get("usage") is not None:
            if usage is not None:
                problems.append(f"event {i}: a second usage")
            usage = c["usage"]
            if choices != []:
                problems.append(f"event {i}: the usage chunk has choices {choices!r}")
            continue
        if not isinstance(choices, list) or len(choices) != 1 or choices[0].get("index") != 0:
            problems.append(f"event {i}: choices is {choices!r}, not one choice of index 0")
            continue
        if finish is not None:
            problems.append(f"event {i}: a chunk after finish_reason {finish!r}")
        delta = choices[0].get("delta") or {}
        if i == chunks[0][0] and delta.get("role") != "assistant":
            problems.append("the first chunk has no role 'assistant'")
        if has_text(delta):
            text_idx.append(i)
        fr = choices[0].get("finish_reason")
        if fr is not None:
            if fr not in FINISH_REASONS:
                problems.append(f"event {i}: finish_reason {fr!r}")
            finish = fr
    if len(ids) > 1 or None in ids or "" in ids:
        problems.append(f"chunk ids are {sorted(map(str, ids))}, not one id")
    if not complete:
        return problems, text_idx, finish, usage
    if not done:
        problems.append("no [DONE]")
    if finish is None:
        problems.append("no finish_reason")
    if usage is None:
        problems.append("no usage chunk (stream_options.include_usage was set)")
    elif chunks and chunks[-1][1].get("usage") is None:
        problems.append("the usage chunk is not the last chunk")
    if usage is not None:
        problems += check_usage(usage, max_tokens, finish, bool(text_idx))
    return problems, text_idx, finish, usage


def check_usage(u, max_tokens, finish, produced_text):
    p, c, t = u.get("prompt_tokens"), u.get("completion_tokens"), u.get("total_tokens")
    if not all(isinstance(x, int) for x in (p, c, t)):
        return [f"usage counts are not integers: {u}"]
    problems = []
    if p <= 0:
        problems.append(f"usage.prompt_tokens is {p}")
    if t != p + c:
        problems.append(f"usage.total_tokens {t} != prompt {p} + completion {c}")
    if not 0 <= c <= max_tokens:
        problems.append(f"usage.completion_tokens {c} outside 0..max_tokens {max_tokens}")
    if finish == "length" and c != max_tokens:
        problems.append(f"finish_reason length after {c} of max_tokens {max_tokens} tokens")
    if produced_text and c == 0:
        problems.append("text streamed but usage.completion_tokens is 0")
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None and not (isinstance(cached, int) and 0 <= cached <= p):
        problems.append(f"cached_tokens {cached!r} outside 0..prompt_tokens {p}")
    return problems


def stream_chat(client, model, messages, max_tokens, fixed, cut_after=None, label=""):
    """One streaming chat completion, measured and checked. `fixed` asks for
    exactly max_tokens tokens (`ignore_eos`, which the server implements). `cut_after`:
    None reads to the end; 0 closes the stream as soon as the response
    headers arrive (a cancel before any token); k closes it after k chunks
    carrying text (a mid-stream disconnect)."""
    rec = {"label": label, "max_tokens": max_tokens, "ok": False, "error_kind": None,
           "error": None, "cut": False, "problems": [], "prompt_tokens": None,
           "completion_tokens": None, "cached_tokens": None, "finish_reason": None,
           "ttft_s": None, "e2e_s": None, "text_chunks": 0}
    events, text, reading = [], [], False
    t0 = time.perf_counter()
    try:
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True} if fixed else None)
        record_events(stream, events)
        reading = True
        if cut_after == 0:
            stream.close()
            rec["cut"] = True
        else:
            n = 0
            for ch in stream:
                if ch.choices and ch.choices[0].delta is not None:
                    d = ch.choices[0].delta
                    text.append(d.content or "")
                    if has_text(d.model_dump(exclude_none=True)):
                        n += 1
                if cut_after is not None and n >= cut_after:
                    stream.close()
                    rec["cut"] = True
                    break
    except openai.APIStatusError as e:
        rec["error_kind"] = "rejected" if e.status_code == 503 else "http"
        rec["error"] = f"HTTP {e.status_code}: {e.message}"
        if e.status_code == 503 and not e.response.headers.get("retry-after"):
            rec["problems"].append("503 without Retry-After")
    except openai.APITimeoutError:
        rec["error_kind"], rec["error"] = "timeout", "client timeout"
    except openai.APIConnectionError as e:
        rec["error_kind"], rec["error"] = "connection", f"connection: {e}"
    except openai.APIError as e:
        rec["error_kind"], rec["error"] = "stream_error", f"error in the stream: {e.message}"
    except ValueError as e:  # an event the client could not parse as JSON
        rec["error_kind"], rec["error"] = "malformed", f"unparsable stream: {e}"
    rec["e2e_s"] = time.perf_counter() - t0
    if not reading:
        return rec, ""
    datas = [d for _, d in events]
    problems, text_idx, finish, usage = check_stream(
        datas, model, max_tokens, complete=not rec["cut"] and rec["error"] is None)
    rec["problems"] += problems
    times = [events[i][0] for i in text_idx]
    rec["text_chunks"] = len(times)
    rec["finish_reason"] = finish
    if times:
        rec["ttft_s"] = times[0] - t0
        rec["itl_s"] = [b - a for a, b in zip(times, times[1:])]
        rec["last_text_s"] = times[-1] - t0
    if usage is not None:
        rec["prompt_tokens"] = usage.get("prompt_tokens")
        rec["completion_tokens"] = usage.get("completion_tokens")
        rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if rec["problems"] and rec["error"] is None:
        rec["error_kind"], rec["error"] = "malformed", "; ".join(rec["problems"][:4])
    rec["ok"] = rec["error"] is None and not rec["cut"]
    return rec, "".join(text)


# ---------------------------------------------------------------- statistics


def pct(xs, q):
    """The q-th percentile, linear between closest ranks (numpy's default)."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def spread(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def run_metrics(recs, wall_s):
    """One run's figures over its requests."""
    ok = [r for r in recs if r["ok"]]
    errors = {}
    for r in recs:
        if r["error_kind"]:
            errors[r["error_kind"]] = errors.get(r["error_kind"], 0) + 1
    tokens = sum(r["completion_tokens"] for r in ok)
    itl = [g for r in ok for g in r.get("itl_s", [])]
    tpot = [(r["last_text_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1)
            for r in ok if r["ttft_s"] is not None and r["completion_tokens"] > 1]
    cached = [r["cached_tokens"] for r in ok]
    reported = [c for c in cached if c is not None]
    return {
        "requests": len(recs),
        "ok": len(ok),
        "errors": errors,
        "wall_s": wall_s,
        "ttft_p50_s": pct([r["ttft_s"] for r in ok], 50),
        "ttft_p95_s": pct([r["ttft_s"] for r in ok], 95),
        "itl_p50_s": pct(itl, 50),
        "itl_p95_s": pct(itl, 95),
        "tpot_p50_s": pct(tpot, 50),
        "request_tok_s_p50": pct([r["completion_tokens"] / r["e2e_s"] for r in ok], 50),
        "aggregate_tok_s": tokens / wall_s if wall_s > 0 else None,
        "completion_tokens": tokens,
        "prompt_tokens_p50": pct([r["prompt_tokens"] for r in ok], 50),
        "all_reached_max_tokens": bool(ok) and all(
            r["completion_tokens"] == r["max_tokens"] for r in ok),
        "cached_tokens": (sum(reported) if len(reported) == len(cached) and reported
                          else NOT_REPORTED if not reported
                          else f"reported by {len(reported)} of {len(cached)} requests"),
    }


def summarize(runs):
    """median (min-max) over the timed runs of every numeric figure."""
    keys = [k for k, v in runs[0]["metrics"].items() if not isinstance(v, (bool, str, dict))]
    return {k: spread([r["metrics"][k] for r in runs]) for k in keys}


def public(rec):
    """A request record for the JSON report (its ITL median, not every gap)."""
    out = {k: v for k, v in rec.items() if k != "itl_s"}
    out["itl_p50_s"] = pct(rec.get("itl_s", []), 50)
    return out


def server_check(before, after, recs):
    """The server's request log against the client's usage: the engine's
    own count of prompt and completion tokens for this run's requests."""
    first = max((r["id"] for r in before.get("recent_requests", [])), default=0)
    new = [r for r in after.get("recent_requests", []) if r["id"] > first]
    ok = [r for r in recs if r["ok"]]
    if len(new) != len(recs) or len(recs) != len(ok):
        return {"compared": False,
                "reason": f"{len(new)} new log records for {len(recs)} requests ({len(ok)} ok); "
                          "the log keeps the last 64"}
    client = (sum(r["prompt_tokens"] for r in ok), sum(r["completion_tokens"] for r in ok))
    server = (sum(r["prompt_tokens"] for r in new), sum(r["completion_tokens"] for r in new))
    ttfts = [r["ttft_ms"] / 1e3 if r.get("ttft_ms") else None for r in new]
    return {"compared": True, "match": client == server,
            "client_prompt_completion": client, "server_prompt_completion": server,
            "server_ttft_p50_s": pct([t for t in ttfts if t is not None], 50),
            # Per request, in the order the server took them (its log ids).
            "server_ttft_s": ttfts}


# ---------------------------------------------------------------- runs


def concurrently(n, work, prepare=None):
    """Runs work(i) on n threads released together; (results, wall seconds).
    With `prepare`, each thread first runs prepare(i) outside the timed
    span and its work gets the result, work(i, prepared): building an
    `openai` client (an httpx client and its TLS context) takes tens of ms
    of CPU under the GIL, so n threads building theirs after the start
    serialised and delayed the later clients' first requests (a 4-client
    run lost ~100 ms of a ~1 s wall to it; agents keep their clients). The
    clock starts once every thread is ready and before any is released, so
    no request starts before it."""
    ready = threading.Barrier(n + 1)
    go = threading.Event()
    out, failures = [None] * n, []

    def body(i):
        prepared, ok = None, True
        try:
            prepared = prepare(i) if prepare else None
        except BaseException as e:  # re-raised below, after every thread is ready
            failures.append(e)
            ok = False
        ready.wait()
        go.wait()
        if not ok:
            return
        try:
            out[i] = work(i, prepared) if prepare else work(i)
        except BaseException as e:  # re-raised below: a generator bug must not pass silently
            failures.append(e)
    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    ready.wait()
    t0 = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if failures:
        raise failures[0]
    return out, wall


def measured(server, label, once, repeats):
    """One discarded warm-up run, then `repeats` timed runs of once() ->
    (measured request records, wall seconds, other requests sent, extra
    run fields)."""
    runs = []
    for k in range(repeats + 1):
        before = server.wait_idle()
        recs, wall, other, fields = once()
        after = server.wait_idle()
        run = {"warmup": k == 0, "metrics": run_metrics(recs, wall),
               "server_check": server_check(before, after, recs + other), **fields,
               "requests": [public(r) for r in recs]}
        m = run["metrics"]
        print(f"  {label} {'warm-up' if k == 0 else f'run {k}'}: {m['ok']}/{m['requests']} ok, "
              f"TTFT p50 {fmt_s(m['ttft_p50_s'])}, aggregate {fmt(m['aggregate_tok_s'])} tok/s",
              file=sys.stderr)
        runs.append(run)
    return {"warmup": runs[0], "runs": runs[1:], "summary": summarize(runs[1:])}


def scenario_parallel(server, text, a, fixed):
    out = {"prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
           "requests_per_client": a.requests, "by_clients": {}}
    for n in a.clients:
        def once(n=n):
            def prepare(i):
                return server.client(), [text.prompt(a.prompt_tokens) for _ in range(a.requests)]

            def client_work(i, prepared):
                c, prompts = prepared
                return [stream_chat(c, server.model, [{"role": "user", "content": p}],
                                    a.max_tokens, fixed, label=f"c{i}r{j}")[0]
                        for j, p in enumerate(prompts)]
            per_client, wall = concurrently(n, client_work, prepare)
            return [r for rs in per_client for r in rs], wall, [], {}
        out["by_clients"][str(n)] = measured(server, f"parallel x{n}", once, a.repeats)
    return out


AGENT_SYSTEM = ("You are a coding agent. The project's reference material follows; "
                "answer questions about it.\n\n")


def scenario_agent(server, text, a, fixed):
    def once():
        c = server.client()
        msgs = [{"role": "system", "content": AGENT_SYSTEM + text.prompt(a.context_tokens,
                                                                          "Reference")}]
        recs, evict = [], []
        t0 = time.perf_counter()
        for turn in range(1, a.turns + 1):
            if turn == 2 and a.evict_requests:
                # Unrelated contexts of the same size, to push this one out
                # of the VRAM prefix pool (the RAM tier's restore is turn 2).
                for _ in range(a.evict_requests):
                    r, _ = stream_chat(c, server.model, [{"role": "user", "content": text.prompt(
                        a.context_tokens)}], 1, fixed, label="evict")
                    evict.append(r)
            msgs.append({"role": "user", "content": text.prompt(
                a.append_tokens, f"Turn {turn}: tool output follows; summarise it in one line")})
            r, reply = stream_chat(c, server.model, msgs, a.reply_tokens, fixed,
                                   label=f"turn{turn}")
            r["turn"] = turn
            recs.append(r)
            if not r["ok"]:
                break
            msgs.append({"role": "assistant", "content": reply})
        wall = time.perf_counter() - t0
        return recs, wall, evict, {"turns": [turn_figures(r) for r in recs],
                                   "evict_requests": [public(r) for r in evict]}

    m = measured(server, "agent", once, a.repeats)
    for run in [m["warmup"], *m["runs"]]:
        add_server_ttft(run, a.evict_requests)
    per_turn = []
    for t in range(a.turns):
        rows = [run["turns"][t] for run in m["runs"] if len(run["turns"]) > t]
        per_turn.append({"turn": t + 1, **{k: spread([row[k] for row in rows])
                                           for k in ("ttft_s", "server_ttft_s", "prompt_tokens",
                                                     "e2e_s")},
                         "cached_tokens": cached_summary([row["cached_tokens"] for row in rows])})
    return {"context_tokens": a.context_tokens, "turns": a.turns, "append_tokens": a.append_tokens,
            "reply_tokens": a.reply_tokens, "evict_requests": a.evict_requests,
            "per_turn": per_turn, **m}


def add_server_ttft(run, evict_requests):
    """Each turn's TTFT as the server measured it (its first token sampled,
    /v1/stats), beside the client's (its first visible text). They differ
    where the output format holds text back: gpt-oss's harmony parser keeps
    a message's header until `<|message|>`, which a random-weight model
    never writes, so its client sees the text only at the end. The agent's
    requests are sequential, so the server's log order is turn 1, the
    evicting requests, then turns 2 and on."""
    ttfts = run["server_check"].get("server_ttft_s")
    for x in run["turns"]:
        i = x["turn"] - 1 + (evict_requests if x["turn"] > 1 else 0)
        x["server_ttft_s"] = ttfts[i] if ttfts and i < len(ttfts) else None


def turn_figures(r):
    return {k: r[k] for k in ("turn", "ttft_s", "e2e_s", "prompt_tokens", "completion_tokens",
                              "cached_tokens", "ok", "error")}


def cached_summary(values):
    reported = [v for v in values if v is not None]
    if not reported:
        return NOT_REPORTED
    return spread(reported) if len(reported) == len(values) else \
        f"reported by {len(reported)} of {len(values)} runs"


CHAOS_ACTIONS = (("complete", 0.4), ("disconnect", 0.3), ("cancel", 0.15), ("timeout", 0.15))


def scenario_chaos(server, text, a, fixed):
    rng = random.Random(a.seed)
    plan = [[(rng.choices([x for x, _ in CHAOS_ACTIONS], [w for _, w in CHAOS_ACTIONS])[0],
              rng.randint(1, max(1, a.chaos_max_tokens - 1)),
              rng.randint(max(1, a.chaos_prompt_tokens // 8), a.chaos_prompt_tokens))
             for _ in range(a.chaos_requests)] for _ in range(a.chaos_clients)]
    before = server.wait_idle()

    def client_work(i):
        recs = []
        for j, (action, cut, tokens) in enumerate(plan[i]):
            c = server.client(timeout=0.02) if action == "timeout" else server.client()
            cut_after = {"disconnect": cut, "cancel": 0}.get(action)
            r, _ = stream_chat(c, server.model, [{"role": "user", "content": text.prompt(tokens)}],
                               a.chaos_max_tokens, fixed, cut_after=cut_after,
                               label=f"c{i}r{j}:{action}")
            r["action"] = action
            recs.append(r)
        return recs
    per_client, wall = concurrently(a.chaos_clients, client_work)
    recs = [r for rs in per_client for r in rs]
    after = server.wait_idle(deadline_s=a.idle_deadline)
    checks = chaos_checks(server, text, a, fixed, recs, before, after)
    actions = {}
    for r in recs:
        actions[r["action"]] = actions.get(r["action"], 0) + 1
    return {"clients": a.chaos_clients, "requests_per_client": a.chaos_requests,
            "actions": actions, "metrics": run_metrics(recs, wall), "checks": checks,
            "stats_changed": changed_numbers(before, after),
            "requests": [public(r) for r in recs]}


def chaos_checks(server, text, a, fixed, recs, before, after):
    def check(name, ok, detail=""):
        return {"check": name, "pass": bool(ok), "detail": detail}
    checks = []
    status, health = server.get("/health")
    checks.append(check("server healthy after", status == 200 and health.get("status") == "ok",
                        f"{status} {health}"))
    bad = [f"{r['label']}: {r['error'] or r['problems']}" for r in recs
           if r["problems"] or (r["error_kind"] not in (None, "rejected")
                                and not (r["action"] == "timeout" and r["error_kind"] == "timeout"))]
    checks.append(check("every response well-formed (read parts of cut ones too)", not bad,
                        "; ".join(bad[:5])))
    checks.append(check("engine idle after (activity idle, no running request, "
                        "active_sequences 0, queue_len 0)", idle(after),
                        json.dumps({k: after.get(k) for k in
                                    ("activity", "running", "active_sequences", "queue_len")})))
    for g in a.gauge:
        b, f = dig(before, g), dig(after, g)
        checks.append(check(f"{g} back to baseline", b is not None and b == f,
                            f"before {b}, after {f}"))
    d = {k: after[k] - before[k] for k in
         ("requests_completed", "requests_cancelled", "requests_rejected")}
    sent = len(recs)
    rejected = sum(r["error_kind"] == "rejected" for r in recs)
    read_whole = sum(r["ok"] for r in recs)
    checks.append(check(
        "accounting: every request read to the end counted completed, none counted twice",
        read_whole <= d["requests_completed"]
        and d["requests_completed"] + d["requests_cancelled"] <= sent - rejected,
        f"sent {sent}, read to the end {read_whole}, 503 {rejected}; server {d}"))
    # Every admission slot must be free again once the engine is idle: the
    # same concurrency, read to the end. (A disconnected client's queued job
    # keeps its slot until the engine reaches it, so the chaos itself may see
    # 503s; this may not. The server does not report its queue depth: keep
    # --chaos-clients <= queue depth + the server's `parallel`.)
    def work(i):
        return stream_chat(server.client(), server.model,
                           [{"role": "user", "content": text.prompt(a.chaos_prompt_tokens)}],
                           a.chaos_max_tokens, fixed, label=f"after{i}")[0]
    follow, _ = concurrently(a.chaos_clients, work)
    bad = [f"{r['label']}: {r['error']}" for r in follow if not r["ok"]]
    checks.append(check(f"no leaked admission slots ({a.chaos_clients} concurrent requests "
                        "afterwards all answered well-formed)", not bad, "; ".join(bad[:5])))
    return checks


def dig(d, path):
    for part in path.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def changed_numbers(before, after, prefix=""):
    """Every numeric /v1/stats field that differs (for the reader)."""
    out = {}
    for k, v in after.items():
        b = before.get(k) if isinstance(before, dict) else None
        if isinstance(v, dict):
            out.update(changed_numbers(b or {}, v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and v != b:
            out[prefix + k] = [b, v]
    return out


# ---------------------------------------------------------------- targets


def targets(report):
    out = []
    par = report["scenarios"].get("parallel")
    if par and "1" in par["by_clients"] and "4" in par["by_clients"]:
        one = par["by_clients"]["1"]["summary"]["aggregate_tok_s"]["median"]
        four = par["by_clients"]["4"]["summary"]["aggregate_tok_s"]["median"]
        ratio = four / one if one else None
        out.append({"target": "4 parallel clients >= 2.5x the aggregate tok/s of one",
                    "value": ratio, "pass": ratio is not None and ratio >= 2.5,
                    "detail": f"{fmt(four)} vs {fmt(one)} tok/s (medians)"})
    ag = report["scenarios"].get("agent")
    if ag and ag["turns"] >= 2:
        # Per run: the slowest turn after the first (after the restore turn
        # with --evict-requests) over the cold first turn; median over runs.
        later = 3 if ag["evict_requests"] else 2
        restores = []
        for run in ag["runs"]:
            t = {x["turn"]: x["ttft_s"] for x in run["turns"]}
            cold = t.get(1)
            restores.append(t[2] / cold if cold and t.get(2) else None)
        if ag["turns"] >= later:
            out.append(later_turns_target(ag, later, "ttft_s", "TTFT",
                                          "a turn with no visible text"))
            # The engine's side of the same figure, labelled as such: for a
            # model whose output format holds the text back (see
            # add_server_ttft) it is the only TTFT there is.
            if any(x.get("server_ttft_s") is not None for run in ag["runs"]
                   for x in run["turns"]):
                out.append(later_turns_target(
                    ag, later, "server_ttft_s",
                    "server TTFT (first token sampled, /v1/stats)",
                    "a turn the server log did not time"))
        if ag["evict_requests"]:
            r2 = spread(restores) if None not in restores else None
            out.append({"target": "agent turn 2 after forced eviction (RAM-tier restore) "
                                  "TTFT <= 25% of cold",
                        "value": r2 and r2["median"], "pass": bool(r2) and r2["median"] <= 0.25,
                        "detail": fmt_spread(r2, pct_=True)})
    ch = report["scenarios"].get("chaos")
    if ch:
        failed = [c["check"] for c in ch["checks"] if not c["pass"]]
        out.append({"target": "chaos: no leak, no crash, every response well-formed",
                    "value": None, "pass": not failed, "detail": "; ".join(failed)})
    return out


def later_turns_target(ag, later, key, what, missing):
    """Per run: the slowest turn from `later` on over the cold first turn,
    by `key`; median (min-max) over runs. A run with a turn that has no
    figure (a client TTFT needs visible text: a random-weight model can
    spend all its tokens on ones that decode to nothing) is left out and
    counted."""
    ratios = []
    for run in ag["runs"]:
        t = {x["turn"]: x.get(key) for x in run["turns"]}
        cold = t.get(1)
        rest = [t.get(k) for k in range(later, ag["turns"] + 1)]
        ratios.append(max(rest) / cold if cold and rest and None not in rest else None)
    complete = [x for x in ratios if x is not None]
    r = spread(complete)
    left_out = len(ratios) - len(complete)
    note = (f" ({left_out} of {len(ratios)} runs left out: {missing})"
            if left_out and complete else "")
    return {"target": f"agent turns {later}+ {what} <= 10% of the cold first turn",
            "value": r and r["median"], "pass": bool(r) and r["median"] <= 0.10,
            "runs_left_out": left_out,
            "detail": f"slowest later turn / cold, median (min-max) over runs: "
                      f"{fmt_spread(r, pct_=True)}{note}"}


def request_errors(report):
    """Errors of the timed and warm-up runs (chaos outcomes are its checks)."""
    n = 0
    for name, sc in report["scenarios"].items():
        runs = ([m for v in sc["by_clients"].values() for m in [v["warmup"], *v["runs"]]]
                if name == "parallel" else [sc["warmup"], *sc["runs"]] if name == "agent" else [])
        for run in runs:
            n += sum(run["metrics"]["errors"].values())
            sc_check = run["server_check"]
            n += sc_check.get("compared") is True and not sc_check["match"]
    return n


# ---------------------------------------------------------------- output


def fmt(x, digits=1):
    return "-" if x is None else f"{x:,.{digits}f}"


def fmt_s(x):
    return "-" if x is None else f"{x * 1e3:,.1f} ms"


def fmt_spread(s, ms=False, pct_=False, digits=1):
    if not isinstance(s, dict):
        return s if isinstance(s, str) else "-"
    f = (lambda x: f"{x * 1e3:,.{digits}f}") if ms else \
        (lambda x: f"{x * 100:.1f}%") if pct_ else (lambda x: f"{x:,.{digits}f}")
    return f"**{f(s['median'])}** ({f(s['min'])}–{f(s['max'])})"


def markdown(report):
    ident = report["identity"]
    lines = ["# agent_load report", "",
             f"Server {ident['url']}, model `{ident['model']}`, backend "
             f"`{ident['health'].get('backend')}`, server commit {ident['server_commit']}, "
             f"GPU {ident.get('gpu', 'none seen (no nvidia-smi)')}, generator "
             f"{ident['generator_commit']}, openai {ident['client']['openai']}.",
             f"Figures: median (min–max) over {report['config']['repeats']} runs after one "
             "discarded warm-up run. Times in ms.", ""]
    if report["config"]["ignore_eos"]:
        lines.append("Requests carry `ignore_eos` (generation runs to max_tokens past the end "
                     "of sequence), so every completion has max_tokens tokens (column `all max`).")
        lines.append("")
    sc = report["scenarios"]
    if "parallel" in sc:
        p = sc["parallel"]
        lines += [f"## parallel: {p['requests_per_client']} requests per client, prompt "
                  f"~{p['prompt_tokens']} tokens, max_tokens {p['max_tokens']}", "",
                  "TTFT is the client's (first visible text); server TTFT is the engine's "
                  "(first token sampled, from /v1/stats).", "",
                  "| clients | TTFT p50 | TTFT p95 | server TTFT p50 | ITL p50 | ITL p95 | "
                  "TPOT p50 | tok/s per request | aggregate tok/s | prompt tokens | "
                  "cached tokens | all max | errors |",
                  "| --- " * 13 + "|"]
        for n, m in p["by_clients"].items():
            s = m["summary"]
            runs = m["runs"]
            server_ttft = spread([r["server_check"].get("server_ttft_p50_s") for r in runs])
            lines.append(
                f"| {n} | {fmt_spread(s['ttft_p50_s'], ms=True)} | "
                f"{fmt_spread(s['ttft_p95_s'], ms=True)} | {fmt_spread(server_ttft, ms=True)} | "
                f"{fmt_spread(s['itl_p50_s'], ms=True)} | "
                f"{fmt_spread(s['itl_p95_s'], ms=True)} | {fmt_spread(s['tpot_p50_s'], ms=True)} | "
                f"{fmt_spread(s['request_tok_s_p50'])} | {fmt_spread(s['aggregate_tok_s'])} | "
                f"{fmt_spread(s['prompt_tokens_p50'], digits=0)} | "
                f"{cached_cell([r['metrics']['cached_tokens'] for r in runs])} | "
                f"{'yes' if all(r['metrics']['all_reached_max_tokens'] for r in runs) else 'no'} | "
                f"{errors_cell(runs)} |")
        lines.append("")
    if "agent" in sc:
        g = sc["agent"]
        lines += [f"## agent: context ~{g['context_tokens']} tokens, {g['turns']} turns, "
                  f"+~{g['append_tokens']} tokens of tool output per turn, replies of "
                  f"{g['reply_tokens']} tokens, {g['evict_requests']} evicting requests "
                  "before turn 2", "",
                  "TTFT is the client's (first visible text); server TTFT is the engine's "
                  "(first token sampled, from /v1/stats).", "",
                  "| turn | prompt tokens | TTFT | TTFT / cold turn 1 | server TTFT | "
                  "server TTFT / cold | request time | cached tokens |", "| --- " * 8 + "|"]

        def ratio(t, key):
            cold = g["per_turn"][0].get(key)
            r = (t[key]["median"] / cold["median"]
                 if t.get(key) and cold and cold["median"] else None)
            return "-" if r is None else f"{r * 100:.1f}%"
        for t in g["per_turn"]:
            lines.append(f"| {t['turn']} | {fmt_spread(t['prompt_tokens'], digits=0)} | "
                         f"{fmt_spread(t['ttft_s'], ms=True)} | {ratio(t, 'ttft_s')} | "
                         f"{fmt_spread(t.get('server_ttft_s'), ms=True)} | "
                         f"{ratio(t, 'server_ttft_s')} | "
                         f"{fmt_spread(t['e2e_s'], ms=True)} | "
                         f"{fmt_spread(t['cached_tokens'], digits=0)} |")
        lines += ["", f"Errors: {errors_cell(g['runs'])}.", ""]
    if "chaos" in sc:
        c = sc["chaos"]
        m = c["metrics"]
        lines += [f"## chaos: {c['clients']} clients x {c['requests_per_client']} requests", "",
                  f"Actions: {c['actions']}. Outcomes: {m['ok']} read to the end, errors "
                  f"{m['errors'] or 'none'}. Completed requests: TTFT p50 "
                  f"{fmt_s(m['ttft_p50_s'])}, aggregate {fmt(m['aggregate_tok_s'])} tok/s "
                  "(one run: a reliability check, not a measurement).", "",
                  "| check | result | detail |", "| --- | --- | --- |"]
        for ch in c["checks"]:
            lines.append(f"| {ch['check']} | {'PASS' if ch['pass'] else 'FAIL'} | "
                         f"{ch['detail'].replace('|', '/')[:300]} |")
        lines += ["", f"/v1/stats numbers that changed: `{json.dumps(c['stats_changed'])[:600]}`",
                  ""]
    lines += ["## targets", ""] + [target_line(t) for t in report["targets"]]
    return "\n".join(lines) + "\n"


def cached_cell(values):
    nums = [v for v in values if isinstance(v, int)]
    if len(nums) == len(values):
        return fmt_spread(spread(nums), digits=0)
    return values[0] if len(set(map(str, values))) == 1 else "mixed: " + ", ".join(map(str, values))


def errors_cell(runs):
    total = {}
    for r in runs:
        for k, v in r["metrics"]["errors"].items():
            total[k] = total.get(k, 0) + v
        if r["server_check"].get("compared") and not r["server_check"]["match"]:
            total["usage != server log"] = total.get("usage != server log", 0) + 1
    return ", ".join(f"{k} {v}" for k, v in total.items()) or "none"


def target_line(t):
    return f"{'PASS' if t['pass'] else 'FAIL'}: {t['target']}" + (
        f": {t['detail']}" if t["detail"] else "")


# ---------------------------------------------------------------- CLI


def csv_ints(s):
    try:
        xs = [int(x) for x in s.split(",") if x]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of integers") from e
    if not xs or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: every count must be at least 1")
    return xs


def parser():
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("server and report")
    g.add_argument("--url", default="http://127.0.0.1:8080", help="server (with or without /v1)")
    g.add_argument("--api-key-file", help="file holding the API key (else KRASIS_API_KEY)")
    g.add_argument("--commit", help="the server's commit, for the report (it does not say)")
    g.add_argument("--runtime-bin", help="the krasis-runtime binary, for its --version")
    g.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up (>= 3)")
    g.add_argument("--seed", type=int, default=0, help="chaos's random plan")
    g.add_argument("--timeout", type=float, default=600, help="client timeout per request, s")
    g.add_argument("--chars-per-token", type=float,
                   help="skip the calibration requests and use this ratio")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos")
    g.add_argument("--json", help="write the full report here")
    g.add_argument("--markdown", help="write the markdown tables here")
    g.add_argument("--strict", action="store_true",
                   help="exit 1 on a FAIL target or any request error")

    par = argparse.ArgumentParser(add_help=False)
    g = par.add_argument_group("parallel")
    g.add_argument("--clients", type=csv_ints, default=[1, 2, 4, 8])
    g.add_argument("--requests", type=int, default=4, help="requests per client per run")
    g.add_argument("--prompt-tokens", type=int, default=1000)
    g.add_argument("--max-tokens", type=int, default=256)

    agent = argparse.ArgumentParser(add_help=False)
    g = agent.add_argument_group("agent")
    g.add_argument("--context-tokens", type=int, default=24000)
    g.add_argument("--turns", type=int, default=6)
    g.add_argument("--append-tokens", type=int, default=256, help="tool output per turn")
    g.add_argument("--reply-tokens", type=int, default=128, help="max_tokens of each turn")
    g.add_argument("--evict-requests", type=int, default=0,
                   help="unrelated contexts of the same size sent before turn 2")

    chaos = argparse.ArgumentParser(add_help=False)
    g = chaos.add_argument_group("chaos")
    g.add_argument("--chaos-clients", type=int, default=16)
    g.add_argument("--chaos-requests", type=int, default=20, help="requests per client")
    g.add_argument("--chaos-prompt-tokens", type=int, default=512, help="largest prompt")
    g.add_argument("--chaos-max-tokens", type=int, default=64)
    g.add_argument("--gauge", action="append", default=[], metavar="PATH",
                   help="a /v1/stats field (dotted path, e.g. kv.used_blocks) that must return "
                        "to its baseline; repeatable")
    g.add_argument("--idle-deadline", type=float, default=60,
                   help="seconds the engine gets to become idle after the chaos")

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="scenario", required=True)
    sub.add_parser("parallel", parents=[common, par], help="N concurrent streaming clients")
    sub.add_parser("agent", parents=[common, agent], help="a multi-turn coding-agent loop")
    sub.add_parser("chaos", parents=[common, chaos], help="disconnects, cancels, leak checks")
    sub.add_parser("all", parents=[common, par, agent, chaos], help="the three, in order")
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    if a.repeats < 3:
        raise Fatal(f"--repeats {a.repeats}: the statistics need at least 3 timed runs")
    server = Server(a.url, read_api_key(a.api_key_file), a.timeout)
    try:
        status, models = server.get("/v1/models")
    except OSError as e:
        raise Fatal(f"cannot reach {server.base}: {e}") from e
    if status != 200 or not models.get("data"):
        raise Fatal(f"GET /v1/models answered {status}: {models}")
    server.model = models["data"][0]["id"]
    report = {"tool": "benchmarks/agent_load.py", "identity": identity(server, a),
              "config": {k: v for k, v in vars(a).items() if k != "api_key_file"},
              "scenarios": {}}
    cpt, overhead = (a.chars_per_token, 0) if a.chars_per_token else calibrate(server)
    report["config"].update(chars_per_token=cpt, prompt_overhead_tokens=overhead)
    text = Text(cpt, overhead)
    scenarios = {"parallel": scenario_parallel, "agent": scenario_agent, "chaos": scenario_chaos}
    for name in scenarios if a.scenario == "all" else [a.scenario]:
        print(f"{name}:", file=sys.stderr)
        report["scenarios"][name] = scenarios[name](server, text, a, a.ignore_eos)
    report["targets"] = targets(report)
    report["request_errors"] = request_errors(report)
    md = markdown(report)
    print(md)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(md)
    failed = [t for t in report["targets"] if not t["pass"]]
    if a.strict and (failed or report["request_errors"]):
        print(f"--strict: {len(failed)} target(s) failed, {report['request_errors']} request "
              "error(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Fatal as e:
        print(f"agent_load: {e}", file=sys.stderr)
        sys.exit(2)
