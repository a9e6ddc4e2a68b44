#!/usr/bin/env bash
# Per-kernel times of a3b-24l's decode step on the device, with Nsight Compute (no Nsight Systems
# there): `ncu --clock-control none` times every kernel of a short `generate` (load, a short
# prompt, 3 new tokens; graph nodes are profiled one by one), and a summary groups the kernels of
# the last decode step by name. Run from the repository root with dist/pack/bins.tar.xz holding
# krasis-runtime (carry dist/pack and .cache/vocab):
#   bash tools/device/ncu_decode.sh [PRESET]      (default a3b-24l; all experts resident)
# Results: $OUT/ncu-PRESET.csv.xz (raw), $OUT/ncu-PRESET.txt (summary).
set -u
P=${1:-a3b-24l}
mkdir -p dist/gpu /tmp/bins && tar xJf dist/pack/bins.tar.xz -C /tmp/bins && cp /tmp/bins/*/* dist/gpu/
kr=$(realpath dist/gpu/krasis-runtime); V=$PWD/.cache/vocab/qwen.tiktoken; M=/tmp/ncu-$P
export KRASIS_LOG=warn
[ -d $M ] || { "$kr" synth --preset "$P" --out $M --vocab "$V" --experts-in-cache-only \
  && "$kr" build-cache --model $M --cache-dir /tmp/ncu-kc; } > "$OUT/ncu-synth.log" 2>&1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 150 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --launch-count 6000 \
  "$kr" generate --model $M --cache-dir /tmp/ncu-kc --context-length 1024 --max-tokens 3 \
  --prompt "In the beginning God created the heaven and the earth. And the earth was without form." \
  > "$OUT/ncu-$P.csv" 2> "$OUT/ncu-$P.err"
echo "ncu rc=$? ($(wc -l < "$OUT/ncu-$P.csv") lines)" > "$OUT/ncu-$P.txt"
# The last decode step: the kernels after the second-to-last sampler launch, summed by name.
python3 - "$OUT/ncu-$P.csv" >> "$OUT/ncu-$P.txt" <<'PY'
import csv, sys, collections
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))
        if r.get("Metric Name") == "gpu__time_duration.sum"]
names = [r["Kernel Name"].split("(")[0] for r in rows]
unit = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9}
ns = [float(r["Metric Value"].replace(",", "")) * unit.get(r["Metric Unit"], 1.0) for r in rows]
samp = [i for i, n in enumerate(names) if "sample" in n]
lo = samp[-2] + 1 if len(samp) >= 2 else 0
hi = samp[-1] + 1 if samp else len(names)
by = collections.defaultdict(lambda: [0, 0.0])
for n, t in zip(names[lo:hi], ns[lo:hi]):
    by[n][0] += 1; by[n][1] += t
tot = sum(v[1] for v in by.values())
print(f"last decode step: {hi - lo} kernels, {tot / 1e3:.1f} us of kernel time")
for n, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
    print(f"{t / 1e3:9.1f} us {c:5d} x {t / 1e3 / c:7.2f} us  {n}")
PY
xz -9 -f "$OUT/ncu-$P.csv"
cat "$OUT/ncu-$P.txt"
