#!/usr/bin/env bash
# Drives the real TUI in tmux: pick the model, change the port in the options
# form, launch, wait for the runtime to be ready, kill it (the launcher must
# restart it and show that), stop it, quit; then checks the terminal was
# restored and no runtime process is left.
# Needs tmux, curl, python3 and target/debug/{krasis,krasis-runtime}
# (cargo build -p krasis -p krasis-runtime).
set -euo pipefail

NAME=tui_tmux
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need tmux curl python3
cleanup() { T kill-server 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT

synth_tiny
PORT=$(free_port)

# Run inside a shell so the terminal state after krasis exits can be recorded.
T -f /dev/null new-session -d -s k -x 120 -y 40 \
    "cd $TMP && HF_HOME=$TMP/hf $BIN/krasis --config-dir $TMP/c --data-dir $TMP/d tui; stty -a > $TMP/stty; echo EXITED; sleep 30"
wait_for "1 Model" 20
wait_for "tiny" 10
launch_tiny
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
