#!/usr/bin/env bash
# Issue 15's serving measurements on the H200: benchmarks/agent_load.py against a real
# `krasis-runtime serve --backend cuda` of a3b-24l at a VRAM limit (6GiB unless LIMIT is set;
# LIMIT=none serves all resident; CLIENTS=1,2,4 narrows parallel). One PHASE per device call (each stays under 580 s):
#   prep      synth a3b-24l, build its INT4 cache and the heatmap at 6GiB (benchmarks/run_device.sh
#             heatmap-a3b-24l; skipped when done, device /tmp may persist)
#   parallel  1/2/4/8 streaming clients, 2 requests each, ~1000-token prompts, 128 tokens
#   agent     the agent loop over a ~24K-token context (6 turns), then the same with 4 evicting
#             contexts before turn 2 (3 turns)
#   chaos     16 clients x 20 requests with disconnects and cancellations, stats before/after
# Run from the repository root with dist/gpu/krasis-runtime; uses /opt/torch/.venv/bin/python3
# (it has the openai client). Usage: agent_load_device.sh PHASE [COMMIT]. Writes
# $OUT/agent-load-PHASE.tgz (reports, server log) and $OUT/summary.txt.
set -u
phase=${1:?usage: agent_load_device.sh prep|parallel|agent|chaos [COMMIT]}
C=${2:-unknown}
O=${OUT:?set OUT}
T=/tmp/agent-load                     # model, cache, heatmap (kept between calls)
R=/tmp/agent-load-out-$phase; rm -rf "$R"; mkdir -p "$R" "$T"
kr=$(realpath dist/gpu/krasis-runtime)
py=/opt/torch/.venv/bin/python3
L=${LIMIT:-6GiB}
T0=$SECONDS
log() { echo "$* (t=$((SECONDS-T0))s)" | tee -a "$R/summary.txt"; }
left() { local l=$((575-(SECONDS-T0))); echo $((l > 1 ? l : 1)); }
finish() {
  [ -n "${spid:-}" ] && kill -TERM "$spid" 2>/dev/null && wait "$spid" 2>/dev/null
  cp "$R/summary.txt" "$O/summary.txt" 2>/dev/null
  tar -czf "$O/agent-load-$phase.tgz" -C "$R" . 2>/dev/null
}
trap finish EXIT
export KRASIS_LOG=warn
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt" 2>&1
# The prep (model, cache, heatmap) needs no client: bench-only device calls need not carry it.
if [ "$phase" = prep ]; then
  KRASIS_DEVICE_TMP=$T timeout "$(left)" bash benchmarks/run_device.sh "$R/rd" "$C" heatmap-a3b-24l \
    > "$R/prep.log" 2>&1
  log "prep rc=$?"; exit 0
fi
# The device has no network and its Python no openai client: install the wheels carried in
# .cache/wheels (fetched here with `pip download --python-version 3.12 --only-binary=:all:
# --platform manylinux2014_x86_64 openai -d .cache/wheels`) into a directory of their own.
if ! "$py" -c "import openai" 2> /dev/null && [ -d .cache/wheels ]; then
  "$py" -m pip install -q --no-index --find-links .cache/wheels --target "$T/pydeps" openai \
    > "$R/pip.log" 2>&1
  export PYTHONPATH="$T/pydeps"
fi
"$py" -c "import openai; print('openai', openai.__version__)" >> "$R/summary.txt" 2>&1 \
  || { log "no openai client in $py"; exit 1; }

[ -f "$T/a3b-24l/config.json" ] || { log "run the prep phase first"; exit 1; }

port=18095; url=http://127.0.0.1:$port
lim=(--vram-limit "$L"); [ "$L" = none ] && lim=()
"$kr" serve --model "$T/a3b-24l" --cache-dir "$T/krasis-cache" --backend cuda "${lim[@]}" \
  --context-length 32768 --port $port --progress-json > "$R/events.jsonl" 2> "$R/serve.log" &
spid=$!
for _ in $(seq 1 900); do
  curl -sf "$url/health" > /dev/null 2>&1 && break
  kill -0 "$spid" 2>/dev/null || { log "serve exited: $(tail -3 "$R/serve.log")"; exit 1; }
  sleep 0.2
done
log "serving at ${L}: $(curl -s "$url/health")"

al() { # name args...: one agent_load run
  local name=$1; shift
  timeout "$(left)" "$py" benchmarks/agent_load.py "$@" --url "$url" --commit "$C" --runtime-bin "$kr" \
    --json "$R/$name.json" --markdown "$R/$name.md" > "$R/$name.log" 2>&1
  log "$name rc=$?"; sed -n '/^PASS\|^FAIL/p' "$R/$name.log" >> "$R/summary.txt"
}
case "$phase" in
  parallel) al parallel parallel --clients "${CLIENTS:-1,2,4,8}" --requests 2 --prompt-tokens 1000 --max-tokens 128 ;;
  agent)
    al agent agent --context-tokens 24000 --turns 6 --append-tokens 256 --reply-tokens 64
    al agent-evict agent --context-tokens 24000 --turns 3 --append-tokens 256 --reply-tokens 64 \
      --evict-requests 4 ;;
  chaos) al chaos chaos --chaos-clients 16 --chaos-requests 20 --chaos-prompt-tokens 512 \
      --chaos-max-tokens 64 ;;
  *) log "unknown phase $phase"; exit 2 ;;
esac
