"""Carry an imported graph to another machine: the Relax module without the import.

Why
---
The GPU machine has another torch and transformers than the one we import with (torch 2.11 /
transformers 5.17 there, our pinned 2.13 here), no peft, and minutes that must not be spent on
``torch.export``. So the import runs here, and what it produced travels: the Relax module (as
TVMScript), its calling convention (names, shapes and dtypes of inputs, parameters and outputs,
the dims' ranges) and the few constants the module holds. The weights do not travel (a real
size Llama has 260 MB of them): on the other machine the same model is built from its config
with the torch found there, and :func:`attach_model` takes the parameters from it by name,
checks every shape and dtype against the carried record, and builds the torch reference and
the torch module from that model, so that TVM and torch run the same weights there and the
outputs are checked against the torch of that machine.

The format
----------
One ``.npz`` file (zlib-compressed): ``record`` is a JSON document (:data:`FORMAT`, the names,
shapes, dims, ``info``), ``script`` the module's TVMScript, and ``const_<k>`` the ``k``-th tensor
constant the script refers to as ``metadata["ir.GenericConst"][k]``. TVM 0.27's
``tvm.ir.save_json`` cannot serialize a tensor constant (it crashes the process), so the
constants are stored as arrays and handed back to the parser. :func:`save_graph` parses the
text back at once and compares it with the module (``tvm.ir.assert_structural_equal``): what is
written is known to load as the same module.

Nothing here exports or imports a model; :func:`load_graph` needs neither torch nor
transformers, :func:`attach_model` only the model it is given.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tvm import relax

from .imported import DimRange, ImportedGraph

__all__ = ["FORMAT", "CarriedGraph", "attach_model", "load_graph", "save_graph"]

#: Format name written into every carried graph; :func:`load_graph` refuses others.
FORMAT = "blade_relax.carried/1"

_META = re.compile(r'metadata\["ir\.GenericConst"\]\[(\d+)\]')


@dataclass
class CarriedGraph:
    """An imported graph as carried: the module and its calling convention, no weights.

    Attributes
    ----------
    mod
        The Relax module (``main`` takes the inputs, then the parameters).
    kind
        ``"training"`` or ``"inference"``.
    input_names, input_shapes, input_dtypes, output_names, param_names
        As in :class:`~blade_relax.frontend.ImportedGraph`.
    param_shapes, param_dtypes
        Shape and dtype of every parameter, checked against the model :func:`attach_model`
        is given.
    dims
        The symbolic dims and their exported ranges.
    int_input_high, num_frozen, metadata
        As in :class:`~blade_relax.frontend.ImportedGraph`.
    info
        What the caller stored with the graph (the workload, its sizes and seed, the versions
        it was imported with).
    """

    mod: tvm.IRModule
    kind: str
    input_names: list[str]
    input_shapes: list[tuple[int | str, ...]]
    input_dtypes: list[str]
    output_names: list[str]
    param_names: list[str]
    param_shapes: list[tuple[int, ...]]
    param_dtypes: list[str]
    dims: dict[str, DimRange]
    int_input_high: int | None = None
    num_frozen: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def _tensor_constants(mod: tvm.IRModule) -> list[Any]:
    """The module's tensor constants in the order TVMScript numbers them (first use, in text
    order; each constant object once)."""
    found: list[Any] = []

    def visit(expr: Any) -> None:
        if type(expr).__name__ == "GenericConst" and "metadata[" in expr.script():
            if not any(expr.same_as(seen) for seen in found):
                found.append(expr)

    for _, func in sorted(mod.functions.items(), key=lambda item: item[0].name_hint):
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return found


def _parse(script: str, constants: Sequence[Any]) -> tvm.IRModule:
    """The module of ``script``, ``metadata["ir.GenericConst"][k]`` being ``constants[k]``."""
    from typing import TypeVar

    from tvm.script import ir as I  # noqa: E741
    from tvm.script import relax as R
    from tvm.script import tirx as T

    # The names the script's commented-out header imports (symbolic dims print as TypeVars).
    names = {"TypeVar": TypeVar, "I": I, "R": R, "T": T}
    return tvm.script.from_source(
        script, extra_vars={**names, "metadata": {"ir.GenericConst": list(constants)}}
    )


def save_graph(
    graph: ImportedGraph, path: str | os.PathLike, *, info: dict[str, Any] | None = None
) -> Path:
    """Write ``graph`` (without its weights) to ``path`` (an ``.npz`` file).

    Parameters
    ----------
    graph
        The imported graph.
    path
        Where to write; the folder is created.
    info
        JSON-serializable notes stored with it (e.g. how to rebuild the model).

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    ValueError
        When the module does not read back as itself (then it could not be carried).
    """
    constants = _tensor_constants(graph.mod)
    script = graph.mod.script()
    used = {int(k) for k in _META.findall(script)}
    if used != set(range(len(constants))):
        raise ValueError(
            f"the script refers to constants {sorted(used)}, {len(constants)} were collected"
        )
    arrays = [c.value.numpy() for c in constants]
    reread = _parse(script, [relax.const(a) for a in arrays])
    try:
        tvm.ir.assert_structural_equal(reread, graph.mod, map_free_vars=True)
    except ValueError as err:
        raise ValueError(f"the module does not read back as itself: {err}") from None
    record = {
        "format": FORMAT,
        "kind": graph.kind,
        "input_names": graph.input_names,
        "input_shapes": [list(s) for s in graph.input_shapes],
        "input_dtypes": graph.input_dtypes,
        "output_names": graph.output_names,
        "param_names": graph.param_names,
        "param_shapes": [list(p.shape) for p in graph.params],
        "param_dtypes": [str(p.dtype) for p in graph.params],
        "dims": {name: [d.lower, d.upper] for name, d in graph.dims.items()},
        "int_input_high": graph.int_input_high,
        "num_frozen": graph.num_frozen,
        "metadata": graph.metadata,
        "info": info or {},
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    consts = {f"const_{k}": a for k, a in enumerate(arrays)}
    with open(out, "wb") as f:
        np.savez_compressed(
            f, record=np.array(json.dumps(record)), script=np.array(script), **consts
        )
    return out


def load_graph(path: str | os.PathLike) -> CarriedGraph:
    """Read a graph written by :func:`save_graph` (no torch needed).

    Raises
    ------
    ValueError
        When the file is not a carried graph of this format.
    """
    with np.load(path, allow_pickle=False) as data:
        record = json.loads(str(data["record"]))
        if record.get("format") != FORMAT:
            raise ValueError(f"{path}: format {record.get('format')!r}, expected {FORMAT!r}")
        script = str(data["script"])
        count = len([k for k in data.files if k.startswith("const_")])
        constants = [relax.const(data[f"const_{k}"]) for k in range(count)]
    return CarriedGraph(
        mod=_parse(script, constants),
        kind=record["kind"],
        input_names=list(record["input_names"]),
        input_shapes=[tuple(s) for s in record["input_shapes"]],
        input_dtypes=list(record["input_dtypes"]),
        output_names=list(record["output_names"]),
        param_names=list(record["param_names"]),
        param_shapes=[tuple(s) for s in record["param_shapes"]],
        param_dtypes=list(record["param_dtypes"]),
        dims={name: DimRange(name, lo, hi) for name, (lo, hi) in record["dims"].items()},
        int_input_high=record["int_input_high"],
        num_frozen=int(record["num_frozen"]),
        metadata=dict(record["metadata"]),
        info=dict(record["info"]),
    )


def attach_model(carried: CarriedGraph, model: Any) -> ImportedGraph:
    """The :class:`ImportedGraph` of ``carried`` run with the weights of ``model``.

    ``model`` is the Hugging Face model the graph was imported from, built again (same class
    and config; its weights may differ): the parameters are taken from it by name, and the
    reference and torch module run it, so TVM and torch compute with the same weights.

    Raises
    ------
    ValueError
        When ``model`` lacks a parameter of the graph or has one of another shape or dtype.
    """
    from .hf import step_wrappers
    from .references import inference_reference, torch_to_numpy, training_reference

    named = dict(model.named_parameters(remove_duplicate=False))
    params = []
    for name, shape, dtype in zip(carried.param_names, carried.param_shapes, carried.param_dtypes):
        if name not in named:
            raise ValueError(f"the model has no parameter {name!r} (the carried graph needs it)")
        array = torch_to_numpy(named[name])
        if tuple(array.shape) != tuple(shape) or str(array.dtype) != dtype:
            raise ValueError(
                f"parameter {name!r} is {array.dtype}{list(array.shape)} in the model, "
                f"{dtype}{list(shape)} in the carried graph"
            )
        params.append(array)
    inference_cls, plain_cls, masked_cls = step_wrappers()
    trainable = carried.param_names[: len(carried.param_names) - carried.num_frozen]
    if carried.kind == "inference":
        wrapper = inference_cls(model)
        reference = inference_reference(model, wrapper)
        float64_reference = inference_reference(model, wrapper, float64=True)
        torch_params = [named[name] for name in carried.param_names]
    else:
        import torch

        autocast = carried.metadata.get("autocast")
        wrapper_cls = masked_cls if "attention_mask" in carried.input_names else plain_cls
        wrapper = wrapper_cls(model, autocast=getattr(torch, autocast) if autocast else None)
        reference = training_reference(model, wrapper, trainable)
        float64_reference = training_reference(model, wrapper, trainable, float64=True)
        torch_params = [named[name] for name in trainable]
    return ImportedGraph(
        mod=carried.mod,
        params=params,
        input_names=carried.input_names,
        param_names=carried.param_names,
        output_names=carried.output_names,
        input_shapes=carried.input_shapes,
        input_dtypes=carried.input_dtypes,
        dims=carried.dims,
        kind=carried.kind,
        reference=reference,
        float64_reference=float64_reference,
        torch_module=wrapper,
        torch_params=torch_params,
        int_input_high=carried.int_input_high,
        metadata=carried.metadata,
        num_frozen=carried.num_frozen,
    )
