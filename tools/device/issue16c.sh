#!/usr/bin/env bash
# Device orchestration for issue 16, session 15: the decode tail taking the whole reclaimable
# tier by default, with the per-row prefill scratch past decode's rows lent to it, and the host
# CPU as a second miss server measured (`kbench --cpu-expert`). One phase per call over the
# xz-packed stripped binaries in dist/pack/bins.tar.xz (carry dist/pack, .cache/vocab,
# .cache/wheels):
#   bash tools/device/issue16c.sh a3b COMMIT
#       the a3b-24l prep, HCS exactness at 6 GiB, the 8K-sized bench at 6 GiB with the
#       all-resident baseline (greedy, decode 16 and 128), the same with the old two-token tail
#       (--hcs-tail 384, the rest a prior), then sampled at temperature 1.
#   bash tools/device/issue16c.sh rest COMMIT
#       the engine tests that run HCS (batching with its planted faults, gpt_oss, glm4_moe,
#       prefix_cache, gpu_engine), qcn uniform at 16 GiB, then kbench --cpu-expert when the
#       pack has it.
#   bash tools/device/issue16c.sh long COMMIT
#       the batching, cancel and live tests, the 32K-context runs (a3b-24l at 6 GiB: a 32,000-token
#       prompt then decode 50; qcn uniform at 16 GiB with prompts up to 32,000, as the issue's
#       128 tok/s figure), then kbench --cpu-expert when the pack has it.
#   bash tools/device/issue16c.sh final-a3b COMMIT
#       the close-out on one build: every engine test that runs HCS (batching, gpt_oss,
#       glm4_moe, prefix_cache, gpu_engine, cancel, live), HCS exactness at 6 GiB and the
#       8K-sized a3b-24l bench at 6 GiB with the all-resident baseline.
#   bash tools/device/issue16c.sh final-a3b-bench COMMIT
#       final-a3b without the engine tests, then a3b-24l sampled at temperature 1.
#   bash tools/device/issue16c.sh final-qcn COMMIT
#       qcn uniform at 16 GiB at a 1K and a 32K context (decode 50 and 250), then a3b-24l
#       sampled at temperature 1.
# Results: $OUT/issue16c-PHASE.txt (the summary) and the logs beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/issue16c-$P.txt
T0=$SECONDS
# Always the pack of this call (dist/ is kept between calls on a warm machine).
rm -rf dist/gpu /tmp/bins
mkdir -p /tmp/bins dist/gpu && tar xJf dist/pack/bins.tar.xz -C /tmp/bins && cp /tmp/bins/*/* dist/gpu/
kr=$(realpath dist/gpu/krasis-runtime); A=/tmp/agent-load
test_bin() { # name timeout [filter...]
  local b n=$1 t=$2; shift 2; b=$(ls dist/gpu/$n-* 2>/dev/null | head -1)
  [ -z "$b" ] && { echo "test $n: binary missing" >> "$S"; return; }
  timeout "$t" "$b" --test-threads 1 --nocapture "$@" > "$OUT/test-$n.log" 2>&1
  echo "test $n $* rc=$? $(grep '^test result' "$OUT/test-$n.log") (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "panicked|FAILED|differ|SKIPPED|HCS with a prior:" -A2 "$OUT/test-$n.log" | head -30 >> "$S"
}
prep() { [ -f $A/a3b-24l/config.json ] || BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1; }
bench() { # tag args...
  local t=$1; shift
  timeout 240 "$kr" bench --model $A/a3b-24l --cache-dir $A/krasis-cache --commit "$C" \
    --json "$OUT/bench-$t.json" "$@" > "$OUT/bench-$t.log" 2>&1
  echo "bench $t rc=$? (t=$((SECONDS-T0))s)" >> "$S"
  grep -iE "^experts|prefill|decode|bound|HCS|free VRAM" "$OUT/bench-$t.log" | tail -40 >> "$S"
}
Q=/tmp/qcn-u
qcn_prep() { # qcn, uniform routes (router skew 0), INT4 experts in the cache only
  local V=$PWD/.cache/vocab/qwen.tiktoken
  [ -f $Q/config.json ] || { timeout 300 "$kr" synth --preset qcn --out $Q --vocab "$V" --experts-in-cache-only \
    --router-skew 0 > "$OUT/qcn-synth.log" 2>&1 && timeout 300 "$kr" build-cache --model $Q --cache-dir /tmp/qcn-kc \
    >> "$OUT/qcn-synth.log" 2>&1; echo "qcn synth rc=$? (t=$((SECONDS-T0))s)" >> "$S"; }
}
cpu_expert() {
  if [ -x dist/gpu/kbench ] && grep -qa -- "--cpu-expert" dist/gpu/kbench; then
    timeout 200 dist/gpu/kbench --cpu-expert > "$OUT/kbench-cpu-expert.txt" 2>&1
    echo "kbench --cpu-expert rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    tail -60 "$OUT/kbench-cpu-expert.txt" >> "$S"
  fi
}
a3b_close() { # HCS exactness at 6 GiB and the 8K-sized bench with the all-resident baseline
  prep
  timeout 150 "$kr" bench --model $A/a3b-24l --cache-dir $A/krasis-cache --hcs-exactness 6GiB --heatmap off \
    > "$OUT/hcs-exact.log" 2>&1
  echo "hcs-exactness 6GiB rc=$? (t=$((SECONDS-T0))s)" >> "$S"
  tail -6 "$OUT/hcs-exact.log" >> "$S"
  bench 6gib-8k --vram-limit 6GiB --baseline --prompt-tokens 512,8192 --decode-tokens 16,128 --hcs-prefetch 0
}
case "$P" in
  a3b)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    a3b_close
    bench 6gib-8k-tail384 --vram-limit 6GiB --prompt-tokens 8192 --decode-tokens 16,128 --hcs-prefetch 0 \
      --hcs-tail 384
    bench 6gib-8k-sampled --vram-limit 6GiB --prompt-tokens 8192 --decode-tokens 16,128 --hcs-prefetch 0 \
      --decode-temperature 1
    ;;
  rest)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    test_bin batching 200
    test_bin gpt_oss 150
    test_bin glm4_moe 150
    test_bin prefix_cache 120
    test_bin gpu_engine 90
    qcn_prep
    timeout 240 "$kr" bench --model $Q --cache-dir /tmp/qcn-kc --commit "$C" --json "$OUT/bench-qcn.json" \
      --vram-limit 16GiB --heatmap off --prompt-tokens 1000 --decode-tokens 50,250 --hcs-prefetch 0 \
      > "$OUT/bench-qcn.log" 2>&1
    echo "bench qcn rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -iE "^experts|^prefill|^decode|HCS:" "$OUT/bench-qcn.log" | tail -12 >> "$S"
    cpu_expert
    ;;
  long)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    test_bin batching 200
    test_bin cancel 70
    test_bin live 90
    prep
    bench 6gib-32k --vram-limit 6GiB --prompt-tokens 32000 --decode-tokens 50 --hcs-prefetch 0
    qcn_prep
    timeout 300 "$kr" bench --model $Q --cache-dir /tmp/qcn-kc --commit "$C" --json "$OUT/bench-qcn-32k.json" \
      --vram-limit 16GiB --heatmap off --prompt-tokens 1000,32000 --decode-tokens 50,250 --hcs-prefetch 0 \
      > "$OUT/bench-qcn-32k.log" 2>&1
    echo "bench qcn 32k rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -iE "^experts|^prefill|^decode|HCS:" "$OUT/bench-qcn-32k.log" | tail -14 >> "$S"
    cpu_expert
    ;;
  final-a3b)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    for t in batching:200 gpt_oss:150 glm4_moe:150 prefix_cache:120 gpu_engine:90 cancel:70 live:90; do
      test_bin "${t%%:*}" "${t##*:}"
    done
    a3b_close
    ;;
  final-a3b-bench)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    a3b_close
    bench 6gib-8k-sampled --vram-limit 6GiB --prompt-tokens 8192 --decode-tokens 16,128 --hcs-prefetch 0 \
      --decode-temperature 1
    ;;
  final-qcn)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    qcn_prep
    timeout 300 "$kr" bench --model $Q --cache-dir /tmp/qcn-kc --commit "$C" --json "$OUT/bench-qcn-32k.json" \
      --vram-limit 16GiB --heatmap off --prompt-tokens 1000,32000 --decode-tokens 50,250 --hcs-prefetch 0 \
      > "$OUT/bench-qcn-32k.log" 2>&1
    echo "bench qcn 1k+32k rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -iE "^experts|^prefill|^decode|HCS:|free VRAM" "$OUT/bench-qcn-32k.log" | tail -16 >> "$S"
    timeout 300 "$kr" bench --model $Q --cache-dir /tmp/qcn-kc --commit "$C" --json "$OUT/bench-qcn.json" \
      --vram-limit 16GiB --heatmap off --prompt-tokens 1000 --decode-tokens 50,250 --hcs-prefetch 0 \
      > "$OUT/bench-qcn.log" 2>&1
    echo "bench qcn 1k rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -iE "^experts|^prefill|^decode|HCS:|free VRAM" "$OUT/bench-qcn.log" | tail -12 >> "$S"
    prep
    bench 6gib-8k-sampled --vram-limit 6GiB --prompt-tokens 8192 --decode-tokens 16,128 --hcs-prefetch 0 \
      --decode-temperature 1
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
cat "$S"
