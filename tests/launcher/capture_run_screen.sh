#!/usr/bin/env bash
# Captures the TUI's run screen while a request runs, as docs/run-screen.txt
# shows it: the real launcher and runtime (reference backend, the synthetic
# tiny model) in tmux at 120x40, one short request for the request log, then
# a long streaming one, captured while it decodes.
# Needs tmux, curl and target/debug/{krasis,krasis-runtime}
# (cargo build -p krasis -p krasis-runtime).
# Usage: tests/launcher/capture_run_screen.sh [OUT]   (default docs/run-screen.txt)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${CARGO_TARGET_DIR:-$REPO/target}/debug"
OUT="${1:-$REPO/docs/run-screen.txt}"
for t in tmux curl; do
    command -v $t >/dev/null || { echo "capture: $t is not installed" >&2; exit 1; }
done
for b in krasis krasis-runtime; do
    [ -x "$BIN/$b" ] || { echo "capture: $BIN/$b missing; run cargo build -p krasis -p krasis-runtime" >&2; exit 1; }
done

TMP="$(mktemp -d)"
SOCK="$TMP/tmux.sock"
T() { tmux -S "$SOCK" "$@"; }
CURL_PID=""
cleanup() {
    [ -n "$CURL_PID" ] && kill "$CURL_PID" 2>/dev/null || true
    T send-keys -t k q 2>/dev/null || true
    sleep 2
    T kill-server 2>/dev/null || true
    rm -rf "$TMP"
}
trap cleanup EXIT
fail() {
    echo "capture: FAIL: $*" >&2
    T capture-pane -p -t k 2>/dev/null >&2 || true
    exit 1
}
wait_for() { # TEXT SECONDS
    local i
    for ((i = 0; i < $2 * 10; i++)); do
        T capture-pane -p -t k 2>/dev/null | grep -qF -- "$1" && return 0
        sleep 0.1
    done
    fail "'$1' did not appear within $2 s"
}

"$BIN/krasis-runtime" synth --preset tiny --out "$TMP/models/tiny" >/dev/null 2>&1 || fail "synth"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

T -f /dev/null new-session -d -s k -x 120 -y 40 \
    "cd $TMP && HF_HOME=$TMP/hf $BIN/krasis --config-dir $TMP/c --data-dir $TMP/d tui"
wait_for "tiny" 20
T send-keys -t k Enter            # choose the model
wait_for "GPU" 10
T send-keys -t k Enter            # hardware -> options
wait_for "Options for" 10
for _ in $(seq 11); do T send-keys -t k Down; done   # Port field
T send-keys -t k Enter
for _ in 1 2 3 4 5; do T send-keys -t k BSpace; done
T send-keys -t k "$PORT" Enter
wait_for "$PORT" 5
T send-keys -t k Tab              # summary
wait_for "Valid. Press Enter to launch." 10
T send-keys -t k Enter            # launch
wait_for "READY at http://127.0.0.1:$PORT" 120

API="http://127.0.0.1:$PORT/v1/chat/completions"
curl -s "$API" -H 'content-type: application/json' \
    -d '{"model":"tiny","max_tokens":16,"messages":[{"role":"user","content":"Hello"}]}' >/dev/null \
    || fail "the short request failed"
curl -sN "$API" -H 'content-type: application/json' \
    -d '{"model":"tiny","max_tokens":8000,"stream":true,"messages":[{"role":"user","content":"Tell me a very long story about a lighthouse keeper."}]}' \
    >/dev/null &   # 8000: the tiny model's 8192-token context
CURL_PID=$!
wait_for "decoding" 60
sleep 4                           # some sparkline history
T capture-pane -p -t k | sed 's/[[:space:]]*$//' > "$OUT"
grep -qF "decoding" "$OUT" || fail "the capture does not show the request decoding"
echo "capture: wrote $OUT"
