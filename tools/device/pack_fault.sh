#!/usr/bin/env bash
# Builds the kernel test binary with a planted fault, so a device script can show that a test
# fails when the kernel is wrong (a test-only build; the checkout is restored):
#   bash tools/device/pack_fault.sh NAME FILE SED_EXPR
# applies SED_EXPR to FILE (a kernels/cuda source, which must have no uncommitted change and
# which the expression must change), builds the release kernel test binary, checks that it
# embeds the changed line (the kernels are compiled from the embedded source at run time), and
# packs it as dist/pack/NAME.tar.xz (NAME/gpu-NAME-bin, stripped; a session script runs it with
# lib.sh's test_fault). FILE is restored on every
# exit, and the kernel sources are touched so the next build (pack.sh) embeds them again.
# CARGO_TARGET_DIR defaults to /tmp/krasis-rel, as for pack.sh.
set -euo pipefail
NAME=${1:?pack name}; FILE=${2:?kernel source}; EXPR=${3:?sed expression}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/tmp/krasis-rel}
git diff --quiet -- "$FILE" || { echo "$FILE has uncommitted changes; commit or stash them" >&2; exit 1; }
trap 'git checkout -- "$FILE"; touch kernels/cuda/*' EXIT
sed -i -e "$EXPR" "$FILE"
if git diff --quiet -- "$FILE"; then
  echo "the expression changed nothing in $FILE" >&2; exit 1
fi
line=$(git diff -U0 -- "$FILE" | grep '^+[^+]' | head -1 | cut -c2-)
touch kernels/cuda/* kernels/src/lib.rs
cargo test --release --locked -p krasis-kernels --test gpu --no-run
g=$(ls -t "$CARGO_TARGET_DIR"/release/deps/gpu-* | grep -v '\.d$' | head -1)
grep -qF -- "$line" "$g" || { echo "$g does not embed the planted line: $line" >&2; exit 1; }
D=$(mktemp -d)/$NAME; mkdir -p "$D" dist/pack
cp "$g" "$D/gpu-$NAME-bin"; strip "$D"/*
tar cJf "dist/pack/$NAME.tar.xz" -C "$(dirname "$D")" "$NAME"
echo "packed dist/pack/$NAME.tar.xz ($(du -h "dist/pack/$NAME.tar.xz" | cut -f1)): $line"
