#!/usr/bin/env bash
# Device orchestration for issue 15, session 5, one phase per call over the xz-packed stripped
# binaries in dist/pack/bins.tar.xz (carry dist/pack, .cache/vocab, .cache/wheels):
#   bash tools/device/issue15b.sh rows COMMIT
#       the row-invariance tests (GEMM rows against 1-row GEMMs up to a full 8192-row chunk,
#       chunk-invariant tiny prefill), then prep (a3b-24l, INT4 cache, heatmap) and
#       `bench --decode-rows 1,2,4,8` all resident: aggregate decode tok/s of M sequences
#       decoding together, the step's device time and its parts.
#   TESTS="prefix_cache batching ..." bash tools/device/issue15b.sh tests COMMIT
#       engine test binaries, each with --nocapture.
#   bash tools/device/issue15b.sh verify COMMIT
#       batching and prefix_cache tests, then `agent_load.py parallel` all resident (1/2/4/8).
#   bash tools/device/issue15b.sh perf COMMIT
#       `agent_load.py parallel` at 6 GiB, then the agent loop at 6 GiB and all resident.
#   bash tools/device/issue15b.sh final COMMIT
#       `agent_load.py parallel` all resident, then the agent loop all resident and at 6 GiB.
# Results: $OUT/issue15b-PHASE.txt (the summary) and the logs beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/issue15b-$P.txt
T0=$SECONDS
if [ ! -x dist/gpu/krasis-runtime ]; then
  mkdir -p /tmp/bins dist/gpu && tar xJf dist/pack/bins.tar.xz -C /tmp/bins && cp /tmp/bins/*/* dist/gpu/
fi
kr=$(realpath dist/gpu/krasis-runtime); A=/tmp/agent-load
test_bin() { # name timeout [filter]
  local b; b=$(ls dist/gpu/$1-* 2>/dev/null | head -1)
  [ -z "$b" ] && { echo "test $1: binary missing" >> "$S"; return; }
  timeout "$2" "$b" --test-threads 1 --nocapture ${3:-} > "$OUT/test-$1.log" 2>&1
  echo "test $1 rc=$? $(grep '^test result' "$OUT/test-$1.log") (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "panicked|FAILED|pairs|differ" -A2 "$OUT/test-$1.log" | head -20 >> "$S"
}
case "$P" in
  rows)
    test_bin row_invariance 200
    [ -f $A/a3b-24l/config.json ] || BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    timeout 240 "$kr" bench --model $A/a3b-24l --cache-dir $A/krasis-cache --commit "$C" \
      --prompt-tokens 512 --decode-tokens 64 --decode-prompt-tokens 1000 --decode-rows 1,2,4,8 \
      --json "$OUT/bench-rows.json" > "$OUT/bench-rows.log" 2>&1
    echo "bench rows rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "decode|prefill|rows" "$OUT/bench-rows.log" | tail -14 >> "$S"
    ;;
  tests)
    for t in ${TESTS:-prefix_cache batching}; do test_bin "$t" 200; done
    ;;
  verify)
    # Packed prefill + any-block reuse: the engine tests, then the server's parallel clients all
    # resident (1/2/4/8) and the per-step decode figures.
    for t in batching prefix_cache; do test_bin "$t" 170; done
    [ -f $A/a3b-24l/config.json ] || BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    LIMIT=none CLIENTS=1,2,4,8 BUDGET=200 bash tools/device/batching.sh parallel "$C" > /dev/null 2>&1
    cat /tmp/btr-parallel-none/summary.txt >> "$S"
    ;;
  perf)
    # At 6 GiB: parallel clients; the agent loop at 6 GiB and all resident (auto tiers).
    [ -f $A/a3b-24l/config.json ] || BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    LIMIT=6GiB CLIENTS=1,2,4,8 BUDGET=220 bash tools/device/batching.sh parallel "$C" > /dev/null 2>&1
    cat /tmp/btr-parallel-6GiB/summary.txt >> "$S"
    export PYTHONPATH=/tmp/agent-load/pydeps
    for l in 6GiB none; do
      LIMIT=$l CONFIG=auto BUDGET=140 bash tools/device/prefix_cache.sh agent "$C" > /dev/null 2>&1
      cat /tmp/pcr-agent-$l-auto/summary.txt >> "$S"
    done
    ;;
  final)
    # The final runtime: parallel clients all resident, the agent loop all resident and at 6 GiB.
    [ -f $A/a3b-24l/config.json ] || BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    LIMIT=none CLIENTS=1,2,4,8 BUDGET=150 bash tools/device/batching.sh parallel "$C" > /dev/null 2>&1
    cat /tmp/btr-parallel-none/summary.txt >> "$S"
    export PYTHONPATH=/tmp/agent-load/pydeps
    for l in none 6GiB; do
      LIMIT=$l CONFIG=auto BUDGET=140 bash tools/device/prefix_cache.sh agent "$C" > /dev/null 2>&1
      cat /tmp/pcr-agent-$l-auto/summary.txt >> "$S"
    done
    ;;
  *) echo "unknown phase $P" >> "$S"; exit 2 ;;
esac
cat "$S"
