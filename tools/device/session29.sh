#!/usr/bin/env bash
# Device orchestration for session 29 (issue 15): branch next/gemv-tc (the decode GEMVs on tensor
# cores) against main, over the xz-packed stripped binaries in dist/pack/*.tar.xz (carry
# dist/pack and .cache/vocab; COMMIT says what each holds):
#   bash tools/device/session29.sh g COMMIT
#       the branch's kernel tests (gemv::, fp16 / fp16_mlp, rows::gemv: every M <= 8 bit for bit
#       against one row), its engine tests (gpu_engine: the witness fixtures; batching,
#       row_invariance: batch invariance through the engine); kbench --gemv and --rows of main
#       and the branch; a3b-24l at the serve shape (1,000-token prompts, 128 tokens, 1 and 4
#       rows) with main's runtime and the branch's, alternating.
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
bench_rows() { # tag model cache-dir suffix
  timeout 40 "dist/gpu/krasis-runtime$4" bench --model "$2" --cache-dir "$3" --commit "$C$4" \
    --prompt-tokens 1000 --decode-prompt-tokens 1000 --decode-tokens 128 --decode-rows 1,4 \
    --context-length 32768 --json "$OUT/bench-$1$4.json" > "$OUT/bench.log" 2>&1
  echo "bench $1 ($4) rc=$? (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "^decode [0-9] rows" "$OUT/bench.log" | cut -c1-400 >> "$S"
}
case "$P" in
  g2)
    BUDGET=150 bash tools/device/batching.sh prep "$C" > "$OUT/prep.out" 2>&1 &
    prep=$!
    timeout 150 dist/gpu/gpug-bin --test-threads 1 gemv:: rows::gemv fp16::rmsnorm_f32_to_f16_and_gemv \
      fp16_mlp::gemv_f16 > "$OUT/test-gpug.log" 2>&1
    echo "test gpug rc=$? $(grep '^test result' "$OUT/test-gpug.log") (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "panicked|FAILED" "$OUT/test-gpug.log" | head -20 >> "$S"
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
      bench_rows a3b $M $K "$v"
    done
    [ $((SECONDS-T0)) -lt 480 ] && test_bin batching 90
    ;;
  g)
    BUDGET=150 bash tools/device/batching.sh prep "$C" > "$OUT/prep.out" 2>&1 &
    prep=$!
    timeout 170 dist/gpu/gpug-bin --test-threads 1 gemv > "$OUT/test-gpug.log" 2>&1
    echo "test gpug rc=$? $(grep '^test result' "$OUT/test-gpug.log") (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "panicked|FAILED|worst error" "$OUT/test-gpug.log" | sort | uniq -c | sort -rn | head -30 >> "$S"
    test_bin gpu_engine 60
    test_bin batching 90
    wait $prep
    echo "prep (t=$((SECONDS-T0))s)" >> "$S"
    for v in "" -g; do
      timeout 60 "dist/gpu/kbench$v" --rows > "$OUT/kbench-rows$v.log" 2>&1
      echo "kbench$v --rows rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      grep -iE "qkv|o_proj|router|lm_head" "$OUT/kbench-rows$v.log" | sed "s/^/[$v] /" | head -8 >> "$S"
    done
    for v in -g "" -g "" -g ""; do
      [ $((SECONDS-T0)) -gt 470 ] && break
      bench_rows a3b $M $K "$v"
    done
    [ $((SECONDS-T0)) -lt 480 ] && test_bin row_invariance 90
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
