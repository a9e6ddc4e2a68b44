#!/usr/bin/env bash
# Device orchestration for session 25 (issue 15: gpt_oss batching and prefix cache, written
# without a GPU), over the xz-packed stripped binaries in dist/pack/*.tar.xz (carry dist/pack,
# .cache/vocab, .cache/wheels): krasis-runtime, the kernel test binary gpu-* and the engine
# test binaries gpt_oss-*, batching-*, prefix_cache-*, gpu_engine-*, fault_injection-*,
# row_invariance-*.
#   bash tools/device/session25.sh t COMMIT
#       the new kernel tests (rings at per-sequence bases, batched ring decode, ring prefill
#       chunk invariance, kv_blocks_copy over rings and skipped layers, MXFP4 decode rows), the
#       kernel families whose entry points changed, then the engine's gpt_oss tests (sliding
#       pieces bit-identical to any chunking), gpt_oss batching (invariance all resident and
#       HCS, both MXFP4 ways, SwapRowRings) and the prefix cache (gpt_oss hits, the window
#       restore fault, the prefix cache file across a restart, and every earlier test), then
#       tests/e2e/test_oss_serving.py and test_prefix_cache.py with --backend cuda (pytest
#       from .cache/wheels).
#   bash tools/device/session25.sh r COMMIT
#       the regressions of the paths touched: batching (all), gpu_engine, fault_injection,
#       row_invariance.
#   bash tools/device/session25.sh o COMMIT
#       gpt-oss-20b (synth + MXFP4 cache), `bench --decode-rows 1,2,4,8` at the serve shape,
#       then `serve --parallel 8` all resident at context 32,768:
#       agent_load parallel 1/2/4/8 clients (~1,000-token prompts, 128 tokens) and the agent
#       loop (24K-token context, 6 turns: later turns' TTFT against the cold turn's).
#   bash tools/device/session25.sh i COMMIT
#       the agent loop (4 turns) with gpt-oss's MXFP4 experts dequantized for every prompt while
#       the cache is on (krasis-runtime) and in place for every prompt (krasis-runtime-i):
#       which way serves agents better (the cold turn against the later ones).
# Results: $OUT/session25-PHASE.txt (the summary) and the logs beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/session25-$P.txt
T0=$SECONDS
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
unpack_binaries
case "$P" in
  t)
    # shellcheck disable=SC2086  # KFILTER: several test-name filters
    test_bin gpu "${KTIME:-240}" ${KFILTER:-ring kv_blocks rows:: attention_prefill attention_decode}
    test_bin gpt_oss 150
    test_bin batching 150 gpt_oss_ a_prefix_hit
    test_bin prefix_cache 200
    grep -E "gpt-oss.*(cached|differ)|SwapRowRings|requests differ" "$OUT/test-batching.log" \
      "$OUT/test-prefix_cache.log" | head -30 >> "$S"
    # gpt-oss through the official openai client on the CUDA engine: a second turn's cached
    # tokens and cold-equal answer, parallel streams equal to their solo outputs.
    py=/opt/torch/.venv/bin/python3
    "$py" -m pip install -q --no-index --find-links .cache/wheels --target /tmp/e2e-deps openai \
      pytest > "$OUT/pip-e2e.log" 2>&1
    PYTHONPATH=/tmp/e2e-deps timeout 200 "$py" -m pytest -q tests/e2e/test_oss_serving.py \
      --backend cuda --runtime dist/gpu/krasis-runtime > "$OUT/e2e-oss.log" 2>&1
    echo "e2e oss (cuda) rc=$? $(tail -1 "$OUT/e2e-oss.log") (t=$((SECONDS-T0))s)" >> "$S"
    # The prefix cache through the server on the CUDA engine, its file across a restart
    # (session 26) among it; on the tiny model with the head_dim the CUDA engine runs.
    PYTHONPATH=/tmp/e2e-deps timeout 150 "$py" -m pytest -q tests/e2e/test_prefix_cache.py \
      --backend cuda --runtime dist/gpu/krasis-runtime --synth-set head_dim=64 > "$OUT/e2e-prefix.log" 2>&1
    echo "e2e prefix (cuda) rc=$? $(tail -1 "$OUT/e2e-prefix.log") (t=$((SECONDS-T0))s)" >> "$S"
    ;;
  r)
    test_bin batching 240
    test_bin gpu_engine 120
    test_bin fault_injection 120
    test_bin row_invariance 120
    ;;
  o|i)
    py=/opt/torch/.venv/bin/python3; T=/tmp/oss-load
    mkdir -p "$T"
    if ! "$py" -c "import openai" 2> /dev/null && [ -d .cache/wheels ]; then
      "$py" -m pip install -q --no-index --find-links .cache/wheels --target "$T/pydeps" openai \
        > "$OUT/pip.log" 2>&1
      export PYTHONPATH="$T/pydeps"
    fi
    kr0=$(realpath dist/gpu/krasis-runtime)
    [ -f "$T/g20/config.json" ] || timeout 150 "$kr0" synth --preset gpt-oss-20b --seed 1 \
      --out "$T/g20" --vocab .cache/vocab/o200k_base.tiktoken > "$OUT/synth.log" 2>&1
    echo "synth rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    [ -d "$T/kc" ] || timeout 150 "$kr0" build-cache --model "$T/g20" --cache-dir "$T/kc" \
      > "$OUT/cache.log" 2>&1
    echo "build-cache rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    port=18096; url=http://127.0.0.1:$port
    serve() { # binary tag: serve --parallel 8, all resident, context 32,768
      KRASIS_LOG=warn "$1" serve --model "$T/g20" --cache-dir "$T/kc" --backend cuda \
        --context-length 32768 --parallel 8 --port $port > "$OUT/serve-$2.log" 2>&1 &
      spid=$!
      for _ in $(seq 1 900); do
        curl -sf "$url/health" > /dev/null 2>&1 && break
        kill -0 "$spid" 2>/dev/null || { echo "serve $2 exited: $(tail -3 "$OUT/serve-$2.log")" >> "$S"; return 1; }
        sleep 0.2
      done
      echo "serving $2 (t=$((SECONDS-T0))s): $(curl -s "$url/health")" >> "$S"
      grep -iE "parallel|prefix|KV" "$OUT/serve-$2.log" | head -6 >> "$S"
    }
    stop() { curl -s "$url/v1/stats" > "$OUT/stats-$1.json"; kill -TERM "$spid" 2>/dev/null; wait "$spid" 2>/dev/null; }
    al() { # name binary args...
      local name=$1 bin=$2; shift 2
      timeout $((560-(SECONDS-T0))) "$py" benchmarks/agent_load.py "$@" --url "$url" --commit "$C" \
        --runtime-bin "$bin" --json "$OUT/$name.json" --markdown "$OUT/$name.md" > "$OUT/$name.log" 2>&1
      echo "$name rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      grep -E "^PASS|^FAIL|aggregate|TTFT" "$OUT/$name.log" | head -12 >> "$S"
    }
    if [ "$P" = o ]; then
      # Batched decode at the serve shape (one sequence per row, rings per sequence).
      timeout 120 "$kr0" bench --model "$T/g20" --cache-dir "$T/kc" --commit "$C" --prompt-tokens 1000 \
        --decode-prompt-tokens 1000 --decode-tokens 128 --decode-rows 1,2,4,8 --context-length 32768 \
        --json "$OUT/bench-g20-rows.json" > "$OUT/bench-g20-rows.log" 2>&1
      echo "bench decode rows rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      grep -E "^decode [0-9] rows|^prefill" "$OUT/bench-g20-rows.log" | cut -c1-300 >> "$S"
      serve "$kr0" main || exit 0
      al oss-parallel "$kr0" parallel --clients 1,2,4,8 --requests 2 --prompt-tokens 1000 --max-tokens 128
      al oss-agent "$kr0" agent --context-tokens 24000 --turns 6 --append-tokens 256 --reply-tokens 64
      stop main
    else
      # The MXFP4 way while the cache is on: dequantized for every prompt (krasis-runtime) or
      # in place for every prompt (krasis-runtime-i, a build of the same commit with
      # `mxfp4_in_place_for` true under the cache): the agent loop's cold and later turns.
      # The same commit with and without the in-place switch (dist/pack/COMMIT: -old and -i).
      # shellcheck disable=SC2086  # IWAYS: several suffixes
      for v in ${IWAYS:--old -i}; do
        b=$(realpath "dist/gpu/krasis-runtime$v" 2>/dev/null) || { echo "no krasis-runtime$v" >> "$S"; continue; }
        serve "$b" "way$v" || continue
        al "oss-agent-way$v" "$b" agent --context-tokens 24000 --turns 4 --append-tokens 256 --reply-tokens 64
        stop "way$v"
      done
    fi
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
