# Sourced by scripts/test (argument: setup | after). Bounded fuzzing with cargo-fuzz on the stable
# toolchain (RUSTC_BOOTSTRAP=1): each target first replays its committed corpus (fuzz/corpus/NAME)
# and its seeds, then fuzzes for a fixed time from a scratch copy of them, so the committed corpus
# only changes by hand. trace_parse is seeded with the trace zoo (tests/zoo/*.jsonl), so its corpus
# keeps no copies of the zoo's traces.
# KVGUARD_FUZZ_SECONDS sets the table_ops run (default 60 s, twice the parsers' 30 s: sequences of
# table operations have far more state to explore than one manifest or one trace).

kvguard_fuzz_setup() {
  if ! command -v cargo-fuzz >/dev/null 2>&1; then
    echo "installing cargo-fuzz (not on this machine)"
    cargo install cargo-fuzz --locked --quiet
  fi
}

# kvguard_fuzz_target TARGET SECONDS [SEED_FILE...]
kvguard_fuzz_target() {
  local target=$1 seconds=$2 scratch log status seed
  shift 2
  scratch=$(mktemp -d)
  log=$(mktemp)
  mkdir -p "fuzz/corpus/$target"
  cp -r "fuzz/corpus/$target/." "$scratch/"
  # Prefixed, so a seed never overwrites a committed input of the same name.
  for seed in "$@"; do
    cp "$seed" "$scratch/seed-$(basename "$seed")"
  done
  echo "-- $target: replaying $(find "fuzz/corpus/$target" -type f | wc -l) committed inputs and $# seeds, then fuzzing ${seconds}s"
  status=0
  (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run "$target" "$scratch" -- -runs=0) >"$log" 2>&1 || status=$?
  if [ "$status" -eq 0 ]; then
    (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run "$target" "$scratch" -- -max_total_time="$seconds" -print_final_stats=1) \
      >"$log" 2>&1 || status=$?
  fi
  grep -E "^(Done|stat::number_of_executed_units)" "$log" || true
  if [ "$status" -ne 0 ]; then
    echo "FUZZ FAILURE in $target (exit $status):"
    tail -n 60 "$log"
  fi
  rm -rf "$scratch" "$log"
  return "$status"
}

case "${1:-}" in
  setup) kvguard_fuzz_setup ;;
  after)
    (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz build 2>&1 | tail -n 1)
    # Two lanes side by side (each fuzzer is one thread; CI has two cores): table_ops then
    # trace_parse, and engine_step then manifest_decode. Each lane's output is printed when both
    # are done; a failure in either fails the part.
    kvguard_fuzz_lane_a=$(mktemp)
    kvguard_fuzz_lane_b=$(mktemp)
    (
      s=0
      kvguard_fuzz_target table_ops "${KVGUARD_FUZZ_SECONDS:-60}" || s=1
      kvguard_fuzz_target trace_parse 30 tests/zoo/*.jsonl || s=1
      exit "$s"
    ) >"$kvguard_fuzz_lane_a" 2>&1 &
    kvguard_fuzz_pid_a=$!
    (
      s=0
      kvguard_fuzz_target engine_step 30 || s=1
      kvguard_fuzz_target manifest_decode 30 || s=1
      exit "$s"
    ) >"$kvguard_fuzz_lane_b" 2>&1 &
    kvguard_fuzz_pid_b=$!
    kvguard_fuzz_status=0
    wait "$kvguard_fuzz_pid_a" || kvguard_fuzz_status=1
    wait "$kvguard_fuzz_pid_b" || kvguard_fuzz_status=1
    cat "$kvguard_fuzz_lane_a" "$kvguard_fuzz_lane_b"
    rm -f "$kvguard_fuzz_lane_a" "$kvguard_fuzz_lane_b"
    [ "$kvguard_fuzz_status" -eq 0 ] || { echo "fuzz.sh: a fuzz target failed" >&2; exit 1; }
    ;;
esac
