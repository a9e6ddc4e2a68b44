#!/usr/bin/env bash
# Per-kernel times of one decode step on the device, with Nsight Compute (there is no Nsight
# Systems there). `bench` brackets one eager decode step (layers and LM head) of its decode
# breakdown with cuProfilerStart/Stop, so `ncu --profile-from-start off` times exactly that
# step's kernels, each on its own (`--clock-control none`, as METHOD.md asks). Run from the
# repository root with dist/pack/bins.tar.xz holding krasis-runtime (carry dist/pack and
# .cache/vocab):
#   [PROMPT=512] [STEPS=1] [TAG=] bash tools/device/ncu_decode.sh [PRESET [BENCH ARGS...]]
#       default a3b-24l, all experts resident; e.g. `qcn --vram-limit 16GiB --heatmap off` (a
#       limited run needs a heatmap, and the synthesized model has none); PROMPT is the
#       prefill measurement's prompt (the profiled step attends over `--decode-prompt-tokens`,
#       default 32). With `--decode-rows R` bench profiles two steps (one row, then R rows):
#       STEPS=2 summarizes each apart. TAG names the results of runs with other BENCH ARGS.
# Results: $OUT/ncu-PRESET-PROMPT.csv.xz (raw), $OUT/ncu-PRESET-PROMPT.txt (summary: time per
# kernel name).
set -u
P=${1:-a3b-24l}; shift || true
N=${PROMPT:-512}; R=ncu-$P-$N${TAG:+-$TAG}
mkdir -p dist/gpu /tmp/bins && tar xJf dist/pack/bins.tar.xz -C /tmp/bins && cp /tmp/bins/*/* dist/gpu/
kr=$(realpath dist/gpu/krasis-runtime); V=$PWD/.cache/vocab/qwen.tiktoken; M=/tmp/ncu-$P
export KRASIS_LOG=warn
[ -d $M ] || { "$kr" synth --preset "$P" --out $M --vocab "$V" --experts-in-cache-only \
  && "$kr" build-cache --model $M --cache-dir /tmp/ncu-kc; } > "$OUT/ncu-synth.log" 2>&1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 400 "$NCU" --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
  --csv "$kr" bench --model $M --cache-dir /tmp/ncu-kc --prompt-tokens "$N" --decode-tokens 16 \
  --hcs-prefetch 0 "$@" > "$OUT/$R.csv" 2> "$OUT/$R.err"
echo "ncu rc=$? ($(wc -l < "$OUT/$R.csv") lines)" > "$OUT/$R.txt"
STEPS=${STEPS:-1} python3 - "$OUT/$R.csv" >> "$OUT/$R.txt" <<'PY'
import csv, sys, collections, os
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))
        if r.get("Metric Name") == "gpu__time_duration.sum"]
unit = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9}
steps = int(os.environ["STEPS"])
# Profiled steps are contiguous in launch order; a step of more rows launches the same kernels.
size = len(rows) // steps
for s in range(steps):
    by = collections.defaultdict(lambda: [0, 0.0])
    part = rows[s * size:(s + 1) * size]
    for r in part:
        t = float(r["Metric Value"].replace(",", "")) * unit.get(r["Metric Unit"], 1.0)
        n = r["Kernel Name"].split("(")[0]
        by[n][0] += 1
        by[n][1] += t
    tot = sum(v[1] for v in by.values())
    print(f"decode step {s + 1} of {steps}: {len(part)} kernels, {tot / 1e3:.1f} us of kernel time")
    for n, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"{t / 1e3:9.1f} us {c:5d} x {t / 1e3 / c:7.2f} us  {n}")
PY
xz -9 -f "$OUT/$R.csv"
cat "$OUT/$R.txt"
