#!/usr/bin/env bash
# Device orchestration for HCS decode reading cold experts in place from mapped host memory (issue
# 16's first lever: no host round trip, the decode step one CUDA graph under HCS too; since
# session 9 the misses are promoted into an LRU tail by the GPU itself), one phase
# per call over the xz-packed stripped binaries in dist/pack/bins.tar.xz (carry dist/pack,
# .cache/vocab, .cache/wheels):
#   bash tools/device/issue16a.sh kbench COMMIT
#       `kbench --host-experts` (mapped-host read rates; GEMV reading j experts in place vs copying
#       them first; a prefill chunk's grouped GEMMs reading in place).
#   bash tools/device/issue16a.sh engine COMMIT
#       the expert_tail kernel against its CPU reference, then prep (a3b-24l, cache, heatmap), the HCS exactness check at 6 GiB (prompt
#       logits, greedy tokens and decode logits bit-identical to all resident), `bench` at 6 GiB
#       with the all-resident baseline (decode graphs on and off, prefill 512 and 8192; the
#       bound max(compute, cold bytes / H2D)), and batching (invariance under HCS).
#   bash tools/device/issue16a.sh more COMMIT
#       the other engine tests (live: HCS figures; prefix_cache, gpu_engine, cancel, glm4_moe,
#       gpt_oss, row_invariance, fault_injection) and `bench --decode-rows 1,2,4,8` at 6 GiB.
#   bash tools/device/issue16a.sh prefetch COMMIT
#       decode prefetch (session 10): the expert_tail kernel (demand and prefetch launches) against
#       its CPU reference, HCS exactness at 6 GiB with the default prefetch, `bench` at 6 GiB with
#       prefetch 8 (default), 0, 1, 2 and 4 per layer, then batching and live.
#   bash tools/device/issue16a.sh lend COMMIT
#       decode's prior in prefill's grouped scratch: HCS exactness at 6 GiB, then `bench` at 6 GiB
#       sized for an 8K prompt (no baseline: compare with the session's earlier runs).
#   bash tools/device/issue16a.sh settle COMMIT
#       the prior's reload queued without a compute wait (session 11): exactness, the 8K bench
#       with free VRAM per stage, then batching, prefix_cache, live, gpu_engine and cancel.
#   bash tools/device/issue16a.sh reload COMMIT
#       decode beside the prior's reload (session 13): the expert_tail kernel (with tail_home)
#       against its CPU reference, exactness, the 8K bench (compare with `settle`), then the
#       engine tests that reload a prior (batching, prefix_cache, live, gpu_engine, cancel).
#   bash tools/device/issue16a.sh split COMMIT
#       the same checks as reload (expert_tail, exactness, batching), the 8K bench, then the
#       decode benches with the tail/prior split of the reclaimable tier moved (bench --hcs-tail,
#       TAILS, default 64,256,384).
#   bash tools/device/issue16a.sh sampled COMMIT
#       the tail/prior splits (TAILS, default 128,256,384) decoded greedily and sampled at
#       temperature 1 (bench --decode-temperature: text that does not repeat itself).
#   bash tools/device/issue16a.sh tail COMMIT
#       the default split after session 13 (tail of two tokens' experts): exactness, the 8K bench
#       greedy and sampled, then the engine tests under HCS (batching, prefix_cache, live,
#       gpu_engine, cancel, glm4_moe, gpt_oss).
#   bash tools/device/issue16a.sh serve COMMIT
#       `agent_load.py parallel` (1/2/4/8 clients) through serve at 6 GiB, and the agent loop.
# Results: $OUT/issue16a-PHASE.txt (the summary) and the logs beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/issue16a-$P.txt
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
exact() { # HCS at 6 GiB bit-identical to all resident (prompt, greedy, decode logits, spans)
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
  grep -iE "prefill|decode|bound|HCS|experts|prefetch" "$OUT/bench-$t.log" | tail -48 >> "$S"
}
case "$P" in
  kbench)
    timeout 90 dist/gpu/kbench --host-experts > "$OUT/kbench-host.txt" 2>&1
    echo "kbench --host-experts rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    sed -n '/^====/,$p' "$OUT/kbench-host.txt" >> "$S"
    ;;
  engine)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    test_bin gpu 120 expert_tail
    prep
    exact
    bench 6gib --vram-limit 6GiB --baseline --prompt-tokens 512,8192 --decode-tokens 16,128
    test_bin batching 150
    ;;
  prefetch)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    test_bin gpu 120 expert_tail
    prep
    exact
    bench 6gib-prefetch --vram-limit 6GiB --baseline --prompt-tokens 512 --decode-tokens 16,128 --hcs-prefetch 0,1,2,4
    # Session 9's configuration (an 8K prompt: a larger prefill chunk, fewer experts on the GPU).
    bench 6gib-8k-prefetch --vram-limit 6GiB --baseline --prompt-tokens 512,8192 --decode-tokens 16,128 --hcs-prefetch 0,2
    test_bin batching 150
    [ -x "$(ls dist/gpu/live-* 2>/dev/null | head -1)" ] && test_bin live 100
    ;;
  lend)
    # Session 10: decode's prior extended into prefill's grouped scratch. Exactness first, then the
    # 8K configuration (chunk 4096: the largest grouped scratch) against this session's figures.
    prep
    exact
    bench 6gib-8k-lend --vram-limit 6GiB --prompt-tokens 512,8192 --decode-tokens 16,128 --hcs-prefetch 0
    ;;
  settle)
    # Session 11: the prior's reload off the prompt's critical path (Hcs::settle), verified:
    # exactness, the 8K configuration's bench (prefill 512 back near session 10's 5,061?), then
    # the engine tests that run HCS with the scratch prior.
    prep
    exact
    bench 6gib-8k-settle --vram-limit 6GiB --prompt-tokens 512,8192 --decode-tokens 16,128 --hcs-prefetch 0
    grep -iE "free|margin" "$OUT/bench-6gib-8k-settle.log" | tail -24 >> "$S"
    test_bin batching 150
    test_bin prefix_cache 120
    test_bin live 90
    test_bin gpu_engine 90
    test_bin cancel 70
    ;;
  reload)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    test_bin gpu 120 expert_tail
    prep
    exact
    bench 6gib-8k-reload --vram-limit 6GiB --prompt-tokens 512,8192 --decode-tokens 16,128 --hcs-prefetch 0
    test_bin batching 200
    test_bin prefix_cache 120
    test_bin live 90
    test_bin gpu_engine 90
    test_bin cancel 70
    ;;
  split)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    test_bin gpu 120 expert_tail
    prep
    exact
    bench 6gib-8k --vram-limit 6GiB --prompt-tokens 512,8192 --decode-tokens 16,128 --hcs-prefetch 0
    for t in $(echo "${TAILS:-64,256,384}" | tr , ' '); do
      bench 6gib-8k-tail$t --vram-limit 6GiB --prompt-tokens 512,8192 --decode-tokens 16,128 \
        --hcs-prefetch 0 --hcs-tail "$t"
    done
    test_bin batching 200
    ;;
  sampled)
    prep
    for t in $(echo "${TAILS:-128,256,384}" | tr , ' '); do
      bench 6gib-8k-t$t-sampled --vram-limit 6GiB --prompt-tokens 8192 --decode-tokens 16,128 \
        --hcs-prefetch 0 --hcs-tail "$t" --decode-temperature 1
      bench 6gib-8k-t$t-greedy --vram-limit 6GiB --prompt-tokens 8192 --decode-tokens 128 \
        --hcs-prefetch 0 --hcs-tail "$t"
    done
    ;;
  tail)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
    prep
    exact
    bench 6gib-8k --vram-limit 6GiB --prompt-tokens 512,8192 --decode-tokens 16,128 --hcs-prefetch 0
    bench 6gib-8k-sampled --vram-limit 6GiB --prompt-tokens 8192 --decode-tokens 16,128 \
      --hcs-prefetch 0 --decode-temperature 1
    test_bin batching 200
    test_bin prefix_cache 120
    test_bin live 90
    test_bin gpu_engine 90
    test_bin cancel 70
    test_bin glm4_moe 120
    test_bin gpt_oss 120
    ;;
  more)
    test_bin batching 150
    prep
    # The reclaimable tier's (prior, tail) split, by variant binaries when present: 128/128 (the
    # default), 64/192 and 0/256.
    for v in tail192 tail256; do
      [ -x dist/gpu/krasis-runtime-$v ] || continue
      timeout 120 dist/gpu/krasis-runtime-$v bench --model $A/a3b-24l --cache-dir $A/krasis-cache --commit "$C-$v" \
        --json "$OUT/bench-6gib-$v.json" --vram-limit 6GiB --prompt-tokens 512 --decode-tokens 16,128 \
        > "$OUT/bench-6gib-$v.log" 2>&1
      echo "bench 6gib $v rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      grep -E "^experts:|^decode|HCS: hit" "$OUT/bench-6gib-$v.log" >> "$S"
    done
    test_bin live 100
    test_bin prefix_cache 120
    test_bin gpu_engine 100
    test_bin cancel 80
    test_bin glm4_moe 120
    test_bin gpt_oss 120
    test_bin row_invariance 80
    test_bin fault_injection 100
    prep
    bench rows-6gib --vram-limit 6GiB --prompt-tokens 512 --decode-tokens 16 --decode-rows 1,2,4,8
    ;;
  verify)
    # The engines that build HCS, calibrate and then find every expert fits (graphs captured
    # during calibration must not survive into the all-resident path).
    test_bin cancel 60
    test_bin gpu_engine 60
    test_bin live 60
    test_bin glm4_moe 90
    test_bin gpt_oss 90
    ;;
  serve)
    # LIMITS (default 6GiB): comma-separated, `none` for all resident, one serve after another.
    prep
    LIMIT=${LIMITS:-6GiB} CLIENTS=1,2,4,8 BUDGET=$((${SERVE_BUDGET:-300}-(SECONDS-T0))) \
      bash tools/device/batching.sh parallel "$C" > /dev/null 2>&1
    for d in /tmp/btr-parallel-*; do
      cat "$d/summary.txt" >> "$S"
      mkdir -p "$OUT/${d##*/}"; cp -r "$d"/* "$OUT/${d##*/}/" 2>/dev/null
    done
    ;;
  *) echo "unknown phase $P" >> "$S"; exit 2 ;;
esac
cat "$S"
