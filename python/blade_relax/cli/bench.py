"""``blade-relax bench``: the benchmark ruler, :func:`blade_relax.bench.main`, with its own flags.

The arguments after ``bench`` go to the ruler's own parser untouched, ``--help`` included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["add_bench_parser", "run_bench"]


def add_bench_parser(subparsers: Any) -> None:
    """Name ``bench`` among the subcommands of ``blade-relax`` (its flags are the ruler's)."""
    subparsers.add_parser(
        "bench",
        help="the benchmark ruler; same flags as python -m blade_relax.bench "
        "(blade-relax bench --help lists them)",
        add_help=False,
    )


def run_bench(argv: Sequence[str]) -> int:
    """Hand the arguments to the benchmark's own command line."""
    from ..bench.cli import main as bench_main

    return int(bench_main(list(argv), prog="blade-relax bench") or 0)
