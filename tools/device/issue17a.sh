#!/usr/bin/env bash
# Device orchestration for the grouped INT4 prefill GEMMs (issue 17's first kernel, and issue 15's
# short-prefill lever), one phase per call over the xz-packed stripped binaries in
# dist/pack/bins.tar.xz (carry dist/pack, .cache/vocab, .cache/wheels):
#   bash tools/device/issue17a.sh kern COMMIT
#       the kernel tests of the grouped GEMMs (int4_grouped::, against the f64 reference, row
#       invariance, NaN for a missing expert) and of the MoE grouping (moe::), `kbench --grouped`
#       (grouped INT4 vs dequantize + per-expert cuBLAS at 512..8192 tokens), then prep
#       (a3b-24l) and `bench` prefill at 512/1024/2048/8192/32768 tokens all resident and at
#       512/8192 under a 6 GiB limit.
#   bash tools/device/issue17a.sh engine COMMIT
#       the grouped kernel tests again (in the engine's build), the engine tests (gpu_engine
#       witness checks, batching invariance, prefix_cache exactness, glm4_moe) and the HCS
#       exactness check at 6 GiB.
#   bash tools/device/issue17a.sh serve COMMIT
#       `agent_load.py parallel` (1/2/4/8 clients) through serve, all resident then at 6 GiB.
#   bash tools/device/issue17a.sh glm COMMIT
#       issue15b.sh's glm phase (glm-4.5-air-12l: parallel clients and the agent loop).
# Results: $OUT/issue17a-PHASE.txt (the summary) and the logs beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/issue17a-$P.txt
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
  grep -E "panicked|FAILED|differ|rel err" -A2 "$OUT/test-$n.log" | head -40 >> "$S"
}
prep() { [ -f $A/a3b-24l/config.json ] || BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1; }
bench() { # tag args...
  local t=$1; shift
  timeout 200 "$kr" bench --model $A/a3b-24l --cache-dir $A/krasis-cache --commit "$C" --decode-tokens 16 \
    --json "$OUT/bench-$t.json" "$@" > "$OUT/bench-$t.log" 2>&1
  echo "bench $t rc=$? (t=$((SECONDS-T0))s)" >> "$S"
  grep -iE "prefill|bound" "$OUT/bench-$t.log" | tail -14 >> "$S"
}
case "$P" in
  kern)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    test_bin gpu 240 int4_grouped moe:: int4::int4_invalid int4::int4_w13_slot
    timeout 150 dist/gpu/kbench --grouped > "$OUT/kbench-grouped.txt" 2>&1
    echo "kbench --grouped rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    sed -n '/^====/,$p' "$OUT/kbench-grouped.txt" >> "$S"
    tail -3 "$OUT/kbench-grouped.txt" >> "$S"
    prep
    bench resident --prompt-tokens 512,1024,2048,8192,32768
    bench 6gib --vram-limit 6GiB --prompt-tokens 512,8192
    ;;
  engine)
    test_bin gpu 120 int4_grouped
    test_bin gpu_engine 100
    test_bin batching 150
    test_bin prefix_cache 150
    test_bin glm4_moe 150
    prep
    timeout 150 "$kr" bench --model $A/a3b-24l --cache-dir $A/krasis-cache --hcs-exactness 6GiB --heatmap off \
      > "$OUT/hcs-exact.log" 2>&1
    echo "hcs-exactness 6GiB rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    tail -6 "$OUT/hcs-exact.log" >> "$S"
    ;;
  serve)
    prep
    for L in none 6GiB; do
      LIMIT=$L CLIENTS=1,2,4,8 BUDGET=$((280-(SECONDS-T0)/2)) bash tools/device/batching.sh parallel "$C" > /dev/null 2>&1
      cat /tmp/btr-parallel-$L/summary.txt >> "$S"
      mkdir -p "$OUT/parallel-$L"; cp /tmp/btr-parallel-$L/*.json /tmp/btr-parallel-$L/*.md "$OUT/parallel-$L/" 2>/dev/null
    done
    ;;
  glm)
    bash tools/device/issue15b.sh glm "$C" > /dev/null 2>&1
    cat "$OUT/issue15b-glm.txt" >> "$S"
    ;;
  *) echo "unknown phase $P" >> "$S"; exit 2 ;;
esac
cat "$S"
