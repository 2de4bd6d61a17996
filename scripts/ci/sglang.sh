# Sourced by scripts/test (argument: setup | after). kvguard inside SGLang 0.5.23: a cached venv in
# $HOME/.cache/kvguard/sglang-venv with SGLang (--no-deps), torch 2.14.1 and what its mem_cache and
# schedule_batch modules import (about 6 GB, created once, in the background while the Rust
# steps run, then reused), the kvguard wheel that
# scripts/ci/python.sh built into target/wheels (built here if missing), then pytest against
# SGLang's real allocator, ReqToTokenPool, MHATokenToKVPool and RadixCache on CPU, and its own Scheduler
# (whose module imports setproctitle, uvicorn and fastapi). Never skipped.

# shellcheck source=scripts/ci/venv-job.bash
source "$(dirname "${BASH_SOURCE[0]}")/venv-job.bash"
kvguard_sglang_venv="$HOME/.cache/kvguard/sglang-venv"

# Whether the venv's SGLang and torch import (`after`); `setup` only reads their versions
# (importing them takes tens of seconds, on the run's critical path there).
kvguard_sglang_venv_ready() {
  [ -x "$kvguard_sglang_venv/bin/python" ] && "$kvguard_sglang_venv/bin/python" -c "import sglang, torch" 2>/dev/null
}

kvguard_sglang_venv_installed() {
  [ -x "$kvguard_sglang_venv/bin/python" ] && "$kvguard_sglang_venv/bin/python" -c \
    'import importlib.metadata as m, sys; sys.exit(m.version("sglang") != "0.5.23" or m.version("torch") != "2.14.1")' 2>/dev/null
}

# Creates the venv (a download of about 6 GB). pip compiles every module at install time, as it
# should: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) Python would
# otherwise compile torch's imports again in every process.
kvguard_sglang_venv_create() {
  local venv=$kvguard_sglang_venv
  echo "sglang.sh: creating $venv (SGLang 0.5.23 --no-deps, torch 2.14.1, about 6 GB)"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv" || return 1
  "$venv/bin/pip" install --quiet --disable-pip-version-check torch==2.14.1 numpy orjson psutil pillow \
    pybase64 requests packaging starlette msgspec pydantic pyzmq tqdm IPython aiohttp torchvision dill \
    apache-tvm-ffi==0.1.11 transformers==5.19.0 sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf \
    einops openai==2.8.0 partial_json_parser || return 1
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps sglang==0.5.23 || return 1
}

kvguard_sglang_after() {
  local root venv wheel status
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  venv=$kvguard_sglang_venv
  kvguard_venv_wait "${KVGUARD_SGLANG_VENV_JOB:-}" sglang.sh || return 1
  if ! kvguard_sglang_venv_ready; then
    kvguard_sglang_venv_create || return 1
  fi
  "$venv/bin/pip" install --quiet --disable-pip-version-check "maturin==1.9.6" "pytest==8.3.5" \
    "prometheus_client==0.26.0" "setproctitle==1.3.8" "uvicorn==0.55.0" "fastapi==0.165.0" || return 1
  wheel=$(ls "$root"/target/wheels/kvguard-*.whl 2>/dev/null | head -n 1)
  if [ -z "$wheel" ]; then
    echo "sglang.sh: building the kvguard wheel (maturin, profile wheel: LTO)"
    (cd "$root" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
      maturin build --profile wheel --quiet -m bindings/python/Cargo.toml -o target/wheels) || return 1
    wheel=$(ls "$root"/target/wheels/kvguard-*.whl | head -n 1)
  fi
  "$venv/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheel" || return 1
  status=0
  # From the tests' directory, so `import kvguard` is the installed wheel, not the source tree.
  (cd "$root/bindings/python/tests/engines/sglang" && \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -W ignore .) || status=$?
  # The binding's tests that need torch (torch tensors and their numpy views as arrays).
  (cd "$root/bindings/python/tests" && \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -W ignore -k torch test_hostile_arrays.py) || status=$?
  return "$status"
}

case "${1:-}" in
  setup)
    # A bare machine downloads the venv while the Rust steps build and test.
    kvguard_sglang_venv_installed || kvguard_venv_start KVGUARD_SGLANG_VENV_JOB kvguard_sglang_venv_create sglang.sh
    ;;
  after) kvguard_sglang_after || { echo "sglang.sh: the SGLang tests failed" >&2; unset -f kvguard_sglang_after; exit 1; } ;;
  *) echo "usage: source scripts/ci/sglang.sh setup|after" >&2 ;;
esac
unset -f kvguard_sglang_after kvguard_sglang_venv_ready kvguard_sglang_venv_installed kvguard_sglang_venv_create
unset kvguard_sglang_venv
unset -f kvguard_venv_start kvguard_venv_wait
