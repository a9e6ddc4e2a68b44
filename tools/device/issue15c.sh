#!/usr/bin/env bash
# Device orchestration for issue 15, session 6 (batched decode kernels), one phase per call over
# the xz-packed stripped binaries in dist/pack/bins.tar.xz (carry dist/pack, .cache/vocab,
# .cache/wheels):
#   bash tools/device/issue15c.sh kern COMMIT
#       the kernel tests of the decode kernels (rows, int4, gemv: bit-exact row invariance over
#       every block shape), `kbench --rows` (BF16 GEMVs and INT4 expert GEMVs at 1/2/4/8 rows,
#       independent routes, each block shape) and `kbench --gemv` / `--int4` (the one-row
#       figures), then prep (a3b-24l) and `bench --decode-rows 1,2,4,8` all resident.
#   bash tools/device/issue15c.sh engine COMMIT
#       engine tests (gpu_engine witness checks, batching), `bench --decode-rows 1,2,4,8`, then
#       `agent_load.py parallel` all resident (1/2/4/8) through serve.
#   bash tools/device/issue15c.sh more COMMIT
#       `agent_load.py parallel` at 6 GiB, then issue15b.sh's glm phase (glm-4.5-air-12l).
#   Other phases: issue15b.sh's (perf, glm, final, ncu) run unchanged on these binaries.
# Results: $OUT/issue15c-PHASE.txt (the summary) and the logs beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/issue15c-$P.txt
T0=$SECONDS
if [ ! -x dist/gpu/krasis-runtime ]; then
  mkdir -p /tmp/bins dist/gpu && tar xJf dist/pack/bins.tar.xz -C /tmp/bins && cp /tmp/bins/*/* dist/gpu/
fi
kr=$(realpath dist/gpu/krasis-runtime); A=/tmp/agent-load
test_bin() { # name timeout [filter...]
  local b n=$1 t=$2; shift 2; b=$(ls dist/gpu/$n-* 2>/dev/null | head -1)
  [ -z "$b" ] && { echo "test $n: binary missing" >> "$S"; return; }
  timeout "$t" "$b" --test-threads 1 "$@" > "$OUT/test-$n.log" 2>&1
  echo "test $n $* rc=$? $(grep '^test result' "$OUT/test-$n.log") (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "panicked|FAILED|differ" -A2 "$OUT/test-$n.log" | head -20 >> "$S"
}
case "$P" in
  kern)
    test_bin gpu 150 rows::
    cp "$OUT/test-gpu.log" "$OUT/test-gpu-rows.log"
    test_bin gpu 160 gemv:: int4:: fp16
    for m in rows gemv; do
      timeout 120 dist/gpu/kbench --$m > "$OUT/kbench-$m.txt" 2>&1
      echo "kbench --$m rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      sed -n '/^====/,$p' "$OUT/kbench-$m.txt" >> "$S"
    done
    [ -f $A/a3b-24l/config.json ] || BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    timeout 240 "$kr" bench --model $A/a3b-24l --cache-dir $A/krasis-cache --commit "$C" \
      --prompt-tokens 512 --decode-tokens 64 --decode-prompt-tokens 1000 --decode-rows 1,2,4,8 \
      --json "$OUT/bench-rows.json" > "$OUT/bench-rows.log" 2>&1
    echo "bench rows rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "decode|prefill|rows" "$OUT/bench-rows.log" | tail -14 >> "$S"
    ;;
  engine)
    test_bin gpu_engine 100
    test_bin batching 150
    [ -f $A/a3b-24l/config.json ] || BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    timeout 120 "$kr" bench --model $A/a3b-24l --cache-dir $A/krasis-cache --commit "$C" \
      --prompt-tokens 512 --decode-tokens 64 --decode-prompt-tokens 1000 --decode-rows 1,2,4,8 \
      --json "$OUT/bench-rows.json" > "$OUT/bench-rows.log" 2>&1
    echo "bench rows rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "^decode [0-9] rows" "$OUT/bench-rows.log" >> "$S"
    LIMIT=none CLIENTS=1,2,4,8 BUDGET=$((560-(SECONDS-T0))) bash tools/device/batching.sh parallel "$C" > /dev/null 2>&1
    cat /tmp/btr-parallel-none/summary.txt >> "$S"
    cp /tmp/btr-parallel-none/*.json /tmp/btr-parallel-none/*.md "$OUT/" 2>/dev/null
    ;;
  more)
    # At 6 GiB: parallel clients (1/2/4/8); then glm-4.5-air-12l all resident through serve
    # (issue15b.sh's glm phase: parallel clients and the agent loop).
    [ -f $A/a3b-24l/config.json ] || BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    LIMIT=6GiB CLIENTS=1,2,4,8 BUDGET=200 bash tools/device/batching.sh parallel "$C" > /dev/null 2>&1
    cat /tmp/btr-parallel-6GiB/summary.txt >> "$S"
    bash tools/device/issue15b.sh glm "$C" > /dev/null 2>&1
    cat "$OUT/issue15b-glm.txt" >> "$S"
    ;;
  *) echo "unknown phase $P" >> "$S"; exit 2 ;;
esac
cat "$S"
