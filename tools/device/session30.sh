#!/usr/bin/env bash
# Device orchestration for session 30 (issue 15), over the xz-packed stripped binaries in
# dist/pack/*.tar.xz (carry dist/pack, .cache/vocab, .cache/wheels; COMMIT says what each holds):
#   bash tools/device/session30.sh s COMMIT
#       the 4-client ratio through `serve` (all resident, context 32,768, 1 and 4 clients of
#       ~1,000-token prompts and 128 tokens: tools/device/batching.sh parallel) with the
#       branch's runtime (dist/gpu/krasis-runtime-$V, V=g by default) and main's, alternating,
#       three runs each while time is left; the summary gets each run's table rows.
#   bash tools/device/session30.sh x COMMIT
#       branch next/mxfp4-w13-3s (x.tar.xz: krasis-runtime-x and its engine test binaries, which
#       replace main's of the same name): the engine tests batching, gpt_oss and row_invariance,
#       then gpt-oss-20b at the serve shape with main's runtime and the branch's, alternating.
#   bash tools/device/session30.sh l COMMIT
#       branch next/lm-head-tc (l.tar.xz: krasis-runtime-l, kbench-l, gpu-l-bin and its engine
#       test binaries): the kernel tests of the tensor-core LM head (reference, both forms'
#       normed bits, row invariance), the witness fixtures, kbench-l --rows (the LM head in both
#       forms), a3b-24l at 1 and 8 rows with main's runtime and the branch's, alternating, then
#       `batching` and `row_invariance` while time is left (BUDGET seconds, 170 by default).
# Results: $OUT/session30-PHASE.txt (the summary) and bt-*.tgz beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/session30-$P.txt
T0=$SECONDS
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
unpack_binaries
T=/tmp/oss-load
case "$P" in
  s)
    BUDGET=120 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    echo "prep (t=$((SECONDS-T0))s)" >> "$S"
    n=0
    for v in "-${V:-g}" "" "-${V:-g}" "" "-${V:-g}" ""; do
      [ $((SECONDS-T0)) -gt 500 ] && break
      n=$((n + 1))
      KR=dist/gpu/krasis-runtime$v LIMIT=none CLIENTS=1,4 BUDGET=$((575 - (SECONDS - T0))) \
        bash tools/device/batching.sh parallel "$C" > /dev/null 2>&1
      echo "run $n krasis-runtime$v (t=$((SECONDS-T0))s)" >> "$S"
      grep -E "^\| [0-9]+ \||^PASS|^FAIL|parallel rc" \
        "/tmp/btr-parallel-none-ctx32768-krasis-runtime$v/summary.txt" >> "$S"
      cp "$OUT/bt-parallel-none-ctx32768-krasis-runtime$v.tgz" "$OUT/bt-run$n$v.tgz" 2>/dev/null
    done
    ;;
  x)
    g20_prep
    test_bin batching 200
    test_bin gpt_oss 120
    test_bin row_invariance 100
    oss_bench 430 -x "" -x "" -x ""
    ;;
  l)
    M=/tmp/agent-load/a3b-24l; K=/tmp/agent-load/krasis-cache
    BUDGET=100 bash tools/device/batching.sh prep "$C" > "$OUT/prep.out" 2>&1 &
    prep=$!
    test_bin gpu-l-bin 70 rows::gemv_tensor_core gemv::gemv_rmsnorm_matches gemv::gemv_rejects
    test_bin gpu_engine 30
    timeout 40 dist/gpu/kbench-l --rows > "$OUT/kbench-rows-l.log" 2>&1
    echo "kbench-l --rows rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "^(qkv|o_proj|router|lm_head)" "$OUT/kbench-rows-l.log" >> "$S"
    wait $prep
    echo "prep (t=$((SECONDS-T0))s)" >> "$S"
    for v in -l "" -l ""; do
      [ $((SECONDS-T0)) -gt $((${BUDGET:-170} - 25)) ] && break
      ROWS=1,8 bench_serve_shape a3b $M $K "$v"
    done
    for t in batching row_invariance; do
      left=$((${BUDGET:-170} - (SECONDS - T0)))
      [ "$left" -lt 20 ] && break
      test_bin "$t" "$left"
    done
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
