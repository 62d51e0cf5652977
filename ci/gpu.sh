#!/usr/bin/env bash
# The GPU program in one command (python -m blade_relax.gpuprog; see its docstrings).
#
#   bash ci/gpu.sh --plan        # the steps and their estimated seconds on the GPU machine
#   bash ci/gpu.sh --dry-run     # on the CPU: import and carry the workloads (.gpuprog/), build
#                                # every CUDA executable, collect the GPU tests, check what
#                                # travels (with .gpukit/ from ../shared/gpu/make-kit.sh), plan
#   . .gpukit/device-setup.sh && bash ci/gpu.sh   # on the GPU machine: results under $OUT
#
# Python: $BLADE_RELAX_PYTHON, else the project's .venv when there is one (the CPU machine),
# else python3 (the GPU machine, whose PYTHONPATH device-setup.sh sets). Extra arguments go to
# the program (--size tiny, --carried DIR, --out DIR, --only STEP,..., --deadline S).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${BLADE_RELAX_PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then
        BLADE_RELAX_PYTHON="$PWD/.venv/bin/python"
    else
        BLADE_RELAX_PYTHON=python3
    fi
fi
export BLADE_RELAX_PYTHON
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$BLADE_RELAX_PYTHON" -m blade_relax.gpuprog "$@"
