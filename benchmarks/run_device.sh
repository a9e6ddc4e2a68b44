#!/usr/bin/env bash
# Runs the CUDA engine's GPU tests, correctness checks and benchmarks on a
# bare GPU machine, from the repository root, with binaries built elsewhere
# and copied into dist/gpu/ (krasis-runtime, the kernels' gpu-* and the engine's test binaries).
# Usage: benchmarks/run_device.sh OUT_DIR COMMIT PHASE...
#   PHASE: kernels | kbench | tests | check-tiny | check-tiny-dense | bench-a3b-24l | check-a3b-24l
#          | bench-a3b | hcs-exact-a3b-24l | heatmap-a3b-24l | heatmap-a3b | hcs-bench-a3b-24l
#          | hcs-bench-a3b | hcs-32k-a3b-24l | hcs-32k-a3b | hcs-qcn-uniform | hcs-qcn-skewed
#          | generate-a3b-24l
#   The VRAM limit of heatmap-*, hcs-bench-* and hcs-32k-* is the issue's for the preset
#   (a3b-24l 6GiB, a3b 8GiB) unless HCS_LIMIT is set. dist/gpu holds krasis-runtime, the
#   engine's gpu_engine-*, cancel-*, fault_injection-*, routes-*, live-* and the kernels' gpu-* test
#   binaries, and kbench.
#   Scratch (synthetic checkpoints, INT4 cache, logs) goes under $KRASIS_DEVICE_TMP (/tmp).
#   $KRASIS_BIN names another krasis-runtime (default dist/gpu/krasis-runtime): an earlier
#   build run in the same session, with its own KRASIS_DEVICE_TMP, is the before/after baseline.
# Every phase runs even when an earlier one fails; logs go to OUT_DIR/results.tgz, rewritten
# after every phase so a run cut short still returns what it finished.
# Exit status: 0 only if every phase, every command in it and every test binary succeeded;
# otherwise 1, after a summary naming each failure (also in failures.txt in results.tgz).
# Filters in the pipelines below are `sed`, not `grep`, so that "no line matched" is not a
# failure, and pipefail makes the status of every pipeline that of its first failing part.
set -u -o pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 OUT_DIR COMMIT PHASE..." >&2
  exit 2
fi
final="$1"; commit="$2"; shift 2
tmp="${KRASIS_DEVICE_TMP:-/tmp}"
out="$tmp/krasis-results"; mkdir -p "$out" "$final" || exit 1
py=python3; [ -x /opt/torch/.venv/bin/python3 ] && py=/opt/torch/.venv/bin/python3
kr="$(realpath "${KRASIS_BIN:-dist/gpu/krasis-runtime}")"
vocab="$PWD/.cache/vocab/qwen.tiktoken"
kc="$tmp/krasis-cache"
export KRASIS_LOG=${KRASIS_LOG:-info}

