#!/usr/bin/env bash
# Krasis installer for Linux: builds `krasis` and `krasis-runtime` from this
# source tree and installs them into a prefix (default ~/.local/bin).
# Safe to run again (it replaces the binaries); `--uninstall` removes them.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: installer/install.sh [options]

  --prefix DIR       install into DIR (default: ~/.local/bin)
  --target-dir DIR   cargo target directory to build in / reuse
                     (default: $CARGO_TARGET_DIR, else <repo>/target)
  --debug            build and install the debug profile (faster build, slow binaries)
  --install-rust     install Rust with rustup's official installer if cargo is missing
  --uninstall        remove krasis and krasis-runtime from the prefix
  -h, --help         this text
USAGE
}

PREFIX="${HOME}/.local/bin"
TARGET_DIR="${CARGO_TARGET_DIR:-}"
PROFILE=release
INSTALL_RUST=0
UNINSTALL=0
BINS=(krasis krasis-runtime)

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) PREFIX="${2:?--prefix needs a directory}"; shift 2 ;;
        --prefix=*) PREFIX="${1#*=}"; shift ;;
        --target-dir) TARGET_DIR="${2:?--target-dir needs a directory}"; shift 2 ;;
        --target-dir=*) TARGET_DIR="${1#*=}"; shift ;;
        --debug) PROFILE=debug; shift ;;
        --install-rust) INSTALL_RUST=1; shift ;;
        --uninstall) UNINSTALL=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    esac
done

say() { printf '==> %s\n' "$*"; }
warn() { printf 'warning: %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

if [ "$UNINSTALL" = 1 ]; then
    removed=0
    for b in "${BINS[@]}"; do
        if [ -e "$PREFIX/$b" ]; then
            rm -f "$PREFIX/$b"
            say "removed $PREFIX/$b"
            removed=1
        fi
    done
    [ "$removed" = 1 ] || say "nothing to remove in $PREFIX"
    exit 0
fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f "$REPO/Cargo.toml" ] && [ -d "$REPO/launcher" ] \
    || die "run this script from a Krasis source tree (no Cargo.toml next to installer/ in $REPO)"

# Rust toolchain.
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
    if [ "$INSTALL_RUST" = 1 ]; then
        command -v curl >/dev/null 2>&1 || die "curl is needed to install Rust; install curl or Rust (https://rustup.rs) first"
        say "installing Rust with rustup (https://rustup.rs)"
        curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal \
            || die "rustup failed; install Rust from https://rustup.rs and run this script again"
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        die "cargo not found. Install Rust from https://rustup.rs, or run this script with --install-rust"
    fi
fi
say "using $(cargo --version)"

# Build.
build_args=(build -p krasis -p krasis-runtime --manifest-path "$REPO/Cargo.toml")
[ "$PROFILE" = release ] && build_args+=(--release)
if [ -n "$TARGET_DIR" ]; then
    build_args+=(--target-dir "$TARGET_DIR")
else
    TARGET_DIR="$REPO/target"
fi
say "building ($PROFILE) in $TARGET_DIR"
cargo "${build_args[@]}" || die "the build failed (see above)"

# Install: copy next to the destination, then rename, so a running krasis
# is never half-overwritten.
mkdir -p "$PREFIX" || die "cannot create $PREFIX; choose another --prefix"
for b in "${BINS[@]}"; do
    src="$TARGET_DIR/$PROFILE/$b"
    [ -x "$src" ] || die "$src was not built"
    tmp="$PREFIX/.$b.install-$$"
    cp "$src" "$tmp" && chmod 755 "$tmp" && mv -f "$tmp" "$PREFIX/$b" \
        || { rm -f "$tmp"; die "could not install $PREFIX/$b"; }
    say "installed $PREFIX/$b"
done

# Checks that do not fail the install.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    say "NVIDIA driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1)"
else
    warn "no working NVIDIA driver found (nvidia-smi); only the CPU reference backend will run. 'krasis demo' still works."
fi
case ":$PATH:" in
    *":$PREFIX:"*) ;;
    *) warn "$PREFIX is not on your PATH; add: export PATH=\"$PREFIX:\$PATH\"" ;;
esac
say "done. Try: krasis demo"
