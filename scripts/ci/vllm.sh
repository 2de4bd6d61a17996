# Sourced by scripts/test (argument: setup | after). kvguard.vllm against vLLM 0.33 itself, on
# CPU: vLLM's own EngineCore step loop (async scheduling's batch queue and the synchronous one),
# its schedulers, KV cache manager and the V1 model runner's input preparation, only the model
# forward and the Triton slot-mapping kernel stood in (bindings/python/tests/engines/vllm/
# real_engine.py says what is real); then vLLM's Model Runner V2 on CPU (v2/, its own process:
# V2's Triton kernels under TRITON_INTERPRET=1; v2/v2_engine.py says what is real). Never skipped.
#
# The vLLM venv lives in $KVGUARD_VLLM_VENV (default $HOME/.cache/kvguard/vllm-venv): created
# and `pip install vllm==0.33.0` once (about 3 minutes and 9 GB: torch's CUDA wheels come with
# it even on CPU; in the background while the Rust steps run), reused afterwards. The kvguard
# wheel scripts/ci/python.sh built into target/wheels is installed into it (--force-reinstall
# --no-deps); built here with maturin if that part did not run first. The 69 V1 tests take 2-3
# minutes, V2's 25 about 5 (one core each; they run side by side).

# shellcheck source=scripts/ci/venv-job.bash
source "$(dirname "${BASH_SOURCE[0]}")/venv-job.bash"
kvguard_vllm_venv="${KVGUARD_VLLM_VENV:-$HOME/.cache/kvguard/vllm-venv}"

kvguard_vllm_venv_ready() {
  [ -x "$kvguard_vllm_venv/bin/python" ] && VLLM_TARGET_DEVICE=cpu "$kvguard_vllm_venv/bin/python" -c \
    'import importlib.metadata as m, sys; sys.exit(m.version("vllm") != "0.33.0")' 2>/dev/null
}

# Creates the venv (about 9 GB). pip compiles every module at install time, as it should: where
# PYTHONDONTWRITEBYTECODE is set (as on this project's machines) Python would otherwise compile
# torch's and vLLM's imports again in every process.
kvguard_vllm_venv_create() {
  local venv=$kvguard_vllm_venv
  echo "vllm.sh: creating $venv with vllm==0.33.0 (once; several minutes)"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv" || return 1
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "vllm==0.33.0" || return 1
}

kvguard_vllm_after() {
  local root venv wheel_dir wheel status v1_log v2_log v1_pid v2_pid
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  venv=$kvguard_vllm_venv
  kvguard_venv_wait "${KVGUARD_VLLM_VENV_JOB:-}" vllm.sh || return 1
  if ! kvguard_vllm_venv_ready; then
    kvguard_vllm_venv_create || return 1
  fi
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "maturin==1.9.6" "pytest==8.3.5" || return 1
  wheel_dir="$root/target/wheels"
  wheel=$(ls "$wheel_dir"/kvguard-*.whl 2>/dev/null | head -n 1)
  if [ -z "$wheel" ]; then
    echo "vllm.sh: building the kvguard wheel (maturin, profile wheel: LTO)"
    (cd "$root" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
      maturin build --profile wheel --quiet -m bindings/python/Cargo.toml -o "$wheel_dir") || return 1
    wheel=$(ls "$wheel_dir"/kvguard-*.whl | head -n 1)
  fi
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheel" || return 1
  status=0
  # The V1 tests and Model Runner V2's side by side (each is one Python thread for most of its
  # time), each into its own log, printed in order when both are done.
  v1_log=$(mktemp)
  v2_log=$(mktemp)
  # From the tests' directory, so `import kvguard` is the installed wheel, not the source tree.
  (cd "$root/bindings/python/tests/engines/vllm" && VLLM_TARGET_DEVICE=cpu \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider .) >"$v1_log" 2>&1 &
  v1_pid=$!
  # Model Runner V2 in a process of its own: its Triton kernels run under TRITON_INTERPRET=1,
  # set (by v2/v2_engine.py) before vLLM is imported.
  (cd "$root/bindings/python/tests/engines/vllm/v2" && VLLM_TARGET_DEVICE=cpu \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider .) >"$v2_log" 2>&1 &
  v2_pid=$!
  wait "$v1_pid" || status=$?
  wait "$v2_pid" || status=$?
  echo "-- vLLM V1 (bindings/python/tests/engines/vllm)"
  cat "$v1_log"
  echo "-- vLLM Model Runner V2 (bindings/python/tests/engines/vllm/v2)"
  cat "$v2_log"
  rm -f "$v1_log" "$v2_log"
  return "$status"
}

case "${1:-}" in
  setup)
    # A bare machine downloads the venv (about 9 GB) while the Rust steps build and test.
    kvguard_vllm_venv_ready || kvguard_venv_start KVGUARD_VLLM_VENV_JOB kvguard_vllm_venv_create vllm.sh
    ;;
  after) kvguard_vllm_after || { echo "vllm.sh: the vLLM tests failed" >&2; unset -f kvguard_vllm_after; exit 1; } ;;
  *) echo "usage: source scripts/ci/vllm.sh setup|after" >&2 ;;
esac
unset -f kvguard_vllm_after kvguard_vllm_venv_ready kvguard_vllm_venv_create
unset kvguard_vllm_venv
unset -f kvguard_venv_start kvguard_venv_wait
