#!/usr/bin/env bash
# What the launcher's run screen sees on a GPU: serves MODEL with the CUDA
# engine, records the startup progress events (with arrival times), sends one
# streaming completion of real text while polling /v1/stats every 200 ms, then
# stops the server with SIGTERM. Writes into OUT_DIR: events.jsonl, stats.jsonl
# (one snapshot per line, prefixed by seconds since the request), summary.txt.
# Usage: benchmarks/serve_live.sh OUT_DIR RUNTIME MODEL CACHE_DIR [serve args...]
set -u -o pipefail
out="$1" kr="$2" model="$3" cache="$4"; shift 4
mkdir -p "$out"
port=18080
url="http://127.0.0.1:$port"
t0=$(date +%s.%N)
"$kr" serve --model "$model" --cache-dir "$cache" --backend cuda --port "$port" --progress-json "$@" \
  2> "$out/serve.stderr" \
  | while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done > "$out/events.jsonl" &
for _ in $(seq 1 600); do
  curl -sf "$url/health" >/dev/null 2>&1 && break
  sleep 0.2
done
ready=$(date +%s.%N)
pid=$(pgrep -f "serve --model $model" | head -1)
# ~4K tokens of real English text (assets/text, public domain).
prompt=$(head -c 16000 assets/text/kjv-genesis-exodus.txt | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')
id=$(curl -s "$url/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
body="{\"model\":\"$id\",\"prompt\":$prompt,\"max_tokens\":400,\"stream\":true,\"temperature\":0}"
r0=$(date +%s.%N)
curl -sN "$url/v1/completions" -H 'Content-Type: application/json' -d "$body" > "$out/stream.txt" &
cpid=$!
: > "$out/stats.jsonl"
while kill -0 "$cpid" 2>/dev/null; do
  s=$(curl -s "$url/v1/stats")
  printf '%s %s\n' "$(python3 -c "print(round($(date +%s.%N) - $r0, 3))")" "$s" >> "$out/stats.jsonl"
  sleep 0.2
done
sleep 0.5
printf '%s %s\n' after "$(curl -s "$url/v1/stats")" >> "$out/stats.jsonl"
s0=$(date +%s.%N)
kill -TERM "$pid" 2>/dev/null
while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
s1=$(date +%s.%N)
python3 - "$out" "$t0" "$ready" "$s0" "$s1" <<'EOF' | tee "$out/summary.txt"
import json, sys
out, t0, ready, s0, s1 = sys.argv[1], *map(float, sys.argv[2:])
print(f"time to /health ok: {ready - t0:.1f} s; exit after SIGTERM: {s1 - s0:.2f} s")
for line in open(f"{out}/events.jsonl"):
    t, _, ev = line.partition(" ")
    try:
        e = json.loads(ev)
    except ValueError:
        continue
    if e.get("event") == "progress" and e["done"] not in (0, e["total"]):
        continue
    print(f"  +{float(t) - t0:6.2f} s  {json.dumps(e)[:150]}")
acts, last = [], None
for line in open(f"{out}/stats.jsonl"):
    t, _, js = line.partition(" ")
    try:
        s = json.loads(js)
    except ValueError:
        print("  unparsable stats:", js[:200]); continue
    c = s.get("current") or {}
    h = s.get("hcs") or {}
    v = s.get("vram") or {}
    print(f"  t={t:>6} {s.get('activity'):10} prefilled {c.get('prefilled_tokens')}/{c.get('prompt_tokens')} "
          f"gen {c.get('generated_tokens')} ttft {c.get('ttft_ms')} pf {c.get('prefill_tok_s', 0):.0f} "
          f"dec {c.get('decode_tok_s', 0):.1f} tok/s | hit {h.get('hit_rate', 0):.3f} "
          f"cold {h.get('cold_bytes_per_token', 0) / 1e6:.1f} MB/tok copy {h.get('copy_ms_per_token', 0):.3f} ms/tok "
          f"| vram free {v.get('free_bytes', 0) / 2**30:.2f} GiB limit {v.get('limit_bytes')} margin {v.get('margin_bytes')} "
          f"| pinned {s.get('pinned_host_bytes')}")
    acts.append(s.get("activity")); last = s
print("activities seen:", sorted(set(acts)))
if last:
    print("request log:", json.dumps(last.get("recent_requests"))[:600])
EOF
