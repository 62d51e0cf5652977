"""The measuring ruler: every configuration, every length of the trace, the same numbers.

What is measured, per configuration and sequence length:

``peak_bytes``
    ``step_peak_bytes + caller_bytes``.
``step_peak_bytes``
    Bytes the step allocates at its highest point, outputs (loss, gradients, logits) included.
    TVM: the peak of ``blade_relax.runtime.memory_stats()`` over one VM call (every storage the
    VM allocates, at the size requested, and the workspace of the kernel running at that point,
    see ``workspace_bytes``), minus the live bytes before the call, on a fresh VM
    (``blade_relax.runtime.measure_call``). PyTorch: the peak of
    :class:`~blade_relax.training.torch_memory.LiveBytesCounter` over one step (every storage an
    ATen op creates, gradients included; ``.grad`` is reset to ``None`` before the step, as TVM returns
    fresh gradients). With gradient checkpointing (``torch-*-ckpt``) the recomputation in the
    backward pass is counted the same way.
``workspace_bytes`` (TVM)
    Kernel workspace included in ``step_peak_bytes``: the scratch buffers the kernel running at
    the peak allocates inside (``TVMBackendAllocWorkspace``), counted from the compiled module's
    kernels (:func:`blade_relax.analysis.workspace.workspace_table`) while each kernel runs. 0
    when the peak falls between kernels.
``caller_bytes``
    Bytes of the inputs and parameters, which the caller owns in both systems.
``lower_bound_bytes``
    ``blade_relax.analysis.memory_timeline(main).lower_bound`` of the imported graph at the
    length: parameters and inputs plus the largest single-operator working set. No schedule
    or rematerialization goes below it.
``offloads`` / ``peak_host_bytes`` (TVM under a budget)
    Evicted tensors copied to host memory in the measured step, and the most bytes of host
    copies held at once (``"offload"`` and ``"auto"`` eviction modes; 0 in ``"recompute"``).
``unevictable_bytes`` (TVM under a budget)
    What no eviction set removes at one point of the step, counting what regenerations bring
    back, parameters and inputs included (``unevictable_peak`` of
    ``blade_relax.runtime.last_remat_decision()``): a floor under every peak the runtime can
    reach for this function at this length.
``step_time_s``
    Median wall time of ``repeat`` steps after a warm-up step (not counted).
``compile_time_s`` / ``compilations``
    Compile time spent for this length (0 when an earlier compilation is reused; a schedule
    remembered from an earlier lowering in the process counts the seconds it took then, see
    :class:`blade_relax.transform.CompileClock`) and the number of compilations so far for
    the configuration. For ``torch.compile`` the compile time is the first call at the length
    minus the median step, when dynamo compiled a new graph.
``driver_peak_bytes`` / ``driver_agrees`` (TVM on CUDA)
    The step's peak in the CUDA driver's view (free memory read after every VM instruction, a
    ``memory_cfg="naive"`` VM so that every storage is one ``cudaMalloc``), and whether it
    agrees with ``step_peak_bytes`` within the driver's 2 MiB allocation granularity
    (:func:`blade_relax.runtime.devices.agrees_with_driver`).
On CUDA, PyTorch runs on the same GPU and its ``step_peak_bytes`` is
``torch.cuda.max_memory_allocated()`` over one step minus ``torch.cuda.memory_allocated()``
before it (Inductor's CUDA buffers bypass the dispatcher, so the CPU counter cannot see them);
step times include a device synchronisation for both systems.
``padded_to`` (bucketed TVM configs)
    The length the step ran at: the bucket's, the inputs padded to it (:mod:`.bucketing`).
    ``caller_bytes`` then counts the padded inputs.
``source``
    ``"measured"`` here; ``"predicted"`` for the rows of :mod:`.predict` (no kernel ran).
``max_rel_error`` / ``correct`` / ``float64_checked``
    Largest normwise relative error ``||out - ref|| / ||ref||`` over the outputs (loss and every
    gradient, or the logits) against the torch reference; ``correct`` when ``<= tolerance``.
    An output above the tolerance is checked again where the graph has a float64 reference
    (``ImportedGraph.float64_reference``): it passes when it is at most
    :data:`FLOAT64_MULTIPLIER` times as far from torch's float64 result as torch's own float32
    result is (:func:`within_float64_rounding`). Such outputs (their names in
    ``float64_checked``) are rounding noise in float32, as the gradient of a bias added to
    every key of an attention row (zero in exact arithmetic); ``max_rel_error`` is then taken
    over the other outputs.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from ..frontend import ImportedGraph, flatten_outputs, specialize, torch_to_numpy
from .configs import BenchConfig, TorchConfig, TvmConfig, resolve_configs
from .workloads import Workload

__all__ = [
    "BenchResult",
    "ConfigSummary",
    "Measurement",
    "pad_for_bucket",
    "relative_error",
    "run_benchmark",
    "within_float64_rounding",
]


@dataclass
class Measurement:
    """One configuration at one sequence length (see the module docstring for each field)."""

    config: str
    seq_len: int
    peak_bytes: int | None = None
    step_peak_bytes: int | None = None
    caller_bytes: int = 0
    lower_bound_bytes: int | None = None
    step_time_s: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    compile_time_s: float = 0.0
    compilations: int = 0
    loss: float | None = None
    max_rel_error: float | None = None
    correct: bool | None = None
    float64_checked: list[str] | None = None
    budget_bytes: int | None = None
    evictions: int | None = None
    regenerations: int | None = None
    offloads: int | None = None
    peak_host_bytes: int | None = None
    unevictable_bytes: int | None = None
    workspace_bytes: int | None = None
    allocations: int | None = None
    driver_peak_bytes: int | None = None
    driver_agrees: bool | None = None
    padded_to: int | None = None
    source: str = "measured"
    error: str | None = None


@dataclass
class ConfigSummary:
    """A configuration as run: its description and its totals."""

    name: str
    kind: str
    description: str
    requested: bool
    compile_time_s: float = 0.0
    compilations: int = 0
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchResult:
    """Everything one run measured (what ``--out`` writes, see :mod:`.report`)."""

    workload: Workload
    target: str
    lengths: list[int]
    trace: dict[str, Any]
    repeat: int
    tolerance: float
    configs: list[ConfigSummary]
    measurements: list[Measurement]

    @property
    def all_correct(self) -> bool:
        """Every requested measurement ran and matched the reference."""
        requested = {c.name for c in self.configs if c.requested}
        rows = [m for m in self.measurements if m.config in requested]
        return bool(rows) and all(m.error is None and m.correct for m in rows)


#: How much farther from torch's float64 result than torch's float32 one an output may be
#: where float32's relative error says nothing (:func:`within_float64_rounding`).
FLOAT64_MULTIPLIER = 10.0


def within_float64_rounding(out: np.ndarray, ref: np.ndarray, exact: np.ndarray) -> bool:
    """Whether ``out`` is at most :data:`FLOAT64_MULTIPLIER` times as far from ``exact`` (the
    step in float64) as ``ref`` (torch's step in the model's precision) is:
    ``||out - exact|| <= 10 ||ref - exact||``.

    The check for an output whose relative error against ``ref`` exceeds the tolerance because
    ``ref`` itself is rounding noise (a gradient zero in exact arithmetic: both sides are
    noise of one order of magnitude, and their relative difference is about 1). It is
    ``torch._dynamo.utils.same``'s check against a float64 result, whose multiplier of 2 comes
    with an absolute slack (``tol / 10``) that a normwise check has no scale for: the
    multiplier carries it here (XGLM's key-bias gradient, noise of norm 1e-12, is 2.5 times
    as far from float64 as torch's at one length). It cannot pass a wrong output where torch
    is accurate: failing ``||out - ref|| <= tol ||ref||`` and passing this imply
    ``||ref - exact|| > tol ||ref|| / 11``, torch's own error above about 1e-5 relative.
    """
    exact = np.asarray(exact, dtype=np.float64)
    ours = float(np.linalg.norm((np.asarray(out, dtype=np.float64) - exact).ravel()))
    theirs = float(np.linalg.norm((np.asarray(ref, dtype=np.float64) - exact).ravel()))
    return ours <= FLOAT64_MULTIPLIER * theirs


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """Normwise relative error ``||out - ref||_2 / ||ref||_2`` (absolute when ``ref`` is 0)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"shape {out.shape} differs from the reference's {ref.shape}")
    diff = float(np.linalg.norm((out - ref).ravel()))
    scale = float(np.linalg.norm(ref.ravel()))
    return diff / scale if scale > 0 else diff


