#!/usr/bin/env bash
# Builds the current checkout's device binaries and packs them for the device tool (no Rust there):
#   bash tools/device/pack.sh NAME [SUFFIX] [ENGINE_TEST...]
# builds, stripped, into dist/pack/NAME.tar.xz (one folder, NAME/):
#   krasis-runtime$SUFFIX, kbench$SUFFIX, the kernel test binary (gpu-* without a suffix, else
#   gpu$SUFFIX-bin so a session script can tell it from main's), and each ENGINE_TEST of
#   runtime/gpu/tests (batching, gpu_engine, row_invariance, ...) under its cargo name.
# Then it checks that every binary embeds the checkout's kernel sources (the first, middle and
# last long lines of each kernels/cuda file: a heuristic, which tells two branches' kernels
# apart), because two mistakes have shipped stale binaries:
#   - `cargo build -p krasis-runtime -p krasis-kernels --example kbench` builds only the
#     example, so the runtime stays whatever was built before;
#   - after a branch switch in one checkout, cargo once kept kbench built from the other branch's
#     kernel sources (the sources are touched below to rule that out).
# CARGO_TARGET_DIR defaults to /tmp/krasis-rel (a second checkout should use its own).
set -euo pipefail
NAME=${1:?pack name}; SUFFIX=${2:-}; shift $(( $# >= 2 ? 2 : 1 ))
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/tmp/krasis-rel}
R=$CARGO_TARGET_DIR/release
touch kernels/cuda/* kernels/src/lib.rs
cargo build --release --locked -p krasis-runtime
cargo build --release --locked -p krasis-kernels --example kbench
newest() { ls -t "$R"/deps/"$1"-* | grep -v '\.d$' | head -1; }
cargo test --release --locked -p krasis-kernels --test gpu --no-run
tests=()
for t in "$@"; do tests+=(--test "$t"); done
[ ${#tests[@]} -gt 0 ] && cargo test --release --locked -p krasis-gpu "${tests[@]}" --no-run
D=$(mktemp -d)/$NAME; mkdir -p "$D"
cp "$R/krasis-runtime" "$D/krasis-runtime$SUFFIX"
cp "$R/examples/kbench" "$D/kbench$SUFFIX"
g=$(newest gpu)
if [ -z "$SUFFIX" ]; then cp "$g" "$D/"; else cp "$g" "$D/gpu$SUFFIX-bin"; fi
for t in "$@"; do cp "$(newest "$t")" "$D/"; done
strip "$D"/*
bad=0
for src in kernels/cuda/*; do
  n=$(grep -cE '.{40,}' "$src")
  for k in 1 $(( (n + 1) / 2 )) "$n"; do
    line=$(grep -E '.{40,}' "$src" | sed -n "${k}p")
    for b in "$D"/*; do
      grep -qF -- "$line" "$b" || { echo "STALE: $(basename "$b") lacks line $k of $src" >&2; bad=1; }
    done
  done
done
[ $bad = 0 ] || exit 1
mkdir -p dist/pack
tar cJf "dist/pack/$NAME.tar.xz" -C "$(dirname "$D")" "$NAME"
ls -la "dist/pack/$NAME.tar.xz"
