# Sourced by scripts/test (argument: setup | after). The C ABI (bindings/c): its test program,
# compiled as C11 with warnings as errors against include/kvguard.h and the static library, run
# plain, under AddressSanitizer and under valgrind's memcheck; a C++17 caller of the same
# header; the C examples of docs/c-api.md and README.md, compiled as C11 and as C++17 (what the
# docs claim). That the header is current is checked by `cargo test`
# (bindings/c/tests/header.rs; `KVGUARD_BLESS=1 cargo test -p kvguard-c --test header` rewrites
# it).

# Installs Debian packages when missing (root, or through sudo).
kvguard_c_apt() {
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "c.sh: installing $*"
  $sudo apt-get update -qq && $sudo apt-get install -y -qq "$@" >/dev/null
}

# The memory checkers: gcc's AddressSanitizer runtime and valgrind.
kvguard_c_memory_tools() {
  local probe
  probe=$(mktemp -d)
  echo 'int main(void) { return 0; }' >"$probe/p.c"
  if ! cc -fsanitize=address "$probe/p.c" -o "$probe/p" 2>/dev/null; then
    # The runtime of the distribution's gcc: libasan8 for gcc 12 and 13 (Debian 12, 13).
    kvguard_c_apt libasan8 || kvguard_c_apt "libasan$(cc -dumpversion | cut -d. -f1)" || true
    cc -fsanitize=address "$probe/p.c" -o "$probe/p" \
      || { echo "c.sh: cc cannot build with -fsanitize=address" >&2; return 1; }
  fi
  rm -rf "$probe"
  command -v valgrind >/dev/null || kvguard_c_apt valgrind
  command -v valgrind >/dev/null || { echo "c.sh: valgrind is not installed" >&2; return 1; }
}

# The ```c blocks of a Markdown file, each as a translation unit (a block without `main` is a
# fragment of one: its #include lines stay on top, the rest becomes main's body).
kvguard_c_doc_examples() {
  local doc=$1 out=$2
  awk -v out="$out" '
    /^```c$/ { f = 1; n++; body = ""; inc = ""; next }
    /^```$/ && f {
      f = 0
      file = out "_" n ".c"
      if (body ~ /int main/) printf "%s%s", inc, body > file
      else printf "%s#include <stdio.h>\nint main(void) {\n%s    return 0;\n}\n", inc, body > file
      close(file)
      next
    }
    f && /^#include/ { inc = inc $0 "\n"; next }
    f { body = body $0 "\n" }' "$doc"
}

kvguard_c_after() {
  local out=target/c-test libs src
  mkdir -p "$out"
  cargo build --release --package kvguard-c
  kvguard_c_memory_tools
  # What a Rust static library needs from the C runtime, as rustc prints it for this platform.
  libs=$(cargo rustc --release --package kvguard-c --lib --crate-type staticlib -- --print native-static-libs 2>&1 \
    | sed -n 's/.*native-static-libs: //p' | tail -n 1)
  # shellcheck disable=SC2086 # $libs is a list of flags
  cc -std=c11 -Wall -Wextra -Werror -pedantic -pthread -Ibindings/c/include bindings/c/tests/test_kvguard.c \
    target/release/libkvguard_c.a $libs -o "$out/test_kvguard"
  # The same test with AddressSanitizer: the C side instrumented, and every malloc and free of
  # the library intercepted (a double free, a leak of unreachable memory).
  # shellcheck disable=SC2086
  cc -std=c11 -Wall -Wextra -Werror -pedantic -pthread -g -fsanitize=address -fno-omit-frame-pointer \
    -Ibindings/c/include bindings/c/tests/test_kvguard.c target/release/libkvguard_c.a $libs \
    -o "$out/test_kvguard_asan"
  # shellcheck disable=SC2086
  g++ -std=c++17 -Wall -Wextra -Werror -pedantic -Ibindings/c/include bindings/c/tests/test_header.cpp \
    target/release/libkvguard_c.a $libs -o "$out/test_header"
  # The C examples of the docs, compiled as they are written there, as C11 and as C++17.
  rm -f "$out"/docs_*.c "$out"/readme_*.c
  kvguard_c_doc_examples docs/c-api.md "$out/docs"
  kvguard_c_doc_examples README.md "$out/readme"
  for src in "$out"/docs_*.c "$out"/readme_*.c; do
    # shellcheck disable=SC2086
    cc -std=c11 -Wall -Wextra -Werror -pedantic -Ibindings/c/include "$src" \
      target/release/libkvguard_c.a $libs -o "${src%.c}"
    # shellcheck disable=SC2086
    g++ -x c++ -std=c++17 -Wall -Wextra -Werror -pedantic -Ibindings/c/include "$src" -x none \
      target/release/libkvguard_c.a $libs -o "${src%.c}_cpp"
  done
  "$out/test_kvguard"
  ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 "$out/test_kvguard_asan"
  # memcheck sees what ASan cannot: the Rust side is not instrumented, so a read of freed
  # memory there fails only here.
  valgrind --quiet --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite,indirect,possible \
    "$out/test_kvguard"
  "$out/test_header"
  for src in "$out"/docs_*.c "$out"/readme_*.c; do
    "${src%.c}"
    "${src%.c}_cpp"
  done
}

case "${1:-}" in
  setup) ;;
  after) kvguard_c_after ;;
esac
