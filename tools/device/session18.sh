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
#   bash tools/device/session18.sh rows6 COMMIT
#       `bench --decode-rows 1,2,4,8` at 6 GiB: the tail's hit rate and cold experts per step.
#   bash tools/device/session18.sh final COMMIT
#       the engine tests (batching, prefix_cache, gpu_engine, gpt_oss) of the final build.
#   bash tools/device/session18.sh rows COMMIT
#       `bench --decode-rows 1,2,4,8` all resident (where a step of M rows goes).
#   bash tools/device/session18.sh mxfp4 COMMIT
#       gpt-oss's per-prompt MXFP4 path: the gpt_oss tests, `bench --check` of tiny-gpt-oss, and
#       gpt-oss-20b prefill at 512..8,000 tokens before (krasis-runtime-a) and after the change.
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
  rows6)
    # The batched decode at 6 GiB with the tail's traffic per step (1, 2, 4, 8 rows).
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    timeout 200 dist/gpu/krasis-runtime bench --model /tmp/agent-load/a3b-24l --cache-dir /tmp/agent-load/krasis-cache \
      --commit "$C" --vram-limit 6GiB --decode-rows 1,2,4,8 --json "$OUT/bench-rows-6gib.json" > "$OUT/bench-rows-6gib.log" 2>&1
    echo "bench --decode-rows 6GiB rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "^decode [0-9] rows|per step of|^experts" "$OUT/bench-rows-6gib.log" | cut -c1-300 >> "$S"
    ;;
  final)
    # The engine tests of the final build.
    for t in batching:150 prefix_cache:100 gpu_engine:90 gpt_oss:150; do test_bin "${t%%:*}" "${t##*:}"; done
    ;;
  rows)
    # The batched decode all resident (1, 2, 4, 8 rows) with the decode LM head in the breakdown.
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    timeout 120 dist/gpu/krasis-runtime bench --model /tmp/agent-load/a3b-24l --cache-dir /tmp/agent-load/krasis-cache \
      --commit "$C" --decode-rows 1,2,4,8 --json "$OUT/bench-rows.json" > "$OUT/bench-rows.log" 2>&1
    echo "bench --decode-rows rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "^decode [0-9] rows" "$OUT/bench-rows.log" | cut -c1-500 >> "$S"
    ;;
  mxfp4)
    # gpt-oss's per-prompt MXFP4 expert path: the gpt_oss tests, `bench --check` of tiny-gpt-oss
    # against its witness, then gpt-oss-20b all resident at 512..8,000 tokens with the binary
    # before the change (krasis-runtime-a) and after it (krasis-runtime), back to back.
    V=$PWD/.cache/vocab
    test_bin gpt_oss 200
    kr=dist/gpu/krasis-runtime
    [ "${SKIP_CHECK:-0}" = 1 ] || {
    timeout 30 $kr synth --preset tiny-gpt-oss --seed 1 --dtype bf16 --out /tmp/tgo \
      --vocab "$V/o200k_base.tiktoken" > "$OUT/synth-tgo.log" 2>&1
    timeout 120 $kr bench --check --model /tmp/tgo --cache-dir /tmp/tgo-kc \
      --witness tests/fixtures/witness/tiny-gpt-oss/source --long-tokens 2048 --prefill-chunk 64 \
      --determinism-runs 2 --json "$OUT/check-gpt-oss.json" > "$OUT/check-gpt-oss.log" 2>&1
    echo "check tiny-gpt-oss rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "^CHECK|all checks" "$OUT/check-gpt-oss.log" | cut -c1-180 >> "$S"
    }
    timeout 200 $kr synth --preset gpt-oss-20b --seed 1 --out /tmp/g20 \
      --vocab "$V/o200k_base.tiktoken" > "$OUT/synth-g20.log" 2>&1 &&
      timeout 100 $kr build-cache --model /tmp/g20 --cache-dir /tmp/g20-kc >> "$OUT/synth-g20.log" 2>&1
    echo "synth + build-cache gpt-oss-20b rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    for b in krasis-runtime-a krasis-runtime; do
      timeout 150 dist/gpu/$b bench --model /tmp/g20 --cache-dir /tmp/g20-kc --commit "$C-$b" \
        --prompt-tokens 512,1024,1536,2048,8000 --decode-tokens 16 --json "$OUT/bench-g20-$b.json" \
        > "$OUT/bench-g20-$b.log" 2>&1
      echo "bench gpt-oss-20b $b rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      grep -E "^prefill" "$OUT/bench-g20-$b.log" | cut -c1-160 >> "$S"
    done
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
cat "$S"
