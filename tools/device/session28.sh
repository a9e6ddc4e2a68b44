#!/usr/bin/env bash
# Device orchestration for session 28 (issue 15), over the xz-packed stripped binaries in
# dist/pack/*.tar.xz (carry dist/pack, .cache/vocab, .cache/wheels).
#   bash tools/device/session28.sh m COMMIT
#       kbench --mxfp4 (gpt-oss's MXFP4 decode experts at 1/2/4/8 rows, w13 and w2 apart);
#       the a3b-24l prep; bench all resident at the serve shape (1,000-token prompts, 128
#       tokens, 1 and 4 rows) with the decode breakdown's experts timed on the step's own routes
#       and the prefill's parts at 512 / 1,000 / 4,000 tokens (--prefill-breakdown); the same
#       decode at 6 GiB.
#   bash tools/device/session28.sh x COMMIT
#       the MXFP4 down GEMV with its weight ring and the int4 several-tokens down GEMV grouped
#       by expert (s28.tar.xz: gpu-mx, kbench-B with 24-warp MXFP4 w2 blocks, kbench-C with 12,
#       krasis-runtime-mx) against main's (kbench, krasis-runtime): the kernel tests, kbench
#       --mxfp4 of each, then a3b-24l's and gpt-oss-20b's decode at 1 and 4 rows through bench
#       with each runtime, alternating.
#   For the next device session (dist/pack as packed at the end of session 28, COMMIT says what):
#   bash tools/device/session28.sh t COMMIT
#       kernel tests of main (`rows:: int4:: mxfp4:: fp16_mlp::`) and of branch next/w13-smem
#       (gpuw-bin: `rows::int4 rows::mxfp4 int4:: mxfp4:: fp16_mlp::`).
#   bash tools/device/session28.sh e COMMIT
#       main's engine tests `batching`, `gpt_oss`, `row_invariance`.
#   bash tools/device/session28.sh b COMMIT
#       kbench --mxfp4 of main and of the branch; a3b-24l at the serve shape, 1 and 4 rows: main
#       against the branch (krasis-runtime-w), alternating; gpt-oss-20b: main (12-warp MXFP4 w2),
#       the branch (its w13 staged too) and krasis-runtime-old (2e34b53).
#   bash tools/device/session20.sh serve COMMIT   (the serve ratio of main, all resident)
# Results: $OUT/session28-PHASE.txt (the summary) and the logs beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/session28-$P.txt
T0=$SECONDS
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
unpack_binaries
M=/tmp/agent-load/a3b-24l; K=/tmp/agent-load/krasis-cache
T=/tmp/oss-load
# kbench --mxfp4 with each suffix's binary, tagged lines into $OUT/LOG.
kbench_mx() { # log suffix...
  local log=$1 v; shift
  for v in "$@"; do
    timeout 60 "dist/gpu/kbench$v" --mxfp4 > "$OUT/kb.log" 2>&1
    echo "kbench$v rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep "^mxfp4" "$OUT/kb.log" | sed "s/^/[$v] /" >> "$OUT/$log"
  done
}
case "$P" in
  m)
    timeout 100 dist/gpu/kbench --mxfp4 > "$OUT/kbench-mxfp4.log" 2>&1
    echo "kbench --mxfp4 rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    echo "prep (t=$((SECONDS-T0))s)" >> "$S"
    timeout 150 dist/gpu/krasis-runtime bench --model $M --cache-dir $K --commit "$C" \
      --prompt-tokens 512,1000,4000 --prefill-breakdown --decode-prompt-tokens 1000 \
      --decode-tokens 128 --decode-rows 1,4 --json "$OUT/bench-resident.json" \
      > "$OUT/bench-resident.log" 2>&1
    echo "bench resident rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "^prefill|breakdown|parts|^decode [0-9] rows" "$OUT/bench-resident.log" | cut -c1-420 >> "$S"
    timeout 90 dist/gpu/krasis-runtime bench --model $M --cache-dir $K --commit "$C" \
      --prompt-tokens 1000 --decode-prompt-tokens 1000 --decode-tokens 128 --decode-rows 1,4 \
      --vram-limit 6GiB --json "$OUT/bench-6GiB.json" > "$OUT/bench-6GiB.log" 2>&1
    echo "bench 6GiB rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -E "^decode [0-9] rows|HCS: hit rate .* per step" "$OUT/bench-6GiB.log" | cut -c1-420 >> "$S"
    ;;
  x)
    g20_prep
    # Kernel tests: MXFP4 decode (reference, rows), int4 decode (reference, rows with every w2
    # block shape: the grouped several-tokens w2 against each token alone).
    test_bin gpu-mx 150 mxfp4:: mxfp4_decode_rows int4:: int4_decode_rows
    kbench_mx kbench-ab.log "" -B -C
    # a3b-24l at the serve shape, 1 and 4 rows: main's runtime against the new one, twice.
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    echo "prep (t=$((SECONDS-T0))s)" >> "$S"
    for v in -mx "" -mx ""; do
      [ $((SECONDS-T0)) -gt 200 ] && break
      bench_serve_shape a3b $M $K "$v"
    done
    # gpt-oss-20b, the same (its checkpoint and cache made in the background from the start).
    oss_bench 330 -mx "" -mx ""
    ;;
  t)
    # shellcheck disable=SC2086
    test_bin gpu 280 ${KFILTER:-rows:: int4:: mxfp4:: fp16_mlp::}
    test_bin gpuw-bin 220 rows::int4 rows::mxfp4 int4:: mxfp4:: fp16_mlp::
    ;;
  e)
    test_bin batching 260
    test_bin gpt_oss 150
    test_bin row_invariance 120
    ;;
  b)
    g20_prep
    kbench_mx kbench-w.log "" -w
    # The branch's 32-row w13 staged against in registers, in one binary (kbench --rows).
    timeout 60 dist/gpu/kbench-w --rows > "$OUT/kbench-w-rows.log" 2>&1
    echo "kbench-w --rows rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    echo "prep (t=$((SECONDS-T0))s)" >> "$S"
    for v in -w "" -w ""; do
      bench_serve_shape a3b $M $K "$v"
    done
    oss_bench 480 "" -w -old "" -w -old
    ;;
  a)
    # Session 29, one call: the branch's kernel tests (its existing entry points are main's,
    # unchanged), kbench --mxfp4 of main and the branch, the branch's 32-row w13 staged against
    # in registers, a3b-24l at the serve shape, main against the branch, alternating. The a3b
    # prep (CPU and disk) runs beside the tests, which time nothing.
    BUDGET=150 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1 &
    prep=$!
    test_bin gpuw-bin 240 rows::int4 rows::mxfp4 int4:: mxfp4:: fp16_mlp::
    wait $prep
    echo "prep (t=$((SECONDS-T0))s)" >> "$S"
    kbench_mx kbench-w.log "" -w
    timeout 60 dist/gpu/kbench-w --rows > "$OUT/kbench-w-rows.log" 2>&1
    echo "kbench-w --rows rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    for v in -w "" -w "" -w ""; do
      [ $((SECONDS-T0)) -gt 540 ] && break
      bench_serve_shape a3b $M $K "$v"
    done
    ;;
  c)
    # Session 29: main's engine tests, then gpt-oss-20b main / branch / old, alternating.
    g20_prep
    test_bin batching 200
    test_bin gpt_oss 120
    test_bin row_invariance 100
    oss_bench 520 "" -w -old "" -w -old
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
