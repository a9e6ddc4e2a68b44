# Helpers shared by the device scripts (tools/device/session*.sh), sourced after they set
# S (the summary file), T0 (=$SECONDS at the start) and C (the commit label); $OUT is the device
# tool's output folder.
# The session scripts before session 20 carry their own copies of these.

# The xz-packed stripped binaries in dist/pack/*.tar.xz (each holding one folder) into
# dist/gpu/, and the GPU's identity into the summary.
unpack_binaries() {
  rm -rf dist/gpu /tmp/bins
  mkdir -p /tmp/bins dist/gpu && for f in dist/pack/*.tar.xz; do tar xJf "$f" -C /tmp/bins; done
  cp /tmp/bins/*/* dist/gpu/
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
}

# Runs the packed test binary dist/gpu/NAME or dist/gpu/NAME-* (one test thread) with the given
# filters, its log in $OUT/test-NAME.log; the summary gets its result line and any failure, panic
# or skip.
test_bin() { # name timeout [filter...]
  local b n=$1 t=$2; shift 2; b=$(ls dist/gpu/$n dist/gpu/$n-* 2>/dev/null | head -1)
  [ -z "$b" ] && { echo "test $n: binary missing" >> "$S"; return; }
  timeout "$t" "$b" --test-threads 1 --nocapture "$@" > "$OUT/test-$n.log" 2>&1
  echo "test $n rc=$? $(grep '^test result' "$OUT/test-$n.log" | tail -1) (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "panicked|FAILED|SKIPPED" -A2 "$OUT/test-$n.log" | head -20 >> "$S"
}

# bench at the serve shape (1,000-token prompts, 128 tokens, 1 and 4 rows, context 32,768) with
# dist/gpu/krasis-runtime$SUFFIX (commit label $C$SUFFIX), its decode lines into the summary.
bench_serve_shape() { # tag model cache-dir suffix
  timeout 60 "dist/gpu/krasis-runtime$4" bench --model "$2" --cache-dir "$3" --commit "$C$4" \
    --prompt-tokens 1000 --decode-prompt-tokens 1000 --decode-tokens 128 --decode-rows 1,4 \
    --context-length 32768 --json "$OUT/bench-$1$4.json" > "$OUT/bench.log" 2>&1
  echo "bench $1 ($4) rc=$? (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "^decode [0-9] rows" "$OUT/bench.log" | cut -c1-400 >> "$S"
}
