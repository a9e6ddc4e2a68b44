#!/usr/bin/env bash
# The launcher as a good citizen, driven through tmux: however it is ended
# (the terminal closed with tmux kill-session, SIGTERM, SIGHUP, SIGINT, the
# Ctrl-C key during a long request, SIGKILL), the launcher and its runtime
# are gone within 5 s and the port is free; an idle launcher sleeps; a
# runtime that has to be killed makes the launcher's exit status say so.
# Processes are told apart by this test's temp dir in their command line,
# never by name alone.
# Needs tmux, curl, python3 and target/debug/{krasis,krasis-runtime}
# (cargo build -p krasis -p krasis-runtime).
set -euo pipefail

NAME=lifecycle_tmux
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need tmux curl python3

# Pids of this test's krasis and krasis-runtime processes that still run
# (a zombie has ended; a container may have no init to reap it).
ours() {
    local p
    for p in $(pgrep -x krasis || true) $(pgrep -x krasis-runtime || true); do
        tr '\0' ' ' 2>/dev/null <"/proc/$p/cmdline" | grep -qF -- "$TMP/" || continue
        grep -q '^[0-9]* ([^)]*) Z' "/proc/$p/stat" 2>/dev/null && continue
        echo "$p"
    done
}
cleanup() {
    T kill-server 2>/dev/null || true
    local p
    for p in $(ours); do kill -KILL "$p" 2>/dev/null || true; done
    rm -rf "$TMP"
}
trap cleanup EXIT

CASE=""
on_fail() {
    echo "--- processes ---" >&2
    for p in $(ours); do ps -o pid,ppid,stat,pcpu,args -p "$p" >&2 || true; done
}
healthy() { curl -s --max-time 2 "http://127.0.0.1:$PORT/health" | grep -q '"status":"ok"'; }
wait_healthy() {
    local i
    for ((i = 0; i < 1200; i++)); do healthy && return 0; sleep 0.1; done
    fail "the server on port $PORT did not become ready"
}
port_free() { # nothing listens on $PORT (a new server could bind it)
    python3 -c "
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(('127.0.0.1', $PORT))
except OSError:
    sys.exit(1)"
}
# Everything of this test gone and the port free within SECONDS (default 5).
all_gone() {
    local i left
    for ((i = 0; i < ${1:-5} * 10; i++)); do
        left=$(ours)
        [ -z "$left" ] && port_free && return 0
        sleep 0.1
    done
    fail "still running after ${1:-5} s: $(echo $left) (port $PORT free: $(port_free && echo yes || echo no))"
}
# CPU use of PID over 2 s, in percent of one core.
cpu_percent() {
    local hz a b
    hz=$(getconf CLK_TCK)
    a=$(awk '{print $14 + $15}' "/proc/$1/stat")
    sleep 2
    b=$(awk '{print $14 + $15}' "/proc/$1/stat")
    echo $(((b - a) * 100 / (2 * hz)))
}
assert_idle() { # PID WHAT
    local pct
    pct=$(cpu_percent "$1")
    [ "$pct" -lt 10 ] || fail "$2 uses ${pct}% CPU while idle"
}
new_port() { PORT=$(free_port); }

synth_tiny
export HF_HOME="$TMP/hf"

# Ends this test's tmux server and waits until no tmux process of its socket
# runs: kill-server returns first (and a case may have closed the last
# session, so the server is exiting on its own), and a new-session that
# reaches an exiting server fails with tmux's "server exited unexpectedly"
# (seen once in a full suite run on 2 cores, between two cases).
stop_tmux() {
    local i p live
    T kill-server 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        live=""
        for p in $(pgrep -f -- "-S $SOCK" || true); do
            grep -q '^[0-9]* ([^)]*) Z' "/proc/$p/stat" 2>/dev/null || live=1
        done
        [ -z "$live" ] && return 0
        sleep 0.05
    done
}

# Starts COMMAND in a fresh tmux session, in the pane's shell as a user
# would; LAUNCHER is its pid. Its stderr goes to $TMP/stderr (what it says
# after leaving the TUI), its exit status to $TMP/status.
start() {
    local i pane
    stop_tmux
    rm -f "$TMP/status"
    : >"$TMP/stderr"
    T -f /dev/null new-session -d -s k -x 120 -y 40 -c "$TMP" \
        "$* 2>$TMP/stderr; echo \$? >$TMP/status; sleep 60"
    pane=$(T display -p -t k '#{pane_pid}')
    LAUNCHER=""
    for ((i = 0; i < 100; i++)); do
        LAUNCHER=$(pgrep -P "$pane" -x krasis || true)
        [ -n "$LAUNCHER" ] && break
        sleep 0.05
    done
    [ -n "$LAUNCHER" ] || fail "the launcher did not start"
}
start_tui() { start "$BIN/krasis --config-dir $TMP/c --data-dir $TMP/d tui"; wait_for "tiny" 20; }
# The launcher exited with STATUS.
exited_with() {
    local i
    for ((i = 0; i < 50; i++)); do
        [ -s "$TMP/status" ] && break
        sleep 0.1
    done
    local st
    st=$(cat "$TMP/status" 2>/dev/null || true)
    [ "$st" = "$1" ] || fail "the launcher exited with status '$st', expected $1"
}

