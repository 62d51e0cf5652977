"""The models ``demo`` runs and ``report`` reads: by name, or a TVMScript file for ``report``.

The names are known without importing TVM (``--help`` and bad names are answered in
milliseconds); a model is built, and TVM imported, only when a command asks for it.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import load
from ..bench.cli import WORKLOAD_NAMES
from ..util.cliargs import CliError, first_line
from .common import progress

if TYPE_CHECKING:
    from ..bench.workloads import ModelSizes

__all__ = [
    "BENCH_PREFIX",
    "BUILTIN_MODEL_NAMES",
    "DEFAULT_DEMO_MODEL",
    "Model",
    "load_model",
    "model_names",
    "models_help",
    "precheck_bench_dims",
    "resolve_input",
]

#: The model ``demo`` runs unless ``--model`` names another.
DEFAULT_DEMO_MODEL = "mlp-deep-train"
#: ``bench:<workload>`` names a benchmark workload (:data:`blade_relax.bench.WORKLOADS`).
BENCH_PREFIX = "bench:"
#: The names of :data:`blade_relax.frontend.builtin.BUILTIN_MODELS`, known without importing TVM.
BUILTIN_MODEL_NAMES = ("mlp", "attention", "layer-norm", "concat-split", "mlp-train")


@dataclass
class Model:
    """A module to report on or run, with a way to make arguments for its ``main``.

    Attributes
    ----------
    name
        The name it was asked for (a built-in name or a file path).
    mod
        The Relax module.
    description
        One line saying what it is.
    make_args
        Numpy arrays for the parameters of ``main`` at concrete dims (``None`` for a file).
    check_dims
        Raises ``ValueError`` when concrete dims lie outside the model's declared ranges.
    """

    name: str
    mod: Any
    description: str
    make_args: Callable[[Mapping[str, int]], list[Any]] | None = None
    check_dims: Callable[[Mapping[str, int]], None] | None = None


def _deep_mlp_sizes() -> ModelSizes:
    from ..bench.workloads import ModelSizes

    return ModelSizes(layers=4, hidden=64, intermediate=256, vocab=128)


def _deep_mlp_train() -> Model:
    """A four-layer MLP classifier's training step (loss and every gradient), dynamic ``s``.

    Deep enough that rematerialization has activations to trade, small enough to compile in a
    couple of seconds; built in Relax and differentiated by ``relax.transform.Gradient``.
    """
    import numpy as np

    from ..bench.workloads import mlp_forward_module
    from ..frontend import relax_training_step

    sizes = _deep_mlp_sizes()
    forward = mlp_forward_module(sizes)
    rng = np.random.default_rng(0)
    params = []
    for param in forward["main"].params[2:]:
        shape = [int(v) for v in param.ty.shape.values]
        scale = 1.0 / math.sqrt(shape[0]) if len(shape) == 2 else 0.1
        params.append((rng.standard_normal(shape) * scale).astype("float32"))
    graph = relax_training_step(
        forward, params=params, num_input=2, dims={"s": (1, None)}, keep_upper_bound=False
    )
    return _graph_model(
        DEFAULT_DEMO_MODEL,
        graph,
        f"training step of an MLP classifier ({sizes.layers} hidden layers of {sizes.intermediate}, "
        f"input {sizes.hidden}, {sizes.vocab} classes), {len(params)} parameters; "
        "dynamic number of rows s",
    )


def _graph_model(name: str, graph: Any, description: str) -> Model:
    def make_args(dims: Mapping[str, int]) -> list[Any]:
        return [*graph.random_inputs(dims), *graph.params]

    return Model(name, graph.mod, description, make_args, graph.check_dims)


def _builtin_model(name: str) -> Model:
    from ..frontend.builtin import BUILTIN_MODELS, random_arguments

    mod = BUILTIN_MODELS[name]()
    doc = (BUILTIN_MODELS[name].__doc__ or name).strip().splitlines()[0].replace("``", "")

    def make_args(dims: Mapping[str, int]) -> list[Any]:
        return random_arguments(mod["main"], dict(dims))

    return Model(name, mod, f"built-in: {doc}", make_args)


def _bench_ranges(name: str) -> dict[str, tuple[int, int]]:
    """The dim ranges benchmark workload ``name`` is exported with (the ``small`` preset)."""
    from ..bench.workloads import SFT_WORKLOADS, SMALL, workload_sizes

    workload = name[len(BENCH_PREFIX) :]
    ranges = {"s": (SMALL.min_seq_len, SMALL.max_seq_len)}
    if workload in SFT_WORKLOADS:
        ranges["b"] = (1, workload_sizes(workload, SMALL).batch)
    return ranges


def precheck_bench_dims(name: str, dims: Mapping[str, int], flag: str) -> None:
    """Refuse dims outside a benchmark workload's range before spending time on its export.

    Names other than ``bench:<workload>`` pass: their dims are checked once they are built.

    Raises
    ------
    CliError
        For a dim the workload does not have, or a value outside its range, naming ``flag``.
    """
    if not name.startswith(BENCH_PREFIX) or name not in model_names():
        return
    ranges = _bench_ranges(name)
    for dim, value in dims.items():
        if dim not in ranges:
            raise CliError(f"{flag}: unknown dim {dim!r}; {name} has {', '.join(sorted(ranges))}")
        low, high = ranges[dim]
        if not low <= value <= high:
            raise CliError(f"{flag}: {dim} = {value} is outside {name}'s range [{low}, {high}]")


def _bench_model(name: str) -> Model:
    from ..bench.workloads import build_workload
    from ..frontend.imported import set_dim_bounds

    workload_name = name[len(BENCH_PREFIX) :]
    progress(f"building the {workload_name} workload (small sizes; PyTorch export for HF models)")
    try:
        workload = build_workload(workload_name)
    except ImportError as err:
        raise CliError(f"{name} needs PyTorch and transformers: {first_line(err)}") from None
    # Without upper bounds stock TVM plans buffers at their actual sizes; the batch keeps its
    # bound, the batch size the workload was exported for (an empty mapping drops them all).
    batch = workload.graph.dims.get("b")
    kept = {"b": batch.upper} if batch is not None and batch.upper is not None else {}
    graph = dataclasses.replace(workload.graph, mod=set_dim_bounds(workload.graph.mod, upper=kept))
    ranges = ", ".join(
        f"{d.lower} <= {n} <= {d.upper if d.upper is not None else 'inf'}"
        for n, d in graph.dims.items()
    )
    return _graph_model(name, graph, f"benchmark workload {workload_name} ({graph.kind}; {ranges})")


def model_names() -> list[str]:
    """Every model name ``demo --model`` and ``report`` accept."""
    return [
        DEFAULT_DEMO_MODEL,
        *BUILTIN_MODEL_NAMES,
        *(f"{BENCH_PREFIX}{name}" for name in WORKLOAD_NAMES),
    ]


def load_model(name: str) -> Model:
    """A model by name: the demo's MLP, a built-in model, or ``bench:<workload>``.

    Raises
    ------
    CliError
        When no model has that name.
    """
    if name not in model_names():
        raise CliError(f"unknown model {name!r}; choose one of {', '.join(model_names())}")
    load()
    if name == DEFAULT_DEMO_MODEL:
        return _deep_mlp_train()
    if name in BUILTIN_MODEL_NAMES:
        return _builtin_model(name)
    return _bench_model(name)


def _load_script(path: str) -> Model:
    load()
    import tvm
    import tvm.script
    from tvm import relax

    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except UnicodeDecodeError:
        raise CliError(f"{path} is not a text file") from None
    except OSError as err:
        raise CliError(f"cannot read {path}: {err.strerror}") from None
    problem = None
    try:
        parsed = tvm.script.from_source(source)
    except Exception as err:  # the parser raises SyntaxError, DiagnosticError, TVMError, ...
        problem = first_line(err).removeprefix("error: ")
        if "No result exists in IRBuilder" in problem:
            problem = "it defines no IRModule or function (save one with mod.script())"
    if problem is not None:
        # Raised outside the handler so that the parser's frames are not kept alive as context.
        _collect_quietly()
        raise CliError(f"cannot parse {path} as TVMScript: {problem}")
    if isinstance(parsed, relax.Function):
        parsed = tvm.IRModule({"main": parsed})
    if not isinstance(parsed, tvm.IRModule):
        raise CliError(
            f"{path} holds a {type(parsed).__name__}, not an IRModule of Relax functions"
        )
    return Model(path, parsed, f"TVMScript module from {path}")


def resolve_input(text: str) -> Model:
    """``report``'s input: a model name (:func:`load_model`) or a file of TVMScript.

    Raises
    ------
    CliError
        When ``text`` is neither, or the file cannot be read or parsed as an IRModule.
    """
    if text in model_names():
        return load_model(text)
    if os.path.isdir(text):
        raise CliError(f"{text} is a directory, not a TVMScript file or model name")
    if os.path.exists(text):
        return _load_script(text)
    looks_like_path = os.sep in text or text.endswith((".py", ".tvmscript", ".txt", ".relax"))
    if looks_like_path:
        raise CliError(f"no such file: {text}")
    raise CliError(
        f"{text!r} is neither a file nor a model name; models: {', '.join(model_names())}"
    )


def models_help() -> str:
    """The model names, as the help of ``demo --model`` and of ``report``'s input lists them."""
    return (
        f"{DEFAULT_DEMO_MODEL} (a 4-layer MLP training step), the built-ins "
        f"{', '.join(BUILTIN_MODEL_NAMES)}, and the benchmark workloads "
        f"{', '.join(BENCH_PREFIX + w for w in WORKLOAD_NAMES)} (need PyTorch; dims within "
        "the exported range)"
    )


def _collect_quietly() -> None:
    """Collect garbage with the native stderr silenced.

    When TVM's parser raises it can leave a half-built block builder behind, whose destructor
    warns on stderr whenever the garbage collector gets to it; collected here, after a failed
    parse, the warning does not add to the one-line error.
    """
    try:
        saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        gc.collect()
        return
    try:
        sys.stderr.flush()
        os.dup2(devnull, 2)
        gc.collect()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
