"""Command line of the benchmark: ``python -m blade_relax.bench`` and ``blade-relax bench``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

DEFAULT_CONFIGS = "tvm-dynamic,tvm-bounded,tvm-static,torch-eager"


def _progress(message: str) -> None:
    print(f"... {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (sizes default to the ``small`` preset)."""
    from .workloads import WORKLOADS

    parser = argparse.ArgumentParser(
        prog="python -m blade_relax.bench",
        description="Measure peak memory, step time, compile time and correctness of several "
        "configurations side by side on one workload and one sequence-length trace.",
    )
    parser.add_argument("--workload", default="llama-train", choices=sorted(WORKLOADS))
    parser.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help=f"comma-separated config names (default: {DEFAULT_CONFIGS}); see --list-configs",
    )
    parser.add_argument("--list-configs", action="store_true", help="list configs and exit")
    parser.add_argument(
        "--size",
        default="small",
        choices=["small", "real"],
        help="size preset; the flags below override single sizes (default: small)",
    )
    for flag, help_text in (
        ("layers", "decoder layers (hidden layers for mlp-train)"),
        ("hidden", "hidden size"),
        ("heads", "attention heads"),
        ("kv-heads", "key/value heads (Llama)"),
        ("intermediate", "MLP width"),
        ("vocab", "vocabulary size (classes for mlp-train)"),
        ("max-seq-len", "largest sequence length (the exported Dim max)"),
        ("min-seq-len", "smallest sequence length (>= 2)"),
        ("batch", "batch size"),
    ):
        parser.add_argument(f"--{flag}", type=int, default=None, help=help_text)
    parser.add_argument("--trace-len", type=int, default=6, help="entries in the trace (6)")
    parser.add_argument("--seed", type=int, default=0, help="seed of trace and weights (0)")
    parser.add_argument(
        "--lengths", default=None, help="explicit comma-separated lengths instead of the trace"
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed steps per length (3)")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max relative error")
    parser.add_argument(
        "--target", default="llvm", help="TVM target for the TVM configs (default: llvm)"
    )
    parser.add_argument("--out", default=None, help="write the JSON results here")
    parser.add_argument("--plot", default=None, help="write a PNG of peak bytes vs length here")
    parser.add_argument(
        "--budget-plot",
        default=None,
        help="write a PNG of step time vs peak for the budgeted configurations here "
        "(blade-relax@B and torch-compile@F, as ratios to their unbudgeted runs)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def _sizes(args: argparse.Namespace):
    from .workloads import PRESETS

    sizes = PRESETS[args.size]
    overrides = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(sizes)
        if getattr(args, field.name, None) is not None
    }
    return dataclasses.replace(sizes, **overrides)


def _lengths(args: argparse.Namespace, sizes) -> tuple[list[int], dict]:
    from .trace import length_trace

    if args.lengths:
        try:
            lengths = [int(v) for v in args.lengths.split(",") if v.strip()]
        except ValueError:
            raise ValueError(
                f"--lengths takes comma-separated integers, not {args.lengths!r}"
            ) from None
        return lengths, {"kind": "explicit", "lengths": lengths}
    trace = length_trace(args.trace_len, sizes.min_seq_len, sizes.max_seq_len, seed=args.seed)
    info = {
        "kind": "lognormal",
        "seed": trace.seed,
        "lengths": list(trace.lengths),
        "distribution": trace.distribution,
    }
    return trace.unique, info


def _print_configs() -> None:
    from .configs import _CONFIGS, _FAMILIES

    names = [*_CONFIGS, *(prefix + "@B" for prefix in _FAMILIES)]
    width = max(map(len, names), default=0) + 1
    for name, config in sorted(_CONFIGS.items()):
        print(f"{name:<{width}} {config.description}")
    for prefix, family in sorted(_FAMILIES.items()):
        print(f"{prefix + '@B':<{width}} {family.description}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 when every requested measurement matched torch, 1 otherwise."""
    from ..frontend import DimOutOfRangeError
    from .configs import get_config
    from .report import budget_table, markdown_table, write_budget_plot, write_json, write_plot
    from .runner import run_benchmark
    from .workloads import build_workload

    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.list_configs:
        _print_configs()
        return 0
    say = (lambda _m: None) if args.quiet else _progress
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    try:
        for name in names:
            get_config(name)
        sizes = _sizes(args)
        lengths, trace = _lengths(args, sizes)
        for n in lengths:
            if not sizes.min_seq_len <= n <= sizes.max_seq_len:
                raise DimOutOfRangeError(
                    f"sequence length {n} is outside the exported range "
                    f"{sizes.min_seq_len} <= s <= {sizes.max_seq_len} (--max-seq-len)"
                )
    except ValueError as err:
        parser.error(str(err))
    say(f"building {args.workload} ({sizes})")
    workload = build_workload(args.workload, sizes, seed=args.seed)
    result = run_benchmark(
        workload,
        names,
        lengths,
        target=args.target,
        repeat=args.repeat,
        tolerance=args.tolerance,
        trace=trace,
        progress=say,
    )
    print(f"## {args.workload} on {args.target}: trace {trace.get('lengths')}\n")
    print(markdown_table(result))
    sweep = budget_table(result)
    if sweep:
        print("\n### Peak and step time against the budget (medians over the trace)\n")
        print(sweep)
    if args.out:
        say(f"wrote {write_json(result, args.out)}")
    if args.plot:
        say(f"wrote {write_plot(result, args.plot)}")
    if args.budget_plot:
        if sweep:
            say(f"wrote {write_budget_plot(result, args.budget_plot)}")
        else:
            say("no budgeted configuration was run: --budget-plot skipped")
    return 0 if result.all_correct else 1