# Failures are appended to a file, not a variable: `fail` is also called
# inside pipelines (subshells), e.g. from the loops over test binaries.
failures="$out/failures.txt"; : > "$failures"
fail() { # what
  echo "FAILED: $*"
  echo "$*" >> "$failures"
}
nfailed() { wc -l < "$failures" | tr -d ' '; }
save() { tar czf "$final/results.tgz" -C "$out" . || fail "writing $final/results.tgz"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt" \
  || fail "setup: nvidia-smi"

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

run_tests() { # phase glob: runs each test binary, naming every one that fails
  local phase="$1" glob="$2" t any=0
  for t in dist/gpu/$glob; do
    [ -e "$t" ] || continue
    any=1
    echo "--- $t"
    "$t" --test-threads 1 2>&1 || fail "$phase: test binary $t"
  done
  [ "$any" = 1 ] || fail "$phase: no test binaries dist/gpu/$glob"
}

for phase in "$@"; do
  echo "=== $phase $(date +%T)"
  before=$(nfailed)
  case "$phase" in
    kernels)
      run_tests kernels 'gpu-*' | tee "$out/kernels.log" | sed -n -E '/^--- |test result|FAILED|panicked/p' \
        || fail "kernels: the log pipeline" ;;
    kbench)
      dist/gpu/kbench --gemv 2>&1 | tee "$out/kbench.log" || fail "kbench: kbench --gemv" ;;
    tests)
      # Every engine test binary of runtime/gpu/tests: the engine against the
      # CPU reference, cancellation, planted faults, route recording, live figures.
      for g in 'gpu_engine-*' 'cancel-*' 'fault_injection-*' 'routes-*' 'live-*'; do run_tests tests "$g"; done \
        | tee "$out/tests.log" | sed -n -E '/^--- |test result|FAILED|panicked/p' \
        || fail "tests: the log pipeline" ;;
    check-tiny|check-tiny-dense)
      # The attention kernels have no head_dim 32 (the presets' own): check
      # the presets at head_dim 64 against the committed witness fixtures
      # made from this very checkpoint (tools/witness/run_device.sh; the CPU
      # tests check the same fixtures against the reference engine).
      p="${phase#check-}"; d="$tmp/$p-hd64"
      synth "$p" "$d" --seed 1 --dtype bf16 --set head_dim=64 2>&1 | tail -3 || fail "$phase: synth $p"
      extra=(--prefill-chunk 1000); [ "$p" = tiny-dense ] && extra=(--long-tokens 2000 --determinism-runs 0 --prefill-chunk 700)
      "$kr" bench --check --model "$d" --cache-dir "$kc" --witness "tests/fixtures/witness/$p-hd64/int4" \
        "${extra[@]}" --json "$out/check-$p.json" 2>&1 | sed -e '/^\s*$/d' -e '/INFO/d' | tee "$out/check-$p.log" \
        || fail "$phase: bench --check" ;;
    check-a3b-24l)
      "$kr" bench --check --model "$tmp/a3b-24l" --cache-dir "$kc" --no-reference \
        --long-tokens 2048 --determinism-runs 2 --determinism-tokens 64 2>&1 | tee "$out/check-a3b-24l.log" \
        || fail "$phase: bench --check" ;;
    bench-a3b-24l|bench-a3b)
      p="${phase#bench-}"
      synth "$p" "$tmp/$p" --experts-in-cache-only 2>&1 | tail -3 || fail "$phase: synth $p"
      "$kr" bench --model "$tmp/$p" --cache-dir "$kc" --commit "$commit" ${BENCH_ARGS:-} \
        --json "$out/bench-$p.json" --markdown "$out/bench.md" 2>&1 | tee "$out/bench-$p.log" \
        || fail "$phase: bench" ;;
    hcs-exact-a3b-24l)
      synth a3b-24l "$tmp/a3b-24l" --experts-in-cache-only 2>&1 | tail -3 || fail "$phase: synth a3b-24l"
      "$kr" bench --model "$tmp/a3b-24l" --cache-dir "$kc" --hcs-exactness ${HCS_EXACT_LIMITS:-6GiB,8GiB} --heatmap off \
        --long-tokens 2048 --prefill-chunk 1024 --json "$out/hcs-exact-a3b-24l.json" 2>&1 | sed '/INFO/d' \
        | tee "$out/hcs-exact-a3b-24l.log" || fail "$phase: bench --hcs-exactness" ;;
    heatmap-a3b-24l|heatmap-a3b)
      p="${phase#heatmap-}"
      synth "$p" "$tmp/$p" --experts-in-cache-only 2>&1 | tail -3 || fail "$phase: synth $p"
      "$kr" heatmap --model "$tmp/$p" --cache-dir "$kc" --vram-limit "$(limit "$p")" 2>&1 | sed '/INFO/d' \
        | tee "$out/heatmap-$p.log" || fail "$phase: heatmap" ;;
    hcs-bench-a3b-24l|hcs-bench-a3b)
      p="${phase#hcs-bench-}"; l="$(limit "$p")"
      synth "$p" "$tmp/$p" --experts-in-cache-only 2>&1 | tail -3 || fail "$phase: synth $p"
      "$kr" bench --model "$tmp/$p" --cache-dir "$kc" --commit "$commit" --vram-limit "$l" --baseline \
        --prompt-tokens 1000,8000 --decode-tokens 50,100,250 ${BENCH_ARGS:-} \
        --json "$out/hcs-bench-$p-$l.json" --markdown "$out/bench.md" 2>&1 | sed '/INFO/d' \
        | tee "$out/hcs-bench-$p-$l.log" || fail "$phase: bench --vram-limit $l" ;;
    hcs-32k-a3b-24l|hcs-32k-a3b)
      # A 32K context under the limit: its KV cache alone is 3.1 GB (24
      # layers) / 6.3 GB (48 layers), so this shows what is left or the
      # refusal. bench needs at least 3 timed runs (+ 1 warm-up).
      p="${phase#hcs-32k-}"; l="$(limit "$p")"
      synth "$p" "$tmp/$p" --experts-in-cache-only 2>&1 | tail -3 || fail "$phase: synth $p"
      "$kr" bench --model "$tmp/$p" --cache-dir "$kc" --commit "$commit" --vram-limit "$l" \
        --prompt-tokens 32000 --decode-tokens 50 ${BENCH_ARGS:-} \
        --json "$out/hcs-32k-$p-$l.json" --markdown "$out/bench.md" 2>&1 | sed '/INFO/d' \
        | tee "$out/hcs-32k-$p-$l.log" || fail "$phase: bench --vram-limit $l" ;;
    hcs-qcn-uniform|hcs-qcn-skewed)
      # qcn's INT4 experts are 43 GB: only one variant fits the disk at a
      # time, so each phase removes the other's cache first.
      v="${phase#hcs-qcn-}"; skew=0; [ "$v" = skewed ] && skew=1.0
      rm -rf "$tmp"/qcn-* "$kc"; d="$tmp/qcn-$v"
      synth qcn "$d" --experts-in-cache-only --router-skew "$skew" 2>&1 | tail -3 || fail "$phase: synth qcn"
      "$kr" heatmap --model "$d" --cache-dir "$kc" --vram-limit 16GiB 2>&1 | sed '/INFO/d' \
        | tee "$out/heatmap-qcn-$v.log" || fail "$phase: heatmap"
      # The all-resident baseline does not depend on the limit: measured
      # with the first, reused by the second.
      base=(--baseline)
      for lim in 16GiB 24GiB; do
        "$kr" bench --model "$d" --cache-dir "$kc" --commit "$commit" --vram-limit "$lim" "${base[@]}" \
          ${BENCH_ARGS:-} --json "$out/hcs-bench-qcn-$v-$lim.json" --markdown "$out/bench.md" 2>&1 | sed '/INFO/d' \
          | tee "$out/hcs-bench-qcn-$v-$lim.log" || fail "$phase: bench --vram-limit $lim"
        base=(--baseline-from "$out/hcs-bench-qcn-$v-16GiB.json")
      done ;;
    generate-a3b-24l)
      # End to end through `generate` under the 6 GiB limit (HCS without a prior:
      # the heatmap phases show the prior).
      synth a3b-24l "$tmp/a3b-24l" --experts-in-cache-only 2>&1 | tail -3 || fail "$phase: synth a3b-24l"
      "$kr" generate --model "$tmp/a3b-24l" --cache-dir "$kc" --vram-limit 6GiB --heatmap off --context-length 4096 \
        --prompt "In the beginning God created the heaven and the earth." --max-tokens 64 2>&1 | sed '/INFO/d' \
        | tee "$out/generate-a3b-24l-6GiB.log" || fail "$phase: generate" ;;
    *) fail "$phase: unknown phase" ;;
  esac
  if [ "$(nfailed)" -gt "$before" ]; then echo "=== $phase FAILED"; else echo "=== $phase ok"; fi
  save
done
echo "=== done $(date +%T)"
save
if [ -s "$failures" ]; then
  echo "=== FAILED: $(nfailed) failure(s):"
  sed 's/^/  /' "$failures"
  exit 1
fi
echo "=== every phase passed"
