# Sourced by scripts/test.sh and scripts/run_main.sh: installs the system
# packages and the Python packages cotenant needs, and sets PYTHON to the
# interpreter to use. See scripts/test.sh for the environment variables.
#   COTENANT_SKIP_APT=1   do not apt-get install (the packages are there already)
#   COTENANT_VENV         a virtual environment to create and use (default: .venv
#                         when python3 is the system's externally managed Python,
#                         otherwise python3 itself is used)
started=${started:-$SECONDS}
step() { printf '\n==== %s (%ds elapsed)\n' "$*" $((SECONDS - started)); }

# ---- system packages ----------------------------------------------------------------
if [[ "${COTENANT_SKIP_APT:-0}" != 1 ]]; then
  step "system packages"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO=sudo; fi
  $SUDO apt-get update
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends \
    build-essential cmake ninja-build catch2 libfmt-dev robin-map-dev python3 python3-dev python3-venv python3-pip
fi

# ---- Python -------------------------------------------------------------------------
step "Python environment"
PYTHON=${PYTHON:-python3}
externally_managed=$("$PYTHON" -c 'import os, sysconfig; print(int(os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))))')
VENV=${COTENANT_VENV:-}
if [[ -z "$VENV" && "$externally_managed" == 1 ]]; then VENV=.venv; fi
if [[ -n "$VENV" ]]; then
  # System site packages stay visible so an installed torch is not downloaded again.
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv --system-site-packages "$VENV"
  PYTHON=$(cd "$VENV" && pwd)/bin/python
fi
"$PYTHON" -m pip install "setuptools>=64" wheel build packaging
# torch: the minor release cotenant's C++ ABI needs (setup.py); the extras
# (cotenant[all]) and what the tests use.
"$PYTHON" -m pip install "torch>=2.11,<2.12" prometheus-client matplotlib "ray>=2.60" scipy pytest pytest-xdist hypothesis nvidia-ml-py 'tomli>=1.1; python_version < "3.11"'
echo "python: $("$PYTHON" -c 'import sys, torch; print(sys.executable, "torch", torch.__version__)' 2>/dev/null)"

