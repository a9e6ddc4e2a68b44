#!/usr/bin/env bash
# Probe (session 19): `serve`'s one-client decode rate (the server's own decode_tok_s per
# request, /v1/stats) with the prefix cache on (auto, serve's default) and off, against `bench`'s
# one-row decode of the same model (a3b-24l of tools/device/batching.sh prep, all resident).
# Needs dist/gpu/krasis-runtime and the carried .cache/wheels. Results under $OUT/probe-*.
set -u
T=/tmp/agent-load; kr=$(realpath dist/gpu/krasis-runtime); py=/opt/torch/.venv/bin/python3
S=$OUT/probe-serve-decode.txt
if ! "$py" -c "import openai" 2> /dev/null; then
  "$py" -m pip install -q --no-index --find-links .cache/wheels --target "$T/pydeps" openai > /dev/null 2>&1
  export PYTHONPATH="$T/pydeps"
fi
export KRASIS_LOG=warn
url=http://127.0.0.1:18098
for pc in auto off; do
  "$kr" serve --model "$T/a3b-24l" --cache-dir "$T/krasis-cache" --backend cuda --parallel 8 \
    --context-length 32768 --port 18098 --prefix-cache "$pc" > "$OUT/probe-serve-$pc.log" 2>&1 &
  spid=$!
  for _ in $(seq 1 600); do curl -sf "$url/health" > /dev/null 2>&1 && break; sleep 0.2; done
  timeout 120 "$py" benchmarks/agent_load.py parallel --url "$url" --clients 1 --requests 4 \
    --prompt-tokens 1000 --max-tokens 128 --json "$OUT/probe-parallel-$pc.json" > /dev/null 2>&1
  curl -s "$url/v1/stats" > "$OUT/probe-stats-$pc.json"
  "$py" - "$OUT/probe-stats-$pc.json" "$pc" >> "$S" <<'PY'
import json, statistics, sys
d = json.load(open(sys.argv[1]))
r = [x["decode_tok_s"] for x in d["recent_requests"] if x["completion_tokens"] > 1]
print(f"serve --prefix-cache {sys.argv[2]}: server decode tok/s per request median "
      f"{statistics.median(r):.1f} (min {min(r):.1f}, max {max(r):.1f}, {len(r)} requests); "
      f"decode_steps {d.get('decode_steps')}, ahead {d.get('decode_steps_ahead')}")
PY
  kill -TERM "$spid"; wait "$spid" 2>/dev/null
done
timeout 150 "$kr" bench --model "$T/a3b-24l" --cache-dir "$T/krasis-cache" --prompt-tokens 1000 \
  --decode-tokens 128 --decode-prompt-tokens 1000 > "$OUT/probe-bench.log" 2>&1
grep -E "^decode +128" "$OUT/probe-bench.log" | cut -c1-160 >> "$S"
cat "$S"