# --------------------------------------------------------------------------------------------
# TVM


class _TvmRunner:
    def __init__(
        self,
        config: TvmConfig,
        graph: ImportedGraph,
        target: tvm.target.Target,
        device: Any,
        builds: dict[Any, Any] | None = None,
    ) -> None:
        self.config = config
        self._builds = builds
        self.graph = graph
        self.target = target
        self.device = device
        self.compilations = 0
        self.compile_time_s = 0.0
        self._vm: Any = None
        self._params = [tvm.runtime.tensor(p, device) for p in graph.params]
        self._workspaces: dict[str, Any] = {}
        # Bucketed configs: bucket length -> (VM, executable, workspaces).
        self._buckets: dict[int, tuple[Any, Any, Any]] = {}
        if config.bucket is not None:
            from .bucketing import check_paddable

            check_paddable(graph.input_names)

    def _compile(self, mod: tvm.IRModule) -> tuple[Any, float]:
        from ..analysis.workspace import compile_keeping_module
        from ..transform import CompileClock

        clock = CompileClock()  # a cold compile's time, when the schedule was remembered
        compiled = compile_keeping_module(mod, self.target, self.config.pipeline(self.target))
        elapsed = clock.seconds()
        self.compilations += 1
        self.compile_time_s += elapsed
        exe = self._exe = compiled.executable
        # Outside the compile time: the kernels' workspaces, read from the module just built.
        self._workspaces = compiled.workspaces
        # A VM binds its builtins when constructed: the accounting wrapper is already installed.
        return relax.VirtualMachine(exe, self.device), elapsed

    def _vm_for(self, dims: dict[str, int]) -> tuple[Any, float]:
        if self.config.static:
            return self._compile(specialize(tvm.IRModule({"main": self.graph.main}), dims))
        if self.config.bucket is not None:
            # One static graph per bucket, compiled when the bucket is first met.
            built = self._buckets.get(dims["s"])
            if built is None:
                vm, elapsed = self._compile(
                    specialize(tvm.IRModule({"main": self.graph.main}), dims)
                )
                self._buckets[dims["s"]] = (vm, self._exe, self._workspaces)
                return vm, elapsed
            vm, self._exe, self._workspaces = built
            return vm, 0.0
        if self._vm is None:
            key = (self.config.pipeline, self.config.keep_bounds)
            if self._builds is not None and key in self._builds:
                # Another configuration compiled the same module with the same pipeline.
                self._exe, self._workspaces = self._builds[key]
                self._vm = relax.VirtualMachine(self._exe, self.device)
                return self._vm, 0.0
            variant = self.graph.with_upper_bounds(self.config.keep_bounds)
            self._vm, elapsed = self._compile(variant.mod)
            if self._builds is not None:
                self._builds[key] = (self._exe, self._workspaces)
            return self._vm, elapsed
        return self._vm, 0.0

    def padded(
        self, inputs: Sequence[np.ndarray], dims: dict[str, int]
    ) -> tuple[list[np.ndarray], dict[str, int]]:
        """The inputs padded to the bucket of ``dims["s"]``, and the bucket's dims."""
        return pad_for_bucket(self.config, self.graph, inputs, dims)

    def measure(
        self,
        row: Measurement,
        inputs: Sequence[np.ndarray],
        dims: dict[str, int],
        repeat: int,
        budget_bytes: int | None,
    ) -> list[np.ndarray]:
        from ..runtime import set_eviction_mode

        # The measured step and the timed ones evict as the configuration says.
        with set_eviction_mode(self.config.eviction):
            return self._measure(row, inputs, dims, repeat, budget_bytes)

    def _measure(
        self,
        row: Measurement,
        inputs: Sequence[np.ndarray],
        dims: dict[str, int],
        repeat: int,
        budget_bytes: int | None,
    ) -> list[np.ndarray]:
        from ..runtime import measure_call, set_memory_budget

        if self.config.bucket is not None:
            inputs, dims = self.padded(inputs, dims)
            row.padded_to = dims["s"]
        vm, row.compile_time_s = self._vm_for(dims)
        row.compilations = self.compilations
        main = vm["main"]
        args = [tvm.runtime.tensor(a, self.device) for a in inputs] + self._params
        # The measured step runs on a fresh VM of the executable, under a budget of what the
        # step may add on top of the bytes live before it (see measure_call). Not collected
        # first (its rule 1): every figure of the row is of the step's own bytes, which
        # garbage of earlier calls cannot change, and a collection costs up to a second.
        measured = measure_call(
            self._exe,
            args,
            budget=budget_bytes,
            workspaces=self._workspaces,
            device=self.device,
            collect_garbage=False,
        )
        outputs = [np.asarray(a) for a in flatten_outputs(measured.outputs)]
        row.step_peak_bytes = int(measured.peak_bytes)
        row.workspace_bytes = int(measured.workspace_bytes)
        if measured.decision is not None:
            row.unevictable_bytes = int(
                measured.decision["unevictable_peak"] - measured.live_before + row.caller_bytes
            )
        row.evictions = measured.evictions
        row.regenerations = measured.regenerations
        row.offloads = measured.stats.get("offloads")
        row.peak_host_bytes = measured.stats.get("peak_host_bytes")
        row.allocations = measured.allocations
        # The timed steps (on the cached VM) run under the same budget.
        with set_memory_budget(measured.runtime_budget):
            row.step_times_s = _timed(lambda: main(*args), repeat, self.device)
            if self.device.dlpack_device_type() == tvm.cuda().dlpack_device_type():
                row.driver_peak_bytes, row.driver_agrees = _driver_view(
                    self._exe, args, self.device, self._workspaces
                )
        return outputs


