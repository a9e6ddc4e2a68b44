#!/usr/bin/env bash
# Device script for issue 15's prefix cache: chunk-invariant prefill, blocks smaller than the chunk,
# the VRAM pool and the page-locked host tier. The lead runs it from the repo root with release
# binaries in dist/gpu/ (stripped): krasis-runtime and the test binaries
#   cargo test --release --locked -p krasis-gpu --test prefix_cache --test row_invariance \
#     --test gpu_engine --test cancel --test live --test glm4_moe --test gpt_oss \
#     --test fault_injection --no-run
#   cargo test --release --locked -p krasis-kernels --test gpu --no-run
# (prefix_cache-*, row_invariance-*, gpu_engine-*, cancel-*, live-*, glm4_moe-*, gpt_oss-*,
# fault_injection-*, gpu-*). One phase per call, each under 580 s; device /tmp may persist:
#   bash tools/device/prefix_cache.sh tests COMMIT
#       row_invariance (GEMM rows vs 1-row GEMMs for M=1..300 on a3b/GLM-4.5-Air shapes and the
#       planted per-shape choice caught; qwen3_moe and glm4_moe tiny prefilled in chunks of
#       512/37/64/100, all resident and streamed: logits, KV and decode bit-identical), the kernel
#       tests attention_prefill_rows_are_chunk_invariant and kv_blocks_copy_matches_reference, then
#       prefix_cache (64-token blocks under 100-token chunks bit-identical to a one-chunk cold
#       prefill; host tier restores; eviction; cancel; bypass; faults; the tiers from the options).
#   bash tools/device/prefix_cache.sh regress COMMIT
#       what the cuBLASLt GEMMs and the grouped-path rule touch: gpu_engine, cancel, live,
#       glm4_moe, gpt_oss, fault_injection, and every kernel GPU test.
#   bash tools/device/prefix_cache.sh prep COMMIT
#       a3b-24l + INT4 cache + heatmap at 6GiB (benchmarks/agent_load_device.sh prep; skipped when
#       done).
#   bash tools/device/prefix_cache.sh bench COMMIT
#       `krasis-runtime bench` of a3b-24l all resident, prompts 512 and 8192 (the prefill path the
#       fixed cuBLASLt algorithms now run; compare with the previous results' prefill tok/s).
#   LIMIT=6GiB|none CONFIG=name[,...] bash tools/device/prefix_cache.sh agent COMMIT
#       `serve --backend cuda` of a3b-24l with the prefix cache per CONFIG, then
#       `benchmarks/agent_load.py agent` over a ~24K-token context (4 turns, 256 appended tokens,
#       64-token replies): the turn TTFTs (cold turn 1 vs later turns), cached_tokens, the startup
#       line of what each tier took, /v1/stats' prefix_cache section (per tier: hits, bytes and
#       restore ms). CONFIG names:
#         off            --prefix-cache off
#         auto           auto tiers, 256-token blocks, 8192-token chunks (all resident: a VRAM pool
#                        of one context's KV; at 6GiB: no VRAM pool, the host tier alone)
#         host           --prefix-cache 0 (no VRAM pool), the host tier alone
#         evict          --prefix-cache 1280MiB (one 24K conversation, not two) + an 8 GiB host
#                        tier, with agent_load --evict-requests 1: an unrelated 24K context before
#                        turn 2 demotes the conversation's blocks to the host tier, and turn 2 is
#                        the "restore from RAM <= 25% of cold" target
#         block-N        auto with --prefix-block N (e.g. block-64, block-1024)
#       Suggested calls (two configurations fit one call): LIMIT=none CONFIG=off,auto;
#       LIMIT=none CONFIG=evict; LIMIT=6GiB CONFIG=off,auto (at 6GiB auto is the host tier alone:
#       every later turn restores from RAM, the <= 25% target there; evict's 1.25 GiB VRAM pool
#       would take most of HCS's slots).
# CONFIG may list several configurations (comma-separated), run one after another in one call.
# Results: $OUT/pc-PHASE[-LIMIT-CONFIG].tgz (summary.txt first).
set -u
P=${1:?phase tests, regress, prep, bench or agent}; C=${2:-unknown}
L=${LIMIT:-6GiB}; CFG=${CONFIG:-auto}
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

