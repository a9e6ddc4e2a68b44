#!/usr/bin/env bash
# Device orchestration for session 19 (issue 15: the batched decode step's projections), over the
# xz-packed stripped binaries in dist/pack/bins.tar.xz (carry dist/pack, .cache/vocab,
# .cache/wheels): krasis-runtime, kbench, the kernel test binary gpu-* and the engine test
# binaries (batching-*, gpu_engine-*, prefix_cache-*, row_invariance-*, gpt_oss-*, glm4_moe-*).
#   bash tools/device/session19.sh gemv COMMIT
#       `kbench --rows` (the decode GEMVs and INT4 experts at 1/2/4/8 rows, a3b shapes), the kernel
#       tests of the GEMVs and of row invariance (gemv::, rows::, fp16::, int4::), the witness
#       checks of tiny and tiny-dense (benchmarks/run_device.sh), then `bench --decode-rows
#       1,2,4,8` of a3b-24l all resident. Run at d7484ca, whose engine ran the tensor-core GEMV
#       and whose kbench and kernel tests also ran the FMA form (the session 19 notes).
#   python3 tools/device/probe/stream_pattern.py
#       (no binaries) the HBM read rate of three per-instruction load patterns.
#   bash tools/device/session19.sh engine COMMIT
#       the engine tests: batching, gpu_engine, prefix_cache, row_invariance, glm4_moe, gpt_oss.
#   bash tools/device/session19.sh serve COMMIT
#       `serve` of a3b-24l with 1/2/4/8 streaming clients all resident, then at 6 GiB with a
#       context of 8,192 (tools/device/batching.sh parallel).
# Results: $OUT/session19-PHASE.txt (the summary) and the logs and archives beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/session19-$P.txt
T0=$SECONDS
rm -rf dist/gpu /tmp/bins
mkdir -p /tmp/bins dist/gpu && tar xJf dist/pack/bins.tar.xz -C /tmp/bins && cp /tmp/bins/*/* dist/gpu/
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
test_bin() { # name timeout [filter...]
  local b n=$1 t=$2; shift 2; b=$(ls dist/gpu/$n-* 2>/dev/null | head -1)
  [ -z "$b" ] && { echo "test $n: binary missing" >> "$S"; return; }
  timeout "$t" "$b" --test-threads 1 --nocapture "$@" > "$OUT/test-$n.log" 2>&1
  echo "test $n rc=$? $(grep '^test result' "$OUT/test-$n.log" | tail -1) (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "panicked|FAILED|SKIPPED" -A2 "$OUT/test-$n.log" | head -20 >> "$S"
  grep -E "requests, staggered .*: ok|of [0-9]+ requests differ from alone" \
    "$OUT/test-$n.log" | head -30 >> "$S"
}
parallel() { # LIMIT budget context
  LIMIT=$1 CLIENTS=1,2,4,8 BUDGET=$2 CTX=$3 bash tools/device/batching.sh parallel "$C" > /dev/null 2>&1
  echo "parallel $1 context $3 (t=$((SECONDS-T0))s)" >> "$S"
  cat /tmp/btr-parallel-${1//,/-}-ctx$3/summary.txt >> "$S"
}
case "$P" in
  gemv)
    timeout 120 dist/gpu/kbench --rows > "$OUT/kbench-rows.txt" 2>&1
    echo "kbench --rows rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "GEMV|Fma|TensorCore|m4:" "$OUT/kbench-rows.txt" >> "$S"
    test_bin gpu 200 gemv:: rows:: fp16:: int4::
    grep -E "worst error" "$OUT/test-gpu.log" | sort -t' ' -k1,1 | awk '{print}' | tail -5 >> "$S"
    timeout 150 bash benchmarks/run_device.sh "$OUT/check" "$C" check-tiny check-tiny-dense > "$OUT/check.log" 2>&1
    echo "witness checks rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "^CHECK|all checks|FAIL" "$OUT/check.log" | cut -c1-160 >> "$S"
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    timeout 120 dist/gpu/krasis-runtime bench --model /tmp/agent-load/a3b-24l --cache-dir /tmp/agent-load/krasis-cache \
      --commit "$C" --decode-rows 1,2,4,8 --json "$OUT/bench-rows.json" > "$OUT/bench-rows.log" 2>&1
    echo "bench --decode-rows rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "^decode [0-9] rows|^decode +[0-9]+ tokens \(graphs on" "$OUT/bench-rows.log" | cut -c1-500 >> "$S"
    ;;
  engine)
    for t in batching:150 gpu_engine:90 prefix_cache:100 row_invariance:60 glm4_moe:80 gpt_oss:120; do
      test_bin "${t%%:*}" "${t##*:}"
    done
    ;;
  serve)
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    parallel none 300 32768
    parallel 6GiB $((560 - (SECONDS - T0))) 8192
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
cat "$S"