def pad_for_bucket(
    config: TvmConfig,
    graph: ImportedGraph,
    inputs: Sequence[np.ndarray],
    dims: dict[str, int],
) -> tuple[list[np.ndarray], dict[str, int]]:
    """``inputs`` padded to the bucket ``config`` runs length ``dims["s"]`` in, and its dims."""
    from .bucketing import bucket_length, pad_to_bucket

    assert config.bucket is not None
    length = bucket_length(dims["s"], config.bucket, graph.dims["s"].upper or dims["s"])
    return pad_to_bucket(graph.input_names, inputs, length), {**dims, "s": length}


def _driver_view(exe: Any, args: Sequence[Any], device: Any, workspaces: Any) -> tuple[int, bool]:
    """The step's peak as the CUDA driver sees it, and whether the accounting agrees."""
    from ..runtime import measure_memory, workspace_instrument
    from ..runtime.devices import agrees_with_driver, measure_driver_memory

    warm = relax.VirtualMachine(exe, device, memory_cfg="naive")
    warm["main"](*args)  # loads the kernels: first-use costs stay out of the reading
    # A VM keeps the value it returned last alive until its next call returns (measure_call's
    # rule 2), so a call on the warmed VM would enter with the warm-up's outputs live, which
    # under a budget changes what the runtime evicts. The row measured a fresh VM's first
    # call; so does the driver. The kernels stay loaded (the executable's module holds them).
    del warm
    vm = relax.VirtualMachine(exe, device, memory_cfg="naive")
    gc.collect()
    # The driver sees the kernels' workspaces too: the accounting counts them in the same run.
    with measure_memory() as measured:
        out, driver = measure_driver_memory(
            vm, "main", args, device, instrument=workspace_instrument(workspaces)
        )
    del out
    stats = measured.stats
    return driver.peak_bytes, agrees_with_driver(
        measured.peak_bytes, driver, stats["allocations"] + stats["workspaces"]
    )