# run_test NAME [FILTER...]: one test binary, at most CAP seconds.
run_test() {
  local t=$1; shift
  local b; b=$(ls $D/$t-* 2>/dev/null | head -1)
  [ -z "$b" ] && { log "test $t: binary missing"; return; }
  local lim=$(( $(left) < ${CAP:-200} ? $(left) : ${CAP:-200} ))
  [ "$lim" -lt 20 ] && { log "test $t: no time left"; return; }
  local f=$R/test-$t${1:+-$1}.log
  timeout "$lim" "$b" --test-threads 1 --nocapture "$@" > "$f" 2>&1
  log "test $t $* rc=$? $(grep -h '^test result' "$f" | tail -1)"
  grep -E "FAILED|panicked|SKIPPED" "$f" | head -10 >> "$SUM"
  grep -E "hits, .* cached tokens|blocks restored|per-shape|planted" "$f" >> "$SUM"
}

if [ "$P" = tests ]; then
  CAP=240 run_test row_invariance
  CAP=60 run_test gpu attention_prefill_rows_are_chunk_invariant
  CAP=60 run_test gpu kv_blocks_copy_matches_reference
  CAP=240 run_test prefix_cache
  exit 0
fi

if [ "$P" = regress ]; then
  for t in gpu_engine cancel live glm4_moe gpt_oss fault_injection gpu; do CAP=120 run_test $t; done
  exit 0
fi

if [ "$P" = prep ]; then
  OUT=$R timeout "$(left)" bash benchmarks/agent_load_device.sh prep "$C" > "$R/prep.log" 2>&1
  log "prep rc=$?"; tail -3 "$R/summary.txt" 2>/dev/null; exit 0
fi

[ -f "$T/a3b-24l/config.json" ] || { log "run the prep phase first"; exit 1; }

if [ "$P" = bench ]; then
  timeout "$(left)" "$kr" bench --model "$T/a3b-24l" --cache-dir "$T/krasis-cache" --commit "$C" \
    --prompt-tokens 512,8192 --decode-tokens 64 --json "$R/bench.json" --markdown "$R/bench.md" \
    > "$R/bench.log" 2>&1
  log "bench rc=$?"; grep -iE "prefill|tok/s" "$R/bench.md" | head -20 >> "$SUM"; exit 0
fi

[ "$P" = agent ] || { log "unknown phase $P"; exit 2; }
"$py" -c "import openai" 2>/dev/null || { log "no openai client in $py"; exit 1; }
run_config() {
local CFG=$1 R=$R/$1; mkdir -p "$R"
local extra=()
case "$CFG" in
  off) pc=(--prefix-cache off) ;;
  auto) pc=(--prefix-cache auto --prefix-cache-host auto) ;;
  host) pc=(--prefix-cache 0 --prefix-cache-host auto) ;;
  evict) pc=(--prefix-cache 1280MiB --prefix-cache-host 8GiB); extra=(--evict-requests 1) ;;
  block-*) pc=(--prefix-cache auto --prefix-cache-host auto --prefix-block "${CFG#block-}") ;;
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
  --context-tokens 24000 --turns 4 --append-tokens 256 --reply-tokens 64 --repeats 3 "${extra[@]}" \
  --json "$R/agent.json" --markdown "$R/agent.md" > "$R/agent.log" 2>&1
log "agent rc=$?"
sed -n '/^PASS\|^FAIL/p' "$R/agent.log" >> "$SUM"
grep -iE "ttft|cached|evict" "$R/agent.md" | head -24 >> "$SUM"
curl -s "$url/v1/stats" > "$R/stats.json"
"$py" -c "import json,sys; s=json.load(open('$R/stats.json')); print('prefix_cache', json.dumps(s.get('prefix_cache')))" \
  >> "$SUM" 2>&1
kill -TERM "$spid" 2>/dev/null; wait "$spid" 2>/dev/null; spid=
}
for c in ${CFG//,/ }; do
  [ "$(left)" -lt 120 ] && { log "no time left for $c"; break; }
  log "== config $c"; run_config "$c"
done
