"""The ``blade-relax`` command line: ``demo``, ``report``, ``train`` and ``bench``.

``demo``
    Compiles a built-in model with a dynamic dimension three ways and runs it at several sizes:
    TVM's stock pipeline, blade_relax's pipeline (:func:`blade_relax.get_pipeline`), and the
    same executable under a runtime memory budget (a fraction of its own measured peak). For
    each it prints the peak the symbolic timeline predicts next to the peak the runtime
    accounting measures, the ratio to stock, the evictions and regenerations, and writes a plot.
    A prediction that misses its measurement, or outputs that differ from stock TVM's, end the
    command with status 1.
``report``
    The :class:`blade_relax.analysis.MemoryReport` of one function of a module saved as
    TVMScript (``mod.script()``) or of a built-in model, before and after our passes, as a text
    table, JSON, a Chrome trace and a plot.
``train``
    Trains a bench model (Llama or GPT-2, random init) for ``--steps`` optimizer steps on
    synthetic token batches of long-tailed lengths, with blade_relax's compiled step (optimizer
    in the graph, one compilation) and with PyTorch's loop on the same init and batches
    (:func:`blade_relax.bench.training.compare_training`); prints loss and peak bytes per length
    against PyTorch's, writes a plot and JSON. Losses that differ from PyTorch's by more than
    ``1e-4`` (relative) end the command with status 1.
``bench``
    The benchmark ruler, :func:`blade_relax.bench.main`, with its own flags.

Bad input (an unknown model, a missing or unparsable file, malformed ``--dims``/``--sizes``,
an unwritable output path, sizes whose predicted memory exceeds what is available now unless
``--force``, ...) ends the command with status 2 and one line on stderr, before anything is
compiled or allocated. Default outputs go under ``out/``, which is created when missing. Progress
lines of long steps (building a model, compiling, lowering, every run) go to stderr, results to
stdout. TVM's native warnings and transformers' notes are filtered from stderr unless
``--verbose`` (or ``BLADE_RELAX_VERBOSE=1``).

``--help`` and the checks of the arguments import no TVM (it takes seconds to import on a small
machine); a command imports it when it starts its work.

One module per command (:mod:`.demo` with :mod:`.demo_plot`, :mod:`.report`, :mod:`.train`,
:mod:`.bench`), each with its ``add_*`` function for the parser and its ``run_*`` function;
:mod:`.models` names and builds the models, :mod:`.lowering` lowers to the memory stage and
names what it finds, :mod:`.common` holds what every command does the same way.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..util.cliargs import CliError, OneLineParser
from .bench import add_bench_parser, run_bench
from .demo import add_demo_arguments, run_demo
from .lowering import function_label
from .models import Model, load_model, model_names
from .report import add_report_arguments, run_report
from .train import add_train_arguments, run_train

__all__ = [
    "CliError",
    "Model",
    "build_parser",
    "function_label",
    "load_model",
    "main",
    "model_names",
]


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``blade-relax`` (``bench`` is handed to :func:`blade_relax.bench.main`)."""
    parser = OneLineParser(
        prog="blade-relax",
        description="Peak-memory optimizations on symbolic shapes for Apache TVM Relax.\n"
        "See the story on a small model (demo), read the memory report of a module (report),\n"
        "train a model with the optimizer in the compiled step against PyTorch (train),\n"
        "or measure configurations side by side (bench).",
        epilog="examples:\n"
        "  blade-relax demo --plot out/demo.png\n"
        "  blade-relax demo --model mlp-train --sizes 64,512 --budget 0.95 --no-plot\n"
        "  blade-relax report attention --dims s=256 --json out/report.json --plot out/r.png\n"
        "  blade-relax report my_module.py --function main --dims n=64 --pipeline stock\n"
        "  blade-relax train --model llama --steps 50 --budget 0.8 --plot out/train.png\n"
        "  blade-relax train --nproc 2 --batch 4 --steps 20 --no-plot\n"
        "  blade-relax bench --workload mlp-train --configs tvm-dynamic,blade-relax\n"
        "exit status: 0 on success, 1 when a check fails (demo, train), 2 on bad input (one line\n"
        "on stderr). Progress lines go to stderr, results to stdout; missing directories of\n"
        "output paths are created. TVM's native warnings are hidden unless --verbose.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,report,train,bench}")
    add_demo_arguments(sub)
    add_report_arguments(sub)
    add_train_arguments(sub)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``blade-relax`` console script.

    Parameters
    ----------
    argv
        The arguments after the program name; ``sys.argv[1:]`` when ``None``.

    Returns
    -------
    int
        The exit status: 0 on success, 1 when a check fails (demo, train), 2 on bad input.
    """
    from ..util.quiet import quiet_stderr

    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "bench":
        return run_bench(args_list[1:])
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(args_list)
        except SystemExit as done:  # --help
            return int(done.code or 0)
        args.argv = args_list  # what a launcher of ranks runs again (train --nproc)
        handler = {"demo": run_demo, "report": run_report, "train": run_train}.get(args.command)
        if handler is None:
            raise CliError(f"unknown command {args.command!r}")
        with quiet_stderr(verbose=True if args.verbose else None):
            return handler(args)
    except CliError as err:
        print(f"blade-relax: error: {err}", file=sys.stderr, flush=True)
        return 2
