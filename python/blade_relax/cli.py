"""The ``blade-relax`` command line: ``demo``, ``report`` and ``bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


class CliError(Exception):
    """Bad input: reported as one line on stderr with a non-zero exit code."""


def _progress(message: str) -> None:
    print(f"... {message}", file=sys.stderr, flush=True)


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CliError(f"--sizes takes comma-separated integers, not {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise CliError(f"--sizes needs positive integers, got {text!r}")
    return sizes


def run_demo(args: argparse.Namespace) -> int:
    """Compile a built-in dynamic model, run it at several sizes, compare predicted and measured."""
    import tvm
    from tvm import relax

    from .analysis import memory_timeline
    from .frontend.builtin import BUILTIN_MODELS, random_arguments
    from .pipeline import lower_to_memory_stage, stock_pipeline
    from .runtime import memory_stats, reset_memory_stats

    if args.model not in BUILTIN_MODELS:
        raise CliError(f"unknown model {args.model!r}; choose one of {', '.join(BUILTIN_MODELS)}")
    sizes = _parse_sizes(args.sizes)
    mod = BUILTIN_MODELS[args.model]()
    _progress(f"compiling {args.model} with the stock TVM pipeline for llvm")
    exe = tvm.compile(mod, "llvm", relax_pipeline=stock_pipeline("llvm"))
    vm = relax.VirtualMachine(exe, tvm.cpu())
    lowered = lower_to_memory_stage(mod)
    timeline = memory_timeline(lowered["main"], mod=lowered)
    dims = sorted(timeline.graph.dims)
    print(f"model: {args.model}   dynamic dims: {', '.join(dims)}")
    print(f"symbolic peak (bytes): {timeline.peak}")
    print()
    print(f"| {'dims':<16} | {'predicted peak':>15} | {'measured peak':>15} | match |")
    print(f"|{'-' * 18}|{'-' * 17}|{'-' * 17}|-------|")
    all_match = True
    for size in sizes:
        bindings = {d: size for d in dims}
        arrays = random_arguments(mod["main"], bindings)
        tensors = [tvm.runtime.tensor(a) for a in arrays]
        reset_memory_stats()
        base = memory_stats()["live_bytes"]
        out = vm["main"](*tensors)
        measured = memory_stats()["peak_bytes"] - base
        del out
        predicted = timeline.evaluate(bindings).peak
        all_match &= predicted == measured
        label = ",".join(f"{d}={v}" for d, v in bindings.items())
        mark = "yes" if predicted == measured else "NO"
        print(f"| {label:<16} | {predicted:>15,} | {measured:>15,} | {mark:^5} |")
    return 0 if all_match else 1


def run_bench(argv: Sequence[str]) -> int:
    from .bench import main as bench_main

    return int(bench_main(list(argv)) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blade-relax",
        description="Peak-memory optimizations on symbolic shapes for Apache TVM Relax.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="compile a small built-in dynamic model and show predicted vs measured peak bytes",
        description="Compile a small built-in model with a dynamic dimension for the CPU, run it "
        "at several sizes, and print the peak bytes the symbolic timeline predicts next to the "
        "peak bytes the runtime accounting measured.",
    )
    demo.add_argument(
        "--model",
        default="mlp-train",
        help="built-in model (mlp, attention, layer-norm, "
        "concat-split, mlp-train; default: mlp-train)",
    )
    demo.add_argument(
        "--sizes",
        default="16,128,1024",
        help="comma-separated values for the dynamic dims (default: 16,128,1024)",
    )
    sub.add_parser(
        "bench",
        help="the benchmark ruler (same flags as python -m blade_relax.bench)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``blade-relax`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return run_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            return run_demo(args)
    except CliError as err:
        print(f"blade-relax: error: {err}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
