"""Running a function of a symbolic length through CUDA graphs, one graph per length bucket.

A CUDA graph replays a recorded sequence of kernel launches at the cost of one launch, which
is what short sequences need (their kernels are too small to hide the launch overhead), but it
replays fixed shapes at fixed addresses. So lengths are grouped into buckets
(:class:`LengthBuckets`: powers of two, multiples of a step, or a user list, bounded by the
declared upper bound), an input is padded to its bucket's length, the bucket's static copy of
the function runs (its graph), and the outputs are cut back to the real length
(:class:`Padding`, :class:`BucketedRunner`). Recording a graph per bucket is cheap; memory is
what costs, so every bucket runs in **one** pool sized by the largest bucket.

What TVM 0.27 provides, and what is built here
----------------------------------------------
* TVM's ``RewriteCUDAGraph`` (PassContext option ``relax.backend.use_cuda_graph``; the
  blade_relax pipeline runs it on CUDA targets after memory planning) lifts the static regions
  of every function into capture functions launched by ``vm.builtin.cuda_graph.run_or_capture``
  (one warm-up, then a capture, on the first call; a replay afterwards), and the static storages
  of *all* functions of the module into one allocation function, ``cuda_graph_alloc``, run once
  per VM (``vm.builtin.cuda_graph.get_cached_alloc``) and merged across functions slot by slot
  (the ``k``-th largest storage of each function shares slot ``k``). That is the shared pool,
  and TVM's own; nothing had to be written for it.
* TVM captures nothing of a function planned for a symbolic length by our planner: its
  storages have symbolic sizes, and ``RewriteCUDAGraph`` lifts only constant ones. Built here:
  static copies of the function, one per bucket, in one module
  (:class:`~blade_relax.transform.SpecializeBuckets`,
  :func:`~blade_relax.gpuprog.buckets.compile_buckets`), each planned by our ``PlanMemory``; the pool's size is
  read from those plans (:mod:`blade_relax.analysis.cuda_graph_pool`): it is the largest
  bucket's planned static bytes whenever that bucket's storages dominate the others' rank by
  rank (static copies of one function at growing lengths), and ``PoolPlan.excess_bytes`` says
  what the merge adds otherwise.
* TVM has no bucketing, padding or slicing: :class:`LengthBuckets`, :class:`Padding` and
  :class:`BucketedRunner` are ours.

When padding is exact
---------------------
Padding a length ``n`` to ``L > n`` and cutting the outputs back to ``n`` gives the unpadded
outputs only when no output at a position ``< n`` depends on an input at a position ``>= n``:
causal language models (attention masked to earlier positions, everything else per position),
position-wise networks. It is *not* exact for bidirectional attention, for reductions over the
length (a mean, a sum, a loss over all positions) or for normalizations across positions. No
analysis proves it here, so :class:`Padding` refuses to run unless the caller asserts it
(``causal=True``): :class:`PaddingNotExactError` otherwise. Padded token ids are ``0`` (any
valid id: their positions are cut away), as in :mod:`blade_relax.bench.bucketing`, whose
bucket lengths :meth:`LengthBuckets.of` reproduces.

Nothing here imports a pass: the runner reads only the executable and the names of
:mod:`blade_relax.contract`.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax

from ..contract import CUDA_GRAPH_RUN, bucket_function_name

__all__ = [
    "BucketedRunner",
    "LengthBuckets",
    "Padding",
    "PaddingNotExactError",
    "round_up_length",
]


@dataclass(frozen=True)
class LengthBuckets:
    """Bucket lengths: a length ``n`` runs in the smallest bucket ``>= n``.

    Attributes
    ----------
    boundaries
        The bucket lengths, strictly increasing, each at least 1. The last is the largest
        length accepted.
    """

    boundaries: tuple[int, ...]

    def __post_init__(self) -> None:
        values = tuple(int(b) for b in self.boundaries)
        if not values:
            raise ValueError("LengthBuckets needs at least one bucket")
        if values[0] < 1 or any(a >= b for a, b in zip(values, values[1:])):
            raise ValueError(
                f"bucket lengths must be positive and strictly increasing, got {list(values)}"
            )
        object.__setattr__(self, "boundaries", values)

    @classmethod
    def of(cls, spec: str | int | Sequence[int], upper: int, lower: int = 1) -> LengthBuckets:
        """Buckets covering ``[lower, upper]``.

        Parameters
        ----------
        spec
            ``"pow2"`` (the next power of two), a positive int ``K`` (the next multiple of
            ``K``), or explicit lengths (sorted here; none above ``upper``).
        upper
            The largest admissible length (the function's declared upper bound): the last
            bucket of ``"pow2"`` / ``K`` is capped at it.
        lower
            The smallest admissible length: no bucket below it.
        """
        if upper < lower or lower < 1:
            raise ValueError(f"need 1 <= lower <= upper, got lower={lower}, upper={upper}")
        if isinstance(spec, str | int) and not isinstance(spec, bool):
            return cls(tuple(_generated(spec, lower, upper)))
        lengths = sorted({int(n) for n in spec})
        outside = [n for n in lengths if not lower <= n <= upper]
        if outside:
            raise ValueError(f"bucket lengths {outside} are outside [{lower}, {upper}]")
        return cls(tuple(lengths))

    @property
    def upper(self) -> int:
        """The largest length accepted (the last bucket)."""
        return self.boundaries[-1]

    def bucket_for(self, length: int) -> int:
        """The bucket ``length`` runs in.

        Raises
        ------
        ValueError
            For a length below 1 or above the largest bucket.
        """
        if length < 1:
            raise ValueError(f"a length must be at least 1, got {length}")
        if length > self.upper:
            raise ValueError(
                f"length {length} is above the largest bucket {self.upper} "
                f"(buckets: {list(self.boundaries)})"
            )
        return self.boundaries[bisect.bisect_left(self.boundaries, length)]

    def __len__(self) -> int:
        return len(self.boundaries)


def round_up_length(length: int, spec: str | int, upper: int) -> int:
    """``length`` rounded up to a bucket of ``spec`` (``"pow2"``: the next power of two; an
    integer: the next multiple of it), capped at ``upper``."""
    if spec == "pow2":
        padded = 1 << (length - 1).bit_length()
    elif isinstance(spec, int) and spec >= 1:
        padded = -(-length // spec) * spec
    else:
        raise ValueError(
            f"a bucket spec is 'pow2', a positive step (a positive number of tokens) or a list, "
            f"not {spec!r}"
        )
    return min(padded, upper)


def _generated(spec: str | int, lower: int, upper: int) -> list[int]:
    found = []
    length = lower
    while length <= upper:
        bucket = round_up_length(length, spec, upper)
        found.append(bucket)
        length = bucket + 1
    return found


class PaddingNotExactError(ValueError):
    """Padding would change the outputs, as far as anyone asserted (see the module docstring)."""


@dataclass(frozen=True)
class Padding:
    """How inputs are padded to their bucket and outputs cut back to the real length.

    Attributes
    ----------
    input_axes
        Per input, the axis sized by the length (``None``: the input has none and is passed
        as it is).
    output_axes
        Per flattened output, the axis sized by the length (``None``: returned whole).
    fill
        Per input, the value its padded positions get (``0`` for all when empty).
    causal
        The caller's assertion that no output at a position ``< n`` depends on an input at a
        position ``>= n`` (causal LMs, position-wise networks); required
        (:meth:`check`).
    """

    input_axes: tuple[int | None, ...]
    output_axes: tuple[int | None, ...]
    fill: tuple[int | float, ...] = ()
    causal: bool = False

    def check(self) -> None:
        """Refuse padding nobody asserted to be exact.

        Raises
        ------
        PaddingNotExactError
            Unless :attr:`causal` is set.
        """
        if not self.causal:
            raise PaddingNotExactError(
                "padding to a bucket and cutting the outputs back is exact only when no output "
                "position depends on a later input position (causal LMs, position-wise "
                "networks), not for bidirectional attention or reductions over the length; "
                "pass causal=True to assert it for this function"
            )
        if not any(axis is not None for axis in self.input_axes):
            raise ValueError("no input has an axis sized by the length: nothing to pad")

    def length_of(self, inputs: Sequence[Any]) -> int:
        """The real length of ``inputs`` (equal on every padded input)."""
        lengths = {
            int(np.shape(x)[axis]) for x, axis in zip(inputs, self.input_axes) if axis is not None
        }
        if len(lengths) != 1:
            raise ValueError(f"the padded inputs disagree on the length: {sorted(lengths)}")
        return lengths.pop()

    def pad(self, inputs: Sequence[np.ndarray], length: int) -> list[np.ndarray]:
        """``inputs`` padded at the end of their length axis to ``length``."""
        if len(inputs) != len(self.input_axes):
            raise ValueError(f"expected {len(self.input_axes)} inputs, got {len(inputs)}")
        out = []
        for i, (array, axis) in enumerate(zip(inputs, self.input_axes)):
            array = np.asarray(array)
            if axis is None:
                out.append(array)
                continue
            extra = length - array.shape[axis]
            if extra < 0:
                raise ValueError(f"input {i} is longer ({array.shape[axis]}) than {length}")
            widths = [(0, 0)] * array.ndim
            widths[axis] = (0, extra)
            fill = self.fill[i] if i < len(self.fill) else 0
            out.append(np.pad(array, widths, constant_values=fill))
        return out

    def cut(self, outputs: Sequence[np.ndarray], length: int) -> list[np.ndarray]:
        """``outputs`` cut back to ``length`` along their length axis."""
        out = []
        for array, axis in zip(outputs, self.output_axes):
            if axis is None:
                out.append(array)
            else:
                out.append(np.take(array, np.arange(length), axis=axis))
        return out


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, tvm.runtime.Tensor):
        return [value]
    if hasattr(value, "__len__") and hasattr(value, "__getitem__"):
        return [t for item in value for t in _flatten(item)]
    return [value]


def _has_graphs(executable: Any) -> bool:
    """Whether ``executable`` launches captured regions (built with CUDA graphs on)."""
    return CUDA_GRAPH_RUN in executable.as_text()


class BucketedRunner:
    """Runs ``function`` of a bucketed executable: pad, run the bucket's copy, cut back.

    Parameters
    ----------
    executable
        Built by :func:`~blade_relax.gpuprog.buckets.compile_buckets` (a static
        copy of ``function`` per bucket, named by
        :func:`~blade_relax.contract.bucket_function_name`).
    device
        The device it runs on.
    buckets
        The bucket lengths (each must have its copy in ``executable``).
    padding
        How to pad and cut (:meth:`Padding.check` is enforced here).
    params
        The arrays passed after the inputs (weights), copied to ``device`` once.
    function, dim
        The specialized function and dim.
    memory_cfg
        The VM's allocator (``None``: pooled).

    On a CUDA device with graphs built in, the first call of a bucket records its graph
    (:meth:`capture`); every later call replays it, in the one pool every bucket shares. On a
    CPU the same copies run as plain VM functions.
    """

    def __init__(
        self,
        executable: Any,
        device: tvm.runtime.Device,
        buckets: LengthBuckets,
        padding: Padding,
        params: Sequence[Any] = (),
        *,
        function: str = "main",
        dim: str = "s",
        memory_cfg: str | None = None,
    ) -> None:
        padding.check()
        self.buckets = buckets
        self.padding = padding
        self.device = device
        self.function = function
        self.dim = dim
        self.graphs = _has_graphs(executable)
        self.vm = relax.VirtualMachine(executable, device, memory_cfg=memory_cfg)
        self.params = [
            p if isinstance(p, tvm.runtime.Tensor) else tvm.runtime.tensor(np.asarray(p), device)
            for p in params
        ]
        self._functions = {b: self._lookup(b) for b in buckets.boundaries}
        self.captured: dict[int, float] = {}

    def _lookup(self, bucket: int) -> Any:
        name = bucket_function_name(self.function, self.dim, bucket)
        try:
            return self.vm[name]
        except (AttributeError, KeyError) as err:
            raise ValueError(
                f"the executable has no copy {name} for bucket {self.dim}={bucket}: build it "
                "with compile_buckets for these buckets"
            ) from err

    def to_device(self, inputs: Sequence[np.ndarray], length: int) -> list[Any]:
        """``inputs`` padded to ``length`` and copied to the device."""
        return [tvm.runtime.tensor(a, self.device) for a in self.padding.pad(inputs, length)]

    def run_bucket(self, bucket: int, device_inputs: Sequence[Any]) -> Any:
        """Call the copy of ``bucket`` on inputs already padded and on the device; its raw
        result (what a timed loop calls)."""
        return self._functions[bucket](*device_inputs, *self.params)

    def capture(self, example: Sequence[np.ndarray]) -> dict[int, float]:
        """Call every bucket once, padding ``example`` (inputs of any admissible length, e.g.
        length 1): with graphs this records each bucket's graph. Returns each bucket's
        seconds (warm-up, capture and instantiation)."""
        length = self.padding.length_of(example)
        for bucket in self.buckets.boundaries:
            if bucket < length:
                continue
            args = self.to_device(example, bucket)
            start = time.perf_counter()
            result = self.run_bucket(bucket, args)
            self.device.sync()
            self.captured[bucket] = time.perf_counter() - start
            del result
        return dict(self.captured)

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        """The function's outputs at the inputs' real length (flattened, as numpy)."""
        length = self.padding.length_of(inputs)
        bucket = self.buckets.bucket_for(length)
        result = self.run_bucket(bucket, self.to_device(inputs, bucket))
        outputs = [t.numpy() if hasattr(t, "numpy") else t for t in _flatten(result)]
        return self.padding.cut(outputs, length)
