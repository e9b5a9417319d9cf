#!/usr/bin/env bash
# Installs everything the tests need, builds the binary and the wheel, then runs every test:
# Rust unit tests, then the Python end-to-end tests against the built binary, the wheel,
# fake-gcs-server, webdataset, torch, JAX and Grain, and promtool.
# Needs only the Rust toolchain and Python 3 to start with; idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_install() {
    local missing=()
    for pkg in "$@"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return
    echo "== apt-get install ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

echo "== system packages"
apt_install prometheus systemd zstd curl iproute2   # promtool checks /metrics and prometheus scrapes the pod; systemd-analyze checks deploy/systemd; zstd and pzstd write the zstd test shards; curl is the blog experiment's pipe: (test_bench_smoke) and the start-up script's; ip makes the pod's network namespaces (tests/pod)

echo "== python venv"
# torch and torch_xla first, without their dependencies (tests/requirements-torch.txt lists
# what they need, less the CUDA packages torch does not load), then the rest.
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/pip install -q --no-cache-dir --disable-pip-version-check)
"${pip[@]}" --no-deps -r tests/requirements-torch.txt
"${pip[@]}" -r tests/requirements.txt -e clients/python
# The benchmarks' peers (litData, its GCS downloader), without dependencies as that file says:
# test_bench_smoke runs the write-up's experiment with its configuration E.
"${pip[@]}" --no-deps -r bench/requirements.txt

echo "== build"
cargo build --locked --bins

echo "== wheel"
# The daemon and the Python package in one wheel (pyproject.toml, maturin; docs/install.md).
# Its release build goes to target/release with the flags of `cargo build --release --locked
# --bins`, so tests/soak/run.sh finds it done; packaging takes seconds.
rm -rf target/dist
MATURIN_PEP517_ARGS="--compatibility manylinux_2_34" PATH="$PWD/.venv/bin:$PATH" \
    .venv/bin/pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w target/dist .
wheel=$(echo "$PWD"/target/dist/shardd-*.whl)

echo "== rust tests"
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --locked
else
    cargo test --locked
fi

echo "== python tests"
SHARDD_BIN="$PWD/target/debug/shardd" SHARDD_WHEEL="$wheel" .venv/bin/python -m pytest tests/python -q

echo "== pod tests"
# 8 hosts in their own network namespaces, booted from the wheel (tests/pod/pod.py); they
# skip, saying why, where namespaces cannot be made (not root).
SHARDD_BIN="$PWD/target/debug/shardd" SHARDD_WHEEL="$wheel" .venv/bin/python -m pytest tests/pod -q -rs
