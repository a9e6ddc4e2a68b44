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
#       decode ahead: the engine tests batching (with decode_ahead_gives_the_tokens_of_steps_
#       waited_for), gpu_engine, cancel, live; TESTS="..." names others (prefix_cache gpt_oss
#       glm4_moe fault_injection).
#   bash tools/device/session19.sh serve COMMIT
#       `serve` of a3b-24l all resident (context 32,768) with 1/2/4/8 streaming clients, the
#       binary before decode ahead (dist/gpu/krasis-runtime-a, CLIENTS 1,4) then after it
#       (tools/device/batching.sh parallel; the generator builds its clients before the timed
#       release, benchmarks/agent_load.md).
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
parallel() { # LIMIT budget context [clients]
  LIMIT=$1 CLIENTS=${4:-1,2,4,8} BUDGET=$2 CTX=$3 bash tools/device/batching.sh parallel "$C" > /dev/null 2>&1
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
    for t in ${TESTS:-batching:200 gpu_engine:90 cancel:80 live:80}; do
      test_bin "${t%%:*}" "${t##*:}"
    done
    grep -E "decode steps went ahead" "$OUT/test-batching.log" >> "$S" 2>/dev/null
    ;;
  serve)
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    cp dist/gpu/krasis-runtime /tmp/kr-after
    cp dist/gpu/krasis-runtime-a dist/gpu/krasis-runtime
    echo "before decode ahead (krasis-runtime-a):" >> "$S"
    parallel none 200 32768 1,4
    mv "$OUT/bt-parallel-none-ctx32768.tgz" "$OUT/bt-parallel-none-ctx32768-before.tgz"
    cp /tmp/kr-after dist/gpu/krasis-runtime
    echo "after decode ahead:" >> "$S"
    parallel none $((560 - (SECONDS - T0))) 32768
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
cat "$S"