def _timed(step: Callable[[], Any], repeat: int, device: Any = None) -> list[float]:
    """Wall times of ``repeat`` steps after one warm-up step."""
    times = []
    for i in range(repeat + 1):
        start = time.perf_counter()
        result = step()
        if device is not None and device != tvm.cpu():
            device.sync()
        elapsed = time.perf_counter() - start
        del result
        if i:
            times.append(elapsed)
    return times


# --------------------------------------------------------------------------------------------
# PyTorch


def _switched_model(config: TorchConfig, module: Any) -> Any:
    """The Hugging Face model in ``module`` whose settings ``config`` switches (gradient
    checkpointing, the attention implementation); ``None`` when it switches none.

    Raises
    ------
    ValueError
        When ``config`` switches a setting and ``module`` holds no Hugging Face model.
    """
    from ..training.hf_checkpointing import checkpointing_model

    if not config.checkpointing and config.attention is None:
        return None
    try:
        return checkpointing_model(module)
    except ValueError as err:
        if config.checkpointing:
            raise ValueError(f"{config.name}: {err}") from None
        raise ValueError(
            f"{config.name}: attention={config.attention!r} needs a Hugging Face model; the "
            f"workload's torch module ({type(module).__name__}) holds none"
        ) from None


class _TorchRunner:
    def __init__(self, config: TorchConfig, graph: ImportedGraph, device: Any = None) -> None:
        import torch

        if graph.torch_module is None:
            raise ValueError(f"{config.name}: the workload has no torch module")
        self.torch = torch
        self.config = config
        self.graph = graph
        self.module = graph.torch_module
        self.params = list(graph.torch_params or [])
        self.cuda = (
            device is not None and device.dlpack_device_type() == tvm.cuda().dlpack_device_type()
        )
        if self.cuda:
            # A copy on the GPU: the reference keeps running the CPU original.
            memo: dict[int, Any] = {}
            self.module = copy.deepcopy(self.module, memo).to(f"cuda:{device.index}")
            self.params = [memo.get(id(p), p) for p in self.params]
        self.hf_model = _switched_model(config, self.module)
        self.compilations = 0
        self.compile_time_s = 0.0
        self._graphs_at_start = 0
        self.step_fn: Callable[..., Any] = self.module
        if config.compile:
            torch._dynamo.reset()
            self._graphs_at_start = self._graph_count()
            self.step_fn = torch.compile(self.module, dynamic=True)

    def _graph_count(self) -> int:
        counters = self.torch._dynamo.utils.counters
        return int(counters["stats"]["unique_graphs"])

    @contextlib.contextmanager
    def _settings(self) -> Iterator[None]:
        from ..frontend.attention import attention_implementation
        from ..training.hf_checkpointing import gradient_checkpointing
        from ..training.torch_memory import visible_inductor_allocations

        with contextlib.ExitStack() as stack:
            # On for the steps only: the module is shared with the other configurations.
            if self.config.attention is not None:
                stack.enter_context(attention_implementation(self.hf_model, self.config.attention))
            if self.config.checkpointing:
                stack.enter_context(gradient_checkpointing(self.module))
            if self.config.compile:
                stack.enter_context(visible_inductor_allocations())
                # Cold compiles: a cache hit from an earlier config (or run) would hide the
                # compile time and could reuse a graph partitioned under another budget.
                stack.enter_context(self.torch._inductor.config.patch(fx_graph_cache=False))
                stack.enter_context(self.torch._functorch.config.patch(enable_autograd_cache=False))
                if self.config.activation_memory_budget is not None:
                    stack.enter_context(
                        self.torch._functorch.config.patch(
                            activation_memory_budget=self.config.activation_memory_budget
                        )
                    )
            if self.graph.kind != "training":
                stack.enter_context(self.torch.no_grad())
            yield

    def _step(self, tensors: Sequence[Any]) -> list[Any]:
        for param in self.params:
            param.grad = None
        result = self.step_fn(*tensors)
        if self.graph.kind == "training":
            (loss,) = result
            loss.backward()
            outputs = [loss, *[p.grad for p in self.params]]
        else:
            outputs = [result]
        if self.cuda:
            self.torch.cuda.synchronize()  # step times cover the GPU work, as TVM's do
        return outputs

    def _first_step(self, tensors: Sequence[Any]) -> tuple[float, int]:
        """One step, as the first call at a length: its seconds, and the graphs compiled
        during it (where it compiles, the seconds include the compilation)."""
        before = self._graph_count()
        start = time.perf_counter()
        self._step(tensors)
        seconds = time.perf_counter() - start
        return seconds, (self._graph_count() - before if self.config.compile else 0)

    def _counted_step(self, tensors: Sequence[Any]) -> tuple[int, list[Any]]:
        """One step on the CPU counted by
        :class:`~blade_relax.training.torch_memory.LiveBytesCounter`: its peak bytes, and its
        outputs."""
        from ..training.torch_memory import LiveBytesCounter

        counter = LiveBytesCounter()
        with counter:
            outputs = self._step(tensors)
        counter.detach_all()
        return int(counter.peak_bytes), outputs

    def _tensors(self, inputs: Sequence[np.ndarray]) -> list[Any]:
        """``inputs`` as torch tensors on the module's device."""
        tensors = [self.torch.from_numpy(np.array(a)) for a in inputs]
        if self.cuda:
            tensors = [t.to(next(self.module.parameters()).device) for t in tensors]
        return tensors

    def _peak_step(self, tensors: Sequence[Any]) -> tuple[int, list[Any]]:
        """One step and its peak bytes (the counted step on the CPU; on CUDA the allocator's
        peak over the step minus the bytes allocated before it), and its outputs. Runs inside
        :meth:`_settings`."""
        if not self.cuda:
            return self._counted_step(tensors)
        for param in self.params:
            param.grad = None  # released before the baseline is read, as _step does
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()
        allocated_before = self.torch.cuda.memory_allocated()
        outputs = self._step(tensors)
        return int(self.torch.cuda.max_memory_allocated() - allocated_before), outputs

    def _compilations_so_far(self) -> int:
        return self._graph_count() - self._graphs_at_start

    def measure(
        self,
        row: Measurement,
        inputs: Sequence[np.ndarray],
        dims: dict[str, int],
        repeat: int,
        budget_bytes: int | None,
    ) -> list[np.ndarray]:
        if budget_bytes is not None:
            raise ValueError(f"{self.config.name}: runtime budgets apply to TVM configs only")
        tensors = self._tensors(inputs)
        with self._settings():
            first_call, compiled_now = self._first_step(tensors)
            gc.collect()
            row.step_peak_bytes, outputs = self._peak_step(tensors)
            arrays = [torch_to_numpy(o) for o in outputs]
            del outputs
            row.step_times_s = _timed(lambda: self._step(tensors), repeat)
        if self.config.compile:
            self.compilations = self._compilations_so_far()
            if compiled_now:
                median = statistics.median(row.step_times_s) if row.step_times_s else 0.0
                row.compile_time_s = max(0.0, first_call - median)
                self.compile_time_s += row.compile_time_s
        row.compilations = self.compilations
        return arrays


