"""Command line of the benchmark: ``python -m blade_relax.bench`` and ``blade-relax bench``.

Bad input (an unknown workload or config, a malformed ``--lengths``, lengths outside the
exported range, sizes that do not fit together, an unwritable output path) ends the command
with status 2 and one line on stderr, before anything is built. ``--help`` and those checks
import no TVM; TVM's native warnings are filtered unless ``--verbose``.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Sequence

from ..util.cliargs import (
    CliError,
    OneLineParser,
    available_memory,
    check_output_path,
    first_line,
    refuse_beyond_memory,
)

__all__ = ["WORKLOAD_NAMES", "build_parser", "main"]

DEFAULT_CONFIGS = "tvm-dynamic,tvm-bounded,tvm-static,torch-eager"
DEFAULT_PROG = "python -m blade_relax.bench"
#: The names of :data:`blade_relax.bench.workloads.WORKLOADS`, known without importing TVM.
WORKLOAD_NAMES = (
    "gpt2-infer",
    "gpt2-train",
    "llama-lora-sft",
    "llama-sft",
    "llama-train",
    "mlp-train",
    "tanh-mlp-train",
)


def _progress(message: str) -> None:
    print(f"... {message}", file=sys.stderr, flush=True)


def build_parser(prog: str = DEFAULT_PROG) -> argparse.ArgumentParser:
    """The argument parser (sizes default to the ``small`` preset); errors raise CliError."""
    parser = OneLineParser(
        prog=prog,
        description="Measure peak memory, step time, compile time and correctness of several "
        "configurations side by side on one workload and one sequence-length trace.",
    )
    parser.add_argument(
        "--workload",
        default="llama-train",
        choices=WORKLOAD_NAMES,
        help="the model and step to measure (default: llama-train)",
    )
    parser.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help=f"comma-separated config names (default: {DEFAULT_CONFIGS}); see --list-configs",
    )
    parser.add_argument("--list-configs", action="store_true", help="list configs and exit")
    parser.add_argument(
        "--size",
        default="small",
        choices=["small", "real", "1b"],
        help="size preset: small (CPU, minutes), real (a GPU), 1b (Llama-2 architecture at "
        "1.1B parameters: 22 layers, hidden 2048, 32 heads / 4 KV heads, MLP 5632, vocabulary "
        "32000, s <= 2048; run it with --predict on a CPU); the flags below override single "
        "sizes (default: small)",
    )
    parser.add_argument(
        "--predict",
        action="store_true",
        help="predict instead of measuring: TVM peaks from the symbolic timeline of the IR "
        "each config compiles (lowered to the memory stage, no kernel built or run), PyTorch "
        "eager's from the same counter on meta tensors, torch.compile's from the same counter "
        "over Inductor's generated code run with its kernels skipped; the weights are not drawn",
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
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="weights and computation of the Hugging Face workloads (default: float32)",
    )
    parser.add_argument(
        "--autocast",
        default=None,
        choices=["bfloat16", "float16"],
        help="mixed precision of the Hugging Face training workloads: float32 weights, the "
        "forward under torch.autocast of this dtype (default: none)",
    )
    parser.add_argument("--trace-len", type=int, default=6, help="entries in the trace (6)")
    parser.add_argument("--seed", type=int, default=0, help="seed of trace and weights (0)")
    parser.add_argument(
        "--lengths", default=None, help="explicit comma-separated lengths instead of the trace"
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed steps per length (3)")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max relative error")
    parser.add_argument(
        "--target",
        default="host",
        help="TVM target for the TVM configs: host (llvm for this machine's CPU, the "
        "default), llvm (a generic CPU of the architecture) or cuda",
    )
    parser.add_argument("--out", default=None, help="write the JSON results here")
    parser.add_argument("--plot", default=None, help="write a PNG of peak bytes vs length here")
    parser.add_argument(
        "--budget-plot",
        default=None,
        help="write a PNG of step time vs peak for the budgeted configurations here "
        "(blade-relax@B and torch-compile@F, as ratios to their unbudgeted runs)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="run even when what a step at these sizes holds at least (parameters, inputs, "
        "the logits or the gradients) exceeds the memory available now (refused by default "
        "with exit status 2, before anything is built)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show TVM's native warnings and transformers' notes (hidden by default; also "
        "BLADE_RELAX_VERBOSE=1)",
    )
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


def _explicit_lengths(text: str) -> list[int]:
    try:
        lengths = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CliError(f"--lengths takes comma-separated integers, not {text!r}") from None
    if not lengths:
        raise CliError(f"--lengths needs at least one length, got {text!r}")
    return lengths


def _lengths(args: argparse.Namespace, sizes) -> tuple[list[int], dict]:
    from .trace import length_trace
    from .workloads import SFT_WORKLOADS, workload_sizes

    if args.lengths:
        lengths = _explicit_lengths(args.lengths)
        return lengths, {"kind": "explicit", "lengths": lengths}
    if args.workload in SFT_WORKLOADS:
        from .sft import sft_trace

        batch = workload_sizes(args.workload, sizes).batch
        sft = sft_trace(args.trace_len, batch, sizes.min_seq_len, sizes.max_seq_len, args.seed)
        info = {
            "kind": "sft",
            "seed": sft.seed,
            "lengths": sft.lengths,
            "pairs": [list(map(list, pairs)) for pairs in sft.steps],
            "distribution": sft.distribution,
        }
        return sft.unique, info
    trace = length_trace(args.trace_len, sizes.min_seq_len, sizes.max_seq_len, seed=args.seed)
    info = {
        "kind": "lognormal",
        "seed": trace.seed,
        "lengths": list(trace.lengths),
        "distribution": trace.distribution,
    }
    return trace.unique, info


def _check_light(args: argparse.Namespace) -> None:
    """Checks that need no TVM: numbers in range, lengths parse, output paths writable."""
    for flag in ("layers", "hidden", "heads", "intermediate", "vocab", "max_seq_len", "batch"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be at least 1, not {value}")
    if args.kv_heads is not None and args.kv_heads < 1:
        raise CliError(f"--kv-heads must be at least 1, not {args.kv_heads}")
    if args.min_seq_len is not None and args.min_seq_len < 2:
        raise CliError(f"--min-seq-len must be at least 2, not {args.min_seq_len}")
    if args.trace_len < 1:
        raise CliError(f"--trace-len must be at least 1, not {args.trace_len}")
    if args.repeat < 1:
        raise CliError(f"--repeat must be at least 1, not {args.repeat}")
    if not args.tolerance > 0:
        raise CliError(f"--tolerance must be positive, not {args.tolerance}")
    if args.lengths:
        _explicit_lengths(args.lengths)
    if not [n for n in args.configs.split(",") if n.strip()]:
        raise CliError("--configs needs at least one config name (see --list-configs)")
    for flag in ("out", "plot", "budget_plot"):
        check_output_path(getattr(args, flag), f"--{flag.replace('_', '-')}")


def _check_heavy(args: argparse.Namespace, names: Sequence[str]):
    """Checks against the registries (imports TVM): configs, sizes, lengths in range."""
    from .configs import get_config

    for name in names:
        try:
            get_config(name)
        except ValueError as err:
            raise CliError(f"--configs: {first_line(err)}") from None
    sizes = _sizes(args)
    if sizes.min_seq_len > sizes.max_seq_len:
        raise CliError(
            f"--min-seq-len ({sizes.min_seq_len}) is above --max-seq-len ({sizes.max_seq_len})"
        )
    if sizes.hidden % sizes.heads or sizes.heads % max(sizes.kv_heads, 1):
        raise CliError(
            f"--hidden ({sizes.hidden}) must be a multiple of --heads ({sizes.heads}), and "
            f"--heads a multiple of --kv-heads ({sizes.kv_heads})"
        )
    lengths, trace = _lengths(args, sizes)
    for n in lengths:
        if not sizes.min_seq_len <= n <= sizes.max_seq_len:
            raise CliError(
                f"sequence length {n} is outside the exported range "
                f"{sizes.min_seq_len} <= s <= {sizes.max_seq_len} (--min-seq-len, --max-seq-len)"
            )
    return sizes, lengths, trace


def _refuse_beyond_memory(args: argparse.Namespace, sizes, lengths: Sequence[int]) -> None:
    """Refuse (one line, exit 2) sizes whose step cannot fit, before the workload is built.

    The floor (:func:`blade_relax.bench.floor.memory_floor`) comes from the sizes alone; the
    predicted mode allocates the parameters and the inputs only (no step runs).
    """
    from .floor import memory_floor

    floor = memory_floor(args.workload, sizes, length=max(lengths), activations=not args.predict)
    step = f"{'predicted run' if args.predict else 'step'} at s={floor.length}"
    refuse_beyond_memory(
        f"--size {args.size}: the {args.workload} {step}",
        floor.total,
        floor.describe(),
        available_memory(),
        force=args.force,
        before="building the workload",
        floor=True,
    )


def _print_configs() -> None:
    """Every registered name with its description, then the deprecated aliases."""
    from .configs import _CONFIGS, _FAMILIES, deprecated_aliases

    aliases = deprecated_aliases()
    names = [*_CONFIGS, *(prefix + "@B" for prefix in _FAMILIES), *aliases]
    width = max(map(len, names), default=0) + 1
    for name, config in sorted(_CONFIGS.items()):
        print(f"{name:<{width}} {config.description}")
    for prefix, family in sorted(_FAMILIES.items()):
        print(f"{prefix + '@B':<{width}} {family.description}")
    for old, new in aliases.items():
        print(f"{old:<{width}} deprecated: now {new}")


def main(argv: Sequence[str] | None = None, *, prog: str = DEFAULT_PROG) -> int:
    """Run the benchmark; 0 when every requested measurement matched torch, 1 otherwise.

    Bad input prints one line on stderr and returns 2.
    """
    from ..util.quiet import quiet_stderr

    arglist = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(prog).parse_args(arglist)
        args.command = f"{prog} {shlex.join(arglist)}"
        _check_light(args)
    except CliError as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return 2
    except SystemExit as done:  # --help
        return int(done.code or 0)
    with quiet_stderr(verbose=True if args.verbose else None):
        try:
            return _run(args, prog)
        except CliError as err:
            print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
            return 2


def _run(args: argparse.Namespace, prog: str) -> int:
    if args.list_configs:
        _print_configs()
        return 0
    say = (lambda _m: None) if args.quiet else _progress
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    from .. import load

    load()  # what `import blade_relax` does elsewhere: accounting, builtins, pipeline
    sizes, lengths, trace = _check_heavy(args, names)
    _refuse_beyond_memory(args, sizes, lengths)

    from .report import budget_table, markdown_table, write_budget_plot, write_json, write_plot
    from .runner import run_benchmark
    from .workloads import build_workload

    # The predicted mode reads no weight: they are allocated, not drawn.
    weights = "empty" if args.predict else "random"
    say(f"building {args.workload} ({sizes}, {weights} weights)")
    try:
        workload = build_workload(args.workload, sizes, seed=args.seed, weights=weights)
    except ImportError as err:
        raise CliError(
            f"{args.workload} needs PyTorch and transformers: {first_line(err)}"
        ) from None
    if args.predict:
        return _predict(args, workload, names, lengths, trace, say)
    if workload.graph.reference is None:
        print(
            f"warning: torch is not installed, so {args.workload}'s outputs are checked against "
            'no reference ("matches torch" shows -) and the exit status is 1',
            file=sys.stderr,
            flush=True,
        )
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
    _print_over_trace(result)
    sweep = budget_table(result)
    if sweep:
        print("\n### Peak and step time against the budget (medians over the trace)\n")
        print(sweep)
    if args.out:
        say(f"wrote {write_json(result, args.out, command=args.command)}")
    if args.plot:
        say(f"wrote {write_plot(result, args.plot)}")
    if args.budget_plot:
        if sweep:
            say(f"wrote {write_budget_plot(result, args.budget_plot)}")
        else:
            say("no budgeted configuration was run: --budget-plot skipped")
    return 0 if result.all_correct else 1


def _print_over_trace(result) -> None:
    """The trace's summary per configuration and the acceptance check, when they say more
    than the table above (several lengths)."""
    from .report import acceptance_lines, trace_summary_table

    if len(result.lengths) < 2:
        return
    print("\n### Over the trace\n")
    print(trace_summary_table(result))
    lines = acceptance_lines(result)
    if lines:
        print()
        print("\n".join(lines))


def _predict(args: argparse.Namespace, workload, names, lengths, trace, say) -> int:
    """The predicted mode (:mod:`.predict`): 0 unless a prediction failed."""
    from .predict import NOT_PREDICTED, predict_benchmark
    from .report import budget_table, peak_grid, write_json, write_plot

    result = predict_benchmark(
        workload, names, lengths, target=args.target, trace=trace, progress=say
    )
    print(f"## {args.workload} on {args.target}, predicted: trace {trace.get('lengths')}\n")
    print(peak_grid(result))
    _print_over_trace(result)
    sweep = budget_table(result)
    if sweep:
        print("\n### Peak against the budget (medians over the trace)\n")
        print(sweep)
    requested = {c.name for c in result.configs if c.requested}
    failed = [
        m
        for m in result.measurements
        if m.config in requested and m.error and not m.error.startswith(NOT_PREDICTED)
    ]
    notes = {m.config: m.error for m in result.measurements if m.error and m not in failed}
    for config, note in notes.items():
        print(f"\n- {config}: {note}")
    for m in failed:
        print(f"\n- {m.config} at s={m.seq_len}: {m.error}")
    if args.out:
        say(f"wrote {write_json(result, args.out, command=args.command)}")
    if args.plot:
        say(f"wrote {write_plot(result, args.plot)}")
    return 1 if failed else 0
