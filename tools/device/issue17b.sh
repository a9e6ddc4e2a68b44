#!/usr/bin/env bash
# Device orchestration for issue 17's kernels written without a device (session 16): the Hopper
# (wgmma) prefill attention, the Hopper grouped INT4 GEMMs and the grouped MXFP4 expert GEMMs. One phase per call over the
# xz-packed stripped binaries in dist/pack/bins.tar.xz (carry dist/pack, .cache/vocab,
# .cache/wheels). The pack holds krasis-runtime, kbench and kcompile (`cargo build --release
# --locked -p krasis-kernels --example kbench --example kcompile`), the kernel test binary gpu-* (`cargo test --release --locked
# -p krasis-kernels --test gpu --no-run`) and the engine test binaries gpt_oss-*, gpu_engine-*,
# fault_injection-*, batching-* (`cargo test --release --locked -p krasis-gpu --test gpt_oss
# --test gpu_engine --test fault_injection --test batching --no-run`).
#   bash tools/device/issue17b.sh kern COMMIT
#       the kernel tests of the new kernels and their neighbours (attention::, which holds
#       attention::hopper::; mxfp4, which holds mxfp4_grouped::; int4_grouped, which holds
#       int4_grouped:: and int4_grouped_sm90::), then `kbench --prefill` (the portable and the
#       wgmma attention at 8K and 32K), `kbench --grouped` (INT4: mma.sync, wgmma, dequantize +
#       cuBLAS) and `kbench --grouped-mxfp4`. Run `kcompile --arch 90 -v` there first if a
#       wgmma kernel fails: the device's ptxas may allocate differently (registers, serialization).
#   bash tools/device/issue17b.sh engine COMMIT
#       (after `kern` passes and the revert of the MXFP4 engine change, d4c8b44, is itself
#       reverted) the engine tests that run prefill through the grouped paths (gpt_oss, gpu_engine,
#       fault_injection, batching), `bench --check` of tiny-gpt-oss against its transformers
#       witness, then gpt-oss-20b all resident: prefill 1,000 and 8,000 tokens.
# Results: $OUT/issue17b-PHASE.txt (the summary) and the logs beside it.
set -u
P=${1:?phase}; C=${2:-unknown}
S=$OUT/issue17b-$P.txt
T0=$SECONDS
rm -rf dist/gpu /tmp/bins
mkdir -p /tmp/bins dist/gpu && tar xJf dist/pack/bins.tar.xz -C /tmp/bins && cp /tmp/bins/*/* dist/gpu/
kr=$(realpath dist/gpu/krasis-runtime)
V=$PWD/.cache/vocab
test_bin() { # name timeout [filter...]
  local b n=$1 t=$2; shift 2; b=$(ls dist/gpu/$n-* 2>/dev/null | head -1)
  [ -z "$b" ] && { echo "test $n: binary missing" >> "$S"; return; }
  local log="$OUT/test-$n${1:+-${1//[^a-z0-9_]/}}.log"
  timeout "$t" "$b" --test-threads 1 "$@" > "$log" 2>&1
  echo "test $n $* rc=$? $(grep '^test result' "$log") (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "panicked|FAILED|differ|SKIPPED|refused" -A3 "$log" | head -40 >> "$S"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
case "$P" in
  kern)
    # The device's NVRTC (13.0) may allocate the wgmma kernels differently from the 13.5 they
    # were written against: registers, spills and serialized wgmma, first.
    if [ -x dist/gpu/kcompile ]; then
      for m in attention_prefill_sm90 int4_gemm_sm90 mxfp4; do
        timeout 60 dist/gpu/kcompile --arch 90 -v --module $m >> "$OUT/kcompile.txt" 2>&1
      done
      echo "kcompile rc=$? (t=$((SECONDS-T0))s)" >> "$S"
      grep -E "Used|spill|C751|arning" "$OUT/kcompile.txt" | grep -E "wgmma|mxfp4_grouped|C751|spill|arning" | head -20 >> "$S"
    fi
    # attention::ring::attention_ring_matches_reference alone takes most of 150 s.
    test_bin gpu 300 attention::
    test_bin gpu 150 mxfp4
    test_bin gpu 150 int4_grouped
    timeout 150 dist/gpu/kbench --prefill > "$OUT/kbench-prefill.txt" 2>&1
    echo "kbench --prefill rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    tail -12 "$OUT/kbench-prefill.txt" >> "$S"
    timeout 150 dist/gpu/kbench --grouped > "$OUT/kbench-grouped.txt" 2>&1
    echo "kbench --grouped rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    tail -24 "$OUT/kbench-grouped.txt" >> "$S"
    timeout 150 dist/gpu/kbench --grouped-mxfp4 > "$OUT/kbench-grouped-mxfp4.txt" 2>&1
    echo "kbench --grouped-mxfp4 rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    tail -20 "$OUT/kbench-grouped-mxfp4.txt" >> "$S"
    ;;
  engine)
    for t in gpt_oss:150 gpu_engine:90 fault_injection:120 batching:200; do
      test_bin "${t%%:*}" "${t##*:}"
    done
    timeout 30 "$kr" synth --preset tiny-gpt-oss --seed 1 --dtype bf16 --out /tmp/tgo \
      --vocab "$V/o200k_base.tiktoken" > "$OUT/synth-tgo.log" 2>&1
    echo "synth tiny-gpt-oss rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    timeout 100 "$kr" bench --check --model /tmp/tgo --cache-dir /tmp/tgo-kc \
      --witness tests/fixtures/witness/tiny-gpt-oss/source --long-tokens 2048 --prefill-chunk 64 \
      --determinism-runs 2 --json "$OUT/check-gpt-oss.json" > "$OUT/check-gpt-oss.log" 2>&1
    echo "check tiny-gpt-oss rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -iE "PASS|FAIL|worst|bound" "$OUT/check-gpt-oss.log" | head -20 >> "$S"
    timeout 60 "$kr" synth --preset gpt-oss-20b --seed 1 --out /tmp/g20 \
      --vocab "$V/o200k_base.tiktoken" > "$OUT/synth-g20.log" 2>&1 &&
      timeout 60 "$kr" build-cache --model /tmp/g20 --cache-dir /tmp/g20-kc >> "$OUT/synth-g20.log" 2>&1
    echo "synth + build-cache gpt-oss-20b rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    timeout 240 "$kr" bench --model /tmp/g20 --cache-dir /tmp/g20-kc --commit "$C" \
      --prompt-tokens 1000,8000 --decode-tokens 16 --json "$OUT/bench-g20.json" > "$OUT/bench-g20.log" 2>&1
    echo "bench gpt-oss-20b rc=$? (t=$((SECONDS-T0))s)" >> "$S"
    grep -iE "^prefill|^decode" "$OUT/bench-g20.log" | tail -8 >> "$S"
    ;;
  *) echo "unknown phase $P" >> "$S" ;;
esac
echo "done (t=$((SECONDS-T0))s)" >> "$S"
cat "$S"
