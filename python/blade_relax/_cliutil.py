"""What the two command lines share: one-line errors and output paths checked up front.

Imports nothing heavy: ``--help`` and bad input are answered before TVM is imported.
"""

from __future__ import annotations

import argparse
import os
from typing import NoReturn

__all__ = ["CliError", "OneLineParser", "check_output_path", "first_line"]


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
