"""What the command lines share: one-line errors, output paths and memory checked up front.

Imports nothing heavy: ``--help`` and bad input are answered before TVM is imported.
"""

from __future__ import annotations

import argparse
import os
from typing import NoReturn

__all__ = [
    "CliError",
    "OneLineParser",
    "available_memory",
    "check_output_path",
    "first_line",
    "human_bytes",
    "refuse_beyond_memory",
]


class CliError(Exception):
    """Bad input: reported as one line on stderr with exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) through :class:`CliError`."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see {self.prog} --help)")


def first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's message (its type name if it has none)."""
    for line in str(err).strip().splitlines():
        if line.strip():
            return line.strip()
    return type(err).__name__


def check_output_path(path: str | None, flag: str) -> str | None:
    """Fail before any long step when an output file cannot be written.

    A missing parent directory is created (``--plot out/demo.png`` works in a fresh clone)
    when its nearest existing ancestor is a writable directory.

    Raises
    ------
    CliError
        When ``path`` is a directory, a parent is not a directory, or nothing can be written.
    """
    if path is None:
        return None
    if not path or os.path.isdir(path):
        raise CliError(f"{flag}: {path!r} is not a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        existing = parent
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise CliError(f"{flag}: {existing} is not a directory")
        if not os.access(existing, os.W_OK):
            raise CliError(f"{flag}: cannot create {parent}: {existing} is not writable")
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as err:
            raise CliError(f"{flag}: cannot create {parent}: {err.strerror}") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise CliError(f"{flag}: {path} is not writable")
    if not os.access(parent, os.W_OK):
        raise CliError(f"{flag}: the directory {parent} is not writable")
    return path


def human_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest unit up to GiB that keeps it readable (``"1,024.00 GiB"``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.2f} {unit}"
        value /= 1024
    return f"{nbytes} B"  # pragma: no cover - the loop always returns


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except (OSError, ValueError):
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory() -> int | None:
    """Bytes this process can still allocate now, where the platform says (``None``: unknown).

    The smaller of what the kernel can hand out (``MemAvailable``: free memory plus caches it
    can drop; free pages where there is no ``/proc/meminfo``) and what the control group's
    limit leaves: in a container the limit, not the machine, is what the OOM killer enforces.
    """
    candidates: list[int] = []
    meminfo = _meminfo_available()
    if meminfo is None:
        try:
            meminfo = int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, OSError, ValueError):
            meminfo = None
    if meminfo is not None:
        candidates.append(meminfo)
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",  # cgroup v1
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        # cgroup v1 reports "no limit" as a number near 2**63.
        if limit is not None and usage is not None and limit < 2**60:
            candidates.append(max(limit - usage, 0))
    return min(candidates) if candidates else None


def refuse_beyond_memory(
    what: str,
    need: int,
    breakdown: str,
    free: int | None,
    *,
    force: bool,
    before: str,
    floor: bool = False,
) -> None:
    """Refuse, as bad input, a run whose predicted bytes exceed the memory available now.

    Without the check such a run dies far from its cause: numpy's ``MemoryError`` traceback
    after seconds, or the kernel's OOM killer (exit 137) after minutes.

    Parameters
    ----------
    what
        The sizes asked for, as the user gave them (``"--sizes: s=100000"``).
    need
        The predicted bytes (the peak, or with ``floor`` what the run holds at least).
    breakdown
        What ``need`` is made of, for the message.
    free
        :func:`available_memory` (``None``: unknown, nothing is refused).
    force
        ``--force``: run anyway.
    before
        What was not done yet (``"compiling or allocating anything"``).
    floor
        ``need`` is a floor, not a predicted peak: the message says "at least".

    Raises
    ------
    CliError
        When ``need > free`` and not ``force``: one line naming the sizes, the predicted bytes,
        the available memory and ``--force``.
    """
    if force or free is None or need <= free:
        return
    amount = "at least" if floor else "a predicted peak of"
    raise CliError(
        f"{what} needs {amount} {human_bytes(need)} ({breakdown}), more than the "
        f"{human_bytes(free)} of memory available now; refused before {before} "
        "(--force runs it anyway)"
    )
