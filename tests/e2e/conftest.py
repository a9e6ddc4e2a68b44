"""Fixtures for end-to-end tests with the official `openai` client.

The servers are real processes: `target/debug/krasis-runtime serve --backend
reference` on a synthesized `tiny` checkpoint, and the `scripted_server`
example (the same server library over a scripted engine) for exact model
output such as tool calls. Build first: `cargo build -p krasis-runtime`
(the scripted example is built here if missing).
"""

import json
import os
import queue
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
RUNTIME = TARGET / "debug" / "krasis-runtime"
SCRIPTED = TARGET / "debug" / "examples" / "scripted_server"


def pytest_addoption(parser):
    # The same client tests run against the CUDA engine on a GPU machine:
    #   pytest tests/e2e --backend cuda --runtime dist/krasis-runtime --synth-set head_dim=64 -k "not scripted"
    parser.addoption("--backend", default="reference", choices=["reference", "cuda"],
                     help="engine behind `krasis-runtime serve` for the model-backed tests")
    parser.addoption("--runtime", default=None, help="krasis-runtime binary (default target/debug)")
    parser.addoption("--synth-set", action="append", default=[],
                     help="extra `synth --set key=value` for the test checkpoint (repeatable)")
    parser.addoption("--vocab", default=None, help="qwen.tiktoken path passed to synth")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process; `url` is set from its `ready` progress event."""

    def __init__(self, argv, timeout=180):
        self.argv = [str(a) for a in argv]
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr_lines = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        lines = queue.Queue()
        threading.Thread(target=self._read_stdout, args=(lines,), daemon=True).start()
        self.events = []
        deadline = time.monotonic() + timeout
        self.url = None
        while self.url is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                pytest.fail(f"{self.argv[0]} did not become ready in {timeout}s:\n{self.stderr()}")
            try:
                line = lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                if self.proc.poll() is not None:
                    pytest.fail(f"{self.argv} exited with {self.proc.returncode}:\n{self.stderr()}")
                continue
            if line is None:
                continue
            event = json.loads(line)
            self.events.append(event)
            if event.get("event") == "ready":
                self.url = event["url"]
            elif event.get("event") == "fatal":
                self.stop()
                pytest.fail(f"server failed to start: {event['message']}")

    def _read_stdout(self, lines):
        for line in self.proc.stdout:
            if line.strip().startswith("{"):
                lines.put(line)
        lines.put(None)

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def stderr(self) -> str:
        return "".join(self.stderr_lines[-40:])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def runtime_bin(pytestconfig) -> Path:
    path = Path(pytestconfig.getoption("--runtime") or RUNTIME)
    if not path.exists():
        pytest.fail(f"{path} not found; run 'cargo build -p krasis-runtime' first")
    return path


def synth_preset(runtime_bin, tmp_path_factory, preset, *extra) -> Path:
    """A checkpoint of `preset` written by `krasis-runtime synth` (fails the
    test with synth's stderr when it cannot be made)."""
    out = tmp_path_factory.mktemp("model") / preset
    r = subprocess.run(
        [runtime_bin, "synth", "--preset", preset, "--out", out, *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        pytest.fail(f"synth {preset} failed ({r.returncode}):\n{r.stderr}")
    return out


def synth_with_vocab(runtime_bin, tmp_path_factory, preset, vocab, fetch) -> Path:
    """`synth_preset` with the family's vocabulary file, which `fetch` writes."""
    if not vocab.exists():
        pytest.fail(f"{vocab} is missing; run {fetch}")
    return synth_preset(runtime_bin, tmp_path_factory, preset, "--vocab", vocab)


@pytest.fixture(scope="session")
def tiny_model(runtime_bin, tmp_path_factory, pytestconfig) -> Path:
    extra = []
    for kv in pytestconfig.getoption("--synth-set"):
        extra += ["--set", kv]
    if pytestconfig.getoption("--vocab"):
        extra += ["--vocab", pytestconfig.getoption("--vocab")]
    return synth_preset(runtime_bin, tmp_path_factory, "tiny", *extra)


CONTEXT = 256


def start_serve(runtime_bin, model, backend, context, *extra):
    return Server(
        [
            runtime_bin, "serve",
            "--model", model,
            "--backend", backend,
            "--port", free_port(),
            "--context-length", context,
            "--queue-depth", 4,
            "--progress-json",
            *extra,
        ]
    )


@pytest.fixture(scope="session")
def reference_server(runtime_bin, tiny_model, pytestconfig):
    s = start_serve(runtime_bin, tiny_model, pytestconfig.getoption("--backend"), CONTEXT)
    yield s
    s.stop()


# The tiny model's whole position range: a prompt of thousands of tokens takes
# the CPU reference engine seconds to prefill (in chunks of 512 tokens), long
# enough to disconnect or shut down in the middle of it.
LONG_CONTEXT = 8192


@pytest.fixture
def long_prefill_server(runtime_bin, tiny_model, pytestconfig):
    if pytestconfig.getoption("--backend") != "reference":
        pytest.skip("needs a prefill of seconds: the CPU reference engine")
    s = start_serve(runtime_bin, tiny_model, "reference", LONG_CONTEXT)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def scripted_bin() -> Path:
    if not SCRIPTED.exists():
        r = subprocess.run(
            ["cargo", "build", "-p", "krasis-server", "--example", "scripted_server"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            pytest.fail(f"building the scripted_server example failed:\n{r.stderr[-4000:]}")
    return SCRIPTED


def start_scripted(scripted_bin, tiny_model, tmp_path_factory, rules, *extra):
    path = tmp_path_factory.mktemp("replies") / "replies.json"
    path.write_text(json.dumps(rules))
    return Server(
        [scripted_bin, "--model", tiny_model, "--replies", path, "--port", free_port(), *extra]
    )


TOOL_CALL = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
    "\n</tool_call>"
)
LONG_REPLY = "tick " * 300

HERMES_RULES = [
    {"when": "<tool_response>", "reply": "It is sunny in Paris."},
    {"when": "get_weather", "reply": TOOL_CALL},
    {"when": "SLOW", "reply": LONG_REPLY},
    {"when": "", "reply": "<think>\nThinking it over.\n</think>\n\nHello from the script."},
]


@pytest.fixture(scope="session")
def scripted_server(scripted_bin, tiny_model, tmp_path_factory):
    s = start_scripted(
        scripted_bin, tiny_model, tmp_path_factory, HERMES_RULES,
        "--token-delay-ms", "5", "--queue-depth", "1", "--parallel", "1",
    )
    yield s
    s.stop()


XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="session")
def coder_server(scripted_bin, tiny_model, tmp_path_factory):
    s = start_scripted(
        scripted_bin, tiny_model, tmp_path_factory,
        [{"when": "", "reply": XML_CALL}],
        "--template", "qwen3-coder",
    )
    yield s
    s.stop()
