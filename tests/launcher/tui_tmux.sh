#!/usr/bin/env bash
# Drives the real TUI in tmux: pick the model, change the port in the options
# form, launch, wait for the runtime to be ready, kill it (the launcher must
# restart it and show that), stop it, quit; then checks the terminal was
# restored and no runtime process is left.
# Needs tmux and target/debug/{krasis,krasis-runtime} (cargo build -p krasis -p krasis-runtime).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${CARGO_TARGET_DIR:-$REPO/target}/debug"
command -v tmux >/dev/null || { echo "tui_tmux: tmux is not installed (apt-get install tmux)" >&2; exit 1; }
for b in krasis krasis-runtime; do
    [ -x "$BIN/$b" ] || { echo "tui_tmux: $BIN/$b missing; run cargo build -p krasis -p krasis-runtime" >&2; exit 1; }
done

TMP="$(mktemp -d)"
SOCK="$TMP/tmux.sock"
T() { tmux -S "$SOCK" "$@"; }
cleanup() { T kill-server 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT
fail() {
    echo "tui_tmux: FAIL: $*" >&2
    echo "--- screen ---" >&2
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

# Run inside a shell so the terminal state after krasis exits can be recorded.
T -f /dev/null new-session -d -s k -x 120 -y 40 \
    "cd $TMP && HF_HOME=$TMP/hf $BIN/krasis --config-dir $TMP/c --data-dir $TMP/d tui; stty -a > $TMP/stty; echo EXITED; sleep 30"
wait_for "1 Model" 20
wait_for "tiny" 10
T send-keys -t k Enter            # choose the model
wait_for "GPU:" 10
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
healthy() { curl -s "http://127.0.0.1:$PORT/health" | grep -q '"status":"ok"'; }
healthy || fail "health is not ok while the screen says READY"
RT=$(pgrep -f "krasis-runtime serve --model $TMP") || fail "no runtime process while ready"
# An injected crash: the supervisor restarts the runtime and says so.
kill -KILL "$RT"
wait_for "runtime crashed (killed by signal 9 (SIGKILL)); restarting in 1 s (attempt 1 of 3)" 20
wait_for "READY at http://127.0.0.1:$PORT" 120
wait_for "restarted after a crash 1 time" 5
healthy || fail "health is not ok after the restart"
RT2=$(pgrep -f "krasis-runtime serve --model $TMP") || fail "no runtime process after the restart"
[ "$RT2" != "$RT" ] || fail "the runtime was not restarted"
T send-keys -t k s                # stop
wait_for "stopped: exited normally" 20
T send-keys -t k q
wait_for "EXITED" 10
grep -q -- "-icanon\|-echo " "$TMP/stty" && fail "terminal left in raw mode: $(cat "$TMP/stty")"
pgrep -f "krasis-runtime serve --model $TMP" >/dev/null && fail "runtime left running"
echo "tui_tmux: OK"
