# Sourced by scripts/test (argument: setup | after). The C ABI (bindings/c): its test program,
# compiled as C11 with warnings as errors against include/kvguard.h and the static library; a
# C++17 caller of the same header; the quick start of docs/c-api.md. That the header is current
# is checked by `cargo test` (bindings/c/tests/header.rs; `KVGUARD_BLESS=1 cargo test -p
# kvguard-c --test header` rewrites it).

kvguard_c_after() {
  local out=target/c-test libs
  mkdir -p "$out"
  cargo build --release --package kvguard-c
  # What a Rust static library needs from the C runtime, as rustc prints it for this platform.
  libs=$(cargo rustc --release --package kvguard-c --lib --crate-type staticlib -- --print native-static-libs 2>&1 \
    | sed -n 's/.*native-static-libs: //p' | tail -n 1)
  # shellcheck disable=SC2086 # $libs is a list of flags
  cc -std=c11 -Wall -Wextra -Werror -pedantic -pthread -Ibindings/c/include bindings/c/tests/test_kvguard.c \
    target/release/libkvguard_c.a $libs -o "$out/test_kvguard"
  # shellcheck disable=SC2086
  g++ -std=c++17 -Wall -Wextra -Werror -pedantic -Ibindings/c/include bindings/c/tests/test_header.cpp \
    target/release/libkvguard_c.a $libs -o "$out/test_header"
  # The quick start in docs/c-api.md, compiled and run as it is written there.
  awk '/^```c$/ { f = 1; next } /^```$/ { f = 0 } f' docs/c-api.md >"$out/quick_start.c"
  # shellcheck disable=SC2086
  cc -std=c11 -Wall -Wextra -Werror -pedantic -Ibindings/c/include "$out/quick_start.c" \
    target/release/libkvguard_c.a $libs -o "$out/quick_start"
  "$out/test_kvguard"
  "$out/test_header"
  "$out/quick_start"
}

case "${1:-}" in
  setup) ;;
  after) kvguard_c_after ;;
esac
