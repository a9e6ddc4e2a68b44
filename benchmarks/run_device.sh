#!/usr/bin/env bash
# Runs the CUDA engine's GPU tests, correctness checks and benchmarks on a
# bare GPU machine, from the repository root, with binaries built elsewhere
# and copied into dist/gpu/ (krasis-runtime and the gpu_engine test binary).
# Usage: benchmarks/run_device.sh OUT_DIR COMMIT PHASE...
#   PHASE: kernels | kbench | tests | check-tiny | check-tiny-dense | bench-a3b-24l | check-a3b-24l
#          | bench-a3b | hcs-exact-a3b-24l | heatmap-a3b-24l | heatmap-a3b | hcs-bench-a3b-24l
#          | hcs-bench-a3b | hcs-32k-a3b-24l | hcs-32k-a3b | hcs-qcn-uniform | hcs-qcn-skewed
#          | generate-a3b-24l
#   The VRAM limit of heatmap-*, hcs-bench-* and hcs-32k-* is the issue's for the preset
#   (a3b-24l 6GiB, a3b 8GiB) unless HCS_LIMIT is set. dist/gpu holds krasis-runtime, the
#   gpu_engine-* and kernels' gpu-* test binaries and kbench.
# Every phase runs even when an earlier one fails; logs go to OUT_DIR/results.tgz, rewritten
# after every phase so a run cut short still returns what it finished.
set -u
final="$1"; commit="$2"; shift 2
out=/tmp/krasis-results; mkdir -p "$out"
py=python3; [ -x /opt/torch/.venv/bin/python3 ] && py=/opt/torch/.venv/bin/python3
kr="$PWD/dist/gpu/krasis-runtime"
vocab="$PWD/.cache/vocab/qwen.tiktoken"
kc=/tmp/krasis-cache
export KRASIS_LOG=${KRASIS_LOG:-info}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"

synth() { # preset dir extra...
  local p="$1" d="$2"; shift 2
  [ -d "$d" ] && return 0
  local t0=$SECONDS
  "$kr" synth --preset "$p" --out "$d" --vocab "$vocab" "$@" || return 1
  echo "synth $p: $((SECONDS - t0)) s"; t0=$SECONDS
  "$kr" build-cache --model "$d" --cache-dir "$kc" || return 1
  echo "build-cache $p: $((SECONDS - t0)) s"
}

limit() { # preset
  if [ -n "${HCS_LIMIT:-}" ]; then echo "$HCS_LIMIT"; elif [ "$1" = a3b ]; then echo 8GiB; else echo 6GiB; fi
}