# From the model screen: choose the tiny model, set the port, launch, and
# wait until the server answers; RUNTIME is its pid.
launch_on_run_screen() {
    new_port
    launch_tiny
    wait_healthy
    RUNTIME=$(pgrep -f "krasis-runtime serve --model $TMP/models/tiny") || fail "no runtime process while ready"
    [ "$(awk '{print $4}' "/proc/$RUNTIME/stat")" = "$LAUNCHER" ] || fail "the runtime is not the launcher's child"
}

# Each case runs when its name contains the optional argument (all by default).
ONLY="${1:-}"
case_() { # NAME FUNCTION [ARGS]
    CASE="$1"
    shift
    [[ "$CASE" == *"$ONLY"* ]] || return 0
    PORT=0
    "$@"
    echo "lifecycle_tmux: ok: $CASE"
}

closed_on_model_screen() {
    start_tui
    assert_idle "$LAUNCHER" "the launcher on the model screen"
    T kill-session -t k
    all_gone
}

closed_on_run_screen() {
    start_tui
    launch_on_run_screen
    assert_idle "$LAUNCHER" "the launcher on the run screen (runtime ready, stats polled)"
    T kill-session -t k
    all_gone
}

signal_on_run_screen() { # SIG
    start_tui
    launch_on_run_screen
    kill -"$1" "$LAUNCHER"
    all_gone
    exited_with 0
}

ctrl_c_during_a_request() {
    local curl
    start_tui
    launch_on_run_screen
    curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
        -d '{"model":"tiny","prompt":"Once upon a time","max_tokens":8000,"ignore_eos":true}' >"$TMP/long.out" 2>&1 &
    curl=$!
    sleep 2
    kill -0 "$curl" 2>/dev/null || fail "the request ended before Ctrl-C: $(head -c 300 "$TMP/long.out")"
    T send-keys -t k C-c
    SECONDS=0
    all_gone 10 # the supervisor's grace period (SHUTDOWN_GRACE)
    echo "lifecycle_tmux: Ctrl-C during a request: all gone after ${SECONDS}s"
    # Stopped by SIGTERM within the grace, not killed: the exit status says so.
    exited_with 0
    wait "$curl" || true
}

sigkill_to_the_launcher() {
    start_tui
    launch_on_run_screen
    kill -KILL "$LAUNCHER"
    all_gone
}

runtime_has_to_be_killed() {
    start_tui
    launch_on_run_screen
    kill -STOP "$RUNTIME" # it cannot act on SIGTERM any more
    kill -TERM "$LAUNCHER"
    all_gone 15 # the 10 s grace period, then SIGKILL
    exited_with 1
    grep -qF "error: runtime did not stop within 10 s of SIGTERM; killed with SIGKILL" "$TMP/stderr" ||
        fail "the launcher did not say the runtime was killed: $(cat "$TMP/stderr")"
}

start_headless() {
    new_port
    start "$BIN/krasis --config-dir $TMP/c --data-dir $TMP/d serve --model $TMP/models/tiny --backend reference --port $PORT"
    wait_healthy
}

headless_signal() { # SIG
    start_headless
    assert_idle "$LAUNCHER" "headless serve"
    kill -"$1" "$LAUNCHER"
    all_gone
    exited_with 0
}

headless_closed() {
    start_headless
    T kill-session -t k
    all_gone
}

case_ "terminal closed on the model screen" closed_on_model_screen
case_ "terminal closed on the run screen" closed_on_run_screen
for sig in TERM HUP INT; do
    case_ "SIG$sig to the launcher on the run screen" signal_on_run_screen $sig
done
case_ "Ctrl-C key during a long request" ctrl_c_during_a_request
case_ "SIGKILL to the launcher" sigkill_to_the_launcher
case_ "a runtime that has to be killed" runtime_has_to_be_killed
for sig in TERM HUP INT; do
    case_ "headless serve, SIG$sig" headless_signal $sig
done
case_ "headless serve, terminal closed" headless_closed

echo "lifecycle_tmux: OK"