# --------------------------------------------------------------------------------------------


def _lower_bounds(
    graph: ImportedGraph, dims: dict[int, dict[str, int]], warn: Callable[[str], None]
):
    """Per length, the lower bound at that length's dims (``b`` too, where it is symbolic)."""
    lengths = list(dims)
    try:
        from ..analysis import memory_timeline

        timeline = memory_timeline(graph.main)
    except Exception as err:  # the analysis is optional for the ruler; report and go on
        warn(f"lower bound unavailable: memory_timeline failed ({type(err).__name__}: {err})")
        return dict.fromkeys(lengths)
    bounds: dict[int, int | None] = {}
    for length in lengths:
        try:
            bounds[length] = int(timeline.evaluate(dims[length]).lower_bound)
        except Exception as err:
            warn(f"lower bound at s={length} unavailable ({type(err).__name__}: {err})")
            bounds[length] = None
    return bounds


def _device_for(target: tvm.target.Target) -> Any:
    kind = target.kind.name
    return tvm.cpu() if kind in ("llvm", "c") else tvm.device(kind, 0)


def run_benchmark(
    workload: Workload,
    config_names: Sequence[str],
    lengths: Sequence[int],
    *,
    target: str | dict | tvm.target.Target = "llvm",
    repeat: int = 3,
    tolerance: float = 1e-4,
    trace: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
    builds: dict[Any, Any] | None = None,
    on_row: Callable[[BenchResult], None] | None = None,
) -> BenchResult:
    """Measure every configuration at every length (see the module docstring).

    Parameters
    ----------
    workload
        What to run (:func:`~.workloads.build_workload`).
    config_names
        Registry names; budget references are added (and run first) when missing.
    lengths
        Sequence lengths; each is checked against the exported range before anything runs.
    target
        TVM target for the TVM configurations (torch runs on the CPU).
    repeat
        Timed steps per configuration and length (after one warm-up step).
    tolerance
        Largest relative error counted as correct.
    trace
        Description of the trace, copied into the result.
    progress
        Called with one line per step of the run (e.g. print to stderr).
    builds
        Executables shared by the dynamic TVM configurations, keyed by ``(config.pipeline,
        config.keep_bounds)`` with values ``(executable, workspace table)``: a configuration
        whose key is there runs that executable (compile time 0), one whose key is not compiles
        and adds its own. ``{}`` compiles each pipeline once (a budget variant runs its
        base's); an entry built beforehand is used as it is (the GPU program compiles before
        it takes the GPU). ``None``: every configuration compiles its own.
    on_row
        Called with the result so far after each row (the GPU program writes it out, so that
        a step killed at its time limit keeps the rows it measured).
    """
    from ..pipeline import as_target

    say = progress or (lambda _msg: None)
    tgt = as_target(target)
    device = _device_for(tgt)
    if tgt.kind.name == "cuda":
        from ..runtime.devices import configure_cuda_compiler

        configure_cuda_compiler()  # on a GPU machine TVM compiles the CUDA C while building
    cases = _cases(workload, lengths, say)
    summaries: list[ConfigSummary] = []
    rows: list[Measurement] = []

    def result() -> BenchResult:
        return BenchResult(
            workload=workload,
            target=str(tgt.kind.name) if not isinstance(target, str) else target,
            lengths=cases.lengths,
            trace=trace or {},
            repeat=repeat,
            tolerance=tolerance,
            configs=summaries,
            measurements=rows,
        )

    def measured(row: Measurement) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(result())

    session = _Session(workload.graph, cases, tgt, device, builds, repeat, tolerance, say)
    for config, requested in resolve_configs(list(config_names)):
        summary = _summary(config, requested)
        summaries.append(summary)
        _measure_config(session, config, summary, rows.append, measured)
    return result()


