#!/usr/bin/env bash
# Two training jobs on one GPU under the coordinator (needs an NVIDIA GPU).
# The guaranteed job keeps its speed; the opportunistic one uses what is left
# and spills to host memory when the guaranteed job needs more.
set -euo pipefail
cd "$(dirname "$0")"
cotenant coordinator --gpus 0 &
coordinator=$!
trap 'kill $coordinator' EXIT
sleep 1
cotenant run --guaranteed --name main -- python capped_training.py &
cotenant run --opportunistic --name extra -- python capped_training.py &
cotenant status --watch --interval 2 &
wait %2 %3
cotenant timeline -o timeline.png
