"""What every command of ``blade-relax`` does the same way.

Progress lines and warnings go to stderr (results to stdout); ``--budget`` is a fraction of a
peak; ``--force`` runs what the memory available now cannot hold; ``--verbose`` shows TVM's
native warnings; an output file that cannot be written is bad input (exit status 2).
"""

from __future__ import annotations

import argparse
import math
import sys

from ..util.cliargs import CliError

__all__ = ["add_force", "add_verbose", "parse_fraction", "progress", "warn", "write_text"]


def progress(message: str) -> None:
    """Print a progress line of a long step on stderr (``... message``)."""
    print(f"... {message}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    """Print a warning on stderr (``warning: message``)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def parse_fraction(value: float) -> float:
    """``--budget``: a fraction of blade_relax's peak in ``(0, 1]``.

    Raises
    ------
    CliError
        For anything else (NaN included).
    """
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise CliError(f"--budget is a fraction of blade_relax's peak in (0, 1], not {value}")
    return value


def write_text(path: str, text: str, flag: str) -> None:
    """Write ``text`` to the file of an output flag (``--json PATH``).

    Raises
    ------
    CliError
        When the file cannot be written, naming ``flag``.
    """
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        raise CliError(f"{flag}: cannot write {path}: {err.strerror}") from None


def add_force(parser: argparse.ArgumentParser, what: str) -> None:
    """Add ``--force``: run even when ``what`` exceeds the memory available now."""
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"run even when {what} exceeds the memory available now (refused by default "
        "with exit status 2, before anything is allocated)",
    )


def add_verbose(parser: argparse.ArgumentParser) -> None:
    """Add ``--verbose``: show what :func:`blade_relax.util.quiet.quiet_stderr` hides."""
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show TVM's native warnings and transformers' notes on stderr (hidden by "
        "default; also BLADE_RELAX_VERBOSE=1)",
    )
