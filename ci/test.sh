#!/usr/bin/env bash
# Creates (or reuses) a virtual environment, installs blade-relax with the extras the tests
# need, and runs ruff and the test suite. Extra arguments go to pytest.
#
# torch is installed as its CPU build, torch==2.13.0+cpu: from the configured package sources
# when they have it, otherwise from PyTorch's CPU index. (On PyPI alone, "torch==2.13.0" is the
# CUDA build: cuda-toolkit, triton and about 15 nvidia-* packages, gigabytes.) The hf extra's
# pin torch==2.13.0 is satisfied by 2.13.0+cpu, so nothing else pulls the CUDA build.
#
# Environment: BLADE_RELAX_VENV (default .venv), BLADE_RELAX_EXTRAS (more extras, e.g. "cuda"
# for NVRTC from PyPI, so that the CUDA build tests compile cubins without a CUDA toolkit),
# BLADE_RELAX_TEST_WORKERS (parallel pytest workers; default one per CPU, at most 4).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${BLADE_RELAX_VENV:-.venv}"
TORCH_VERSION="2.13.0+cpu"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
EXTRAS="hf,test,plot,dev${BLADE_RELAX_EXTRAS:+,$BLADE_RELAX_EXTRAS}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

installed_torch() {
    python -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true
}
if [ "$(installed_torch)" != "$TORCH_VERSION" ]; then
    echo "ci/test.sh: installing torch==$TORCH_VERSION (CPU build)" >&2
    if ! python -m pip install -q "torch==$TORCH_VERSION" 2>/dev/null; then
        python -m pip install -q "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
    fi
fi

# The editable install is redone only when pyproject.toml, the extras or the checkout change.
STAMP="$VENV/.blade-relax-ci"
WANT="$(sha256sum pyproject.toml | cut -c1-16) $EXTRAS $(pwd)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] || ! python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("blade_relax") is None)'; then
    echo "ci/test.sh: installing blade-relax with [$EXTRAS]" >&2
    python -m pip install -q -e ".[$EXTRAS]"
    echo "$WANT" >"$STAMP"
fi

python -m ruff check python tests tutorials
# The tests run in parallel, one pytest-xdist worker per CPU up to 4 (each worker holds a few
# GiB at most); each file's tests run in one worker, so a module's fixtures are built once.
# BLADE_RELAX_TEST_WORKERS sets the number (0 or 1: every test in this process).
if [ -z "${BLADE_RELAX_TEST_WORKERS:-}" ]; then
    cpus="$(nproc 2>/dev/null || echo 1)"
    BLADE_RELAX_TEST_WORKERS=$((cpus < 4 ? cpus : 4))
fi
# One thread per worker for torch (OMP_NUM_THREADS) and TVM's runtime (TVM_NUM_THREADS), unless
# the caller set them: at the tests' sizes a second thread costs more in synchronization than
# it saves, and the workers already share the cores. On 2 cores two test files run side by side
# took 129 s against 144-150 s with the defaults.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TVM_NUM_THREADS="${TVM_NUM_THREADS:-1}"
PARALLEL=()
if [ "$BLADE_RELAX_TEST_WORKERS" -gt 1 ]; then
    PARALLEL=(-n "$BLADE_RELAX_TEST_WORKERS" --dist loadfile)
fi
# -rs: one line per reason a test was skipped (no GPU; no CUDA compiler for the cubin step).
python -m pytest -q -rs -p no:cacheprovider ${PARALLEL[@]+"${PARALLEL[@]}"} "$@"
