#!/usr/bin/env bash
# Device run for structured output (issue 18), over the xz-packed stripped binaries in
# dist/pack/bins.tar.xz (carry dist/pack, .cache/vocab, .cache/wheels):
#   bash tools/device/issue18.sh COMMIT
# 1. the masked GPU sampler against its CPU reference (kernels `gpu` test binary, `sample`);
# 2. the CUDA engine's constrained tests (`constrained`: schema-valid outputs alone and batched,
#    Fault::IgnoreMask fatal) and the batching tests (nothing else changed);
# 3. `bench --grammar` on a3b-24l, all resident: decode with a grammar against without;
#    (BENCH=0 skips it)
# 4. tests/e2e/test_structured.py against `serve --backend cuda` (official openai client,
#    jsonschema validation), on the tiny checkpoint with head_dim 64, and on the coder-template,
#    tiny-glm4-moe and tiny-gpt-oss checkpoints (every tool-call grammar).
# Results: $OUT/issue18.txt (the summary) and the logs beside it.
set -u
C=${1:-unknown}; S=$OUT/issue18.txt; T0=$SECONDS
rm -rf dist/gpu /tmp/bins; mkdir -p /tmp/bins dist/gpu && tar xJf dist/pack/bins.tar.xz -C /tmp/bins \
  && cp /tmp/bins/*/* dist/gpu/
kr=$(realpath dist/gpu/krasis-runtime); A=/tmp/agent-load
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$S" 2>&1
test_bin() { # name timeout [filter...]
  local b n=$1 t=$2; shift 2; b=$(ls dist/gpu/$n-* 2>/dev/null | head -1)
  [ -z "$b" ] && { echo "test $n: binary missing" >> "$S"; return; }
  timeout "$t" "$b" --test-threads 1 --nocapture "$@" > "$OUT/test-$n.log" 2>&1
  echo "test $n $* rc=$? $(grep '^test result' "$OUT/test-$n.log") (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "panicked|FAILED|SKIPPED" -A3 "$OUT/test-$n.log" | head -20 >> "$S"
}
test_bin gpu 120 sample
test_bin constrained 150
test_bin batching 150
if [ "${BENCH:-1}" = 1 ]; then
[ -f $A/a3b-24l/config.json ] || BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
timeout 200 "$kr" bench --model $A/a3b-24l --cache-dir $A/krasis-cache --commit "$C" --grammar \
  --prompt-tokens 512 --decode-tokens 16,128 --hcs-prefetch 0 --json "$OUT/bench-grammar.json" \
  > "$OUT/bench-grammar.log" 2>&1
echo "bench --grammar rc=$? (t=$((SECONDS-T0))s)" >> "$S"
grep -E "^decode|grammar" "$OUT/bench-grammar.log" >> "$S"
fi
py=$(command -v python3)
"$py" -m pip install -q --no-index --find-links .cache/wheels --target /tmp/pydeps openai jsonschema \
  pytest > "$OUT/pip.log" 2>&1
export PYTHONPATH=/tmp/pydeps
timeout 420 "$py" -m pytest -q -p no:cacheprovider tests/e2e/test_structured.py --backend cuda \
  --runtime "$kr" --synth-set head_dim=64 --vocab .cache/vocab/qwen.tiktoken > "$OUT/e2e-structured.log" 2>&1
echo "e2e test_structured (cuda) rc=$? (t=$((SECONDS-T0))s)" >> "$S"
tail -15 "$OUT/e2e-structured.log" >> "$S"
cat "$S"