@dataclass
class _Cases:
    """What every configuration runs on, per length: the inputs, their dims, the bytes the
    caller holds (parameters and inputs), torch's outputs and the lower bound."""

    lengths: list[int]
    inputs: dict[int, list[np.ndarray]]
    dims: dict[int, dict[str, int]]
    caller: dict[int, int]
    references: dict[int, list[np.ndarray] | None]
    lower: dict[int, int | None]
    float64_reference: Callable[[Sequence[np.ndarray]], list[np.ndarray]] | None = None
    float64_outputs: dict[int, list[np.ndarray]] = field(default_factory=dict)

    def float64(self, n: int) -> list[np.ndarray] | None:
        """torch's outputs in float64 at length ``n`` (computed at the first ask), or None."""
        if self.float64_reference is None:
            return None
        if n not in self.float64_outputs:
            try:
                self.float64_outputs[n] = self.float64_reference(self.inputs[n])
            except Exception as err:
                raise RuntimeError(
                    f"an output exceeds the tolerance, and torch's float64 step (what it is "
                    f"checked against then) failed: {type(err).__name__}: {err}"
                ) from err
        return self.float64_outputs[n]


def _cases(workload: Workload, lengths: Sequence[int], say: Callable[[str], None]) -> _Cases:
    """The inputs of ``workload`` at every length (their ranges checked before anything runs),
    torch's reference outputs and the lower bounds."""
    graph = workload.graph
    lengths = sorted(set(int(n) for n in lengths))
    inputs = {n: workload.inputs(n) for n in lengths}
    dims = {n: graph.bind_dims(inputs[n]) for n in lengths}  # checks the ranges first
    caller = {n: graph.param_bytes + int(sum(a.nbytes for a in inputs[n])) for n in lengths}

    say("computing torch references and lower bounds")
    references = {n: graph.reference(inputs[n]) if graph.reference else None for n in lengths}
    lower = _lower_bounds(graph, dims, say)
    return _Cases(lengths, inputs, dims, caller, references, lower, graph.float64_reference)


