#!/usr/bin/env bash
# Device orchestration for issue 16, session 14: where a constrained decode step's time goes
# beside the all-resident one (the device tail's lookup and fetch per MoE layer), and the
# levers that cut it. One phase per call over the xz-packed stripped binaries in
# dist/pack/bins.tar.xz (carry dist/pack, .cache/vocab, .cache/wheels):
#   bash tools/device/issue16b.sh profile COMMIT
#       `kbench --tail` (lookup, fetch and the GEMVs of one MoE layer, 0-2 cold experts), the
#       a3b-24l prep, HCS exactness at 6 GiB, the 8K-sized bench at 6 GiB (greedy, and decode
#       128 under nsys when the machine has it), then batching.
#   bash tools/device/issue16b.sh overlap COMMIT
#       the tail kernels (shared-memory lookup, fetch and w13 as programmatic dependents) against
#       their CPU reference, kbench --tail, exactness, the 8K bench greedy and sampled, then batching,
#       gpt_oss and glm4_moe.
#   bash tools/device/issue16b.sh verify COMMIT
#       the same kernels checks, the 8K bench with --baseline, sampled, a tail of the whole
#       reclaimable tier, the engine tests under HCS, then qcn uniform at 16 GiB.
# Results: $OUT/issue16b-PHASE.txt (the summary) and the logs beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/issue16b-$P.txt
T0=$SECONDS
if [ ! -x dist/gpu/krasis-runtime ]; then
  rm -rf dist/gpu /tmp/bins
  mkdir -p /tmp/bins dist/gpu && tar xJf dist/pack/bins.tar.xz -C /tmp/bins && cp /tmp/bins/*/* dist/gpu/
fi
kr=$(realpath dist/gpu/krasis-runtime); A=/tmp/agent-load
test_bin() { # name timeout [filter...]
  local b n=$1 t=$2; shift 2; b=$(ls dist/gpu/$n-* 2>/dev/null | head -1)
  [ -z "$b" ] && { echo "test $n: binary missing" >> "$S"; return; }
  timeout "$t" "$b" --test-threads 1 --nocapture "$@" > "$OUT/test-$n.log" 2>&1
  echo "test $n $* rc=$? $(grep '^test result' "$OUT/test-$n.log") (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "panicked|FAILED|differ|SKIPPED" -A2 "$OUT/test-$n.log" | head -30 >> "$S"
}
prep() { [ -f $A/a3b-24l/config.json ] || BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1; }
exact() {
  timeout 150 "$kr" bench --model $A/a3b-24l --cache-dir $A/krasis-cache --hcs-exactness 6GiB --heatmap off \
    > "$OUT/hcs-exact.log" 2>&1
  echo "hcs-exactness 6GiB rc=$? (t=$((SECONDS-T0))s)" >> "$S"
  tail -6 "$OUT/hcs-exact.log" >> "$S"
}
bench() { # tag args...
  local t=$1; shift
  timeout 240 "$kr" bench --model $A/a3b-24l --cache-dir $A/krasis-cache --commit "$C" \
    --json "$OUT/bench-$t.json" "$@" > "$OUT/bench-$t.log" 2>&1
  echo "bench $t rc=$? (t=$((SECONDS-T0))s)" >> "$S"
  grep -iE "prefill|decode|bound|HCS|experts" "$OUT/bench-$t.log" | tail -40 >> "$S"
}
kb() { # tag args...
  local t=$1; shift
  timeout 150 dist/gpu/kbench "$@" > "$OUT/kbench-$t.txt" 2>&1
  echo "kbench $* rc=$? (t=$((SECONDS-T0))s)" >> "$S"
  sed -n '/^====/,$p' "$OUT/kbench-$t.txt" >> "$S"; tail -3 "$OUT/kbench-$t.txt" | grep -i error >> "$S"
}
case "$P" in
  profile)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
    echo "nsys: ${NSYS:-none}" >> "$S"
    kb tail --tail
    prep
    exact
    bench 6gib-8k --vram-limit 6GiB --prompt-tokens 512,8192 --decode-tokens 16,128 --hcs-prefetch 0
    if [ -n "$NSYS" ]; then
      timeout 200 "$NSYS" profile --cuda-graph-trace=node -t cuda -o "$OUT/decode" -f true "$kr" bench \
        --model $A/a3b-24l --cache-dir $A/krasis-cache --vram-limit 6GiB --prompt-tokens 8192 \
        --decode-tokens 128 --hcs-prefetch 0 > "$OUT/nsys.log" 2>&1
      echo "nsys rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      timeout 120 "$NSYS" stats -r cuda_gpu_kern_sum -f csv -o "$OUT/kern" "$OUT/decode.nsys-rep" >> "$OUT/nsys.log" 2>&1
      head -40 "$OUT"/kern*.csv | cut -c1-220 >> "$S"
      rm -f "$OUT/decode.nsys-rep" "$OUT"/decode.sqlite
    fi
    test_bin batching 200
    ;;
  overlap)
    # The lookup's loads at once, the fetch and w13 as programmatic dependents (w13's resident and
    # tail-hit experts computed beside the misses' copy): the kernels against their CPU reference,
    # kbench --tail (compare with profile), exactness, the 8K bench greedy and sampled, then the
    # engine tests that run HCS decode (batching with its planted faults, gpt_oss's MXFP4 GEMVs).
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    test_bin gpu 150 expert_tail
    kb tail --tail
    prep
    exact
    bench 6gib-8k --vram-limit 6GiB --prompt-tokens 512,8192 --decode-tokens 16,128 --hcs-prefetch 0
    bench 6gib-8k-sampled --vram-limit 6GiB --prompt-tokens 8192 --decode-tokens 16,128 \
      --hcs-prefetch 0 --decode-temperature 1
    test_bin batching 200
    test_bin gpt_oss 150
    test_bin glm4_moe 150
    ;;
  verify)
    # The lookup also a programmatic dependent of the router, Fault::UnmarkedFetch: the kernels
    # against their CPU reference, kbench --tail, exactness, the 8K bench with the all-resident
    # baseline (the compute side of the bound), sampled, the tail taking the whole reclaimable
    # tier (--hcs-tail 441), the engine tests that run HCS, then qcn uniform at 16 GiB.
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    test_bin gpu 150 expert_tail
    kb tail --tail
    prep
    exact
    bench 6gib-8k --vram-limit 6GiB --baseline --prompt-tokens 512,8192 --decode-tokens 16,128 --hcs-prefetch 0
    bench 6gib-8k-sampled --vram-limit 6GiB --prompt-tokens 8192 --decode-tokens 16,128 \
      --hcs-prefetch 0 --decode-temperature 1
    bench 6gib-8k-tail441 --vram-limit 6GiB --prompt-tokens 8192 --decode-tokens 128 --hcs-prefetch 0 --hcs-tail 441
    bench 6gib-8k-tail441-sampled --vram-limit 6GiB --prompt-tokens 8192 --decode-tokens 128 --hcs-prefetch 0 \
      --hcs-tail 441 --decode-temperature 1
    test_bin batching 200
    test_bin gpt_oss 150
    test_bin glm4_moe 150
    test_bin prefix_cache 120
    test_bin gpu_engine 90
    test_bin cancel 70
    test_bin live 90
    Q=/tmp/qcn-u; V=$PWD/.cache/vocab/qwen.tiktoken
    timeout 300 "$kr" synth --preset qcn --out $Q --vocab "$V" --experts-in-cache-only --router-skew 0 \
      > "$OUT/qcn-synth.log" 2>&1 && timeout 300 "$kr" build-cache --model $Q --cache-dir /tmp/qcn-kc \
      >> "$OUT/qcn-synth.log" 2>&1
    echo "qcn synth rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    timeout 240 "$kr" bench --model $Q --cache-dir /tmp/qcn-kc --commit "$C" --json "$OUT/bench-qcn.json" \
      --vram-limit 16GiB --heatmap off --prompt-tokens 1000 --decode-tokens 50,250 --hcs-prefetch 0 \
      > "$OUT/bench-qcn.log" 2>&1
    echo "bench qcn rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -iE "^experts|^prefill|^decode|HCS:" "$OUT/bench-qcn.log" | tail -12 >> "$S"
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
cat "$S"
