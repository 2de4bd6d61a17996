# Sourced by the engine parts (scripts/ci/sglang.sh, scripts/ci/vllm.sh): an engine's venv (a
# download of several GB) created in the background from `setup`, so that on a bare machine it
# comes down while the Rust steps build and test, and waited for in `after`. Not a part itself
# (scripts/test runs scripts/ci/*.sh).

# kvguard_venv_start VAR CREATE NAME: runs the function CREATE in the background, its output into
# a log; exports VAR=<the job's folder>, where `status` appears with CREATE's exit status.
kvguard_venv_start() {
  local var=$1 create=$2 name=$3 dir
  dir=$(mktemp -d)
  echo "$name: creating its venv in the background (log: $dir/log)"
  (
    status=0
    "$create" >"$dir/log" 2>&1 || status=$?
    echo "$status" >"$dir/status.tmp"
    mv "$dir/status.tmp" "$dir/status"
  ) </dev/null >/dev/null 2>&1 &
  echo "$!" >"$dir/pid"
  export "$var=$dir"
}

# kvguard_venv_wait DIR NAME: waits for the job kvguard_venv_start left in DIR (returns at once
# when DIR is empty) and prints its log; fails when the job failed or died without a status.
kvguard_venv_wait() {
  local dir=$1 name=$2 status
  [ -n "$dir" ] || return 0
  while [ ! -e "$dir/status" ]; do
    if ! kill -0 "$(cat "$dir/pid")" 2>/dev/null && [ ! -e "$dir/status" ]; then
      echo "$name: the venv's background job died without a status; its log:" >&2
      cat "$dir/log" >&2
      return 1
    fi
    sleep 2
  done
  status=$(cat "$dir/status")
  echo "-- $name: its venv, created in the background (exit $status):"
  cat "$dir/log"
  [ "$status" -eq 0 ]
}
