#!/usr/bin/env bash
# Captures the TUI's run screen while a request runs, as docs/run-screen.txt
# shows it: the real launcher and runtime (reference backend, the synthetic
# tiny model) in tmux at 120x40, one short request for the request log, then
# a long streaming one, captured while it decodes.
# Needs tmux, curl and target/debug/{krasis,krasis-runtime}
# (cargo build -p krasis -p krasis-runtime).
# Usage: tests/launcher/capture_run_screen.sh [OUT]   (default docs/run-screen.txt)
set -euo pipefail

NAME=capture
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
OUT="${1:-$REPO/docs/run-screen.txt}"
need tmux curl python3
CURL_PID=""
cleanup() {
    [ -n "$CURL_PID" ] && kill "$CURL_PID" 2>/dev/null || true
    T send-keys -t k q 2>/dev/null || true
    sleep 2
    T kill-server 2>/dev/null || true
    rm -rf "$TMP"
}
trap cleanup EXIT

synth_tiny
PORT=$(free_port)

T -f /dev/null new-session -d -s k -x 120 -y 40 \
    "cd $TMP && HF_HOME=$TMP/hf $BIN/krasis --config-dir $TMP/c --data-dir $TMP/d tui"
wait_for "tiny" 20
launch_tiny
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
