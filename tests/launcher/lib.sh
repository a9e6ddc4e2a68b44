# Shared by the tmux-driven launcher scripts (tui_tmux.sh, lifecycle_tmux.sh,
# capture_run_screen.sh). Source it after setting NAME (the prefix of every
# message); a script may define `on_fail` to print more when a step fails.
# Gives: REPO, BIN, TMP (removed by the script's own cleanup), T (tmux on this
# test's own server), need, fail, screen_has, wait_for, free_port,
# synth_tiny and launch_tiny (model screen -> READY on $PORT).

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${CARGO_TARGET_DIR:-$REPO/target}/debug"

# The tools (and always the two debug binaries) a script needs.
need() { # TOOL...
    local t b
    for t in "$@"; do
        command -v "$t" >/dev/null || { echo "$NAME: $t is not installed" >&2; exit 1; }
    done
    for b in krasis krasis-runtime; do
        [ -x "$BIN/$b" ] || { echo "$NAME: $BIN/$b missing; run cargo build -p krasis -p krasis-runtime" >&2; exit 1; }
    done
}

TMP="$(mktemp -d)"
SOCK="$TMP/tmux.sock"
T() { tmux -S "$SOCK" "$@"; }

fail() {
    echo "$NAME: FAIL${CASE:+ [$CASE]}: $*" >&2
    echo "--- screen ---" >&2
    T capture-pane -p -t k 2>/dev/null >&2 || true
    if declare -F on_fail >/dev/null; then on_fail; fi
    exit 1
}
screen_has() { T capture-pane -p -t k 2>/dev/null | grep -qF -- "$1"; }
wait_for() { # TEXT SECONDS
    local i
    for ((i = 0; i < $2 * 10; i++)); do
        screen_has "$1" && return 0
        sleep 0.1
    done
    fail "'$1' did not appear within $2 s"
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
synth_tiny() { "$BIN/krasis-runtime" synth --preset tiny --out "$TMP/models/tiny" >/dev/null 2>&1 || fail "synth"; }

# From the model screen: choose the tiny model, type $PORT into the options
# form's Port field, go to the summary and launch.
launch_tiny() {
    local i
    T send-keys -t k Enter            # choose the model
    wait_for "GPU:" 10
    T send-keys -t k Enter            # hardware -> options
    wait_for "Options for" 10
    for ((i = 0; i < 30; i++)); do
        screen_has "> Port" && break
        T send-keys -t k Down
        sleep 0.1
    done
    screen_has "> Port" || fail "no Port field in the options form"
    T send-keys -t k Enter
    for _ in 1 2 3 4 5; do T send-keys -t k BSpace; done
    T send-keys -t k "$PORT" Enter
    wait_for "$PORT" 5
    T send-keys -t k Tab              # summary
    wait_for "Valid. Press Enter to launch." 10
    T send-keys -t k Enter            # launch
}
