#!/usr/bin/env bash
# Device orchestration for session 24 (issue 15), over the xz-packed stripped binaries in
# dist/pack/*.tar.xz (carry dist/pack, .cache/vocab, .cache/wheels): krasis-runtime, kbench and
# the kernel test binary gpu-*.
#   bash tools/device/session24.sh a COMMIT
#       the kernel tests main has not run on a GPU (`fp16_mlp::`: the `_r32_f16` w13 entry
#       points; `attention_decode` and `rope` with the wait-first dependents), the a3b-24l prep,
#       then `bench --decode-rows 1,2,4,8` at the serve shape (1,000-token prompts, 128 tokens,
#       context 32,768) at 6 GiB and all resident, whose HCS line now counts every step of the
#       run (the engine's totals) instead of the steps after the second-to-last sequence ended.
#   bash tools/device/session20.sh serve COMMIT   (the serve runs; LIMITS, CLIENTS)
# Results: $OUT/session24-PHASE.txt (the summary) and the logs beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/session24-$P.txt
T0=$SECONDS
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
unpack_binaries
case "$P" in
  a)
    # shellcheck disable=SC2086  # KFILTER: several test-name filters
    test_bin gpu "${KTIME:-200}" ${KFILTER:-fp16_mlp:: attention_decode rope}
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    echo "prep (t=$((SECONDS-T0))s)" >> "$S"
    for l in ${LIMITS:-6GiB none}; do
      lim=(); tag=resident; [ "$l" != none ] && { lim=(--vram-limit "$l"); tag=$l; }
      timeout 150 dist/gpu/krasis-runtime bench --model /tmp/agent-load/a3b-24l \
        --cache-dir /tmp/agent-load/krasis-cache --commit "$C" --prompt-tokens 1000 \
        --decode-prompt-tokens 1000 --decode-tokens 128 --decode-rows 1,2,4,8 \
        --context-length 32768 "${lim[@]}" --json "$OUT/bench-serve-shape-$tag.json" \
        > "$OUT/bench-serve-shape-$tag.log" 2>&1
      echo "bench serve shape ($tag) rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      grep -E "^experts:|^decode [0-9] rows|HCS: hit" "$OUT/bench-serve-shape-$tag.log" | cut -c1-420 >> "$S"
    done
    ;;
  b)
    # The shared-expert w13 (one block per expert for the tokens routed to it): its kernel
    # tests (row invariance with shared experts, the CPU reference, masked pairs, the f16
    # entry points), the engine's batching invariance, then bench at 1,000-token prompts
    # for it and for the binary before (krasis-runtime-a), all resident and 6 GiB.
    # shellcheck disable=SC2086
    test_bin gpu "${KTIME:-300}" ${KFILTER:-rows:: int4:: fp16_mlp::}
    grep -q "test result: ok" "$OUT/test-gpu.log" || { echo "kernel tests failed: no bench" >> "$S"; exit 0; }
    test_bin batching 120
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    echo "prep (t=$((SECONDS-T0))s)" >> "$S"
    for l in ${LIMITS:-none}; do
      for v in "" -a; do
        lim=(); tag=resident$v; [ "$l" != none ] && { lim=(--vram-limit "$l"); tag=$l$v; }
        timeout 120 dist/gpu/krasis-runtime$v bench --model /tmp/agent-load/a3b-24l \
          --cache-dir /tmp/agent-load/krasis-cache --commit "$C$v" --prompt-tokens 1000 \
          --decode-prompt-tokens 1000 --decode-tokens 128 --decode-rows 1,2,4,8 "${lim[@]}" \
          --json "$OUT/bench-1k-$tag.json" > "$OUT/bench-1k-$tag.log" 2>&1
        echo "bench 1k ($tag) rc=$? (t=$((SECONDS-T0))s)" >> "$S"
        grep -E "^decode [0-9] rows|HCS: hit" "$OUT/bench-1k-$tag.log" | cut -c1-330 >> "$S"
      done
    done
    ;;
  c)
    # The shared-expert w13 with 16-row blocks at every row count (krasis-runtime-b) beside
    # its 32-row blocks at several rows (krasis-runtime) and the binary before (-a): all
    # resident, 1,000-token prompts, 1 and 4 rows, the order rotated so no binary always
    # runs first.
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    echo "prep (t=$((SECONDS-T0))s)" >> "$S"
    for v in -b "" -a -b "" -a; do
      [ -x dist/gpu/krasis-runtime$v ] || continue
      timeout 90 dist/gpu/krasis-runtime$v bench --model /tmp/agent-load/a3b-24l \
        --cache-dir /tmp/agent-load/krasis-cache --commit "$C$v" --prompt-tokens 1000 \
        --decode-prompt-tokens 1000 --decode-tokens 128 --decode-rows 1,4 \
        > "$OUT/bench-c$v.log" 2>&1
      echo "bench ($v) rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      grep -E "^decode [0-9] rows" "$OUT/bench-c$v.log" | cut -c1-330 >> "$S"
    done
    ;;
  d)
    # bench's decode breakdown with the experts timed in the step's last MoE layer on the
    # routes the step gave it: all resident and 6 GiB, 1,000-token prompts, 1 and 4 rows.
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    echo "prep (t=$((SECONDS-T0))s)" >> "$S"
    for l in none 6GiB; do
      lim=(); tag=resident; [ "$l" != none ] && { lim=(--vram-limit "$l"); tag=$l; }
      timeout 90 dist/gpu/krasis-runtime bench --model /tmp/agent-load/a3b-24l \
        --cache-dir /tmp/agent-load/krasis-cache --commit "$C" --prompt-tokens 1000 \
        --decode-prompt-tokens 1000 --decode-tokens 128 --decode-rows 1,4 "${lim[@]}" \
        --json "$OUT/bench-d-$tag.json" > "$OUT/bench-d-$tag.log" 2>&1
      echo "bench ($tag) rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      grep -E "^decode [0-9] rows|HCS: hit rate .* per step" "$OUT/bench-d-$tag.log" | cut -c1-420 >> "$S"
    done
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
