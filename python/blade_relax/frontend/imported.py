"""What an import returns: a Relax module with named symbolic dims, its weights, and a reference.

:class:`ImportedGraph` is the one result type of every importer in this package (Hugging Face
inference graphs, joint training steps, Relax-native training steps built by ``Gradient``). The
calling convention of its ``main`` is fixed: the user inputs first (``input_names``), then the
parameters (``param_names``, whose arrays are ``params``), and the outputs, flattened, are
``output_names``. Of the parameters, the last ``num_frozen`` are frozen (a LoRA model's base
weights): a training graph returns a gradient for each trainable parameter only, in order.

The exported range of every symbolic dim is kept in ``dims`` whether or not the function keeps
its ``tir_var_upper_bound`` attribute, so :meth:`ImportedGraph.bind_dims` refuses a length beyond
the range before anything runs (a graph exported by ``torch.export`` is only valid inside it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from ..contract import LOWER_BOUND_ATTR, UPPER_BOUND_ATTR

__all__ = [
    "SIZE_OPTIONS",
    "DimOutOfRangeError",
    "DimRange",
    "ImportedGraph",
    "drop_upper_bounds",
    "flatten_outputs",
    "set_dim_bounds",
    "specialize",
    "with_function",
]


class DimOutOfRangeError(ValueError):
    """A concrete size lies outside the range a symbolic dim was exported (or declared) with."""


#: The ``ImportedGraph.metadata`` key that says which options of the import call bound each
#: axis of the inputs, so that a shape error names the option to change. Plain JSON (it travels
#: with carried graphs)::
#:
#:     {"call": "import_training_step",
#:      "axes": [{"what": "batch", "max": "max_batch_size"},
#:               {"what": "sequence length", "max": "max_seq_len", "min": "min_seq_len",
#:                "lowest": 2, "limit": 2048}]}
#:
#: ``axes[i]`` describes axis ``i`` of every input: ``what`` it is, the option raising its
#: maximum (``max``) and lowering its minimum (``min``, absent when the call has none), the
#: smallest value ``min`` takes (``lowest``) and the largest any import can take (``limit``,
#: the model's position limit; ``None`` when unknown).
SIZE_OPTIONS = "size_options"


@dataclass(frozen=True)
class DimRange:
    """The admissible values of one symbolic dim: ``lower <= value <= upper``.

    Attributes
    ----------
    name
        The dim's name, equal to the name of its ``tirx.Var`` in ``main``.
    lower
        Smallest admissible value.
    upper
        Largest admissible value, ``None`` when unbounded.
    """

    name: str
    lower: int = 1
    upper: int | None = None

    def check(
        self,
        value: int,
        *,
        what: str | None = None,
        hint: Callable[[int, bool], str | None] | None = None,
    ) -> None:
        """Raise :class:`DimOutOfRangeError` naming the bound when ``value`` is outside.

        ``hint(value, too_large)`` says what to change (the option of the import call); the
        message ends with it when it returns a string.
        """
        label = what or f"dim {self.name!r}"
        if value < self.lower:
            advice = hint(value, False) if hint is not None else None
            raise DimOutOfRangeError(
                f"{label} = {value} is below the exported lower bound {self.name} >= {self.lower}"
                + (f"; {advice}" if advice else "")
            )
        if self.upper is not None and value > self.upper:
            advice = hint(value, True) if hint is not None else None
            raise DimOutOfRangeError(
                f"{label} = {value} exceeds the exported upper bound {self.name} <= "
                f"{self.upper} (the torch.export Dim max); "
                + (advice or "import again with a larger maximum to run it")
            )


@dataclass
class ImportedGraph:
    """A Relax ``IRModule`` with a symbolic sequence length (and batch), ready to compile.

    Attributes
    ----------
    mod
        The module; its ``main`` takes ``input_names`` then ``param_names``.
    params
        The parameter arrays, in the order of ``param_names`` (the caller owns them).
    input_names, param_names, output_names
        Names of the inputs, parameters (as in ``model.named_parameters()``) and flattened
        outputs (``"loss"``, ``"grad:<param name>"``, ``"logits"``, ...).
    input_shapes
        Shape of each input, a dim name for every symbolic axis (``(1, "s")``).
    input_dtypes
        Dtype of each input.
    dims
        The symbolic dims and the ranges they were exported with.
    kind
        ``"training"`` (loss and gradients) or ``"inference"``.
    reference
        Computes the same outputs with the source framework from numpy inputs (``None`` when
        there is none); what correctness is checked against.
    float64_reference
        The same in float64 (on a float64 copy of the model made at each call; ``None`` when
        there is none): the yardstick for an output whose float32 value is rounding noise
        (:mod:`blade_relax.frontend.references`).
    torch_module
        For torch imports, the ``torch.nn.Module`` that was exported (its ``forward`` takes the
        inputs as torch tensors and returns ``(loss,)`` or the logits).
    torch_params
        The trainable torch parameters in the order of ``param_names`` (their ``.grad`` after a
        step are the gradients ``main`` returns).
    int_input_high
        Exclusive upper bound of values for integer inputs (the vocabulary size for token ids).
    num_frozen
        How many of the parameters, the last ones, are frozen: inputs of ``main`` that get no
        gradient (and, in a training step, no optimizer state and no update).
    """

    mod: tvm.IRModule
    params: list[np.ndarray]
    input_names: list[str]
    param_names: list[str]
    output_names: list[str]
    input_shapes: list[tuple[int | str, ...]]
    input_dtypes: list[str]
    dims: dict[str, DimRange]
    kind: str
    reference: Callable[[Sequence[np.ndarray]], list[np.ndarray]] | None = None
    float64_reference: Callable[[Sequence[np.ndarray]], list[np.ndarray]] | None = None
    torch_module: Any = None
    torch_params: list[Any] | None = None
    int_input_high: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    num_frozen: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.num_frozen <= len(self.param_names):
            raise ValueError(
                f"num_frozen must be in [0, {len(self.param_names)}], got {self.num_frozen}"
            )

    @property
    def num_trainable(self) -> int:
        """How many parameters, the first ones, are trained (get a gradient)."""
        return len(self.param_names) - self.num_frozen

    @property
    def trainable_names(self) -> list[str]:
        """The names of the trainable parameters (the first :attr:`num_trainable`)."""
        return self.param_names[: self.num_trainable]

    @property
    def frozen_names(self) -> list[str]:
        """The names of the frozen parameters (the last :attr:`num_frozen`)."""
        return self.param_names[self.num_trainable :]

    @property
    def main(self) -> relax.Function:
        """The ``main`` function of :attr:`mod`."""
        return self.mod["main"]

    @property
    def upper_bounds(self) -> dict[str, int]:
        """The ``tir_var_upper_bound`` attribute of ``main`` (empty when dropped)."""
        return _bounds_attr(self.main, UPPER_BOUND_ATTR)

    @property
    def param_bytes(self) -> int:
        """Total bytes of :attr:`params`."""
        return int(sum(p.nbytes for p in self.params))

    def with_upper_bounds(self, keep: bool) -> ImportedGraph:
        """A copy whose ``main`` keeps (planned at the bound) or drops its upper bounds.

        Stock TVM's ``StaticPlanBlockMemory`` plans every internal buffer at the upper bound
        when the attribute is present (the same bytes at every length); without it, dynamic
        buffers are allocated at their actual size.
        """
        if keep:
            bounds = {name: d.upper for name, d in self.dims.items() if d.upper is not None}
            mod = set_dim_bounds(self.mod, upper=bounds)
        else:
            mod = drop_upper_bounds(self.mod)
        return dataclasses.replace(self, mod=mod)

    # ---------------------------------------------------------------- shape errors
    # Every shape error of a batch (a Trainer's, a workload's) is raised below; with the
    # import call's SIZE_OPTIONS in metadata it names the option to pass and its value.

    def _axis_option(self, axis: int) -> Mapping[str, Any] | None:
        """What the import call says of input axis ``axis`` (``None``: nothing)."""
        options = self.metadata.get(SIZE_OPTIONS)
        axes = options.get("axes", []) if isinstance(options, Mapping) else []
        return axes[axis] if 0 <= axis < len(axes) else None

    def _dim_option(self, name: str) -> Mapping[str, Any] | None:
        """What the import call says of the axis that symbolic dim ``name`` sizes."""
        for spec in self.input_shapes:
            if name in spec:
                return self._axis_option(list(spec).index(name))
        return None

    def _size_hint(
        self, option: Mapping[str, Any], value: int, too_large: bool, lower: int = 1
    ) -> str | None:
        """What to pass to the import call so that an axis of size ``value`` fits (``lower``:
        the axis' current minimum)."""
        call = self.metadata[SIZE_OPTIONS].get("call") or "the import"
        limit = option.get("limit")
        if too_large:
            if limit is not None and value > limit:
                return (
                    f"the model's position limit is {limit} (config.max_position_embeddings / "
                    f"n_positions), so no import runs it: truncate or split the sequence"
                )
            if not option.get("max"):
                return None
            most = f", at most {limit}, the model's position limit" if limit is not None else ""
            return f"pass {option['max']}={value} (or more{most}) to {call}"
        if option.get("min") and value >= int(option.get("lowest", 1)):
            return f"pass {option['min']}={value} (or less) to {call}"
        if option.get("what") == "sequence length":
            return f"pad the sequence to {lower} tokens or more"
        return None

    def check_dims(self, dims: Mapping[str, int]) -> None:
        """Check concrete dims against :attr:`dims`; unknown names are an error too."""
        for name, value in dims.items():
            if name not in self.dims:
                raise ValueError(f"unknown dim {name!r}; the graph has {sorted(self.dims)}")
            what = "sequence length" if name == "s" else ("batch size" if name == "b" else None)
            dim, option = self.dims[name], self._dim_option(name)
            hint = None
            if option is not None:
                hint = functools.partial(self._size_hint, option, lower=dim.lower)
            dim.check(int(value), what=f"{what} {name}" if what else None, hint=hint)

    def bind_dims(self, inputs: Sequence[Any]) -> dict[str, int]:
        """Concrete dims from the shapes of ``inputs`` (arrays or shapes), checked.

        Raises
        ------
        DimOutOfRangeError
            When a dim lies outside its exported range; the message names the bound.
        ValueError
            On a wrong number of inputs, a rank mismatch, or inconsistent sizes.
        """
        if len(inputs) != len(self.input_shapes):
            raise ValueError(
                f"expected {len(self.input_shapes)} inputs ({', '.join(self.input_names)}), "
                f"got {len(inputs)}"
            )
        dims: dict[str, int] = {}
        for name, spec, value in zip(self.input_names, self.input_shapes, inputs):
            shape = tuple(int(v) for v in getattr(value, "shape", value))
            if len(shape) != len(spec):
                raise ValueError(self._rank_error(name, shape, len(spec)))
            for axis, (want, got) in enumerate(zip(spec, shape)):
                option = self._axis_option(axis)
                where = f"input {name!r} axis {axis}" + (
                    f" ({option['what']})" if option and option.get("what") else ""
                )
                if isinstance(want, str):
                    if dims.setdefault(want, got) != got:
                        raise ValueError(
                            f"{where} is {got}, but dim {want!r} is {dims[want]} in an earlier "
                            f"input"
                        )
                elif want != got:
                    hint = None if option is None else self._size_hint(option, max(want, got), True)
                    if hint is None:
                        raise ValueError(f"{where} is {got}, expected {want}")
                    raise ValueError(
                        f"{where} is {got}, but the step was imported for "
                        f"{option.get('what', 'size')} {want}: {hint}"
                    )
        self.check_dims(dims)
        return dims

    def _rank_error(self, name: str, shape: tuple[int, ...], rank: int) -> str:
        message = f"input {name!r} has shape {shape}, expected rank {rank}"
        whats = [(self._axis_option(axis) or {}).get("what") for axis in range(rank)]
        if all(whats):
            message += f" ({', '.join(map(str, whats))})"
            if len(shape) == rank - 1 and whats[0] == "batch":
                message += "; a single sequence needs a batch axis: pass ids[None]"
        return message

    def input_shapes_at(self, dims: Mapping[str, int]) -> list[tuple[int, ...]]:
        """The concrete input shapes at ``dims`` (checked against the ranges)."""
        self.check_dims(dims)
        return [
            tuple(int(dims[v]) if isinstance(v, str) else int(v) for v in spec)
            for spec in self.input_shapes
        ]

    def random_inputs(self, dims: Mapping[str, int], seed: int = 0) -> list[np.ndarray]:
        """Seeded random inputs at ``dims``: token ids below :attr:`int_input_high`, floats
        from a standard normal, one-hot rows for float inputs named ``*onehot*``."""
        rng = np.random.default_rng(seed)
        arrays = []
        for name, shape, dtype in zip(
            self.input_names, self.input_shapes_at(dims), self.input_dtypes
        ):
            if np.dtype(dtype).kind in "iu":
                high = self.int_input_high or 2
                arrays.append(rng.integers(0, high, size=shape).astype(dtype))
            elif "onehot" in name:
                classes = shape[-1]
                picks = rng.integers(0, classes, size=shape[:-1])
                arrays.append(np.eye(classes, dtype=dtype)[picks])
            else:
                arrays.append(rng.standard_normal(shape).astype(dtype))
        return arrays


def _bounds_attr(func: relax.Function, key: str) -> dict[str, int]:
    attrs = func.attrs
    if attrs is None or key not in attrs:
        return {}
    return {str(k): int(v) for k, v in attrs[key].items()}


def drop_upper_bounds(mod: tvm.IRModule, func_name: str = "main") -> tvm.IRModule:
    """A copy of ``mod`` whose ``func_name`` has no ``tir_var_upper_bound`` attribute."""
    func = mod[func_name]
    if UPPER_BOUND_ATTR not in (func.attrs or {}):
        return mod
    return with_function(mod, func.without_attr(UPPER_BOUND_ATTR), func_name)


def with_function(mod: tvm.IRModule, func: Any, func_name: str = "main") -> tvm.IRModule:
    """A copy of ``mod`` with ``func`` as its ``func_name``; the other functions (kernels the
    importer added, such as a mixture-of-experts layer's grouped GEMMs) are kept."""
    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
    out[func_name] = func
    return out


def set_dim_bounds(
    mod: tvm.IRModule,
    *,
    upper: Mapping[str, int] | None = None,
    lower: Mapping[str, int] | None = None,
    func_name: str = "main",
) -> tvm.IRModule:
    """A copy of ``mod`` with ``tir_var_upper_bound`` / ``tir_var_lower_bound`` set on
    ``func_name`` (a mapping left ``None`` leaves that attribute unchanged; an empty one
    removes it)."""
    func = mod[func_name]
    for key, bounds in ((UPPER_BOUND_ATTR, upper), (LOWER_BOUND_ATTR, lower)):
        if bounds is None:
            continue
        if bounds:
            value = {str(k): tvm.tirx.IntImm("int64", int(v)) for k, v in bounds.items()}
            func = func.with_attr(key, value)
        elif key in (func.attrs or {}):
            func = func.without_attr(key)
    return with_function(mod, func, func_name)


def specialize(mod: tvm.IRModule, dims: Mapping[str, int], func_name: str = "main") -> tvm.IRModule:
    """A copy of ``mod`` whose ``func_name`` has every dim in ``dims`` bound to its value and
    no ``tir_var_upper_bound`` / ``tir_var_lower_bound``: the static graph of one exact shape."""
    values = {name: tvm.tirx.IntImm("int64", int(v)) for name, v in dims.items()}
    out = with_function(mod, mod[func_name].bind_symbolic_vars(values), func_name)
    return set_dim_bounds(out, upper={}, lower={}, func_name=func_name)


def flatten_outputs(value: Any) -> list[Any]:
    """Flatten the (possibly nested) tuple a VM function returns into a list of tensors."""
    if isinstance(value, tvm.runtime.Tensor):
        return [value]
    if isinstance(value, list | tuple) or (
        hasattr(value, "__len__") and hasattr(value, "__getitem__") and not hasattr(value, "shape")
    ):
        out: list[Any] = []
        for item in value:
            out.extend(flatten_outputs(item))
        return out
    return [value]
