# Sourced by scripts/test (argument: setup | after). NIXL for the `nixl` feature: libclang for
# nixl-sys's bindgen build (apt-get, when missing), and the NIXL wheels nixl 1.5.1 and
# nixl-cu12 1.5.1 (--no-deps: no torch, no CUDA wheels; UCX is bundled) in a venv cached at
# $KVGUARD_NIXL_VENV (default ~/.cache/kvguard/nixl-venv), reused across runs and clones.
#   setup  installs what is missing; exports LD_LIBRARY_PATH (the wheel's libnixl_capi.so),
#          UCX_TLS=tcp,self UCX_NET_DEVICES=lo (loopback TCP only: deterministic, no shared-memory
#          transports, which fail agent creation here), KVGUARD_REQUIRE_NIXL=1 (the NIXL tests
#          fail instead of skipping) and KVGUARD_NIXL_PYTHON.
#   after  runs the two-process demo over NIXL for every fault in both directions, from the
#          release binary, as a user would (cargo test ran the same pairs already).
# Idempotent; never exits the sourcing shell.

kvguard_nixl_setup() {
  local venv site libs
  # libclang itself (libclang.so*, libclang-N.so*), not libclang-cpp.so, which LLVM's own
  # packages install and bindgen cannot use.
  local lib found=""
  for lib in /usr/lib/llvm-*/lib/libclang.so* /usr/lib/*-linux-gnu/libclang.so* \
      /usr/lib/*-linux-gnu/libclang-[0-9]*.so*; do
    if [ -e "$lib" ]; then found=$lib; break; fi
  done
  if [ -z "$found" ]; then
    echo "nixl.sh: installing libclang-dev (nixl-sys generates its bindings with bindgen)"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq && $sudo apt-get install -y -qq libclang-dev >/dev/null \
      || echo "nixl.sh: apt-get install libclang-dev failed; the nixl feature will not build" >&2
  fi
  venv="${KVGUARD_NIXL_VENV:-$HOME/.cache/kvguard/nixl-venv}"
  if [ ! -x "$venv/bin/python" ]; then
    echo "nixl.sh: creating $venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv" || echo "nixl.sh: python3 -m venv failed" >&2
  fi
  if ! "$venv/bin/python" -c 'import nixl_cu12' 2>/dev/null \
      || [ "$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("nixl-cu12"))' 2>/dev/null)" != "1.5.1" ]; then
    echo "nixl.sh: installing nixl==1.5.1 nixl-cu12==1.5.1 numpy into $venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
      "nixl==1.5.1" "nixl-cu12==1.5.1" "numpy==2.2.6" \
      || echo "nixl.sh: pip install failed; the NIXL tests will fail (KVGUARD_REQUIRE_NIXL=1)" >&2
  fi
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
  libs="$site/.nixl_cu12.mesonpy.libs"
  case ":${LD_LIBRARY_PATH:-}:" in
    *":$libs:"*) ;;
    *) export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
  esac
  export UCX_TLS="${UCX_TLS:-tcp,self}"
  export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
  export KVGUARD_REQUIRE_NIXL=1
  export KVGUARD_NIXL_PYTHON="$venv/bin/python"
  echo "nixl.sh: LD_LIBRARY_PATH+=$libs UCX_TLS=$UCX_TLS UCX_NET_DEVICES=$UCX_NET_DEVICES"
}

# One decode/prefill pair as two processes; prints decode's verdicts; fails unless decode
# refused exactly request 2 with `kind` (or accepted all three for the clean run).
kvguard_nixl_pair() {
  local bin=$1 transport=$2 fault=$3 kind=$4 out port status=0 i
  out=$(mktemp)
  "$bin" --transport "$transport" decode --port 0 --timeout-ms 20000 >"$out" 2>&1 &
  local decode=$!
  for i in $(seq 1 200); do
    port=$(sed -n 's/^listening 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$out")
    [ -n "$port" ] && break
    sleep 0.05
  done
  "$bin" --transport "$transport" prefill --port "$port" --fault "$fault" --timeout-ms 20000 >/dev/null 2>&1 || status=1
  wait "$decode" || true
  grep -E "^(ACCEPTED|REFUSED)" "$out" | sed "s/^/  [$transport $fault] /"
  if [ "$fault" = none ]; then
    [ "$(grep -c '^ACCEPTED' "$out")" -eq 3 ] || status=1
  else
    grep -q "^REFUSED req 2: $kind: " "$out" && [ "$(grep -c '^REFUSED' "$out")" -eq 1 ] || status=1
  fi
  [ "$status" -eq 0 ] || { echo "nixl.sh: $transport $fault: unexpected outcome:"; cat "$out"; }
  rm -f "$out"
  return "$status"
}

kvguard_nixl_after() {
  local bin=target/release/kvguard-disagg transport pair status=0
  cargo build --release --quiet -p kvguard-sim --features nixl --bin kvguard-disagg || return 1
  for transport in nixl-write nixl-read; do
    for pair in none: truncate-page:page_length_mismatch flip-byte:page_checksum_mismatch \
        wrong-request:transfer_misrouted late:stale_page dummy-prompt:token_count_mismatch \
        missing-checksum:missing_checksum; do
      kvguard_nixl_pair "$bin" "$transport" "${pair%%:*}" "${pair#*:}" || status=1
    done
  done
  return "$status"
}

case "${1:-}" in
  setup) kvguard_nixl_setup ;;
  after) kvguard_nixl_after || { echo "nixl.sh: the two-process runs over NIXL failed" >&2; unset -f kvguard_nixl_setup kvguard_nixl_pair kvguard_nixl_after; exit 1; } ;;
  *) echo "usage: source scripts/ci/nixl.sh setup|after" >&2 ;;
esac
unset -f kvguard_nixl_setup kvguard_nixl_pair kvguard_nixl_after
