#!/usr/bin/env bash
# Device orchestration written in session 31 (issue 15) for the checks session 30's landed work
# still owes the GPU and for branch next/grouped-tail (the grouped INT4 prefill GEMMs run only
# the column tiles a token tile's rows need). No Rust on the device: build the packs first, on
# this machine, all under dist/pack (carry dist/pack and .cache/vocab; add .cache/wheels for `s`):
#   on main:    bash tools/device/pack.sh m -m
#               bash tools/device/pack_fault.sh tcfault kernels/cuda/gemv_tc.cu "$TCFAULT"
#   on the branch (git checkout next/grouped-tail; if a new checkout lacks it:
#   git checkout -b next/grouped-tail main && git am tools/device/patches/next-grouped-tail.mbox):
#               bash tools/device/pack.sh t "" row_invariance gpu_engine batching prefix_cache gpt_oss glm4_moe
#               bash tools/device/pack_fault.sh gfault kernels/cuda/int4_gemm.cu "$GFAULT"
# with the two planted faults (each a test-only build that a test must catch):
#   TCFAULT='s/const float s0 = (acc\[0\]\[0\] + acc\[1\]\[0\]) + (acc\[2\]\[0\] + acc\[3\]\[0\]);/const float s0 = MB == 8 ? (acc[0][0] + acc[2][0]) + (acc[1][0] + acc[3][0]) : (acc[0][0] + acc[1][0]) + (acc[2][0] + acc[3][0]);/'
#       the tensor-core GEMV adds its chains in another order in the 8-row bucket only:
#       rows::gemv_tensor_core_rows_are_batch_invariant must fail;
#   GFAULT='s/tot\[nt\]\[0\] += s0 \* part\[nt\]\[0\];/tot[nt][0] += NT == 2 ? __fmul_rn(s0, part[nt][0]) : s0 * part[nt][0];/'
#       the 2-column-tile form rounds one product before adding it (one ulp in some rows):
#       int4_grouped::int4_grouped_gemms_match_reference must fail at its rotation check.
# The branch's binaries carry main's kernels too (it changes only cuda/int4_gemm.cu), so its
# kernel and engine tests cover session 30's tensor-core LM head and shared GEMV prologue.
#   bash tools/device/session32.sh k COMMIT    (~9 min)
#       kernel tests (GEMVs, grouped INT4, rows), both faults, then the engine tests while BUDGET
#       (540 s) lasts: row_invariance, gpu_engine, prefix_cache, batching, glm4_moe, gpt_oss.
#   bash tools/device/session32.sh b COMMIT    (~9 min)
#       kbench --grouped, main (-m) and the branch alternating; a3b-24l all resident: prefill at
#       256 / 512 / 1,000 / 4,000 / 8,192 tokens and decode at the serve shape (1 and 4 rows),
#       main and the branch alternating, three runs each (each bench's own median of 3 after a
#       warm-up).
#   bash tools/device/session32.sh o COMMIT    (~6 min)
#       gpt-oss-20b at the serve shape, 1 and 8 rows, main's runtime three times (the tensor-core
#       LM head's engine figures; session 30 has the build before it on an H100: 1 row 373.1 tok/s).
#   V=m bash tools/device/session30.sh s COMMIT  (~9 min, on the H200 if lent)
#       the 4-client ratio through `serve`, main (-m) and the branch alternating.
# Results: $OUT/session32-PHASE.txt (the summary) and the logs and JSON beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/session32-$P.txt
T0=$SECONDS
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
unpack_binaries
M=/tmp/agent-load/a3b-24l; K=/tmp/agent-load/krasis-cache
fault() { # name filter: the planted fault must make the filtered tests fail
  test_bin "gpu-$1-bin" 120 "$2"
  grep -q "test result: FAILED" "$OUT/test-gpu-$1-bin.log" \
    && echo "planted fault $1 caught (expected)" >> "$S" || echo "PLANTED FAULT $1 NOT CAUGHT" >> "$S"
}
case "$P" in
  k)
    gpu=$(basename "$(ls dist/gpu/gpu-* | grep -v -- '-bin$' | head -1)")
    test_bin "$gpu" 200 rows:: gemv:: int4_grouped
    fault tcfault rows::gemv_tensor_core
    fault gfault int4_grouped::int4_grouped_gemms_match_reference
    for t in row_invariance gpu_engine prefix_cache batching glm4_moe gpt_oss; do
      left=$((${BUDGET:-540} - (SECONDS - T0)))
      [ "$left" -lt 30 ] && { echo "not run: $t (time)" >> "$S"; continue; }
      test_bin "$t" "$left"
    done
    ;;
  b)
    BUDGET=120 bash tools/device/batching.sh prep "$C" > "$OUT/prep.out" 2>&1 &
    prep=$!
    for v in -m "" -m ""; do
      timeout 60 "dist/gpu/kbench$v" --grouped > "$OUT/kbench-grouped$v.log" 2>&1
      echo "kbench$v --grouped rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      grep -E "^a3b|^glm|^qcn|tokens" "$OUT/kbench-grouped$v.log" | head -40 >> "$S"
    done
    wait $prep
    echo "prep (t=$((SECONDS-T0))s)" >> "$S"
    n=0
    for v in -m "" -m "" -m ""; do
      [ $((SECONDS-T0)) -gt 480 ] && break
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
    ROWS=1,8 oss_bench 480 -m -m -m
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
