#!/usr/bin/env bash
# Decode attention at long context across builds, on the device:
#   bash tools/device/decode_attn.sh PACK...
# Each PACK names dist/pack/PACK.tar.xz (e.g. `old-2934ced`, `new-abc1234`): a build's stripped
# krasis-runtime and, for a build with kernel changes, the kernels' `gpu` test binary. Carry
# dist/pack and .cache/vocab.
# 1. each build's attention kernels against their CPU references (`gpu` tests, filter
#    `attention`: decode at every split count, rows in their own KV, prefill);
# 2. `bench` of a3b-24l all resident, decode over an 8,192-token context and the default
#    32-token one, each build in turn, min/median/max of 3 after a warm-up;
# 3. `ncu` of one decode step at the 8K context with the last build (tools/device/ncu_decode.sh).
# Results: $OUT/decode-attn.txt (the summary) and the logs and JSON beside it.
set -u
S=$OUT/decode-attn.txt; T0=$SECONDS
export KRASIS_LOG=warn
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$S" 2>&1
M=/tmp/ncu-a3b-24l; V=$PWD/.cache/vocab/qwen.tiktoken
for p in "$@"; do
  rm -rf /tmp/$p; mkdir -p /tmp/$p && tar xJf "dist/pack/$p.tar.xz" -C /tmp/$p
  g=$(ls /tmp/$p/b/gpu-* 2>/dev/null | head -1)
  if [ -n "$g" ]; then
    timeout 150 "$g" --test-threads 1 attention > "$OUT/gpu-attention-$p.log" 2>&1
    echo "$p: gpu attention tests rc=$? $(grep '^test result' "$OUT/gpu-attention-$p.log") (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "panicked|FAILED" -A3 "$OUT/gpu-attention-$p.log" | head -20 >> "$S"
  fi
done
[ -d $M ] || { /tmp/$1/b/krasis-runtime synth --preset a3b-24l --out $M --vocab "$V" \
  --experts-in-cache-only && /tmp/$1/b/krasis-runtime build-cache --model $M \
  --cache-dir /tmp/ncu-kc; } > "$OUT/synth.log" 2>&1
for ctx in 8192 32; do
  for p in "$@"; do
    timeout 150 /tmp/$p/b/krasis-runtime bench --model $M --cache-dir /tmp/ncu-kc --commit "${p#*-}" \
      --prompt-tokens 512 --decode-tokens 64 --decode-prompt-tokens $ctx --hcs-prefetch 0 \
      --json "$OUT/bench-$p-ctx$ctx.json" > "$OUT/bench-$p-ctx$ctx.log" 2>&1
    echo "bench $p decode context $ctx rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "^decode +64 tokens \(graphs on|decode step parts" "$OUT/bench-$p-ctx$ctx.log" >> "$S"
  done
done
last=${!#}; cp "dist/pack/$last.tar.xz" dist/pack/bins.tar.xz
TAG=ctx8k-$last bash tools/device/ncu_decode.sh a3b-24l --decode-prompt-tokens 8192 | head -8 >> "$S"
cat "$S"
