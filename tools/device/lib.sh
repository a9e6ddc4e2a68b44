# Helpers shared by the device scripts (tools/device/session*.sh), sourced after they set
# S (the summary file) and T0 (=$SECONDS at the start); $OUT is the device tool's output folder.
# The session scripts before session 20 carry their own copies of these.

# The xz-packed stripped binaries in dist/pack/*.tar.xz (each holding one folder) into
# dist/gpu/, and the GPU's identity into the summary.
unpack_binaries() {
  rm -rf dist/gpu /tmp/bins
  mkdir -p /tmp/bins dist/gpu && for f in dist/pack/*.tar.xz; do tar xJf "$f" -C /tmp/bins; done
  cp /tmp/bins/*/* dist/gpu/
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
}

# Runs the packed test binary dist/gpu/NAME-* (one test thread) with the given filters, its log
# in $OUT/test-NAME.log; the summary gets its result line and any failure, panic or skip.
test_bin() { # name timeout [filter...]
  local b n=$1 t=$2; shift 2; b=$(ls dist/gpu/$n-* 2>/dev/null | head -1)
  [ -z "$b" ] && { echo "test $n: binary missing" >> "$S"; return; }
  timeout "$t" "$b" --test-threads 1 --nocapture "$@" > "$OUT/test-$n.log" 2>&1
  echo "test $n rc=$? $(grep '^test result' "$OUT/test-$n.log" | tail -1) (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "panicked|FAILED|SKIPPED" -A2 "$OUT/test-$n.log" | head -20 >> "$S"
}
