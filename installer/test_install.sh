#!/usr/bin/env bash
# CI test of install.sh: install into a temporary prefix (reusing the already
# built debug target dir so nothing is recompiled), run the installed
# binaries, install again (idempotent), uninstall.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET_DIR="${CARGO_TARGET_DIR:-$REPO/target}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
PREFIX="$TMP/bin"
fail() { printf 'test_install: FAIL: %s\n' "$*" >&2; exit 1; }

"$REPO/installer/install.sh" --debug --prefix "$PREFIX" --target-dir "$TARGET_DIR" > "$TMP/out1" 2>&1 \
    || { cat "$TMP/out1"; fail "first install"; }
for b in krasis krasis-runtime; do
    [ -x "$PREFIX/$b" ] || fail "$PREFIX/$b missing"
done
grep -q "is not on your PATH" "$TMP/out1" || fail "no PATH warning for a prefix outside PATH"
if ! command -v nvidia-smi >/dev/null 2>&1; then
    grep -q "no working NVIDIA driver" "$TMP/out1" || fail "no driver warning without nvidia-smi"
fi

# The installed launcher finds the runtime next to itself.
# (Output goes to files: `cmd | grep -q` would break the pipe under pipefail.)
"$PREFIX/krasis" --version > "$TMP/version" || fail "krasis --version"
grep -q '^krasis ' "$TMP/version" || fail "krasis --version printed: $(cat "$TMP/version")"
"$PREFIX/krasis-runtime" capabilities --json > "$TMP/caps.json" || fail "runtime capabilities"
grep -q '"qwen3_moe"' "$TMP/caps.json" || fail "runtime capabilities lack qwen3_moe"
env -u PATH "$PREFIX/krasis" --config-dir "$TMP/c" --data-dir "$TMP/d" probe --json > "$TMP/probe.json" \
    || fail "krasis probe"
grep -q "\"path\": \"$PREFIX/krasis-runtime\"" "$TMP/probe.json" || fail "krasis did not locate the runtime next to itself"

# Idempotent: a second run succeeds and leaves the same files.
"$REPO/installer/install.sh" --debug --prefix "$PREFIX" --target-dir "$TARGET_DIR" > "$TMP/out2" 2>&1 \
    || { cat "$TMP/out2"; fail "second install"; }
[ "$(ls -A "$PREFIX" | sort | tr '\n' ' ')" = "krasis krasis-runtime " ] || fail "unexpected files: $(ls -A "$PREFIX")"

"$REPO/installer/install.sh" --uninstall --prefix "$PREFIX" > "$TMP/out3" 2>&1 || fail "uninstall"
[ -z "$(ls -A "$PREFIX")" ] || fail "uninstall left: $(ls -A "$PREFIX")"
"$REPO/installer/install.sh" --uninstall --prefix "$PREFIX" > "$TMP/out4" || fail "second uninstall"
grep -q "nothing to remove" "$TMP/out4" || fail "second uninstall output"
"$REPO/installer/install.sh" --bogus >/dev/null 2>&1 && fail "unknown option accepted"
echo "test_install: OK"
