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
#   bash tools/device/issue15b.sh glm COMMIT
#       glm-4.5-air-12l all resident through serve: parallel clients and the agent loop.
#   bash tools/device/issue15b.sh ncu COMMIT
#       per-kernel device time of one decode step at 1 and 4 rows (ncu, profile-from-start off).
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
  glm)
    # The second family through serve: glm-4.5-air-12l (11 MoE layers x 128 experts of
    # 4096x1408, FP16 MLP block; routed experts only in the INT4 cache, ~12 GiB) all resident,
    # parallel clients 1/2/4/8 and the agent loop (auto prefix cache).
    M=/tmp/glm12; K=/tmp/glmkc; py=/opt/torch/.venv/bin/python3; mkdir -p $A
    if [ ! -f $M/config.json ]; then
      timeout 120 "$kr" synth --preset glm-4.5-air-12l --seed 1 --experts-in-cache-only --out $M \
        --vocab .cache/vocab/qwen.tiktoken > "$OUT/glm-synth.log" 2>&1
      echo "synth rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      timeout 200 "$kr" build-cache --model $M --cache-dir $K > "$OUT/glm-cache.log" 2>&1
      echo "build-cache rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    fi
    "$py" -c "import openai" 2> /dev/null || "$py" -m pip install -q --no-index \
      --find-links .cache/wheels --target $A/pydeps openai > "$OUT/pip.log" 2>&1
    export PYTHONPATH=$A/pydeps
    url=http://127.0.0.1:18098
    "$kr" serve --model $M --cache-dir $K --backend cuda --parallel 8 --context-length 32768 \
      --port 18098 > "$OUT/glm-events.jsonl" 2> "$OUT/glm-serve.log" &
    spid=$!
    for _ in $(seq 1 900); do curl -sf $url/health > /dev/null 2>&1 && break; sleep 0.2; done
    echo "serving: $(curl -s $url/health) (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "^prefix cache|^memory:|^experts:" "$OUT/glm-serve.log" >> "$S"
    timeout 200 "$py" benchmarks/agent_load.py parallel --url $url --commit "$C" --runtime-bin "$kr" \
      --clients 1,2,4,8 --requests 2 --prompt-tokens 1000 --max-tokens 128 \
      --json "$OUT/glm-parallel.json" --markdown "$OUT/glm-parallel.md" > "$OUT/glm-parallel.log" 2>&1
    echo "parallel rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    sed -n '/^PASS\|^FAIL/p' "$OUT/glm-parallel.log" >> "$S"
    grep -E "^\| [0-9]+ \|" "$OUT/glm-parallel.md" | head -8 >> "$S"
    timeout 170 "$py" benchmarks/agent_load.py agent --url $url --commit "$C" --runtime-bin "$kr" \
      --context-tokens 24000 --turns 4 --append-tokens 256 --reply-tokens 64 --repeats 3 \
      --json "$OUT/glm-agent.json" --markdown "$OUT/glm-agent.md" > "$OUT/glm-agent.log" 2>&1
    echo "agent rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    sed -n '/^PASS\|^FAIL/p' "$OUT/glm-agent.log" >> "$S"
    grep -E "^\| [0-9]+ \|" "$OUT/glm-agent.md" | head -8 >> "$S"
    curl -s $url/v1/stats > "$OUT/glm-stats.json"
    kill -TERM $spid 2>/dev/null; wait $spid 2>/dev/null
    ;;
  ncu)
    # Where one decode step's device time goes, kernel by kernel, at 1 and 4 rows: Nsight
    # Compute times each kernel of the step `decode_breakdown` brackets with cuProfilerStart /
    # cuProfilerStop (clocks and caches left alone).
    [ -f $A/a3b-24l/config.json ] || BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    echo "ncu: $ncu (t=$((SECONDS-T0))s)" >> "$S"
    timeout 400 "$ncu" --clock-control none --cache-control none --profile-from-start off \
      --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu.csv" \
      "$kr" bench --model $A/a3b-24l --cache-dir $A/krasis-cache --commit "$C" \
      --prompt-tokens 64 --decode-tokens 16 --decode-prompt-tokens 1000 --decode-rows 1,4 \
      > "$OUT/ncu-bench.log" 2>&1
    echo "ncu rc=$? (t=$((SECONDS-T0))s) $(wc -l < "$OUT/ncu.csv") lines" >> "$S"
    tail -3 "$OUT/ncu-bench.log" >> "$S"
    ;;
  *) echo "unknown phase $P" >> "$S"; exit 2 ;;
esac
cat "$S"
