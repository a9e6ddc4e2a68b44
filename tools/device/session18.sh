#!/usr/bin/env bash
# Device orchestration for session 18 (issues 15 and 17), over the xz-packed stripped binaries in
# dist/pack/bins.tar.xz (carry dist/pack, .cache/vocab, .cache/wheels): krasis-runtime, kbench and
# the engine test binaries (batching-*, prefix_cache-*, gpu_engine-*, row_invariance-*).
#   bash tools/device/session18.sh base COMMIT
#       where things stand before this session's changes: `serve` of a3b-24l with 1/2/4/8
#       streaming clients all resident and at 6 GiB (tools/device/batching.sh parallel), then
#       `bench --prefill-breakdown` all resident at 512, 8,192 and 32,000 tokens
#       (tools/device/issue17c.sh parts), then `kbench --grouped` (a3b, GLM and qcn shapes).
#   bash tools/device/session18.sh packed COMMIT
#       HCS packed streamed prefill: the engine tests (batching, prefix_cache, gpu_engine), HCS
#       exactness at 6 GiB, `bench --decode-rows 1,2,4` at 6 GiB (the tail's hit rate per row
#       count).
#   bash tools/device/session18.sh serve COMMIT
#       `serve` with 1/2/4/8 clients at 6 GiB (contexts 32768 and 8192), then all resident.
# Results: $OUT/session18-PHASE.txt (the summary) and the logs and archives beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/session18-$P.txt
T0=$SECONDS
rm -rf dist/gpu /tmp/bins
mkdir -p /tmp/bins dist/gpu && tar xJf dist/pack/bins.tar.xz -C /tmp/bins && cp /tmp/bins/*/* dist/gpu/
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
parallel() { # LIMITS budget [context]
  local x=${3:-32768}
  LIMIT=$1 CLIENTS=1,2,4,8 BUDGET=$2 CTX=$x bash tools/device/batching.sh parallel "$C" > /dev/null 2>&1
  echo "parallel $1 context $x (t=$((SECONDS-T0))s)" >> "$S"
  cat /tmp/btr-parallel-${1//,/-}-ctx$x/summary.txt >> "$S"
}
test_bin() { # name timeout
  local b n=$1 t=$2; b=$(ls dist/gpu/$n-* 2>/dev/null | head -1)
  [ -z "$b" ] && { echo "test $n: binary missing" >> "$S"; return; }
  timeout "$t" "$b" --test-threads 1 --nocapture > "$OUT/test-$n.log" 2>&1
  echo "test $n rc=$? $(grep '^test result' "$OUT/test-$n.log") (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "panicked|FAILED|SKIPPED" -A2 "$OUT/test-$n.log" | head -20 >> "$S"
  grep -E "requests, staggered .*: ok|of [0-9]+ requests differ from alone|packed" \
    "$OUT/test-$n.log" | head -30 >> "$S"
}
case "$P" in
  base)
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    parallel none,6GiB 300
    timeout 120 dist/gpu/krasis-runtime bench --model /tmp/agent-load/a3b-24l --cache-dir /tmp/agent-load/krasis-cache \
      --commit "$C" --decode-rows 1,2,4,8 --json "$OUT/bench-rows.json" > "$OUT/bench-rows.log" 2>&1
    echo "bench --decode-rows rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "^decode [0-9] rows" "$OUT/bench-rows.log" | cut -c1-400 >> "$S"
    bash tools/device/issue17c.sh parts "$C" > /dev/null 2>&1
    cat "$OUT/issue17c-parts.txt" >> "$S"
    timeout 90 dist/gpu/kbench --grouped > "$OUT/kbench-grouped.txt" 2>&1
    echo "kbench --grouped rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    ;;
  packed)
    # The engine tests, HCS exactness and the batched decode at 6 GiB (hit rate per row count).
    for t in batching:200 prefix_cache:120 gpu_engine:90; do test_bin "${t%%:*}" "${t##*:}"; done
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    timeout 150 dist/gpu/krasis-runtime bench --model /tmp/agent-load/a3b-24l \
      --cache-dir /tmp/agent-load/krasis-cache --hcs-exactness 6GiB --heatmap off > "$OUT/hcs-exact.log" 2>&1
    echo "hcs-exactness 6GiB rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "^CHECK|all HCS" "$OUT/hcs-exact.log" | cut -c1-200 >> "$S"
    timeout 150 dist/gpu/krasis-runtime bench --model /tmp/agent-load/a3b-24l --cache-dir /tmp/agent-load/krasis-cache \
      --commit "$C" --vram-limit 6GiB --decode-rows 1,2,4 --json "$OUT/bench-rows-6gib.json" > "$OUT/bench-rows-6gib.log" 2>&1
    echo "bench --decode-rows 6GiB rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "^decode [0-9] rows|HCS:|^experts" "$OUT/bench-rows-6gib.log" | cut -c1-300 >> "$S"
    ;;
  serve)
    # The batching tests, then 1/2/4/8 clients through serve: 6 GiB at contexts 32768 and 8192,
    # then all resident.
    test_bin batching 150
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    parallel 6GiB 200 32768
    parallel 6GiB 200 8192
    parallel none $((570 - (SECONDS - T0))) 32768
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
cat "$S"
