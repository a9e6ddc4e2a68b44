#!/usr/bin/env bash
# Device orchestration for session 20 (issue 15: the INT4 decode experts at M rows, which ncu
# showed issue bound; dq8's nibble extraction in one LOP3), over the xz-packed stripped binaries in
# dist/pack/bins.tar.xz (carry dist/pack, .cache/vocab, .cache/wheels): krasis-runtime,
# kbench, the kernel test binary gpu-* and the engine test binaries (batching-*, gpu_engine-*,
# cancel-*, live-*, prefix_cache-*, gpt_oss-*, glm4_moe-*, fault_injection-*).
#   bash tools/device/session20.sh kernels COMMIT
#       `kbench --rows` (the INT4 experts at 1/2/4/8 rows, a3b and GLM-Air shapes; the decode
#       GEMVs), `kbench --grouped` (the prefill grouped INT4 GEMMs, which share dq8), the kernel
#       tests of the INT4 kernels, the GEMVs, the routers, decode attention and row invariance
#       (KFILTER; by default int4::, int4_grouped::, rows::, fp16::, gemv::, moe::,
#       attention_decode, attention_ring, mxfp4::, rope, expert_tail, sampling::: every kernel the
#       decode step's programmatic dependent launches touch, and the batched sampler),
#       then `bench --decode-rows 1,2,4,8` of a3b-24l (LIMITS="none 6GiB": all resident, 6 GiB).
#   KBENCH=0 ... skips the kbench runs; TESTS_K=0 the kernel tests. Where the pack holds
#   krasis-runtime-a / kbench-a (the binaries before the change), `bench` and `kbench` also run
#   them. Next session: branch next/dq8-lop3's binaries, with main's as the -a ones.
#   bash tools/device/session20.sh ncu COMMIT
#       ncu (launch, occupancy, warp-state and instruction sections, one serialized launch each)
#       of the INT4 decode experts at 4 rows (`kbench --int4-probe`) and of the qkv and o_proj
#       GEMVs at 1 and 4 rows (inside `kbench --rows`'s graphs: the first launches of each
#       entry point are the qkv / o_proj shapes); the binary before too, where packed.
#   bash tools/device/session20.sh engine COMMIT
#       the engine tests batching, gpu_engine, cancel, live; TESTS="..." names others
#       (prefix_cache gpt_oss glm4_moe fault_injection).
#   bash tools/device/session20.sh serve COMMIT
#       `serve` of a3b-24l all resident (context 32,768) with 1/2/4/8 streaming clients
#       (tools/device/batching.sh parallel), LIMITS="none 6GiB" by default.
# Results: $OUT/session20-PHASE.txt (the summary) and the logs and archives beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/session20-$P.txt
T0=$SECONDS
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
unpack_binaries
bench_rows() { # LIMIT [binary suffix, e.g. -a for the binary before]
  local lim=() tag=resident${2:-}
  [ "$1" != none ] && { lim=(--vram-limit "$1"); tag=$1${2:-}; }
  timeout 150 dist/gpu/krasis-runtime${2:-} bench --model /tmp/agent-load/a3b-24l --cache-dir /tmp/agent-load/krasis-cache \
    --commit "$C" --decode-rows 1,2,4,8 "${lim[@]}" --json "$OUT/bench-rows-$tag.json" > "$OUT/bench-rows-$tag.log" 2>&1
  echo "bench --decode-rows ($tag) rc=$? (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "^decode [0-9] rows|^decode +[0-9]+ tokens \(graphs on" "$OUT/bench-rows-$tag.log" | cut -c1-400 >> "$S"
}
case "$P" in
  kernels)
    if [ "${KBENCH:-1}" = 1 ]; then
      for kb in kbench kbench-a; do  # kbench-a: the binary before (if packed)
        [ -x dist/gpu/$kb ] || continue
        timeout 150 dist/gpu/$kb --rows > "$OUT/$kb-rows.txt" 2>&1
        echo "$kb --rows rc=$? (t=$((SECONDS-T0))s)" >> "$S"
        grep -E "H2048|H4096|Fma" "$OUT/$kb-rows.txt" | cut -c1-200 >> "$S"
      done
      for kb in kbench kbench-a; do  # --attn-decode: only binaries that have it
        [ -x dist/gpu/$kb ] && grep -q -- --attn-decode dist/gpu/$kb || continue
        timeout 60 dist/gpu/$kb --attn-decode > "$OUT/$kb-attn-decode.txt" 2>&1
        echo "$kb --attn-decode rc=$? (t=$((SECONDS-T0))s)" >> "$S"
        grep -E "attn decode" "$OUT/$kb-attn-decode.txt" | cut -c1-160 >> "$S"
      done
      for kb in kbench kbench-a; do  # kbench-a: the binary before (if packed)
        [ -x dist/gpu/$kb ] || continue
        timeout 120 dist/gpu/$kb --grouped > "$OUT/$kb-grouped.txt" 2>&1
        echo "$kb --grouped rc=$? (t=$((SECONDS-T0))s)" >> "$S"
        grep -E "mma.sync|wgmma" "$OUT/$kb-grouped.txt" | head -30 >> "$S"
      done
    fi
    # shellcheck disable=SC2086  # KFILTER: several test-name filters
    [ "${TESTS_K:-1}" = 1 ] && test_bin gpu 420 ${KFILTER:-int4:: int4_grouped:: rows:: fp16:: gemv:: moe:: attention_decode attention_ring mxfp4:: rope expert_tail sampling::}
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    echo "prep (t=$((SECONDS-T0))s)" >> "$S"
    for l in ${LIMITS:-none}; do
      bench_rows "$l"
      [ -x dist/gpu/krasis-runtime-a ] && bench_rows "$l" -a
    done
    ;;
  ncu)
    N=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    SEC="--section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section SpeedOfLight --metrics smsp__inst_executed.sum,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_lsu.sum,smsp__inst_executed_pipe_tensor.sum"
    for kb in kbench kbench-a; do
      [ -x dist/gpu/$kb ] || continue
      timeout 150 $N --clock-control none -k regex:int4_w --launch-skip 2 --launch-count 2 $SEC \
        dist/gpu/$kb --int4-probe > "$OUT/ncu-int4-$kb.txt" 2>&1
      echo "ncu int4 ($kb) rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      if grep -q -- --attn-decode dist/gpu/$kb; then  # the split and combine kernels, 1 row, 1K keys
        timeout 100 $N --clock-control none -k regex:attn_decode --launch-skip 4 --launch-count 2 $SEC \
          dist/gpu/$kb --attn-decode > "$OUT/ncu-attn-decode-$kb.txt" 2>&1
        echo "ncu attn_decode ($kb) rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      fi
      for e in gemv_rmsnorm_bf16_r2_m1 gemv_rmsnorm_bf16_r2_m4 gemv_bf16_r1_m1 gemv_bf16_r1_m4; do
        timeout 100 $N --clock-control none -k regex:"^$e\$" --launch-skip 10 --launch-count 1 $SEC \
          dist/gpu/$kb --rows > "$OUT/ncu-$e-$kb.txt" 2>&1
        echo "ncu $e ($kb) rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      done
    done
    grep -hE "^  [a-z]|Duration|DRAM Throughput|Issued Warp|Eligible Warps|inst_executed" "$OUT"/ncu-*.txt >> "$S"
    ;;
  engine)
    for t in ${TESTS:-batching:200 gpu_engine:90 cancel:80 live:80}; do
      test_bin "${t%%:*}" "${t##*:}"
    done
    ;;
  serve)
    BUDGET=100 bash tools/device/batching.sh prep "$C" > /dev/null 2>&1
    for l in ${LIMITS:-none}; do
      LIMIT=$l CLIENTS=${CLIENTS:-1,2,4,8} BUDGET=$((560 - (SECONDS - T0))) CTX=32768 \
        bash tools/device/batching.sh parallel "$C" > /dev/null 2>&1
      echo "parallel $l context 32768 (t=$((SECONDS-T0))s)" >> "$S"
      cat /tmp/btr-parallel-$l-ctx32768/summary.txt >> "$S"
    done
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