@dataclass
class _Session:
    """What every configuration of one :func:`run_benchmark` is measured with."""

    graph: ImportedGraph
    cases: _Cases
    target: tvm.target.Target
    device: Any
    builds: dict[Any, Any] | None
    repeat: int
    tolerance: float
    say: Callable[[str], None]
    #: (configuration, length) -> its step peak, the base of the budgets taken from it.
    step_peaks: dict[tuple[str, int], int | None] = field(default_factory=dict)


def _measure_config(
    session: _Session,
    config: BenchConfig,
    summary: ConfigSummary,
    unmeasured: Callable[[Measurement], None],
    measured: Callable[[Measurement], None],
) -> None:
    """One configuration at every length: a row each, handed to ``measured`` once measured
    (to ``unmeasured`` when it could not run: no runner, no peak to take its budget from)."""
    graph, cases, say = session.graph, session.cases, session.say
    try:
        runner: Any = (
            _TvmRunner(config, graph, session.target, session.device, session.builds)
            if isinstance(config, TvmConfig)
            else _TorchRunner(config, graph, session.device)
        )
    except Exception as err:
        for n in cases.lengths:
            unmeasured(Measurement(config.name, n, error=_describe(err)))
        say(f"{config.name}: failed to set up: {_describe(err)}")
        return
    for n in cases.lengths:
        row = Measurement(
            config.name, n, caller_bytes=cases.caller[n], lower_bound_bytes=cases.lower[n]
        )
        if isinstance(config, TvmConfig) and config.bucket is not None:
            padded, _ = pad_for_bucket(config, graph, cases.inputs[n], cases.dims[n])
            row.caller_bytes = graph.param_bytes + int(sum(a.nbytes for a in padded))
        budget = None
        if isinstance(config, TvmConfig) and config.budget is not None:
            reference_peak = session.step_peaks.get((config.budget_of, n))
            if reference_peak is None:
                row.error = f"no peak of {config.budget_of} at s={n} to take the budget from"
                unmeasured(row)
                continue
            budget = max(1, int(config.budget * reference_peak))
            row.budget_bytes = budget
        say(f"{config.name}: s={n}")
        try:
            outputs = runner.measure(row, cases.inputs[n], cases.dims[n], session.repeat, budget)
            row.peak_bytes = row.step_peak_bytes + row.caller_bytes
            row.step_time_s = statistics.median(row.step_times_s)
            _check(row, outputs, cases, graph, session.tolerance)
        except Exception as err:
            row.error = _describe(err)
            say(f"{config.name}: s={n}: {row.error}")
        session.step_peaks[(config.name, n)] = row.step_peak_bytes
        measured(row)
    summary.compile_time_s = runner.compile_time_s
    summary.compilations = runner.compilations


