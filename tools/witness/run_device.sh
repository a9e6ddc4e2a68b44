#!/usr/bin/env bash
# Witness fixtures for the synthetic test models, on a machine with torch +
# transformers (GPU if present). Synthesizes `tiny` and `tiny-dense` (BF16,
# seed 1 = krasis_model::testutil::TEST_SEED, so tests regenerate the very
# same checkpoints) and runs witness.py for the `source` and `int4` variants:
#
#   tools/witness/run_device.sh PATH/TO/krasis-runtime OUT_DIR [--vocab qwen.tiktoken] [--python PY]
#
# Writes OUT_DIR/<preset>/<variant>/{case.json,seqN.json,seqN.last.f32}.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
usage() { echo "usage: $0 KRASIS_RUNTIME OUT_DIR [--vocab PATH] [--python PY]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
runtime="$1"; out="$2"; shift 2
vocab=()
python=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --vocab) [[ $# -ge 2 ]] || usage; vocab=(--vocab "$2"); shift 2 ;;
        --python) [[ $# -ge 2 ]] || usage; python="$2"; shift 2 ;;
        *) usage ;;
    esac
done
if [[ -z "$python" ]]; then
    if [[ -x /opt/torch/.venv/bin/python3 ]]; then python=/opt/torch/.venv/bin/python3; else python=python3; fi
fi
[[ -x "$runtime" ]] || { echo "$runtime is not an executable krasis-runtime" >&2; exit 1; }
"$python" -c "import torch, transformers, safetensors, numpy" || {
    echo "$python lacks torch/transformers/safetensors/numpy; pass --python" >&2; exit 1; }

seed=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
for preset in tiny tiny-dense; do
    ckpt="$work/$preset"
    "$runtime" synth --preset "$preset" --seed "$seed" --dtype bf16 --out "$ckpt" "${vocab[@]}"
    for variant in source int4; do
        dest="$out/$preset/$variant"
        rm -rf "$dest"
        "$python" "$here/witness.py" --checkpoint "$ckpt" --sequences "$here/sequences.json" \
            --variant "$variant" --out "$dest"
    done
done
echo "fixtures in $out"
