#!/usr/bin/env bash
# Device orchestration prepared in session 30 (issue 15) for the next device session, over the
# xz-packed stripped binaries in dist/pack/*.tar.xz (carry dist/pack and .cache/vocab; COMMIT
# says what each holds):
#   bash tools/device/session31.sh v COMMIT
#       main with the tensor-core LM head and the shared RMSNorm prologue (n.tar.xz): the GEMV
#       kernel tests of both forms (reference, rejects, row invariance of every GEMV), the same
#       rows test on a build whose tensor-core GEMV sums its 8-row bucket in another order
#       (f/gpu-tcfault-bin: it must FAIL), the engine tests row_invariance, gpt_oss and
#       gpu_engine, then gpt-oss-20b at 1 and 8 rows with main's runtime and the one before the
#       LM head change (krasis-runtime-x, a9b68c9), alternating.
# Results: $OUT/session31-PHASE.txt (the summary) and the logs beside it.
# dist/pack is not in git: rebuild it before the call (session 31 had no device time and a new
# machine, so session 30's packs are gone): n = `bash tools/device/pack.sh n "" row_invariance
# gpt_oss gpu_engine batching` on main; f = the same with SUFFIX -tcfault on a scratch copy whose
# kernels/cuda/gemv_tc.cu adds the four chains in another order for the 8-row bucket only (line
# `const float s0 = ...`: `MB == 8 ? (acc[0][0] + acc[2][0]) + (acc[1][0] + acc[3][0]) : ...`),
# plus krasis-runtime-x built at the commit before the LM head change.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/session31-$P.txt
T0=$SECONDS
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
unpack_binaries
T=/tmp/oss-load
case "$P" in
  v)
    g20_prep
    test_bin gpu-3ced15d790af7087 150 rows::gemv gemv::
    test_bin gpu-tcfault-bin 60 rows::gemv_tensor_core
    grep -q "test result: FAILED" "$OUT/test-gpu-tcfault-bin.log" \
      && echo "planted fault caught (expected)" >> "$S" \
      || echo "PLANTED FAULT NOT CAUGHT" >> "$S"
    test_bin row_invariance 120
    test_bin gpt_oss 100
    test_bin gpu_engine 40
    ROWS=1,8 oss_bench 540 "" -x "" -x "" -x
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
