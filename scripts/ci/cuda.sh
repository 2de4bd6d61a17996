#!/usr/bin/env bash
# CUDA compile checks without a GPU: NVRTC and ptxas from the PyPI wheels nvidia-cuda-nvrtc-cu12
# and nvidia-cuda-nvcc-cu12, installed once into .cache/cuda (gitignored), plus the host C++
# compiler for the simulated-grid kernel tests.
#
# Sourced by scripts/test under `set -euo pipefail`:
#   source scripts/ci/cuda.sh setup   installs (if needed) and exports LD_LIBRARY_PATH,
#                                     KVGUARD_PTXAS, KVGUARD_REQUIRE_NVRTC=1, KVGUARD_REQUIRE_HOSTCXX=1
#   source scripts/ci/cuda.sh after   nothing to undo
# Idempotent; never exits the sourcing shell.

kvguard_cuda_setup() {
  local root cache site nvrtc_lib ptxas
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  cache="${KVGUARD_CUDA_CACHE:-$root/.cache/cuda}"
  site="$cache/site"
  nvrtc_lib="$site/nvidia/cuda_nvrtc/lib"
  ptxas="$site/nvidia/cuda_nvcc/bin/ptxas"
  if [ -e "$nvrtc_lib/libnvrtc.so.12" ] && [ -x "$ptxas" ]; then
    echo "cuda.sh: NVRTC and ptxas already in $site"
  else
    echo "cuda.sh: installing nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvcc-cu12 into $site"
    mkdir -p "$cache"
    if ! python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --upgrade --target "$site" "nvidia-cuda-nvrtc-cu12>=12.8,<13" "nvidia-cuda-nvcc-cu12>=12.8,<13"; then
      echo "cuda.sh: pip install failed; the NVRTC test will fail (KVGUARD_REQUIRE_NVRTC=1)" >&2
    fi
  fi
  if [ -e "$ptxas" ] && [ ! -x "$ptxas" ]; then chmod +x "$ptxas" || true; fi
  case ":${LD_LIBRARY_PATH:-}:" in
    *":$nvrtc_lib:"*) ;;
    *) export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
  esac
  export KVGUARD_PTXAS="$ptxas"
  export KVGUARD_REQUIRE_NVRTC=1
  export KVGUARD_REQUIRE_HOSTCXX=1
  echo "cuda.sh: LD_LIBRARY_PATH+=$nvrtc_lib KVGUARD_PTXAS=$ptxas"
}

case "${1:-}" in
  setup) kvguard_cuda_setup ;;
  after) : ;;
  *) echo "usage: source scripts/ci/cuda.sh setup|after" >&2 ;;
esac
unset -f kvguard_cuda_setup
