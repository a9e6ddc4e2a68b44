#!/usr/bin/env bash
# Device orchestration for session 29 (issue 15): branch next/gemv-tc (the decode GEMVs on tensor
# cores) against main, over the xz-packed stripped binaries in dist/pack/*.tar.xz (carry
# dist/pack and .cache/vocab; COMMIT says what each holds):
#   bash tools/device/session29.sh g COMMIT
#       the branch's kernel tests (filter `gemv`: gemv::, fp16 / fp16_mlp, rows::gemv: every
#       M <= 8 bit for bit against one row), its witness fixtures (gpu_engine); kbench --rows of
#       main and the branch; a3b-24l at the serve shape (1,000-token prompts, 128 tokens, 1 and
#       4 rows) with main's runtime and the branch's, alternating; row_invariance if time is
#       left (session 29's call also ran `batching` before the prep's wait).
#   bash tools/device/session29.sh g2 COMMIT
#       the same for the branch's third form (469c15b: direct fragment loads except the LM head,
#       four accumulator chains), with the kernel tests filtered to the GEMV ones (the `gemv`
#       filter also ran slow int4 tests past the time limit); its gate: every one-row figure
#       no slower than main's.
# Results: $OUT/session29-PHASE.txt (the summary) and the logs beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/session29-$P.txt
T0=$SECONDS
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
unpack_binaries
M=/tmp/agent-load/a3b-24l; K=/tmp/agent-load/krasis-cache
# The branch's kernel tests (gpug-bin, FILTER; timeout SECS), its witness fixtures, the prep
# beside them; kbench --rows of main and the branch; a3b-24l at the serve shape, alternating;
# then the engine test AFTER if time is left.
gemv_ab() { # secs after filter...
  local secs=$1 after=$2; shift 2
  BUDGET=150 bash tools/device/batching.sh prep "$C" > "$OUT/prep.out" 2>&1 &
  local prep=$!
  test_bin gpug-bin "$secs" "$@"
  test_bin gpu_engine 60
  wait $prep
  echo "prep (t=$((SECONDS-T0))s)" >> "$S"
  for v in "" -g; do
    timeout 60 "dist/gpu/kbench$v" --rows > "$OUT/kbench-rows$v.log" 2>&1
    echo "kbench$v --rows rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -iE "qkv|o_proj|router|lm_head" "$OUT/kbench-rows$v.log" | sed "s/^/[$v] /" | head -8 >> "$S"
  done
  for v in -g "" -g "" -g ""; do
    [ $((SECONDS-T0)) -gt 450 ] && break
    bench_serve_shape a3b $M $K "$v"
  done
  [ $((SECONDS-T0)) -lt 480 ] && test_bin "$after" 90
}
case "$P" in
  g2) gemv_ab 150 batching gemv:: rows::gemv fp16::rmsnorm_f32_to_f16_and_gemv fp16_mlp::gemv_f16 ;;
  g) gemv_ab 170 row_invariance gemv ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
