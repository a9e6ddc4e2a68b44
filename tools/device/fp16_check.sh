#!/usr/bin/env bash
# Device run for the FP16 attention path (issue 13's last open item): the kernel GPU tests (the
# new _f16 entry points against their CPU references), the runtime GPU tests of gpt_oss, the
# engine and the planted faults, then `bench --check` of tiny-gpt-oss against its transformers
# witness (the fix: under the 1% bound at every position), the qwen `tiny` check (the BF16 path,
# unchanged), and gpt-oss-20b all resident at 1000/8000 prompt tokens (the speed impact).
#
# Run from the repository root with the release binaries in dist/gpu/: krasis-runtime and the
# test binaries gpu-*, gpt_oss-*, gpu_engine-*, fault_injection-* (`cargo test --release --locked
# -p krasis-kernels --test gpu --no-run` and `cargo test --release --locked -p krasis-gpu
# --test gpt_oss --test gpu_engine --test fault_injection --no-run`, stripped; the dev-dependency
# turns the fault-injection feature on). Usage: fp16_check.sh [COMMIT].
# Everything it writes goes to $OUT/fp16-check.tgz (and $OUT/summary.txt); each step has a
# timeout and the whole run stays under 580 s.
set -u
O=${OUT:?set OUT}
W=/tmp/fp16w
rm -rf "$W" /tmp/fp16-tgo /tmp/fp16-g20 /tmp/fp16-kc /tmp/fp16-rd /tmp/fp16-rdout
mkdir -p "$W"
D=dist/gpu; kr=$D/krasis-runtime; C=${1:-unknown}
export KRASIS_LOG=warn
T0=$SECONDS
LIMIT=575
log() { echo "$* (t=$((SECONDS-T0))s)" | tee -a "$W/summary.txt"; }
# Seconds for the next step: at most $1, and never past the run's limit.
budget() { local left=$((LIMIT-(SECONDS-T0))); [ "$left" -lt "$1" ] && echo $((left > 1 ? left : 1)) || echo "$1"; }
finish() {
  cp "$W/summary.txt" "$O/summary.txt" 2>/dev/null
  tar -czf "$O/fp16-check.tgz" -C "$W" . 2>/dev/null
}
trap finish EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$W/gpu.txt" 2>&1

# 1. Kernel GPU tests (attention prefill/decode/ring, RoPE table, norm, GEMV, bias in both formats).
b=$(ls $D/gpu-* 2>/dev/null | head -1)
timeout "$(budget 100)" "$b" --test-threads 1 > "$W/test-kernels.log" 2>&1; log "test kernels rc=$?"
grep -E "^test result|FAILED|panicked" "$W/test-kernels.log" | head -20 >> "$W/summary.txt"

# 2. Runtime GPU tests.
for t in gpt_oss gpu_engine fault_injection; do
  b=$(ls $D/$t-* 2>/dev/null | head -1)
  timeout "$(budget 70)" "$b" --test-threads 1 > "$W/test-$t.log" 2>&1; log "test $t rc=$?"
  grep -E "^test result|FAILED|panicked" "$W/test-$t.log" | head -10 >> "$W/summary.txt"
done

# 3. tiny-gpt-oss against its transformers witness (the bound the FP16 path is for).
timeout "$(budget 30)" $kr synth --preset tiny-gpt-oss --seed 1 --dtype bf16 --out /tmp/fp16-tgo \
  --vocab .cache/vocab/o200k_base.tiktoken > "$W/synth-tgo.log" 2>&1
log "synth tiny-gpt-oss rc=$?"
timeout "$(budget 100)" $kr bench --check --model /tmp/fp16-tgo --cache-dir /tmp/fp16-kc \
  --witness tests/fixtures/witness/tiny-gpt-oss/source --long-tokens 2048 --prefill-chunk 64 \
  --determinism-runs 2 --json "$W/check-gpt-oss.json" > "$W/check-gpt-oss.log" 2>&1
log "check gpt-oss rc=$?"
grep -iE "PASS|FAIL|worst|bound" "$W/check-gpt-oss.log" | head -20 >> "$W/summary.txt"

# 4. The qwen tiny check: the BF16 path, unchanged.
timeout "$(budget 70)" env KRASIS_DEVICE_TMP=/tmp/fp16-rd bash benchmarks/run_device.sh /tmp/fp16-rdout "$C" check-tiny \
  > "$W/rd.log" 2>&1
log "check-tiny rc=$?"; cp /tmp/fp16-rdout/results.tgz "$W/rd-results.tgz" 2>/dev/null
tail -5 "$W/rd.log" >> "$W/summary.txt"

# 5. gpt-oss-20b all resident: prefill 1000/8000 tokens, 100 decode tokens.
timeout "$(budget 60)" $kr synth --preset gpt-oss-20b --seed 1 --out /tmp/fp16-g20 \
  --vocab .cache/vocab/o200k_base.tiktoken > "$W/synth-g20.log" 2>&1
log "synth gpt-oss-20b rc=$?"
timeout "$(budget 60)" $kr build-cache --model /tmp/fp16-g20 --cache-dir /tmp/fp16-kc > "$W/cache-g20.log" 2>&1
log "build-cache rc=$?"
timeout "$(budget 400)" $kr bench --model /tmp/fp16-g20 --cache-dir /tmp/fp16-kc --commit "$C" \
  --prompt-tokens 1000,8000 --decode-tokens 100 --json "$W/bench-g20.json" --markdown "$W/bench-g20.md" \
  > "$W/bench-g20.log" 2>&1
log "bench all-resident rc=$?"
cat "$W/bench-g20.md" >> "$W/summary.txt" 2>/dev/null
rm -rf /tmp/fp16-g20 /tmp/fp16-tgo
