#!/usr/bin/env bash
# Creates (or reuses) a virtual environment, installs blade-relax with the extras the tests need,
# and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${BLADE_RELAX_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# The CPU build of torch first: an unpinned torch would pull the CUDA packages.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[hf,test,plot,dev]"

python -m ruff check python tests tutorials
python -m pytest -q -p no:cacheprovider "$@"
