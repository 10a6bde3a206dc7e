#!/usr/bin/env bash
# Builds cotenant's sdist, builds a wheel from that sdist (never from the
# checkout, so a file the sdist lacks fails here), installs the wheel into a
# fresh virtual environment next to the torch already installed, with no
# package index (the torch requirement must accept that torch), and runs
# tests/package against the installed wheel: cotenant._core (and cotenant._C
# where the CUDA toolkit is found) import, `cotenant --version`, the metadata.
# scripts/test.sh runs it and then installs the wheel it checked.
#
#   scripts/check_package.sh
#
# Environment:
#   PYTHON                      the interpreter whose torch the wheel goes next to (default: python3)
#   COTENANT_BUILD_ROOT         where the unpacked sdist, its CMake build, the fresh
#                               environment and dist/ (the sdist and the wheel) go (default: build)
#   CMAKE_BUILD_PARALLEL_LEVEL  parallel compile jobs (default: the CPU count)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
BUILD_ROOT=${COTENANT_BUILD_ROOT:-build}
[[ $BUILD_ROOT == /* ]] || BUILD_ROOT=$ROOT/$BUILD_ROOT
WORK=$BUILD_ROOT/package
DIST=$BUILD_ROOT/dist
say() { printf '\n---- %s (%ds)\n' "$*" "$SECONDS"; }

mkdir -p "$WORK" "$DIST"
rm -f "$DIST"/cotenant-*

say "sdist"
"$PYTHON" -m build --sdist --no-isolation --skip-dependency-check --outdir "$DIST" "$ROOT"
sdist=$(ls "$DIST"/cotenant-*.tar.gz)

say "wheel from the sdist"
# Unpacked at a fixed place, with its files' own times, and built in a CMake
# directory kept between runs: a rerun recompiles only what changed.
rm -rf "$WORK/src"
mkdir -p "$WORK/src"
tar -xzf "$sdist" -C "$WORK/src" --strip-components=1
COTENANT_CMAKE_BUILD_DIR="$WORK/cmake" \
  "$PYTHON" -m pip wheel --no-build-isolation --no-deps --no-index --wheel-dir "$DIST" "$WORK/src"
wheel=$(ls "$DIST"/cotenant-*.whl)

say "install into a fresh environment next to the installed torch"
venv=$WORK/venv
rm -rf "$venv"
"$PYTHON" -m venv --system-site-packages "$venv"
# --system-site-packages shows the base interpreter's packages; where PYTHON is
# itself a virtual environment (CI's .venv), torch lives in that environment's
# site-packages, so the fresh one is pointed there too.
parent_site=$("$PYTHON" -c 'import site, sys; print("\n".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')
if [[ -n $parent_site ]]; then
  venv_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  printf '%s\n' "$parent_site" >"$venv_site/parent_environment.pth"
fi
# The wheel itself, into the fresh environment even where the parent one holds
# a cotenant of the same version; then its requirements, with no index: the
# torch already installed must meet them.
"$venv/bin/python" -m pip install --quiet --no-index --no-deps --force-reinstall "$wheel"
"$venv/bin/python" -m pip install --quiet --no-index "$wheel"

say "tests/package against the installed wheel"
# Where the CUDA toolkit is installed the wheel must hold the torch extension.
if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export COTENANT_REQUIRE_TORCH_EXTENSION=1
fi
# From outside the source tree, so `import cotenant` is the installed wheel.
(cd / && COTENANT_SDIST="$sdist" COTENANT_WHEEL="$wheel" \
  "$venv/bin/python" -m pytest -p no:cacheprovider --rootdir "$ROOT" -c "$ROOT/pyproject.toml" "$ROOT/tests/package")
echo "checked $wheel"
