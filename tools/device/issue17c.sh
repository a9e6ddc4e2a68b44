#!/usr/bin/env bash
# Device orchestration for issue 17, session 17: the engine running the Hopper prefill kernels
# (`runtime/gpu/src/prefill_kernels.rs`) against the portable ones, over the xz-packed stripped
# binaries in dist/pack/bins.tar.xz (carry dist/pack, .cache/vocab, .cache/wheels). The pack holds
# krasis-runtime (portable prefill kernels, the commit before the choice), krasis-runtime-w (the
# engine with the choice) and the engine test binaries of the choice's build (w-gpu_engine-*,
# w-prefix_cache-*, w-batching-*).
#   bash tools/device/issue17c.sh check COMMIT
#       the engine tests of the choice's build, then `bench --check` of krasis-runtime-w (GPU vs the f32 CPU reference, chunked vs whole,
#       graphs, determinism) on tiny with head_dim 128 (the wgmma attention); HCS exactness at
#       6 GiB on a3b-24l (streamed prefill against all resident, both with the wgmma attention).
#   bash tools/device/issue17c.sh pingpong COMMIT
#       the Hopper attention with its warpgroups taking turns: the kernel tests attention::hopper::
#       (gpu-*), `kbench --prefill`, `bench --check` on tiny with head_dim 128 and a3b-24l all
#       resident at 512, 8,192 and 32,000 tokens (krasis-runtime-w only).
#   bash tools/device/issue17c.sh final COMMIT
#       one build (krasis-runtime and the engine test binaries row_invariance-*, prefix_cache-*,
#       batching-*, gpu_engine-*): the tests, `bench --check` on tiny with head_dim 128, HCS
#       exactness at 6 GiB, a3b-24l all resident at 512, 8,192 and 32,000 tokens, then at 6 GiB
#       sized for 8K (prefill 512 and 8,192 with the all-resident baseline).
#   bash tools/device/issue17c.sh parts COMMIT
#       a3b-24l all resident at 512, 8,192 and 32,000 tokens with `--prefill-breakdown` (where
#       each prefill's device time goes).
#   bash tools/device/issue17c.sh speed COMMIT
#       a3b-24l all resident, prefill 512, 8,192 and 32,000 tokens, both binaries back to back;
#       then at 6 GiB sized for 8K, prefill 512 and 8,192 with the all-resident baseline.
# Results: $OUT/issue17c-PHASE.txt (the summary) and the logs beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/issue17c-$P.txt
T0=$SECONDS
rm -rf dist/gpu /tmp/bins
mkdir -p /tmp/bins dist/gpu && tar xJf dist/pack/bins.tar.xz -C /tmp/bins && cp /tmp/bins/*/* dist/gpu/
kr=$(realpath dist/gpu/krasis-runtime); kw=$kr; A=/tmp/agent-load
[ -x dist/gpu/krasis-runtime-w ] && kw=$(realpath dist/gpu/krasis-runtime-w)
V=$PWD/.cache/vocab/qwen.tiktoken
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
prep() { [ -f $A/a3b-24l/config.json ] || BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1; }
bench() { # binary tag args...
  local b=$1 t=$2; shift 2
  timeout 200 "$b" bench --model $A/a3b-24l --cache-dir $A/krasis-cache --commit "$C" \
    --json "$OUT/bench-$t.json" "$@" > "$OUT/bench-$t.log" 2>&1
  echo "bench $t rc=$? (t=$((SECONDS-T0))s)" >> "$S"
  grep -iE "^prefill kernels|^prefill|^decode|bound|free VRAM" "$OUT/bench-$t.log" | tail -14 >> "$S"
}
test_bin() { # name timeout [filter...]
  local b n=$1 t=$2; shift 2; b=$(ls dist/gpu/$n-* 2>/dev/null | head -1)
  [ -z "$b" ] && { echo "test $n: binary missing" >> "$S"; return; }
  timeout "$t" "$b" --test-threads 1 "$@" > "$OUT/test-$n.log" 2>&1
  echo "test $n $* rc=$? $(grep '^test result' "$OUT/test-$n.log") (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "panicked|FAILED|differ|SKIPPED" -A2 "$OUT/test-$n.log" | head -20 >> "$S"
}
check_t128() { # binary: `bench --check` on tiny with head_dim 128 (the wgmma attention)
  timeout 30 "$1" synth --preset tiny --seed 1 --dtype bf16 --set head_dim=128 --out /tmp/t128 \
    --vocab "$V" > "$OUT/synth-t128.log" 2>&1 &&
    timeout 30 "$1" build-cache --model /tmp/t128 --cache-dir /tmp/t128-kc >> "$OUT/synth-t128.log" 2>&1
  timeout 150 "$1" bench --check --model /tmp/t128 --cache-dir /tmp/t128-kc --long-tokens 2048 \
    --prefill-chunk 64 --determinism-runs 2 --json "$OUT/check-t128.json" > "$OUT/check-t128.log" 2>&1
  echo "check tiny head_dim 128 rc=$? (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "^CHECK|all checks" "$OUT/check-t128.log" | cut -c1-160 >> "$S"
}
hcs_exact() { # binary: HCS at 6 GiB against all resident, a3b-24l
  prep
  timeout 150 "$1" bench --model $A/a3b-24l --cache-dir $A/krasis-cache --hcs-exactness 6GiB --heatmap off \
    > "$OUT/hcs-exact.log" 2>&1
  echo "hcs-exactness 6GiB rc=$? (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "^CHECK|all HCS" "$OUT/hcs-exact.log" | cut -c1-200 >> "$S"
}
case "$P" in
  check)
    for t in w-gpu_engine:90 w-prefix_cache:120 w-batching:200; do test_bin "${t%%:*}" "${t##*:}"; done
    check_t128 "$kw"
    hcs_exact "$kw"
    ;;
  pingpong)
    test_bin gpu 120 attention::hopper::
    timeout 120 dist/gpu/kbench --prefill > "$OUT/kbench-prefill.txt" 2>&1
    echo "kbench --prefill rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "attn prefill" "$OUT/kbench-prefill.txt" >> "$S"
    check_t128 "$kw"
    prep
    bench "$kw" res-pingpong --prompt-tokens 512,8192,32000 --decode-tokens 16
    ;;
  final)
    for t in row_invariance:200 prefix_cache:120 batching:200 gpu_engine:90; do
      test_bin "${t%%:*}" "${t##*:}"
    done
    check_t128 "$kr"
    hcs_exact "$kr"
    bench "$kr" res-final --prompt-tokens 512,8192,32000 --decode-tokens 16
    bench "$kr" 6gib-final --vram-limit 6GiB --baseline --prompt-tokens 512,8192 --decode-tokens 16 \
      --hcs-prefetch 0
    ;;
  parts)
    prep
    bench "$kr" res-parts --prompt-tokens 512,8192,32000 --decode-tokens 16 --prefill-breakdown
    grep -E "parts \(ms" "$OUT/bench-res-parts.log" >> "$S"
    ;;
  speed)
    prep
    bench "$kr" res-portable --prompt-tokens 512,8192,32000 --decode-tokens 16
    bench "$kw" res-hopper --prompt-tokens 512,8192,32000 --decode-tokens 16
    bench "$kw" 6gib-hopper --vram-limit 6GiB --baseline --prompt-tokens 512,8192 --decode-tokens 16 \
      --hcs-prefetch 0
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
cat "$S"
