#!/usr/bin/env bash
# Device orchestration for issue 15 (the merged batching + prefix cache tiers), one phase per call.
# The lead packs the stripped release binaries into dist/pack/bins.tar.xz (folders of
# krasis-runtime and the test binaries: xz keeps ten 8 MB test binaries inside the carry limit)
# and carries it with .cache/vocab and .cache/wheels:
#   bash tools/device/issue15.sh tests COMMIT
#       the engine tests of what the merge touched (row_invariance, gpu_engine, batching,
#       prefix_cache, cancel, live, fault_injection, glm4_moe, gpt_oss) and the kernel tests of
#       the decode rows, the block copies and chunk-invariant prefill attention.
#   bash tools/device/issue15.sh perf1 COMMIT
#       prep (a3b-24l, INT4 cache, heatmap), `bench` prefill 512/8192 all resident (the fixed
#       cuBLASLt algorithms), continuous batching all resident with 1/2/4/8 clients, and the
#       chaos run (16 clients x 20 requests with disconnects and cancellations) all resident.
#   bash tools/device/issue15.sh perf2 COMMIT
#       continuous batching at 6 GiB, then the agent loop at 6 GiB with the prefix cache off and
#       auto (the host tier alone there).
#   bash tools/device/issue15.sh perf3 COMMIT
#       the agent loop all resident: auto (VRAM pool + host tier) and evict (restores from RAM).
# Results: the phase scripts' tarballs in $OUT, and $OUT/issue15-PHASE.txt (their summaries).
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/issue15-$P.txt
if [ ! -x dist/gpu/krasis-runtime ]; then
  mkdir -p /tmp/bins dist/gpu && tar xJf dist/pack/bins.tar.xz -C /tmp/bins && cp /tmp/bins/*/* dist/gpu/
fi
case "$P" in
  tests)
    timeout 100 dist/gpu/gpu-* --test-threads 1 rows:: > "$OUT/kernels-rows.log" 2>&1
    echo "kernels rows:: rc=$? $(grep '^test result' "$OUT/kernels-rows.log")" >> "$S"
    grep -E "FAILED|panicked" "$OUT/kernels-rows.log" | head -10 >> "$S"
    CAP=150 BUDGET=200 bash tools/device/prefix_cache.sh tests "$C" > /dev/null 2>&1
    cat /tmp/pcr-tests/summary.txt >> "$S"
    KERNELS=0 TESTS="gpu_engine batching cancel live fault_injection glm4_moe gpt_oss" BUDGET=260 \
      bash tools/device/batching.sh tests "$C" > /dev/null 2>&1
    cat /tmp/btr-tests/summary.txt >> "$S"
    ;;
  perf1)
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    cat /tmp/btr-prep/summary.txt >> "$S"
    BUDGET=120 bash tools/device/prefix_cache.sh bench "$C" > /dev/null 2>&1
    cat /tmp/pcr-bench/summary.txt >> "$S"
    LIMIT=none CLIENTS=1,2,4,8 BUDGET=200 bash tools/device/batching.sh parallel "$C" > /dev/null 2>&1
    cat /tmp/btr-parallel-none/summary.txt >> "$S"
    export PYTHONPATH=/tmp/agent-load/pydeps
    LIMIT=none timeout 170 bash benchmarks/agent_load_device.sh chaos "$C" > /dev/null 2>&1
    cat "$OUT/summary.txt" >> "$S"
    ;;
  perf2)
    LIMIT=6GiB CLIENTS=1,2,4,8 BUDGET=220 bash tools/device/batching.sh parallel "$C" > /dev/null 2>&1
    cat /tmp/btr-parallel-6GiB/summary.txt >> "$S"
    export PYTHONPATH=/tmp/agent-load/pydeps
    LIMIT=6GiB CONFIG=off,auto BUDGET=350 bash tools/device/prefix_cache.sh agent "$C" > /dev/null 2>&1
    cat /tmp/pcr-agent-6GiB-off_auto/summary.txt >> "$S"
    ;;
  perf3)
    export PYTHONPATH=/tmp/agent-load/pydeps
    LIMIT=none CONFIG=auto,evict BUDGET=570 bash tools/device/prefix_cache.sh agent "$C" > /dev/null 2>&1
    cat /tmp/pcr-agent-none-auto_evict/summary.txt >> "$S"
    ;;
  verify)
    # After the whole-chunk reuse rule: its GPU tests, then the agent loop at 6 GiB and all
    # resident with auto tiers (prep first when the machine is fresh).
    for t in prefix_cache batching; do
      timeout 120 dist/gpu/$t-* --test-threads 1 --nocapture > "$OUT/$t.log" 2>&1
      echo "test $t rc=$? $(grep '^test result' "$OUT/$t.log")" >> "$S"
      grep -E "panicked" -A3 "$OUT/$t.log" | head -12 >> "$S"
    done
    [ -f /tmp/agent-load/a3b-24l/config.json ] || BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    export PYTHONPATH=/tmp/agent-load/pydeps
    for l in 6GiB none; do
      LIMIT=$l CONFIG=auto BUDGET=120 bash tools/device/prefix_cache.sh agent "$C" > /dev/null 2>&1
      cat /tmp/pcr-agent-$l-auto/summary.txt >> "$S"
    done
    ;;
  *) echo "unknown phase $P" >> "$S"; exit 2 ;;
esac
cat "$S"
