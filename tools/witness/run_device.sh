#!/usr/bin/env bash
# Witness fixtures for the synthetic test models, on a machine with torch +
# transformers (GPU if present, else the CPU). Synthesizes `tiny` and
# `tiny-dense` (BF16, seed 1 = krasis_model::testutil::TEST_SEED, so tests
# regenerate the very same checkpoints), each at the preset's head_dim 32 and
# at head_dim 64 (cases `<preset>-hd64`, the checkpoints `bench --check` runs
# on the GPU: the CUDA attention kernels have no head_dim 32), and runs
# witness.py for the `source` and `int4` variants; and `tiny-gpt-oss` (MXFP4
# experts, o200k_harmony vocabulary) for `source` only, on
# sequences-gpt-oss.json (its experts are MXFP4 in the checkpoint itself, so
# there is no INT4 variant of this family); `tiny-glm4-moe` (both variants)
# on sequences-glm4.json:
#
#   tools/witness/run_device.sh PATH/TO/krasis-runtime OUT_DIR [--vocab qwen.tiktoken]
#       [--o200k o200k_base.tiktoken] [--python PY] [--device auto|cpu|cuda] [--case NAME]...
#
# --case limits the run to the named cases (tiny, tiny-dense, tiny-hd64,
# tiny-dense-hd64, tiny-gpt-oss, tiny-glm4-moe); repeatable. --o200k defaults to
# .cache/vocab/o200k_base.tiktoken (tools/harmony/vocab.sh writes it) and is
# needed by tiny-gpt-oss only. Writes OUT_DIR/<case>/<variant>/{case.json,
# seqN.json,seqN.last.f32}.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
usage() {
    echo "usage: $0 KRASIS_RUNTIME OUT_DIR [--vocab PATH] [--o200k PATH] [--python PY] [--device auto|cpu|cuda] [--case NAME]..." >&2
    exit 2
}
[[ $# -ge 2 ]] || usage
runtime="$1"; out="$2"; shift 2
vocab=()
o200k="$(cd "$here/../.." && pwd)/.cache/vocab/o200k_base.tiktoken"
python=""
device=auto
only=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --vocab) [[ $# -ge 2 ]] || usage; vocab=(--vocab "$2"); shift 2 ;;
        --o200k) [[ $# -ge 2 ]] || usage; o200k="$2"; shift 2 ;;
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
    "tiny-gpt-oss tiny-gpt-oss"
    "tiny-glm4-moe tiny-glm4-moe"
)
names=" tiny tiny-dense tiny-hd64 tiny-dense-hd64 tiny-gpt-oss tiny-glm4-moe "
for c in "${only[@]}"; do
    [[ "$names" == *" $c "* ]] || { echo "unknown case '$c' (one of:$names)" >&2; exit 2; }
done
selected() { [[ ${#only[@]} -eq 0 || " ${only[*]} " == *" $1 "* ]]; }
if selected tiny-gpt-oss; then
    [[ -f "$o200k" ]] || {
        echo "tiny-gpt-oss needs the o200k_base vocabulary: $o200k is missing (run tools/harmony/vocab.sh or pass --o200k)" >&2
        exit 1; }
fi

seed=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
for entry in "${cases[@]}"; do
    read -r name preset sets <<<"$entry"
    selected "$name" || continue
    set_args=()
    for s in $sets; do set_args+=(--set "$s"); done
    case_vocab=("${vocab[@]}")
    variants=(source int4)
    sequences="$here/sequences.json"
    if [[ "$preset" == tiny-gpt-oss ]]; then
        case_vocab=(--vocab "$o200k")
        variants=(source)
        sequences="$here/sequences-gpt-oss.json"
    fi
    if [[ "$preset" == tiny-glm4-moe ]]; then
        # BF16 experts like qwen3_moe's: source, and int4 (the experts the
        # CUDA engine runs from its INT4 cache).
        sequences="$here/sequences-glm4.json"
    fi
    ckpt="$work/$name"
    "$runtime" synth --preset "$preset" --seed "$seed" --dtype bf16 "${set_args[@]}" --out "$ckpt" "${case_vocab[@]}"
    for variant in "${variants[@]}"; do
        dest="$out/$name/$variant"
        rm -rf "$dest"
        "$python" "$here/witness.py" --checkpoint "$ckpt" --sequences "$sequences" \
            --variant "$variant" --device "$device" --out "$dest"
    done
done
echo "fixtures in $out"
