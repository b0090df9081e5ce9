#!/usr/bin/env bash
# The project's test command (the README's second command; `.ci/run` runs it in CI).
# Formatting and lints first (cheap), then every Rust test, then the end-to-end tests
# that drive a node with real clients (the official `openai` Python package, curl).
set -euo pipefail
cd "$(dirname "$0")/.."

# The machine's own tools the tests drive, installed here when missing and the machine
# can (Debian's apt-get, as root or with password-less sudo), so that this one command
# is all a fresh machine needs: curl (a real client of the end-to-end test), Prometheus
# and promtool (the metrics tests scrape a cluster with a real Prometheus and lint
# /metrics: crates/gorgo-node/tests/node_prometheus.rs; skipped without them outside
# CI), python3 with venv (the Python clients below).
apt_install() {  # apt_install PACKAGE...: quietly, or say what to install by hand
  local sudo=""
  [ "$(id -u)" = 0 ] || { sudo -n true 2>/dev/null && sudo="sudo -n"; } || true
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$sudo" ]; }; then
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
  else
    echo "missing: $* (install them: apt-get install $*)" >&2
    return 1
  fi
}
command -v curl >/dev/null 2>&1 || apt_install curl
python3 -c 'import venv, ensurepip' 2>/dev/null || apt_install python3-venv
command -v promtool >/dev/null 2>&1 || apt_install prometheus \
  || [ "${CI:-}" != "true" ]  # outside CI the Prometheus tests skip without it
rustup component add rustfmt clippy >/dev/null 2>&1 || true

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

# Every public item carries a doc comment saying why it exists; a link in one that no
# longer resolves (an item renamed or made private) is caught here.
echo "== cargo doc --no-deps, warnings denied"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

# In CI the Prometheus tests must run: a missing `prometheus` or `promtool` fails them
# instead of skipping them (.ci/run installs Debian's package).
if [ "${CI:-}" = "true" ]; then
  export GORGO_REQUIRE_PROMETHEUS=1
  # A fresh CI machine's disk can be small (one run failed with "No space left on
  # device" at 8 GiB of target/): no incremental cache (a clean clone never reuses it)
  # and line tables only (backtraces keep file:line) halve what the build writes.
  export CARGO_INCREMENTAL=0
  export CARGO_PROFILE_DEV_DEBUG=line-tables-only
fi

echo "== cargo test --workspace"
# --no-fail-fast: one failing test binary does not hide the others' results.
cargo test --workspace --no-fail-fast

echo "== end-to-end: openai Python client and curl through a node"
# The binary `cargo test` just built for the integration tests (CARGO_BIN_EXE_gorgo):
# `cargo build --bin gorgo` would build every dependency a second time, with the
# features of a build without dev-dependencies, and double what the disk holds.
cargo test --workspace --no-run
# The Python clients live in a virtualenv of this checkout's own (.venv, gitignored),
# made on first use and reused after, so a fresh clone needs nothing installed by hand.
VENV=${GORGO_TEST_VENV:-.venv}
# msgspec and pyzmq: the KV-event test's publisher, vLLM's message classes re-declared.
if ! "$VENV/bin/python" -c 'import openai, msgspec, zmq' 2>/dev/null; then
  echo "   setting up $VENV with the openai, msgspec and pyzmq packages"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    "openai>=1.40" "msgspec>=0.18" "pyzmq>=25"
fi
"$VENV/bin/python" tests/e2e_openai.py target/debug/gorgo

echo "== end-to-end: a vLLM-format KV-event publisher (msgspec + pyzmq) drives a node"
"$VENV/bin/python" tests/kv_events_vllm.py target/debug/gorgo

# In CI (CI=true), or with GORGO_CHAOS=1: the chaos soak's short form, every fault kind
# once on a three-region cluster (about 1.5 minutes, the debug binary built above).
if [ "${CI:-}" = "true" ] || [ "${GORGO_CHAOS:-0}" = "1" ]; then
  echo "== chaos soak, short form: every fault kind once (docs/reliability.md)"
  # Share recovery within 15 s here, not the soak's 10: a node killed and restarted
  # comes back with an empty shadow index, and on a busy 2-core CI machine its share of
  # routing has taken up to 14 s to return (the short form's slots leave 14 s per fault).
  GORGO_BIN=target/debug/gorgo CHAOS_DURATION_S=90 CHAOS_RECOVERY_TARGET_S=15 \
    CHAOS_OUT=out/chaos-ci bash scripts/chaos.sh
fi

if [ "${GORGO_REAL_ENGINE:-0}" = "1" ]; then
  echo "== real engine: llama.cpp in every region (GORGO_REAL_ENGINE=1)"
  bash scripts/real-engine-e2e.sh
fi
echo "== all tests passed"
