#!/usr/bin/env bash
# Device script for issue 15's continuous batching in the CUDA engine. The lead runs it from the
# repo root with release binaries in dist/gpu/: krasis-runtime, the kernel test binary gpu-*
# (`cargo test --release --locked -p krasis-kernels --test gpu --no-run`) and the engine test
# binaries batching-*, gpu_engine-*, cancel-*, live-*, prefix_cache-*, gpt_oss-*, glm4_moe-*,
# fault_injection-* (`cargo test --release --locked -p krasis-gpu --test batching --test
# gpu_engine --test cancel --test live --test prefix_cache --test gpt_oss --test glm4_moe --test
# fault_injection --no-run`, stripped; the dev-dependency turns the fault-injection feature on).
# One phase per call, each under 580 s; device /tmp may persist between calls:
#   bash tools/device/batching.sh tests COMMIT
#       the kernels' row invariance (rows:: — GEMVs, INT4 experts, router, RoPE positions, KV
#       bases, batched decode attention, prefill at a KV row) and the kernel families whose
#       launches changed (attention::, elementwise::, rope::, rope_partial::, fp16::, gemv::,
#       int4::), then batching (invariance alone vs beside 1..7 others all resident / eager /
#       HCS streamed, waits, cancel, prefix hit into a sequence's rows, planted faults), then
#       gpu_engine and cancel. TESTS="name ..." runs those test binaries instead (after the
#       kernel filter; KERNELS=0 skips it).
#   TESTS="live prefix_cache gpt_oss glm4_moe fault_injection" KERNELS=0 bash tools/device/batching.sh tests COMMIT
#       the other engine regressions of the paths batching touched (second call).
#   bash tools/device/batching.sh prep COMMIT
#       a3b-24l + INT4 cache + heatmap at 6GiB (benchmarks/agent_load_device.sh prep; skipped when
#       done).
#   LIMIT=6GiB|none[,...] CLIENTS=1,2,4,8 PARALLEL=8|none CTX=32768 bash tools/device/batching.sh parallel COMMIT
#       `serve --backend cuda --parallel $PARALLEL` of a3b-24l (context CTX, 32768 by default as the
#       issue 15 baseline; the KV arena is one context's rows, so it trades against HCS slots) at
#       each LIMIT (`none`: all resident; several run one after another in one call),
#       then `benchmarks/agent_load.py parallel` with CLIENTS streaming clients (2 requests each,
#       ~1000-token prompts, 128 tokens): aggregate tok/s per client count (target: 4 clients >=
#       2.5x one), TTFT and ITL, the server's startup lines (memory, experts, batching) and
#       /v1/stats after the run. PARALLEL=none leaves the flag out (the engine's default).
#       KR=PATH serves with another runtime binary (a branch's, for an A/B).
#       Suggested: LIMIT=none,6GiB CLIENTS=1,2,4,8 in one call if the loads are warm; else one
#       LIMIT per call.
# Results: $OUT/bt-PHASE[-LIMIT].tgz (summary.txt first).
set -u
P=${1:?phase tests, prep or parallel}; C=${2:-unknown}
L=${LIMIT:-6GiB}; CL=${CLIENTS:-1,2,4,8}; PAR=${PARALLEL:-8}; CTX=${CTX:-32768}
tag=$P; [ "$P" = parallel ] && tag=$P-${L//,/-}-ctx$CTX${KR:+-${KR##*/}}
R=/tmp/btr-$tag; rm -rf "$R"; mkdir -p "$R"
D=dist/gpu; kr=$(realpath "${KR:-$D/krasis-runtime}"); py=/opt/torch/.venv/bin/python3
T=/tmp/agent-load                     # the model, cache and heatmap of agent_load_device.sh prep
export KRASIS_LOG=warn
T0=$SECONDS
SUM=$R/summary.txt
log() { echo "$* (t=$((SECONDS-T0))s)" | tee -a "$SUM"; }
left() { local l=$((${BUDGET:-575}-(SECONDS-T0))); echo $((l > 1 ? l : 1)); }
finish() {
  [ -n "${spid:-}" ] && kill -TERM "$spid" 2>/dev/null && wait "$spid" 2>/dev/null
  tar czf "$OUT/bt-$tag.tgz" -C "$R" . 2>/dev/null
}
trap finish EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv > "$R/gpu.txt" 2>&1

if [ "$P" = tests ]; then
  if [ "${KERNELS:-1}" = 1 ]; then
    b=$(ls $D/gpu-* 2>/dev/null | head -1)
    if [ -z "$b" ]; then log "test gpu (kernels): binary missing"; else
      timeout 200 "$b" --test-threads 1 rows:: attention:: elementwise:: rope:: rope_partial:: fp16:: kv_blocks:: \
        gemv:: int4:: > "$R/test-gpu.log" 2>&1
      log "test gpu (kernels, filtered) rc=$? $(grep -h '^test result' "$R/test-gpu.log" | tail -1)"
      grep -E "FAILED|panicked|SKIPPED" "$R/test-gpu.log" | head -20 >> "$SUM"
    fi
  fi
  for t in ${TESTS:-batching gpu_engine cancel}; do
    b=$(ls $D/$t-* 2>/dev/null | head -1)
    [ -z "$b" ] && { log "test $t: binary missing"; continue; }
    lim=$(( $(left) < 300 ? $(left) : 300 )); [ "$lim" -lt 20 ] && { log "test $t: no time left"; continue; }
    timeout "$lim" "$b" --test-threads 1 --nocapture > "$R/test-$t.log" 2>&1
    log "test $t rc=$? $(grep -h '^test result' "$R/test-$t.log" | tail -1)"
    grep -E "FAILED|panicked|SKIPPED" "$R/test-$t.log" | head -10 >> "$SUM"
    # The invariance runs and what the planted faults broke.
    grep -E "requests, staggered .*: ok|of [0-9]+ requests differ from alone|job 3 cancelled" \
      "$R/test-$t.log" | head -40 >> "$SUM"
  done
  exit 0
fi

if [ "$P" = prep ]; then
  OUT=$R timeout "$(left)" bash benchmarks/agent_load_device.sh prep "$C" > "$R/prep.log" 2>&1
  log "prep rc=$?"; tail -3 "$R/summary.txt" 2>/dev/null; exit 0
fi

[ "$P" = parallel ] || { log "unknown phase $P"; exit 2; }
[ -f "$T/a3b-24l/config.json" ] || { log "run the prep phase first"; exit 1; }
# The device's Python has no openai client and no network: the wheels carried in .cache/wheels
# (see benchmarks/agent_load_device.sh) go into a directory of their own.
if ! "$py" -c "import openai" 2> /dev/null && [ -d .cache/wheels ]; then
  "$py" -m pip install -q --no-index --find-links .cache/wheels --target "$T/pydeps" openai \
    > "$R/pip.log" 2>&1
  export PYTHONPATH="$T/pydeps"
fi
"$py" -c "import openai; print('openai', openai.__version__)" >> "$SUM" 2>&1 \
  || { log "no openai client in $py"; exit 1; }
run_limit() {
local L=$1 R=$R/$1; mkdir -p "$R"
lim=(--vram-limit "$L"); [ "$L" = none ] && lim=()
par=(--parallel "$PAR"); [ "$PAR" = none ] && par=()
port=18097; url=http://127.0.0.1:$port
"$kr" serve --model "$T/a3b-24l" --cache-dir "$T/krasis-cache" --backend cuda "${lim[@]}" "${par[@]}" \
  --context-length "$CTX" --port $port --progress-json > "$R/events.jsonl" 2> "$R/serve.log" &
spid=$!
for _ in $(seq 1 1200); do
  curl -sf "$url/health" > /dev/null 2>&1 && break
  kill -0 "$spid" 2>/dev/null || { log "serve exited: $(tail -3 "$R/serve.log")"; spid=; return 1; }
  sleep 0.2
done
log "serving (limit $L, parallel $PAR, context $CTX): $(curl -s "$url/health")"
grep -iE "^memory:|^experts:|^prefix cache|parallel|batch" "$R/serve.log" | head -8 >> "$SUM"
timeout "$(left)" "$py" benchmarks/agent_load.py parallel --url "$url" --commit "$C" --runtime-bin "$kr" \
  --clients "$CL" --requests 2 --prompt-tokens 1000 --max-tokens 128 \
  --json "$R/parallel.json" --markdown "$R/parallel.md" > "$R/parallel.log" 2>&1
log "parallel rc=$?"
sed -n '/^PASS\|^FAIL/p' "$R/parallel.log" >> "$SUM"
grep -E "^\| [0-9]+ \|" "$R/parallel.md" | head -8 >> "$SUM"
curl -s "$url/v1/stats" > "$R/stats.json"
# The engine's HCS figures first (the recent requests after them are long).
"$py" -c "import json,sys; d=json.load(open(sys.argv[1])); print('stats hcs:', json.dumps(d.get('hcs')))" \
  "$R/stats.json" >> "$SUM" 2>&1
echo "stats: $(head -c 600 "$R/stats.json")" >> "$SUM"
kill -TERM "$spid" 2>/dev/null; wait "$spid" 2>/dev/null; spid=
}
for l in ${L//,/ }; do
  [ "$(left)" -lt 150 ] && { log "no time left for limit $l"; break; }
  log "== limit $l"; run_limit "$l"
done
