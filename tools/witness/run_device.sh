#!/usr/bin/env bash
# Witness fixtures for the synthetic test models, on a machine with torch +
# transformers (GPU if present, else the CPU). Synthesizes `tiny` and
# `tiny-dense` (BF16, seed 1 = krasis_model::testutil::TEST_SEED, so tests
# regenerate the very same checkpoints), each at the preset's head_dim 32 and
# at head_dim 64 (cases `<preset>-hd64`, the checkpoints `bench --check` runs
# on the GPU: the CUDA attention kernels have no head_dim 32), and runs
# witness.py for the `source` and `int4` variants:
#
#   tools/witness/run_device.sh PATH/TO/krasis-runtime OUT_DIR [--vocab qwen.tiktoken]
#       [--python PY] [--device auto|cpu|cuda] [--case NAME]...
#
# --case limits the run to the named cases (tiny, tiny-dense, tiny-hd64,
# tiny-dense-hd64); repeatable. Writes OUT_DIR/<case>/<variant>/{case.json,
# seqN.json,seqN.last.f32}.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
usage() {
    echo "usage: $0 KRASIS_RUNTIME OUT_DIR [--vocab PATH] [--python PY] [--device auto|cpu|cuda] [--case NAME]..." >&2
    exit 2
}
[[ $# -ge 2 ]] || usage
runtime="$1"; out="$2"; shift 2
vocab=()
python=""
device=auto
only=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --vocab) [[ $# -ge 2 ]] || usage; vocab=(--vocab "$2"); shift 2 ;;
        --python) [[ $# -ge 2 ]] || usage; python="$2"; shift 2 ;;
        --device) [[ $# -ge 2 ]] || usage; device="$2"; shift 2 ;;
        --case) [[ $# -ge 2 ]] || usage; only+=("$2"); shift 2 ;;
        *) usage ;;
    esac
done
if [[ -z "$python" ]]; then
    if [[ -x /opt/torch/.venv/bin/python3 ]]; then python=/opt/torch/.venv/bin/python3; else python=python3; fi
fi
[[ -x "$runtime" ]] || { echo "$runtime is not an executable krasis-runtime" >&2; exit 1; }
"$python" -c "import torch, transformers, safetensors, numpy" || {
    echo "$python lacks torch/transformers/safetensors/numpy; pass --python" >&2; exit 1; }

# case name, preset, config overrides (--set, space separated)
cases=(
    "tiny tiny"
    "tiny-dense tiny-dense"
    "tiny-hd64 tiny head_dim=64"
    "tiny-dense-hd64 tiny-dense head_dim=64"
)
for c in "${only[@]}"; do
    [[ " tiny tiny-dense tiny-hd64 tiny-dense-hd64 " == *" $c "* ]] || {
        echo "unknown case '$c' (tiny, tiny-dense, tiny-hd64, tiny-dense-hd64)" >&2; exit 2; }
done

seed=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
for entry in "${cases[@]}"; do
    read -r name preset sets <<<"$entry"
    if [[ ${#only[@]} -gt 0 && " ${only[*]} " != *" $name "* ]]; then
        continue
    fi
    set_args=()
    for s in $sets; do set_args+=(--set "$s"); done
    ckpt="$work/$name"
    "$runtime" synth --preset "$preset" --seed "$seed" --dtype bf16 "${set_args[@]}" --out "$ckpt" "${vocab[@]}"
    for variant in source int4; do
        dest="$out/$name/$variant"
        rm -rf "$dest"
        "$python" "$here/witness.py" --checkpoint "$ckpt" --sequences "$here/sequences.json" \
            --variant "$variant" --device "$device" --out "$dest"
    done
done
echo "fixtures in $out"
