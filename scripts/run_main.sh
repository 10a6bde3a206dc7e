#!/usr/bin/env bash
# Sets everything up on a fresh Debian 12 machine and runs cotenant's main job:
# the replay tool on the bundled allocation traces of real models (a ResNet
# and a GPT training step, GPT token generation, ...) and on two training runs
# recorded on an H100 (PyTorch memory snapshots: the replay prints PyTorch's
# own figures beside cotenant's), first uncapped, then with the device capped
# at half of each trace's peak, so pages spill to the host.
# Extra arguments go to cotenant-replay (e.g. --json, --device-capacity 24GiB).
# Environment: as scripts/test.sh (COTENANT_SKIP_APT, COTENANT_VENV, JOBS).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
JOBS=${JOBS:-$(nproc)}
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS

source scripts/setup_env.sh

step "pip install --no-build-isolation ."
"$PYTHON" -m pip install --no-build-isolation .

mapfile -t TRACES < <("$PYTHON" benchmarks/bundled_traces.py)
step "cotenant-replay, no cap"
"$PYTHON" -m cotenant.replay "${TRACES[@]}" "$@"

for trace in "${TRACES[@]}"; do
  peak=$("$PYTHON" -m cotenant.replay "$trace" --json | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["peak_allocated_bytes"])')
  step "cotenant-replay $trace under a cap of half its peak ($((peak / 2)) bytes)"
  "$PYTHON" -m cotenant.replay "$trace" --cap "$((peak / 2))" "$@"
done
