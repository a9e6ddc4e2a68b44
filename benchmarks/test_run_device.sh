#!/usr/bin/env bash
# CPU test of benchmarks/run_device.sh's exit status: runs it in a temporary
# copy of the repository layout with stand-in binaries in dist/gpu/ (test
# binaries that pass or fail, a krasis-runtime whose subcommands fail on
# request) and a stub nvidia-smi on PATH, and checks that
# - any failing phase, command inside a phase (behind `| tee` / filters) or
#   test binary makes it exit non-zero with a summary naming each failure,
#   while later phases still run and results.tgz is written;
# - an unknown phase is a failure;
# - a run where everything passes exits 0.
# Usage: benchmarks/test_run_device.sh   (from anywhere; needs bash, tar, sed)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

repo="$scratch/repo"; bin="$scratch/bin"
mkdir -p "$repo/benchmarks" "$repo/dist/gpu" "$bin"
cp "$here/run_device.sh" "$repo/benchmarks/"

stub() { # path exit-status text
  printf '#!/usr/bin/env bash\necho "%s"\nexit %s\n' "$3" "$2" > "$1"
  chmod +x "$1"
}
stub "$bin/nvidia-smi" 0 "name, driver_version\nStub GPU, 0.0"
stub "$repo/dist/gpu/gpu-0001" 0 "test result: ok. 3 passed; 0 failed"
stub "$repo/dist/gpu/gpu_engine-0001" 0 "test result: ok. 5 passed; 0 failed"
for t in cancel fault_injection routes live; do stub "$repo/dist/gpu/$t-0001" 0 "test result: ok. 1 passed; 0 failed"; done
stub "$repo/dist/gpu/kbench" 0 "gemv 1 us"
# krasis-runtime: fails (exit 1) when its subcommand, or `bench --check`
# as "check", is listed in $STUB_FAIL; prints INFO noise the phases filter.
cat > "$repo/dist/gpu/krasis-runtime" <<'EOF'
#!/usr/bin/env bash
what="$1"; [ "$1 ${2:-}" = "bench --check" ] && what=check
echo "INFO stub krasis-runtime $*"
for f in ${STUB_FAIL:-}; do
  if [ "$f" = "$what" ]; then echo "stub: $what FAILS"; exit 1; fi
done
echo "stub: $what ok"
EOF
chmod +x "$repo/dist/gpu/krasis-runtime"

failures=0
check() { # description condition...
  local what="$1"; shift
  if "$@"; then echo "ok: $what"; else echo "NOT OK: $what"; failures=$((failures + 1)); fi
}

run() { # log phases... (sets $rc)
  local log="$1"; shift
  rm -rf "$scratch/out" "$scratch/tmp"; mkdir -p "$scratch/out" "$scratch/tmp"
  set +e
  (cd "$repo" && PATH="$bin:$PATH" KRASIS_DEVICE_TMP="$scratch/tmp" \
    bash benchmarks/run_device.sh "$scratch/out" c0ffee "$@") > "$log" 2>&1
  rc=$?
  set -e
}
has() { grep -qF -- "$2" "$1"; }
lacks() { ! grep -qF -- "$2" "$1"; }
summary() { sed -n '/^=== FAILED: /,$p' "$1"; }

# 1. Everything passes: exit 0.
run "$scratch/pass.log" kernels tests kbench check-tiny bench-a3b-24l
check "a passing run exits 0 (rc $rc)" [ "$rc" -eq 0 ]
check "a passing run says so" has "$scratch/pass.log" "=== every phase passed"
check "a passing run writes results.tgz" [ -s "$scratch/out/results.tgz" ]

# 2. A failing kernel test binary, `bench --check` failing behind
#    `| sed | tee`, a failing synth inside a phase, an unknown phase, and a
#    failing nvidia-smi; a passing phase after them still runs.
stub "$repo/dist/gpu/gpu-0002" 101 "test result: FAILED. 2 passed; 1 failed"
stub "$bin/nvidia-smi" 9 "NVIDIA-SMI has failed"
STUB_FAIL="check synth" run "$scratch/fail.log" kernels check-tiny bench-a3b-24l no-such-phase tests
summary "$scratch/fail.log" > "$scratch/summary.txt"
check "a failing run exits non-zero (rc $rc)" [ "$rc" -ne 0 ]
check "summary names the failing test binary" has "$scratch/summary.txt" "kernels: test binary dist/gpu/gpu-0002"
check "summary does not name the passing test binary" lacks "$scratch/summary.txt" "gpu-0001"
check "summary names bench --check behind a pipeline" has "$scratch/summary.txt" "check-tiny: bench --check"
check "summary names the failing synth inside a phase" has "$scratch/summary.txt" "bench-a3b-24l: synth a3b-24l"
check "summary names the unknown phase" has "$scratch/summary.txt" "no-such-phase: unknown phase"
check "summary names nvidia-smi" has "$scratch/summary.txt" "setup: nvidia-smi"
check "summary does not name the passing phase" lacks "$scratch/summary.txt" "tests:"
check "the phase after the failures still ran" has "$scratch/fail.log" "=== tests ok"
check "results.tgz is written with the failures" \
  bash -c "tar xzf '$scratch/out/results.tgz' -O ./failures.txt | grep -qF 'check-tiny: bench --check'"

# 3. A phase whose only failure is its test binaries, alone.
stub "$bin/nvidia-smi" 0 "Stub GPU"
rm "$repo/dist/gpu/gpu_engine-0001"
stub "$repo/dist/gpu/gpu_engine-0002" 101 "test result: FAILED. 4 passed; 1 failed"
run "$scratch/tests.log" tests
check "a failing gpu_engine binary fails the run (rc $rc)" [ "$rc" -ne 0 ]
check "and is named" has "$scratch/tests.log" "tests: test binary dist/gpu/gpu_engine-0002"

# 4. No test binaries at all is a failure, not a pass.
rm "$repo/dist/gpu"/gpu_engine-*
run "$scratch/none.log" tests
check "missing test binaries fail the run (rc $rc)" [ "$rc" -ne 0 ]
check "and are named" has "$scratch/none.log" "tests: no test binaries dist/gpu/gpu_engine-*"

if [ "$failures" -ne 0 ]; then
  echo "test_run_device.sh: $failures check(s) failed; logs:"
  for l in "$scratch"/*.log; do echo "--- $l"; cat "$l"; done
  exit 1
fi
echo "test_run_device.sh: all checks passed"
