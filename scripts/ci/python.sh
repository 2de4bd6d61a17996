# Sourced by scripts/test (argument: setup | wheel | after). The Python package: a project-local venv
# (.venv/, gitignored) with pinned maturin, numpy and pytest from PyPI, the abi3 wheel built by
# maturin (Cargo profile `wheel`: LTO) and installed there, then pytest against the installed wheel.
# Needs only python3 (3.11 or later, with venv and pip) and the Rust toolchain.
# Where scripts/ci/nixl.sh set NIXL up (its setup runs first in scripts/test and exports
# KVGUARD_NIXL_PYTHON, LD_LIBRARY_PATH, the UCX variables and KVGUARD_REQUIRE_NIXL=1), the wheel
# is built with the `nixl` feature and tests/test_nixl.py runs prefill and decode as two
# processes over NIXL; KVGUARD_REQUIRE_NIXL=1 makes those tests fail rather than skip.

# The project venv and the wheel, built into target/wheels (what the engine parts install too)
# and installed in the venv; exports KVGUARD_WHEEL_BUILT=1, so `after` takes it as it is.
kvguard_python_wheel() {
  local root venv wheel_dir wheel features
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  venv="$root/.venv"
  if [ ! -x "$venv/bin/python" ]; then
    echo "python.sh: creating $venv"
    python3 -m venv "$venv" || return 1
  fi
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "maturin==1.9.6" "numpy==2.2.6" "pytest==8.3.5" || return 1
  wheel_dir="$root/target/wheels"
  rm -f "$wheel_dir"/kvguard-*.whl
  # pyproject's feature (pyo3/extension-module) named beside nixl, so the wheel never lacks it.
  features="pyo3/extension-module"
  [ -n "${KVGUARD_NIXL_PYTHON:-}" ] && features="$features,nixl"
  echo "python.sh: building the wheel (maturin, profile wheel: LTO, features $features)"
  (cd "$root" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
    maturin build --profile wheel --quiet -m bindings/python/Cargo.toml --features "$features" -o "$wheel_dir") || return 1
  wheel=$(ls "$wheel_dir"/kvguard-*.whl)
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheel" || return 1
  export KVGUARD_WHEEL_BUILT=1
}

kvguard_python_after() {
  local root venv status
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  venv="$root/.venv"
  if [ "${KVGUARD_WHEEL_BUILT:-}" != 1 ]; then
    kvguard_python_wheel || return 1
  fi
  # The property test replays its traces through the Rust command line too.
  (cd "$root" && cargo build --release --quiet --bin kvguard) || return 1
  status=0
  # From the tests' directory, so `import kvguard` is the installed wheel, not the source tree.
  # The tests that need torch (named *torch*) run in scripts/ci/sglang.sh, whose venv has it.
  (cd "$root/bindings/python/tests" && KVGUARD_BIN="$root/target/release/kvguard" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -k "not torch" .) || status=$?
  return "$status"
}

case "${1:-}" in
  setup) : ;;
  wheel) kvguard_python_wheel || { echo "python.sh: the wheel did not build" >&2; unset -f kvguard_python_wheel kvguard_python_after; exit 1; } ;;
  after) kvguard_python_after || { echo "python.sh: the Python tests failed" >&2; unset -f kvguard_python_wheel kvguard_python_after; exit 1; } ;;
  *) echo "usage: source scripts/ci/python.sh setup|wheel|after" >&2 ;;
esac
unset -f kvguard_python_wheel kvguard_python_after
