#!/usr/bin/env bash
# Copies the header-only build dependencies that a machine without Debian's
# packages lacks (the GPU machine: python3 with torch, nvcc, cmake, ninja, no
# network) from this machine's Debian packages into one prefix:
#
#   scripts/carry_deps.sh [DEST]        DEST: the prefix to write (default: .deps)
#
# DEST then holds include/ and share/cmake/ as the packages lay them out under
# /usr, and CMake finds them there when DEST is on CMAKE_PREFIX_PATH
# (scripts/gpu_check.sh puts .deps there when it exists). .deps is ignored by
# git; carry it to the GPU machine with the working tree. fmt is not copied:
# the torch wheel ships its headers (CMakeLists.txt).
#
# Packages: robin-map-dev (tsl::robin_map, the allocator's map of live blocks).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEST=${1:-.deps}
PACKAGES=(robin-map-dev)

for package in "${PACKAGES[@]}"; do
  if ! files=$(dpkg -L "$package" 2>/dev/null); then
    echo "carry_deps: $package is not installed here: apt-get install $package, then run this again" >&2
    exit 1
  fi
  while IFS= read -r file; do
    [[ -f $file && ($file == /usr/include/* || $file == /usr/share/cmake/*) ]] || continue
    mkdir -p "$DEST/$(dirname "${file#/usr/}")"
    cp "$file" "$DEST/${file#/usr/}"
  done <<<"$files"
done
[[ -f $DEST/include/tsl/robin_map.h && -d $DEST/share/cmake/tsl-robin-map ]] || {
  echo "carry_deps: $DEST lacks tsl-robin-map's headers or CMake files after copying" >&2
  exit 1
}
echo "carry_deps: ${PACKAGES[*]} in $DEST"
