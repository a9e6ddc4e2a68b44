#!/usr/bin/env bash
# Device script for issue 15's prefix cache (first step: exact VRAM pool, no host tier yet). The
# lead runs it from the repo root with release binaries in dist/gpu/: krasis-runtime and the test
# binaries prefix_cache-*, gpu_engine-*, cancel-*, live-* (`cargo test --release --locked -p
# krasis-gpu --test prefix_cache --test gpu_engine --test cancel --test live --no-run`,
# stripped). One phase per call, each under 580 s; device /tmp may persist between calls:
#   bash tools/device/prefix_cache.sh tests COMMIT
#       prefix_cache (bit-identity of cached hits to cold prefill, all resident and under HCS with
#       streamed prefill; eviction; cancel; bypass; fault invalidation; the pool from the options),
#       then the regressions of the paths it touched: gpu_engine, cancel, live.
#   bash tools/device/prefix_cache.sh prep COMMIT
#       a3b-24l + INT4 cache + heatmap at 6GiB (benchmarks/agent_load_device.sh prep; skipped when
#       done).
#   LIMIT=6GiB|none CONFIG=off|auto|auto-2048|auto-2048-1536MiB[,...] bash tools/device/prefix_cache.sh agent COMMIT
#       `serve --backend cuda` of a3b-24l with the prefix cache per CONFIG (off; auto; auto with
#       --prefill-chunk 2048 (blocks of 2048 tokens); the same with an explicit 1.5 GiB pool),
#       then `benchmarks/agent_load.py agent` over a ~24K-token context (4 turns, 256 appended
#       tokens, 64-token replies): the report's turn TTFTs (cold turn 1 vs later turns) and
#       cached_tokens, the server's startup line saying what the pool took from HCS, and
#       /v1/stats' prefix_cache section after the run. Suggested calls: LIMIT=none with CONFIG off,
#       auto, auto-2048; LIMIT=6GiB with CONFIG off, auto-2048, auto-2048-1536MiB.
# CONFIG may list several configurations (comma-separated), run one after another in one call.
# Results: $OUT/pc-PHASE[-LIMIT-CONFIG].tgz (summary.txt first).
set -u
P=${1:?phase tests, prep or agent}; C=${2:-unknown}
L=${LIMIT:-6GiB}; CFG=${CONFIG:-auto-2048}
tag=$P; [ "$P" = agent ] && tag=$P-$L-${CFG//,/_}
R=/tmp/pcr-$tag; rm -rf "$R"; mkdir -p "$R"
D=dist/gpu; kr=$(realpath $D/krasis-runtime); py=/opt/torch/.venv/bin/python3
T=/tmp/agent-load                     # the model, cache and heatmap of agent_load_device.sh prep
export KRASIS_LOG=warn
T0=$SECONDS
SUM=$R/summary.txt
log() { echo "$* (t=$((SECONDS-T0))s)" | tee -a "$SUM"; }
left() { local l=$((${BUDGET:-575}-(SECONDS-T0))); echo $((l > 1 ? l : 1)); }
finish() {
  [ -n "${spid:-}" ] && kill -TERM "$spid" 2>/dev/null && wait "$spid" 2>/dev/null
  tar czf "$OUT/pc-$tag.tgz" -C "$R" . 2>/dev/null
}
trap finish EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv > "$R/gpu.txt" 2>&1

if [ "$P" = tests ]; then
  for t in prefix_cache gpu_engine cancel live; do
    b=$(ls $D/$t-* 2>/dev/null | head -1)
    [ -z "$b" ] && { log "test $t: binary missing"; continue; }
    lim=$(( $(left) < 200 ? $(left) : 200 )); [ "$lim" -lt 20 ] && { log "test $t: no time left"; continue; }
    timeout "$lim" "$b" --test-threads 1 --nocapture > "$R/test-$t.log" 2>&1
    log "test $t rc=$? $(grep -h '^test result' "$R/test-$t.log" | tail -1)"
    grep -E "FAILED|panicked|SKIPPED" "$R/test-$t.log" | head -10 >> "$R/summary.txt"
    grep -E "hits, .* cached tokens" "$R/test-$t.log" >> "$R/summary.txt"
  done
  exit 0
fi

if [ "$P" = prep ]; then
  OUT=$R timeout "$(left)" bash benchmarks/agent_load_device.sh prep "$C" > "$R/prep.log" 2>&1
  log "prep rc=$?"; cat "$R/summary.txt" 2>/dev/null | tail -3; exit 0
fi

[ "$P" = agent ] || { log "unknown phase $P"; exit 2; }
[ -f "$T/a3b-24l/config.json" ] || { log "run the prep phase first"; exit 1; }
"$py" -c "import openai" 2>/dev/null || { log "no openai client in $py"; exit 1; }
run_config() {
local CFG=$1 R=$R/$1; mkdir -p "$R"
case "$CFG" in
  off) pc=(--prefix-cache off) ;;
  auto) pc=(--prefix-cache auto) ;;
  # auto-CHUNK: auto pool, blocks (= prefill chunks) of CHUNK tokens; auto-CHUNK-SIZE: a SIZE pool.
  auto-*-*) c=${CFG#auto-}; pc=(--prefix-cache "${c#*-}" --prefill-chunk "${c%%-*}") ;;
  auto-*) pc=(--prefix-cache auto --prefill-chunk "${CFG#auto-}") ;;
  *) log "unknown CONFIG $CFG"; return 2 ;;
esac
lim=(--vram-limit "$L"); [ "$L" = none ] && lim=()
port=18096; url=http://127.0.0.1:$port
"$kr" serve --model "$T/a3b-24l" --cache-dir "$T/krasis-cache" --backend cuda "${lim[@]}" "${pc[@]}" \
  --context-length 32768 --port $port --progress-json > "$R/events.jsonl" 2> "$R/serve.log" &
spid=$!
for _ in $(seq 1 1200); do
  curl -sf "$url/health" > /dev/null 2>&1 && break
  kill -0 "$spid" 2>/dev/null || { log "serve exited: $(tail -3 "$R/serve.log")"; return 1; }
  sleep 0.2
done
log "serving (limit $L, $CFG): $(curl -s "$url/health")"
grep -E "^prefix cache|^memory:|^experts:" "$R/serve.log" >> "$SUM"
timeout "$(left)" "$py" benchmarks/agent_load.py agent --url "$url" --commit "$C" --runtime-bin "$kr" \
  --context-tokens 24000 --turns 4 --append-tokens 256 --reply-tokens 64 --repeats 3 \
  --json "$R/agent.json" --markdown "$R/agent.md" > "$R/agent.log" 2>&1
log "agent rc=$?"
sed -n '/^PASS\|^FAIL/p' "$R/agent.log" >> "$SUM"
grep -iE "ttft|cached" "$R/agent.md" | head -20 >> "$SUM"
curl -s "$url/v1/stats" > "$R/stats.json"
"$py" -c "import json,sys; s=json.load(open('$R/stats.json')); print('prefix_cache', json.dumps(s.get('prefix_cache')))" \
  >> "$SUM" 2>&1
kill -TERM "$spid" 2>/dev/null; wait "$spid" 2>/dev/null; spid=
}
for c in ${CFG//,/ }; do
  [ "$(left)" -lt 120 ] && { log "no time left for $c"; break; }
  log "== config $c"; run_config "$c"
done
