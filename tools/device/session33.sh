#!/usr/bin/env bash
# Device orchestration written in session 32 (issue 15). Session 32 built the packs but got no
# device (three refusals), so this carries session 32's checks forward and adds branch
# next/grouped-nosync (grouped prefill without a host sync per MoE layer). Three builds, packed
# on this machine under dist/pack (carry dist/pack and .cache/vocab; add .cache/wheels for `s`):
#   main:                    bash tools/device/pack.sh m -m
#                            bash tools/device/pack_fault.sh tcfault kernels/cuda/gemv_tc.cu "$TCFAULT"
#   next/grouped-nosync:     bash tools/device/pack.sh n -n
#   next/prefill-stack       (next/grouped-tail + the nosync commit):
#                            bash tools/device/pack.sh t "" row_invariance gpu_engine batching \
#                              prefix_cache gpt_oss glm4_moe fault_injection cancel live
#                            bash tools/device/pack_fault.sh gfault kernels/cuda/int4_gemm.cu "$GFAULT"
# with the two planted faults (each a test-only build that a test must catch):
#   TCFAULT='s/const float s0 = (acc\[0\]\[0\] + acc\[1\]\[0\]) + (acc\[2\]\[0\] + acc\[3\]\[0\]);/const float s0 = MB == 8 ? (acc[0][0] + acc[2][0]) + (acc[1][0] + acc[3][0]) : (acc[0][0] + acc[1][0]) + (acc[2][0] + acc[3][0]);/'
#       the tensor-core GEMV adds its chains in another order in the 8-row bucket only:
#       rows::gemv_tensor_core_rows_are_batch_invariant must fail;
#   GFAULT='s/tot\[nt\]\[0\] += s0 \* part\[nt\]\[0\];/tot[nt][0] += NT == 2 ? __fmul_rn(s0, part[nt][0]) : s0 * part[nt][0];/'
#       the 2-column-tile form rounds one product before adding it (one ulp in some rows):
#       int4_grouped::int4_grouped_gemms_match_reference must fail at its rotation check.
# (a new checkout lacks the branches: git checkout -b next/prefill-stack main && git am
# tools/device/patches/next-prefill-stack.mbox, and -b next/grouped-nosync with
# next-grouped-nosync.mbox). The stack's binaries carry main's kernels
# and the nosync engine change, so its tests cover session 30's tensor-core LM head and shared
# GEMV prologue, the grouped-tail kernels and the sync-free grouped launches together.
#   bash tools/device/session33.sh k COMMIT    (~9 min)
#       kernel tests of the stack (rows::, gemv::, int4_grouped, mxfp4_grouped: the last two
#       now also launch a grid of grouped_tiles_bound tiles and require the same bits), both
#       planted faults, then engine tests while BUDGET (540 s) lasts: fault_injection (with
#       an_out_of_range_expert_id_fails_closed), prefix_cache, row_invariance, gpu_engine,
#       batching, cancel, live, glm4_moe, gpt_oss. `k2` runs the engine tests k did not reach.
#   bash tools/device/session33.sh b COMMIT    (~9 min)
#       kbench --grouped, main (-m) and the stack alternating (the tail's kernel time; the
#       stack's also times its kernels over the engine's bound-sized grid: what the nosync
#       change costs inside the GEMMs, against the sync it removes); then
#       a3b-24l all resident, prefill 256 / 512 / 1,000 / 4,000 / 8,192 and decode at 1 and 4
#       rows: main (-m), nosync alone (-n) and the stack ("") alternating, two rounds (each
#       bench's own median of 3 after a warm-up). -n against -m is the sync's share, "" against
#       -n the tail kernels'.
#   bash tools/device/session33.sh o COMMIT    (~6 min)
#       gpt-oss-20b at the serve shape (1,000-token prompt: MXFP4 in place, so the nosync
#       change applies; 1 and 8 rows), main and the stack alternating.
#   V=m bash tools/device/session30.sh s COMMIT  (~9 min, on the H200 if lent)
#       the 4-client ratio through `serve`, main (-m) and the stack alternating.
# Merge rules: the nosync commit if k passes and -n is no slower than -m at any prefill length;
# the tail commits if k passes (gfault caught) and "" is no slower than -n at any length.
# Results: $OUT/session33-PHASE.txt (the summary) and the logs and JSON beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/session33-$P.txt
T0=$SECONDS
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
unpack_binaries
M=/tmp/agent-load/a3b-24l; K=/tmp/agent-load/krasis-cache
ENGINE_TESTS="fault_injection prefix_cache row_invariance gpu_engine batching cancel live glm4_moe gpt_oss"
engine_tests() { # the tests of ENGINE_TESTS from the first one not yet logged, while BUDGET lasts
  for t in $ENGINE_TESTS; do
    [ -n "${SKIP:-}" ] && case " $SKIP " in *" $t "*) continue ;; esac
    left=$((${BUDGET:-540} - (SECONDS - T0)))
    [ "$left" -lt 30 ] && { echo "not run: $t (time)" >> "$S"; continue; }
    test_bin "$t" "$left"
  done
}
case "$P" in
  k)
    gpu=$(basename "$(ls dist/gpu/gpu-* | grep -v -- '-bin$' | head -1)")
    test_bin "$gpu" 240 rows:: gemv:: int4_grouped mxfp4_grouped
    test_fault tcfault rows::gemv_tensor_core
    test_fault gfault int4_grouped::int4_grouped_gemms_match_reference
    engine_tests
    ;;
  k2)  # SKIP="the tests k ran" bash tools/device/session33.sh k2 COMMIT
    engine_tests
    ;;
  b)
    BUDGET=120 bash tools/device/batching.sh prep "$C" > "$OUT/prep.out" 2>&1 &
    prep=$!
    for v in -m "" -m ""; do
      timeout 90 "dist/gpu/kbench$v" --grouped > "$OUT/kbench-grouped$v.log" 2>&1
      echo "kbench$v --grouped rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      grep -E "^a3b|^qcn|mma.sync" "$OUT/kbench-grouped$v.log" | head -40 >> "$S"
    done
    wait $prep
    echo "prep (t=$((SECONDS-T0))s)" >> "$S"
    n=0
    for v in -m -n "" -m -n ""; do
      [ $((SECONDS-T0)) -gt 500 ] && break
      n=$((n + 1))
      timeout 75 "dist/gpu/krasis-runtime$v" bench --model $M --cache-dir $K --commit "$C$v" \
        --prompt-tokens 256,512,1000,4000,8192 --decode-prompt-tokens 1000 --decode-tokens 128 \
        --decode-rows 1,4 --context-length 32768 --json "$OUT/bench-a3b$v-$n.json" > "$OUT/bench.log" 2>&1
      echo "bench a3b ($v) run $n rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      grep -E "^prefill +[0-9]+ tokens|^decode [0-9] rows" "$OUT/bench.log" | cut -c1-300 >> "$S"
    done
    ;;
  o)
    T=/tmp/oss-load
    g20_prep
    ROWS=1,8 oss_bench 480 -m "" -m "" -m ""
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
