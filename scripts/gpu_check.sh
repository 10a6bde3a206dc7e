#!/usr/bin/env bash
# The GPU run: builds cotenant with what a GPU machine has (python3 with torch,
# nvcc, cmake, ninja; no network, no Debian fmt, robin-map or Catch2: fmt then
# comes from the torch wheel's headers, tsl::robin_map from .deps, carried in:
# run scripts/carry_deps.sh where the Debian packages are and carry .deps with
# the working tree), runs every test marked gpu, then the benchmarks,
# and writes logs and result JSON to $OUT (default benchmarks/results/gpu_check)
# and the benchmarks' JSON to benchmarks/results/.
#
#   scripts/gpu_check.sh [PHASE ...]     PHASE: build tests bench (default: all three);
#                                        bench is allocator colocate snapshots, each a phase of its own
#
# Phases after `build` use the installed package; `build` is skipped when the
# installed modules are newer than every source file. Each phase is bounded
# (GPU_CHECK_TEST_TIMEOUT, GPU_CHECK_BENCH_SECONDS) so one call of a few
# minutes runs any phase.
#
# Environment:
#   PYTHON                    the interpreter (default: python3)
#   OUT                       where logs and results go
#   GPU_CHECK_DRY_RUN=1       no GPU: build the same way (fmt from torch, robin-map
#                             from a prefix scripts/carry_deps.sh writes, pip with
#                             no index) and stop before the tests; CI runs this
#   COTENANT_DEPS             the carried prefix (default: .deps; put on CMAKE_PREFIX_PATH
#                             when it exists)
#   GPU_CHECK_PYTEST_ARGS     extra pytest arguments (e.g. -k graph; -n 4 with pytest-xdist)
#   GPU_CHECK_TEST_TIMEOUT    seconds for the whole test phase (default 500)
#   GPU_TEST_HANG_SECONDS     a gpu test's script that runs this long prints every thread's
#                             stack and ends (default: its timeout less 30 s)
#   GPU_CHECK_ALLOCATOR_ARGS  bench_allocator.py's arguments (default --quick; "" for the full run,
#                             which takes longer than one 10-minute device call)
#   GPU_CHECK_BENCH_SECONDS   measured seconds per co-location run (default 6)
#   GPU_CHECK_SNAPSHOT_SECONDS  seconds of recording for record_snapshots.py, both workloads (default 60)
#   GPU_CHECK_SNAPSHOT_ARGS   its extra arguments (e.g. --expandable-segments, --steps 10)
#
# Measured on one H100 (2026-11-24): build 1 min; the gpu tests 110 s with -n 4;
# bench_allocator.py --quick 3 min; colocate.py with 6 s runs more than
# 280 s (its six modes and two solo runs); the snapshots 40 s. On one H200
# (2026-11-27): build 40 s, the gpu tests 135 s with -n 4, bench_allocator.py
# --quick 150 s, the snapshots 40 s: `build tests allocator snapshots` took
# 6.2 minutes in one call. colocate.py with 5 s runs took more than 6 minutes
# there, 3 of them a hung worker since fixed. So two calls: `build tests
# allocator snapshots`, then `colocate` (bench in one call runs past the
# 10-minute limit of one call). Later that day `colocate` with 4 s runs
# took 249 s (two more solo runs of the overhead figures have been added
# since, about 20 s, and 12 s in auto mode for the coordinator's share to
# settle before it is measured). On 2026-11-28 `build tests allocator` took
# 266 s and `colocate` 189 s on an H200; bench_allocator.py has since run
# its two comparisons with PyTorch's allocator twice each (six more worker
# processes, about a minute more; not yet timed), and colocate.py runs each
# job alone again after the modes (two more runs, about 30 s with 4 s runs).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$ROOT/benchmarks/results/gpu_check}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
PHASES=("$@")
[[ ${#PHASES[@]} -eq 0 ]] && PHASES=(build tests bench)
failed=()

say() { printf '\n==== %s (%ds)\n' "$*" "$SECONDS" | tee -a "$LOG"; }
has_phase() {
  local p
  for p in "${PHASES[@]}"; do
    [[ $p == "$1" || ($p == bench && $1 =~ ^(allocator|colocate|snapshots)$) ]] && return 0
  done
  return 1
}

say "environment"
{
  uname -a
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi: not available"
  nvcc --version 2>&1 | tail -1
  "$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())'
} 2>&1 | tee -a "$LOG"

if has_phase build; then
  say "build: pip install --no-build-isolation --no-index --no-deps ."
  installed=$(cd / && "$PYTHON" -c "import cotenant, os; print(os.path.dirname(cotenant.__file__))" 2>/dev/null || true)
  newest_source=$(find CMakeLists.txt setup.py csrc include python -type f -newer "${installed:-/nonexistent}/_C"*.so 2>/dev/null | head -1)
  if [[ ${GPU_CHECK_DRY_RUN:-0} != 1 && -n "$installed" && -z "$newest_source" ]] && ls "$installed"/_C*.so >/dev/null 2>&1; then
    echo "up to date: $installed" | tee -a "$LOG"
  else
    # A dry run proves the GPU machine's build path: no fmt package, no index.
    # Its own CMake directory, so its settings never leak into another build.
    cmake_args=${COTENANT_CMAKE_ARGS:-}
    build_dir=${COTENANT_CMAKE_BUILD_DIR:-}
    deps=${COTENANT_DEPS:-$ROOT/.deps}
    if [[ ${GPU_CHECK_DRY_RUN:-0} == 1 ]]; then
      cmake_args="$cmake_args -DCMAKE_DISABLE_FIND_PACKAGE_fmt=ON"
      build_dir="$OUT/cmake"
      deps="$OUT/deps"
      rm -rf "$deps"
      scripts/carry_deps.sh "$deps" 2>&1 | tee -a "$LOG"
    fi
    # CMake searches the environment's CMAKE_PREFIX_PATH before the system's
    # directories, so the carried copy is the one found.
    if [[ -d $deps ]]; then
      export CMAKE_PREFIX_PATH="$deps${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
      echo "carried dependencies: $deps" | tee -a "$LOG"
    fi
    if ! COTENANT_CMAKE_ARGS="$cmake_args" COTENANT_CMAKE_BUILD_DIR="$build_dir" "$PYTHON" -m pip install -v --no-build-isolation --no-index --no-deps . \
        >>"$LOG" 2>&1; then
      tail -40 "$LOG"
      echo "build failed: see $LOG" >&2
      exit 1
    fi
    (cd / && "$PYTHON" -c 'import cotenant._C, cotenant._core; print("built:", cotenant._C.__file__)') 2>&1 | tee -a "$LOG"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || { echo "the built package does not import" >&2; exit 1; }
  fi
fi

if [[ ${GPU_CHECK_DRY_RUN:-0} == 1 ]]; then
  if has_phase build && ! grep -q "fmt from the torch wheel" "$LOG"; then
    echo "dry run: the build did not take fmt from the torch wheel, as the GPU machine must" >&2
    exit 1
  fi
  if has_phase build && ! grep -q "tsl-robin-map .* from $OUT/deps/" "$LOG"; then
    echo "dry run: the build did not take tsl-robin-map from the carried prefix $OUT/deps, as the GPU machine must" >&2
    exit 1
  fi
  say "dry run: built the GPU machine's way; no GPU phases run"
  exit 0
fi

if has_phase tests; then
  say "tests: pytest -m gpu"
  # From outside the tree, so the installed package is the one imported.
  # shellcheck disable=SC2086
  (cd / && timeout "${GPU_CHECK_TEST_TIMEOUT:-500}" "$PYTHON" -m pytest -p no:cacheprovider -m gpu -rA \
      --rootdir "$ROOT" -c "$ROOT/pyproject.toml" --junitxml "$OUT/gpu_tests.xml" \
      ${GPU_CHECK_PYTEST_ARGS:-} "$ROOT/tests/python") 2>&1 | tee -a "$LOG"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || failed+=(tests)
  # The outcome of every gpu test, with the device and versions, as a result file.
  if [[ -s "$OUT/gpu_tests.xml" ]]; then
    "$PYTHON" benchmarks/gpu_test_summary.py "$OUT/gpu_tests.xml" --out "$ROOT/benchmarks/results" 2>&1 | tee -a "$LOG"
    newest=$(ls -t "$ROOT"/benchmarks/results/gpu_tests-*.json 2>/dev/null | head -1)
    [[ -n "$newest" ]] && cp "$newest" "$OUT/"
  fi
fi

if has_phase allocator; then
  say "bench: benchmarks/bench_allocator.py"
  # shellcheck disable=SC2086
  timeout "${GPU_CHECK_ALLOCATOR_TIMEOUT:-300}" "$PYTHON" benchmarks/bench_allocator.py ${GPU_CHECK_ALLOCATOR_ARGS:---quick} \
      --out "$ROOT/benchmarks/results" 2>&1 | tee -a "$LOG"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || failed+=(bench_allocator)
fi

if has_phase colocate; then
  say "bench: benchmarks/colocate.py"
  timeout "${GPU_CHECK_COLOCATE_TIMEOUT:-500}" "$PYTHON" benchmarks/colocate.py --seconds "${GPU_CHECK_BENCH_SECONDS:-6}" \
      --warmup-steps 3 --out "$ROOT/benchmarks/results" 2>&1 | grep -v "enable_nested_tensor\|model = torch.nn" | tee -a "$LOG"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || failed+=(colocate)
fi

if has_phase snapshots; then
  say "bench: PyTorch memory snapshots (PyTorch's own allocator) replayed through cotenant"
  # Two real training loops recorded with PyTorch's caching allocator, cotenant
  # off; the replay of each puts PyTorch's figures beside cotenant's.
  snapshots=$(cd "$OUT" && pwd)/snapshots
  # shellcheck disable=SC2086
  timeout "${GPU_CHECK_SNAPSHOT_TIMEOUT:-180}" "$PYTHON" benchmarks/record_snapshots.py --out "$snapshots" \
      --seconds "${GPU_CHECK_SNAPSHOT_SECONDS:-60}" ${GPU_CHECK_SNAPSHOT_ARGS:-} 2>&1 | tee -a "$LOG"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || failed+=(record_snapshots)
  for snapshot in "$snapshots"/*.pickle; do
    [[ -e $snapshot ]] || continue
    # From outside the tree, so the installed package is the one imported.
    (cd / && "$PYTHON" -m cotenant.replay "$snapshot") 2>&1 | tee -a "$LOG"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || failed+=("replay:$(basename "$snapshot")")
    (cd / && "$PYTHON" -m cotenant.replay --json "$snapshot") >"${snapshot%.pickle}.replay.json" 2>>"$LOG" \
      || failed+=("replay-json:$(basename "$snapshot")")
  done
fi

# The newest result of each benchmark run travels with the log.
for name in allocator colocate; do
  has_phase "$name" || continue
  newest=$(ls -t "$ROOT"/benchmarks/results/"$name"-*.json 2>/dev/null | head -1)
  [[ -n "$newest" ]] && cp "$newest" "$OUT/"
done

if [[ ${#failed[@]} -gt 0 ]]; then
  say "FAILED: ${failed[*]}"
  exit 1
fi
say "gpu check passed: ${PHASES[*]}"
