#!/usr/bin/env bash
# Sets everything up on a fresh Debian 12 machine and runs every test:
#   1. the core and its Catch2 tests (ctest)
#   2. the core tests under AddressSanitizer + UndefinedBehaviorSanitizer
#   3. the core tests under ThreadSanitizer
#   4. the GPU machine's build path (scripts/gpu_check.sh's dry run), where CUDA is found
#   5. the package: an sdist, a wheel built from it (cotenant._core, and _C when
#      CUDA is found), checked in a fresh environment next to the installed torch
#      (scripts/check_package.sh), then installed for the tests
#   6. pytest tests/python                   (GPU tests skip with a reason without a GPU)
# Any failure, sanitizer report or empty test run fails the script.
#
# Environment:
#   COTENANT_BUILD_ROOT   where the CMake builds, the package check and dist/ go (default: build)
#   COTENANT_VENV         a virtual environment to create and use (default: .venv
#                         when python3 is the system's externally managed Python,
#                         otherwise python3 itself is used)
#   COTENANT_SKIP_APT=1   do not apt-get install (the packages are there already)
#   JOBS                  parallel compile jobs (default: the CPU count)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
BUILD_ROOT=${COTENANT_BUILD_ROOT:-build}
JOBS=${JOBS:-$(nproc)}
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS

source scripts/setup_env.sh

GENERATOR=()
if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi

# Builds the core tests in $1 with the extra CMake arguments that follow, then
# runs them under ctest, each command prefixed by RUN_PREFIX (an array).
RUN_PREFIX=()
core_tests() {
  local dir=$1; shift
  cmake -S "$ROOT" -B "$dir" "${GENERATOR[@]}" -DCOTENANT_BUILD_PYTHON=OFF -DCOTENANT_BUILD_TESTS=ON "$@"
  "${RUN_PREFIX[@]}" cmake --build "$dir" --parallel "$JOBS"
  # --no-tests=error: a build that discovered no tests is a failure, not a pass.
  "${RUN_PREFIX[@]}" ctest --test-dir "$dir" --output-on-failure --no-tests=error --parallel "$JOBS"
}

# ---- 1. core ---------------------------------------------------------------------------
step "core build and tests"
# $PYTHON's torch wheel gives pytorch_replay its libc10_cuda.so (benchmarks/pytorch_allocator).
core_tests "$BUILD_ROOT/core" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython3_EXECUTABLE="$(command -v "$PYTHON")"

# ---- 2. ASan + UBSan --------------------------------------------------------------------
step "core tests under AddressSanitizer + UndefinedBehaviorSanitizer"
core_tests "$BUILD_ROOT/asan" -DCMAKE_BUILD_TYPE=Debug -DCOTENANT_SANITIZE=address,undefined

# ---- 3. TSan ----------------------------------------------------------------------------
step "core tests under ThreadSanitizer"
# TSan needs the address-space layout it was built for; with high ASLR entropy
# (vm.mmap_rnd_bits > 28 on recent kernels) it dies with "unexpected memory
# mapping". setarch -R turns randomisation off for the build (test discovery
# runs the binary) and the tests.
if command -v setarch >/dev/null && setarch "$(uname -m)" -R true 2>/dev/null; then
  RUN_PREFIX=(setarch "$(uname -m)" -R)
fi
core_tests "$BUILD_ROOT/tsan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOTENANT_SANITIZE=thread
RUN_PREFIX=()

# ---- 4. the GPU machine's build path --------------------------------------------------------
# scripts/gpu_check.sh builds on a machine with no Debian packages and no package
# index; its dry run builds the same way here, so that path cannot break unseen.
if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  step "scripts/gpu_check.sh build (dry run: fmt from the torch wheel, robin-map carried in, pip with no index)"
  dry_run_out=$BUILD_ROOT/gpu_check_dry_run
  [[ $dry_run_out == /* ]] || dry_run_out=$ROOT/$dry_run_out
  GPU_CHECK_DRY_RUN=1 PYTHON="$PYTHON" OUT="$dry_run_out" scripts/gpu_check.sh build
fi

# ---- 5. the Python package ----------------------------------------------------------------
# The one build of the package: from the sdist, so the sdist is proven to
# build; the tests below then run against the wheel users would install.
step "sdist, wheel from the sdist, the wheel checked in a fresh environment (scripts/check_package.sh)"
PYTHON="$PYTHON" COTENANT_BUILD_ROOT="$BUILD_ROOT" scripts/check_package.sh
step "pip install the checked wheel"
# --force-reinstall: step 4 installed a build of the same version.
"$PYTHON" -m pip install --no-index --no-deps --force-reinstall "$(ls "$BUILD_ROOT"/dist/cotenant-*.whl)"

# ---- 6. Python tests ----------------------------------------------------------------------
step "pytest tests/python"
# This script's own settings are not the tests' business (some tests look at
# the COTENANT_* variables a child process gets).
unset COTENANT_BUILD_ROOT COTENANT_VENV COTENANT_SKIP_APT
# Where the CUDA toolkit is installed the torch extension must have been built:
# its tests then fail instead of skipping when cotenant._C is missing.
if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export COTENANT_REQUIRE_TORCH_EXTENSION=1
fi
# PyTorch's allocator beside cotenant's (tests/python/test_beside_pytorch.py).
pytorch_replay=$BUILD_ROOT/core/pytorch_replay
[[ $pytorch_replay == /* ]] || pytorch_replay=$ROOT/$pytorch_replay
if [[ -x $pytorch_replay ]]; then export COTENANT_PYTORCH_REPLAY=$pytorch_replay; fi
# pytest from outside the source tree, so `import cotenant` is the installed
# package; a run that collects no tests is a failure.
run_pytest() {
  local status
  set +e
  (cd / && "$PYTHON" -m pytest -p no:cacheprovider "$@" --rootdir "$ROOT" -c "$ROOT/pyproject.toml" "$ROOT/tests/python")
  status=$?
  set -e
  if [[ $status -eq 5 ]]; then
    echo "pytest collected no tests: that is a failure" >&2
    exit 1
  fi
  if [[ $status -ne 0 ]]; then exit "$status"; fi
}
# One pytest-xdist worker a CPU: the tests wait on processes, sockets and the
# fake's streams as much as they compute. The Ray cluster tests then run
# alone: beside another worker, a 3-node cluster's torchrun workers once
# missed the 60 s the test gives them to register.
PARALLEL=()
if [[ $JOBS -gt 1 ]]; then PARALLEL=(-n "$JOBS"); fi
run_pytest "${PARALLEL[@]}" -m "not ray"
step "pytest tests/python -m ray (the Ray cluster tests, alone)"
run_pytest -m ray

step "all tests passed"
