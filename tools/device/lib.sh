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

# Runs a planted-fault build's test binary (tools/device/pack_fault.sh: dist/gpu/gpu-NAME-bin)
# with the given filter, which must FAIL: the summary says whether the fault was caught.
test_fault() { # name filter
  test_bin "gpu-$1-bin" 120 "$2"
  grep -q "test result: FAILED" "$OUT/test-gpu-$1-bin.log" \
    && echo "planted fault $1 caught (expected)" >> "$S" || echo "PLANTED FAULT $1 NOT CAUGHT" >> "$S"
}

# bench at the serve shape (1,000-token prompts, 128 tokens, 1 and 4 rows (ROWS), context 32,768)
# with dist/gpu/krasis-runtime$SUFFIX (commit label $C$SUFFIX), its decode lines into the summary.
bench_serve_shape() { # tag model cache-dir suffix
  timeout 60 "dist/gpu/krasis-runtime$4" bench --model "$2" --cache-dir "$3" --commit "$C$4" \
    --prompt-tokens 1000 --decode-prompt-tokens 1000 --decode-tokens 128 --decode-rows "${ROWS:-1,4}" \
    --context-length 32768 --json "$OUT/bench-$1$4.json" > "$OUT/bench.log" 2>&1
  echo "bench $1 ($4) rc=$? (t=$((SECONDS-T0))s)" >> "$S"
  grep -E "^decode [0-9] rows" "$OUT/bench.log" | cut -c1-400 >> "$S"
}

# gpt-oss-20b's checkpoint and MXFP4 cache in $T (set by the caller), made in the background (g20pid).
g20_prep() {
  local kr0; kr0=$(realpath dist/gpu/krasis-runtime); mkdir -p $T
  { [ -f "$T/g20/config.json" ] || timeout 200 "$kr0" synth --preset gpt-oss-20b --seed 1 \
      --out "$T/g20" --vocab .cache/vocab/o200k_base.tiktoken > "$OUT/synth.log" 2>&1
    [ -d "$T/kc" ] || timeout 200 "$kr0" build-cache --model "$T/g20" --cache-dir "$T/kc" \
      > "$OUT/cache.log" 2>&1; } &
  g20pid=$!
}

# Waits for g20_prep, then gpt-oss-20b at the serve shape with each runtime suffix in turn, while
# no more than GUARD seconds have passed since T0 (ROWS passes through to bench_serve_shape).
oss_bench() { # guard suffix...
  local guard=$1 v; shift
  wait "$g20pid"
  echo "g20 ready rc=$? (t=$((SECONDS-T0))s)" >> "$S"
  for v in "$@"; do
    [ $((SECONDS-T0)) -gt "$guard" ] && break
    bench_serve_shape g20 $T/g20 $T/kc "$v"
  done
}
