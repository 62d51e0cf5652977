"""Shared fixtures: well-formedness around every pass, and the `gpu` marker."""

from __future__ import annotations

import gc
import inspect
import os

import pytest
import tvm
from hypothesis import settings
from tvm.relax.ir.instrument import WellFormedInstrument

from blade_relax.transform.schedule import forget_schedules

# Property tests draw the same examples on every run (CI must not turn red by chance);
# HYPOTHESIS_PROFILE=explore draws new ones, to hunt for bugs.
settings.register_profile("deterministic", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

# TVMScript's decorators (``@T.prim_func``, ``@I.ir_module``, ``@R.function``) call
# ``inspect.stack()``, which asks ``inspect.getmodule`` for each frame's module. For a frame of a
# file that does not exist (importlib's, while a test module is imported; runpy's, under
# ``python -m pytest``; TVM's parser's ``<ast>``), Python scans all of ``sys.modules`` on every
# call and finds none: with torch and transformers loaded, ``pytest --collect-only`` of the suite
# took 105 s, 18.6 s with these entries. Naming those files in getmodule's cache, under a module
# name that is not loaded, gives the scan's answer (no module) at once. (A Python without that
# cache scans as before.)
_module_by_file = getattr(inspect, "modulesbyfile", {})
for _pseudo_file in (
    "<frozen importlib._bootstrap>",
    "<frozen importlib._bootstrap_external>",
    "<frozen runpy>",
    "<ast>",
):
    _module_by_file.setdefault(_pseudo_file, "<not a module>")


def pytest_collection_modifyitems(config, items):
    if tvm.cuda().exist:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (tvm.cuda().exist is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_collection_finish(session):
    # Collection imported every test module (torch, transformers, TVM): about 435,000 objects
    # that live as long as the worker. Frozen, they are left out of every later full collection,
    # the explicit ones before a measured call (``measure_call``) included, which otherwise scan
    # them all each time (0.2 s per collection for these imports alone).
    gc.freeze()


@pytest.fixture(autouse=True)
def _schedules_fresh_around_patches(request):
    """MemoryAwareSchedule remembers its runs for the process (``transform/schedule/_memo.py``).
    A test that patches code may change what the pass computes: it neither takes a schedule
    remembered before it nor leaves its own to the tests after it."""
    if "monkeypatch" not in request.fixturenames:
        yield
        return
    forget_schedules()
    yield
    forget_schedules()


@pytest.fixture
def well_formed_checks():
    """Run every pass under a PassContext that checks the module is well formed before/after."""
    current = tvm.transform.PassContext.current()
    instruments = list(current.instruments) + [WellFormedInstrument()]
    with tvm.transform.PassContext(
        opt_level=current.opt_level, instruments=instruments, config=current.config
    ):
        yield
