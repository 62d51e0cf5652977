"""Quiet by default: TVM's native warnings and the Hugging Face stack's notes, filtered.

TVM's C++ code logs warnings straight to file descriptor 2 (``Detected pow(x, y) where y >=
3``, ``Fast mode segfaults when there are out-of-bounds indices``, ``Unknown pragma``, ...):
hundreds of lines for one Hugging Face import, none of them actionable for a user of
blade_relax. Python's ``warnings`` and ``logging`` filters never see them, so
:func:`quiet_stderr` points descriptor 2 at a temporary file while it is active and a thread
copies every line of that file that is not known noise (:func:`is_noise`) to the real stderr
as it arrives. Python's own ``sys.stderr`` keeps writing to the real stderr directly, so
progress lines and tracebacks are neither delayed nor filtered. Writes to a file never block,
so a burst of native warnings cannot stall the process the way a full pipe could.

Python-level noise is filtered too: transformers' logging is set to errors only (its
``eos_token_id must be None ...`` notes on randomly configured models) and torch's
``LeafSpec`` deprecation warning is ignored.

``verbose=True``, or the environment variable ``BLADE_RELAX_VERBOSE=1``, turns all of this
off. The command line has ``--verbose``; tutorials call :func:`quiet` once at the top.

This module imports nothing heavy: the command lines use it before TVM is imported.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator

__all__ = ["NOISE", "VERBOSE_ENV", "is_noise", "quiet", "quiet_stderr", "verbose_requested"]

#: Environment variable that shows everything (``1``, ``true``, ``yes``, ``on``).
VERBOSE_ENV = "BLADE_RELAX_VERBOSE"

#: Native log lines that are known noise: TVM warnings emitted while importing and compiling
#: models, unrelated to anything blade_relax or its user can act on.
NOISE: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p)
    for p in (
        # topi's take/gather in "fast" mode (embedding lookups of every HF import)
        r"Warning: Fast mode segfaults when there are out-of-bounds indices",
        # GELU's tanh approximation (x ** 3) in GPT-2
        r"Warning: Detected pow\(x, y\) where y >= 3",
        # LLVM code generation of the kernels' pragma_scope annotations
        r"Warning: Unknown pragma",
    )
)


def verbose_requested() -> bool:
    """Whether ``BLADE_RELAX_VERBOSE`` asks for every message."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def is_noise(line: str) -> bool:
    """Whether one line of native stderr is known noise (see :data:`NOISE`)."""
    return any(p.search(line) for p in NOISE)


def _quiet_python() -> None:
    """Filter the Python-level notes of the Hugging Face stack (idempotent)."""
    # transformers reads the variable when it configures its logger (on import); when it is
    # imported already, set its verbosity directly.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    module = sys.modules.get("transformers")
    if module is not None:
        with contextlib.suppress(Exception):
            module.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
    warnings.filterwarnings(
        "ignore", message=r"Cannot determine the NVRTC version", category=RuntimeWarning
    )


class _Filter:
    """Descriptor 2 redirected to a temporary file; a thread forwards the lines that matter."""

    POLL_SECONDS = 0.05

    def __init__(self) -> None:
        self._target = os.dup(2)  # the real stderr
        self._capture = tempfile.TemporaryFile(mode="w+b", buffering=0)
        self._done = threading.Event()
        self._offset = 0
        self._pending = b""
        self._python_stderr = None
        self._saved_sys_stderr = None
        # Python's own writes go straight to the real stderr, not through the filter.
        stream = sys.stderr
        if stream is not None and _writes_to_fd2(stream):
            stream.flush()
            self._python_stderr = open(  # noqa: SIM115 - closed in stop()
                os.dup(self._target),
                "w",
                buffering=1,
                encoding=getattr(stream, "encoding", None) or "utf-8",
                errors=getattr(stream, "errors", None) or "backslashreplace",
            )
            self._saved_sys_stderr = stream
            sys.stderr = self._python_stderr
        os.dup2(self._capture.fileno(), 2)
        self._thread = threading.Thread(target=self._run, name="blade-relax-stderr", daemon=True)
        self._thread.start()

    def _forward(self, final: bool) -> None:
        size = os.fstat(self._capture.fileno()).st_size
        if size > self._offset:
            self._pending += os.pread(self._capture.fileno(), size - self._offset, self._offset)
            self._offset = size
        *lines, self._pending = self._pending.split(b"\n")
        if final and self._pending:
            lines.append(self._pending)
            self._pending = b""
        kept = [ln for ln in lines if not is_noise(ln.decode("utf-8", "replace"))]
        if kept:
            data = b"".join(ln + b"\n" for ln in kept)
            with contextlib.suppress(OSError):
                os.write(self._target, data)

    def _run(self) -> None:
        while not self._done.wait(self.POLL_SECONDS):
            self._forward(final=False)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        if self._saved_sys_stderr is not None and sys.stderr is self._python_stderr:
            sys.stderr = self._saved_sys_stderr
        if self._python_stderr is not None:
            with contextlib.suppress(OSError, ValueError):
                self._python_stderr.flush()
                self._python_stderr.close()
        os.dup2(self._target, 2)
        self._forward(final=True)
        os.close(self._target)
        self._capture.close()


def _writes_to_fd2(stream: object) -> bool:
    try:
        return stream.fileno() == 2  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False  # a captured or replaced stream: leave it alone


@contextlib.contextmanager
def quiet_stderr(verbose: bool | None = None) -> Iterator[None]:
    """Filter known native noise from stderr (and quiet transformers) while active.

    Parameters
    ----------
    verbose
        ``True`` shows everything (the context does nothing); ``None`` reads
        ``BLADE_RELAX_VERBOSE``.
    """
    if verbose is None:
        verbose = verbose_requested()
    if verbose:
        yield
        return
    _quiet_python()
    try:
        flt = _Filter()
    except OSError:  # no descriptor 2 to redirect: nothing to filter
        yield
        return
    try:
        yield
    finally:
        flt.stop()


_process_filter: _Filter | None = None


def quiet(verbose: bool | None = None) -> None:
    """Filter known native noise from stderr for the rest of the process (tutorials, scripts).

    Idempotent. ``BLADE_RELAX_VERBOSE=1`` (or ``verbose=True``) leaves stderr as it is.
    """
    global _process_filter
    if verbose is None:
        verbose = verbose_requested()
    if verbose or _process_filter is not None:
        return
    _quiet_python()
    try:
        _process_filter = _Filter()
    except OSError:
        return
    atexit.register(_stop_process_filter)


def _stop_process_filter() -> None:
    global _process_filter
    if _process_filter is not None:
        _process_filter.stop()
        _process_filter = None