def _check(
    row: Measurement,
    outputs: list[np.ndarray],
    cases: _Cases,
    graph: ImportedGraph,
    tolerance: float,
) -> None:
    """``row``'s loss, error and correctness: every output within ``tolerance`` of torch's, or
    within float64 rounding (:func:`within_float64_rounding`) where torch's own float32 output
    is noise (see the module docstring)."""
    if graph.kind == "training" and outputs:
        row.loss = float(np.asarray(outputs[0]).reshape(-1)[0])
    reference = cases.references[row.seq_len]
    if reference is None:
        return
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs, the reference has {len(reference)}")
    errors = [relative_error(o, r) for o, r in zip(outputs, reference)]
    above = [i for i, e in enumerate(errors) if e > tolerance]
    exact = cases.float64(row.seq_len) if above else None
    if exact is not None:
        rounding = [i for i in above if within_float64_rounding(outputs[i], reference[i], exact[i])]
        row.float64_checked = [_output_name(graph, i) for i in rounding] or None
        errors = [e for i, e in enumerate(errors) if i not in rounding] or [0.0]
    row.max_rel_error = max(errors)
    row.correct = bool(row.max_rel_error <= tolerance)


def _output_name(graph: ImportedGraph, index: int) -> str:
    names = graph.output_names
    return names[index] if index < len(names) else f"output {index}"


def _describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    # TVM errors carry a long traceback; the last line holds the message.
    message = text[-1] if text else ""
    return f"{type(err).__name__}: {message}"[:500]


def _summary(config: BenchConfig, requested: bool) -> ConfigSummary:
    if isinstance(config, TvmConfig):
        settings = {
            "static": config.static,
            "keep_bounds": config.keep_bounds,
            "budget": config.budget,
            "budget_of": config.budget_of,
            "eviction": config.eviction,
            "bucket": config.bucket,
        }
    else:
        settings = {
            "compile": config.compile,
            "activation_memory_budget": config.activation_memory_budget,
            "checkpointing": config.checkpointing,
            "attention": config.attention,
        }
    return ConfigSummary(
        name=config.name,
        kind=config.kind,
        description=config.description,
        requested=requested,
        settings=settings,
    )