for phase in "$@"; do
  echo "=== $phase $(date +%T)"
  case "$phase" in
    kernels)
      for t in dist/gpu/gpu-*; do "$t" --test-threads 1 2>&1; done | tee "$out/kernels.log" | grep -E "test result|FAILED|panicked|^test .*FAILED" ;;
    kbench)
      dist/gpu/kbench --gemv 2>&1 | tee "$out/kbench.log" ;;
    tests)
      for t in dist/gpu/gpu_engine-*; do "$t" --test-threads 1 2>&1; done | tee "$out/tests.log" | grep -E "test result|FAILED|panicked" ;;
    check-tiny|check-tiny-dense)
      # The attention kernels have no head_dim 32 (the presets' own): check
      # the presets at head_dim 64 against the committed witness fixtures
      # made from this very checkpoint (tools/witness/run_device.sh; the CPU
      # tests check the same fixtures against the reference engine).
      p="${phase#check-}"; d="/tmp/$p-hd64"
      synth "$p" "$d" --seed 1 --dtype bf16 --set head_dim=64 2>&1 | tail -3
      extra=(--prefill-chunk 1000); [ "$p" = tiny-dense ] && extra=(--long-tokens 2000 --determinism-runs 0 --prefill-chunk 700)
      "$kr" bench --check --model "$d" --cache-dir "$kc" --witness "tests/fixtures/witness/$p-hd64/int4" \
        "${extra[@]}" --json "$out/check-$p.json" 2>&1 | grep -v "^\s*$" | grep -v INFO | tee "$out/check-$p.log" ;;
    check-a3b-24l)
      "$kr" bench --check --model /tmp/a3b-24l --cache-dir "$kc" --no-reference \
        --long-tokens 2048 --determinism-runs 2 --determinism-tokens 64 2>&1 | tee "$out/check-a3b-24l.log" ;;
    bench-a3b-24l|bench-a3b)
      p="${phase#bench-}"
      synth "$p" "/tmp/$p" --experts-in-cache-only 2>&1 | tail -3
      "$kr" bench --model "/tmp/$p" --cache-dir "$kc" --commit "$commit" ${BENCH_ARGS:-} \
        --json "$out/bench-$p.json" --markdown "$out/bench.md" 2>&1 | tee "$out/bench-$p.log" ;;
    hcs-exact-a3b-24l)
      synth a3b-24l /tmp/a3b-24l --experts-in-cache-only 2>&1 | tail -3
      "$kr" bench --model /tmp/a3b-24l --cache-dir "$kc" --hcs-exactness ${HCS_EXACT_LIMITS:-6GiB,8GiB} --heatmap off \
        --long-tokens 2048 --prefill-chunk 1024 --json "$out/hcs-exact-a3b-24l.json" 2>&1 | grep -v INFO | tee "$out/hcs-exact-a3b-24l.log" ;;
    heatmap-a3b-24l|heatmap-a3b)
      p="${phase#heatmap-}"
      synth "$p" "/tmp/$p" --experts-in-cache-only 2>&1 | tail -3
      "$kr" heatmap --model "/tmp/$p" --cache-dir "$kc" --vram-limit "$(limit "$p")" 2>&1 | grep -v INFO | tee "$out/heatmap-$p.log" ;;
    hcs-bench-a3b-24l|hcs-bench-a3b)
      p="${phase#hcs-bench-}"; l="$(limit "$p")"
      synth "$p" "/tmp/$p" --experts-in-cache-only 2>&1 | tail -3
      "$kr" bench --model "/tmp/$p" --cache-dir "$kc" --commit "$commit" --vram-limit "$l" --baseline \
        --prompt-tokens 1000,8000 --decode-tokens 50,100,250 ${BENCH_ARGS:-} \
        --json "$out/hcs-bench-$p-$l.json" --markdown "$out/bench.md" 2>&1 | grep -v INFO | tee "$out/hcs-bench-$p-$l.log" ;;
    hcs-32k-a3b-24l|hcs-32k-a3b)
      # A 32K context under the limit: its KV cache alone is 3.1 GB (24
      # layers) / 6.3 GB (48 layers), so this shows what is left or the
      # refusal.
      p="${phase#hcs-32k-}"; l="$(limit "$p")"
      synth "$p" "/tmp/$p" --experts-in-cache-only 2>&1 | tail -3
      "$kr" bench --model "/tmp/$p" --cache-dir "$kc" --commit "$commit" --vram-limit "$l" \
        --prompt-tokens 32000 --decode-tokens 50 --repeats 1 ${BENCH_ARGS:-} \
        --json "$out/hcs-32k-$p-$l.json" --markdown "$out/bench.md" 2>&1 | grep -v INFO | tee "$out/hcs-32k-$p-$l.log" ;;
    hcs-qcn-uniform|hcs-qcn-skewed)
      # qcn's INT4 experts are 43 GB: only one variant fits the disk at a
      # time, so each phase removes the other's cache first.
      v="${phase#hcs-qcn-}"; skew=0; [ "$v" = skewed ] && skew=1.0
      rm -rf /tmp/qcn-* "$kc"; d="/tmp/qcn-$v"
      synth qcn "$d" --experts-in-cache-only --router-skew "$skew" 2>&1 | tail -3
      "$kr" heatmap --model "$d" --cache-dir "$kc" --vram-limit 16GiB 2>&1 | grep -v INFO | tee "$out/heatmap-qcn-$v.log"
      # The all-resident baseline does not depend on the limit: measured
      # with the first, reused by the second.
      base=(--baseline)
      for lim in 16GiB 24GiB; do
        "$kr" bench --model "$d" --cache-dir "$kc" --commit "$commit" --vram-limit "$lim" "${base[@]}" \
          ${BENCH_ARGS:-} --json "$out/hcs-bench-qcn-$v-$lim.json" --markdown "$out/bench.md" 2>&1 | grep -v INFO | tee "$out/hcs-bench-qcn-$v-$lim.log"
        base=(--baseline-from "$out/hcs-bench-qcn-$v-16GiB.json")
      done ;;
    generate-a3b-24l)
      # End to end through `generate` under the 6 GiB limit (HCS without a prior:
      # the heatmap phases show the prior).
      synth a3b-24l /tmp/a3b-24l --experts-in-cache-only 2>&1 | tail -3
      "$kr" generate --model /tmp/a3b-24l --cache-dir "$kc" --vram-limit 6GiB --heatmap off --context-length 4096 \
        --prompt "In the beginning God created the heaven and the earth." --max-tokens 64 2>&1 | grep -v INFO | tee "$out/generate-a3b-24l-6GiB.log" ;;
    *) echo "unknown phase $phase" ;;
  esac
  tar czf "$final/results.tgz" -C "$out" .
done
echo "=== done $(date +%T)"
tar czf "$final/results.tgz" -C "$out" .
