"""The configurations the benchmark compares, and the registry they live in.

A configuration says how one system runs a workload. Two kinds exist:

:class:`TvmConfig`
    A Relax pipeline factory (``target -> tvm.transform.Pass``), whether the module is compiled
    once for the symbolic length or recompiled per exact length, whether ``main`` keeps its
    ``tir_var_upper_bound`` (stock TVM then plans every buffer at the bound), and an optional
    runtime memory budget (a fraction of another configuration's measured peak at the same
    length, applied with ``blade_relax.runtime.set_memory_budget``).
:class:`TorchConfig`
    PyTorch eager, or ``torch.compile(dynamic=True)`` with an optional
    ``torch._functorch.config.activation_memory_budget``; either with Hugging Face gradient
    checkpointing (:mod:`blade_relax.training.hf_checkpointing`).

A TVM configuration whose pipeline is a :class:`FlagsPipeline` (every one registered here) says
which :class:`~blade_relax.pipeline.PipelineFlags` it compiles with, so that the predicted mode
(:mod:`.predict`) can lower the module through the same passes to the memory stage and read
its timeline, without building or running a kernel.

Names are either fixed (``register_config``) or parametrized as ``family@argument``
(``register_config_family``): ``torch-compile@0.5`` asks the ``torch-compile`` family for a
configuration with argument ``"0.5"``; ``blade-relax@0.5`` is a budget of half the
``blade-relax`` peak once that family is registered (:func:`register_budget_family`), and
``blade-relax@0.5:offload`` (or ``:auto``) the same budget with evicted tensors offloaded to
host memory (or offloaded or recomputed, per tensor, whichever is estimated faster: the
eviction modes of :func:`blade_relax.runtime.set_eviction_mode`).

``blade-relax`` is the default pipeline (``get_pipeline(target)``),
``blade-relax-no-<flag>`` that pipeline without one graph pass and ``blade-relax-with-<flag>``
with one it leaves off (an opt-in pass, such as ``RewriteSoftmaxBackward``);
``blade-relax-schedule-remat`` is ``MemoryAwareSchedule`` + ``Rematerialize`` alone (the name
``blade-relax`` had before).
Renamed configurations keep their old names as deprecated aliases (:data:`_DEPRECATED_ALIASES`):
:func:`get_config` resolves one to the configuration under its new name, which the results
carry, and says so once per process on stderr.

Adding a configuration is a few lines, here (at the end of this file) or in the module that owns
the passes, e.g.::

    from blade_relax import get_pipeline
    from blade_relax.bench.configs import TvmConfig, register_budget_family, register_config

    register_config(TvmConfig(
        "blade-relax-schedule",
        pipeline=lambda target: get_pipeline(target, schedule=True, remat=False, plan=False),
        description="stock + MemoryAwareSchedule, bounds dropped",
    ))
    register_config(TvmConfig("my-pipeline", pipeline=lambda target: get_pipeline(target)))
    register_budget_family("my-pipeline")        # my-pipeline@0.5, my-pipeline@0.25, ...
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..pipeline import PipelineFlags

__all__ = [
    "DEFAULT_CONFIG",
    "BenchConfig",
    "ConfigFamily",
    "FlagsPipeline",
    "TorchConfig",
    "TvmConfig",
    "available_configs",
    "budget_variant",
    "canonical_name",
    "deprecated_aliases",
    "get_config",
    "register_budget_family",
    "register_config",
    "register_config_family",
    "resolve_configs",
    "stock_pipeline_factory",
]

PipelineFactory = Callable[[Any], Any]
"""``target (tvm.target.Target) -> tvm.transform.Pass`` usable as ``relax_pipeline=``."""


@dataclass(frozen=True)
class FlagsPipeline:
    """A pipeline factory that knows its flags: ``get_pipeline(target, **flags)``.

    With :meth:`PipelineFlags.stock` flags it is TVM's default pipeline for the target
    (:func:`blade_relax.pipeline.stock_pipeline`).

    Attributes
    ----------
    flags
        The passes and options of the pipeline.
    """

    flags: PipelineFlags

    def __call__(self, target: Any) -> Any:
        from ..pipeline import get_pipeline, stock_pipeline

        if self.flags == PipelineFlags.stock():
            return stock_pipeline(target)
        return get_pipeline(target, **self.keywords())

    def keywords(self) -> dict[str, Any]:
        """The flags as the keywords of ``get_pipeline`` / ``lower_to_memory_stage``."""
        return {f.name: getattr(self.flags, f.name) for f in dataclasses.fields(self.flags)}


@dataclass(frozen=True)
class TvmConfig:
    """TVM Relax: a pipeline, per-shape or dynamic compilation, bounds, and a budget.

    Attributes
    ----------
    name
        Registry name (``"tvm-dynamic"``, ``"blade-relax@0.5"``).
    pipeline
        ``target -> tvm.transform.Pass``: the whole Relax pipeline (``tvm.compile`` replaces
        its default with it), e.g. ``lambda t: blade_relax.get_pipeline(t, remat=False)``.
    static
        Recompile for every exact length (the symbolic dims bound to constants); otherwise
        compile once for the symbolic length.
    keep_bounds
        Keep ``tir_var_upper_bound`` on ``main`` (dynamic compilation only).
    budget
        A runtime memory budget as a fraction of the step peak (VM-allocated bytes) that
        ``budget_of`` measured at the same length; ``None`` for no budget.
    budget_of
        The configuration whose peak defines ``budget`` (run first, added if not requested).
    eviction
        The runtime's eviction mode under the budget (``"recompute"``, ``"offload"`` or
        ``"auto"``; :func:`blade_relax.runtime.set_eviction_mode`, rates measured on the
        device).
    bucket
        Compile one static graph per bucket of lengths and pad the inputs to the bucket
        (:mod:`.bucketing`): a number of tokens per bucket, or ``"pow2"``; ``None``: no
        bucketing.
    description
        One line for the README and ``--list-configs``.
    """

    name: str
    pipeline: PipelineFactory
    static: bool = False
    keep_bounds: bool = False
    budget: float | None = None
    budget_of: str | None = None
    eviction: str = "recompute"
    bucket: int | str | None = None
    description: str = ""

    kind = "tvm"

    def __post_init__(self) -> None:
        if self.budget is not None:
            if not 0 < self.budget:
                raise ValueError(f"{self.name}: budget must be a positive fraction")
            if not self.budget_of:
                raise ValueError(f"{self.name}: a budget needs budget_of (the reference config)")
        from ..runtime.budget import EVICTION_MODES

        if self.eviction not in EVICTION_MODES:
            raise ValueError(
                f"{self.name}: eviction mode {self.eviction!r} not in {EVICTION_MODES}"
            )
        if self.eviction != "recompute" and self.budget is None:
            raise ValueError(f"{self.name}: an eviction mode needs a budget (nothing is evicted)")
        if self.static and self.keep_bounds:
            raise ValueError(f"{self.name}: a static config has no symbolic bounds to keep")
        if self.bucket is not None and (self.static or self.keep_bounds):
            raise ValueError(f"{self.name}: a bucketed config is neither static nor bounded")


@dataclass(frozen=True)
class TorchConfig:
    """PyTorch on the CPU, its live bytes counted by a ``TorchDispatchMode``.

    Attributes
    ----------
    name
        Registry name.
    compile
        Run ``torch.compile(module, dynamic=True)`` instead of eager.
    activation_memory_budget
        ``torch._functorch.config.activation_memory_budget`` while compiling (``None``: the
        default, 1.0).
    checkpointing
        Run the Hugging Face model with ``gradient_checkpointing_enable()`` (non-reentrant,
        in train mode; restored after each measurement, see
        :mod:`blade_relax.training.hf_checkpointing`): every decoder layer recomputes its
        activations in the backward pass. Only for workloads whose torch module holds a Hugging
        Face model.
    attention
        The attention implementation the Hugging Face model runs (``"sdpa"``: PyTorch's
        ``scaled_dot_product_attention``, transformers' default, which keeps no attention
        matrix for the backward pass); ``None``: the model's own. The registered Hugging Face
        workloads build their models with ``"eager"`` attention, the computation the compiled
        step imports, so ``torch-eager`` and ``torch-compile`` compute what TVM computes.
    description
        One line for the README and ``--list-configs``.
    """

    name: str
    compile: bool = False
    activation_memory_budget: float | None = None
    checkpointing: bool = False
    attention: str | None = None
    description: str = ""

    kind = "torch"


BenchConfig = TvmConfig | TorchConfig


@dataclass(frozen=True)
class ConfigFamily:
    """Configurations named ``prefix@argument``, built on demand by ``make(argument)``."""

    prefix: str
    make: Callable[[str], BenchConfig]
    description: str = ""


_CONFIGS: dict[str, BenchConfig] = {}
_FAMILIES: dict[str, ConfigFamily] = {}

#: The default pipeline's configuration (``get_pipeline(target)``).
DEFAULT_CONFIG = "blade-relax"

#: Old names that still resolve: old name -> (current name, what it is, for the message).
#: An old name that was also a family prefix stands for the family too: ``blade-relax-full@0.5``
#: is ``blade-relax@0.5``. Nothing may be registered under an old name, and a name whose meaning
#: changed (``blade-relax``, once ``blade-relax-schedule-remat``) cannot be an alias.
_DEPRECATED_ALIASES: dict[str, tuple[str, str]] = {
    "blade-relax-full": (DEFAULT_CONFIG, "the default pipeline"),
    **{
        f"blade-relax-full-no-{flag.replace('_', '-')}": (
            f"{DEFAULT_CONFIG}-no-{flag.replace('_', '-')}",
            f"the default pipeline without {name}",
        )
        for flag, name in PipelineFlags.passes("graph").items()
        if PipelineFlags.defaults("graph")[flag]
    },
}
#: The old names :func:`canonical_name` has warned about in this process.
_WARNED: set[str] = set()


def deprecated_aliases() -> dict[str, str]:
    """The deprecated names that still resolve, each with the name it now stands for.

    Returns
    -------
    dict[str, str]
        Old name -> current name; an old family prefix appears as ``old@B`` -> ``new@B``.
    """
    aliases = {}
    for old, (new, _what) in sorted(_DEPRECATED_ALIASES.items()):
        aliases[old] = new
        if new in _FAMILIES:
            aliases[f"{old}@B"] = f"{new}@B"
    return aliases


def canonical_name(name: str) -> str:
    """``name`` under its current spelling: a deprecated alias becomes its new name.

    The first use of each old name in a process prints one line on stderr; any other name
    (registered or not) comes back unchanged.

    Parameters
    ----------
    name
        A configuration name, fixed or ``family@argument``.

    Returns
    -------
    str
        The name to look the configuration up by and to report its results under.
    """
    if name in _DEPRECATED_ALIASES:
        new, what = _DEPRECATED_ALIASES[name]
    else:
        prefix, at, argument = name.partition("@")
        if not (at and prefix in _DEPRECATED_ALIASES):
            return name
        base, what = _DEPRECATED_ALIASES[prefix]
        new, what = f"{base}@{argument}", f"{what} under a budget"
    if name not in _WARNED:
        _WARNED.add(name)
        print(
            f"blade-relax bench: config {name!r} is now {new!r} ({what}); "
            "the old name will be removed",
            file=sys.stderr,
            flush=True,
        )
    return new


def register_config(config: BenchConfig, *, override: bool = False) -> BenchConfig:
    """Add ``config`` under ``config.name``; returns it (so it can be used inline).

    Raises
    ------
    ValueError
        When the name is taken (unless ``override``), is a deprecated alias, or contains ``@``
        (use a family).
    """
    if "@" in config.name:
        raise ValueError(
            f"config names with '@' are parametrized: register a family for {config.name!r}"
        )
    _refuse_alias(config.name)
    if config.name in _CONFIGS and not override:
        raise ValueError(f"config {config.name!r} is already registered")
    _CONFIGS[config.name] = config
    return config


def register_config_family(
    prefix: str,
    make: Callable[[str], BenchConfig],
    *,
    description: str = "",
    override: bool = False,
) -> ConfigFamily:
    """Register configurations named ``prefix@ARG``; ``make(ARG)`` builds one.

    ``make`` should raise ``ValueError`` for an argument it does not accept; the configuration
    it returns is renamed to the requested name.
    """
    if "@" in prefix:
        raise ValueError(f"a family prefix may not contain '@': {prefix!r}")
    _refuse_alias(prefix)
    if prefix in _FAMILIES and not override:
        raise ValueError(f"config family {prefix!r}@... is already registered")
    family = ConfigFamily(prefix, make, description)
    _FAMILIES[prefix] = family
    return family


def _refuse_alias(name: str) -> None:
    if name in _DEPRECATED_ALIASES:
        raise ValueError(
            f"{name!r} is the deprecated name of {_DEPRECATED_ALIASES[name][0]!r}: "
            "choose another name"
        )


def _fraction(argument: str, name: str) -> float:
    try:
        value = float(argument)
    except ValueError:
        raise ValueError(f"{name}: expected a number after '@', got {argument!r}") from None
    if not 0 < value:
        raise ValueError(f"{name}: the fraction after '@' must be positive, got {value}")
    return value


def budget_variant(
    base: TvmConfig, fraction: float, name: str | None = None, eviction: str = "recompute"
) -> TvmConfig:
    """``base`` run under a budget of ``fraction`` times ``base``'s own peak, evicted tensors
    brought back as ``eviction`` says (see :class:`TvmConfig`)."""
    mode = "" if eviction == "recompute" else f":{eviction}"
    how = "" if eviction == "recompute" else f", evicted tensors: {eviction}"
    return dataclasses.replace(
        base,
        name=name or f"{base.name}@{fraction:g}{mode}",
        budget=fraction,
        budget_of=base.name,
        eviction=eviction,
        description=f"{base.name} under a runtime budget of {fraction:g} x its peak{how}",
    )


def register_budget_family(base_name: str, *, override: bool = False) -> ConfigFamily:
    """Register ``base_name@B``: the registered ``base_name`` under a budget of ``B`` times
    ``base_name``'s peak at the same length."""

    def make(argument: str) -> TvmConfig:
        base = get_config(base_name)
        if not isinstance(base, TvmConfig):
            raise ValueError(f"{base_name} is not a TVM config; budgets apply to TVM configs")
        fraction, _, eviction = argument.partition(":")
        return budget_variant(
            base,
            _fraction(fraction, f"{base_name}@{argument}"),
            eviction=eviction or "recompute",
        )

    return register_config_family(
        base_name,
        make,
        description=f"{base_name} under a runtime budget: {base_name}@B, B a fraction of its "
        "peak; @B:offload or @B:auto to offload evicted tensors to host memory",
        override=override,
    )


def get_config(name: str) -> BenchConfig:
    """The configuration called ``name`` (fixed or ``family@argument``).

    A deprecated alias (:func:`canonical_name`) gives the configuration under its new name.

    Raises
    ------
    ValueError
        For an unknown name or a family argument its family refuses.
    """
    name = canonical_name(name)
    if name in _CONFIGS:
        return _CONFIGS[name]
    prefix, at, argument = name.partition("@")
    if at and prefix in _FAMILIES:
        if not argument:
            raise ValueError(f"{name!r}: missing argument after '@'")
        config = _FAMILIES[prefix].make(argument)
        return dataclasses.replace(config, name=name)
    known = ", ".join(available_configs())
    raise ValueError(f"unknown config {name!r}; available: {known}")


def available_configs() -> list[str]:
    """Registered names, families shown as ``prefix@B`` (deprecated aliases left out)."""
    return sorted(_CONFIGS) + sorted(f"{p}@B" for p in _FAMILIES)


def resolve_configs(names: list[str]) -> list[tuple[BenchConfig, bool]]:
    """Configurations for ``names`` in run order, each budget reference before its users.

    Returns ``(config, requested)`` pairs; ``requested`` is False for a reference added only
    because a budget needs its peak. Deprecated aliases are resolved first (an old and a new
    name of one configuration give one entry).
    """
    ordered: list[tuple[BenchConfig, bool]] = []
    seen: dict[str, int] = {}

    def add(name: str, requested: bool, chain: tuple[str, ...]) -> None:
        name = canonical_name(name)
        if name in chain:
            raise ValueError(f"budget references form a cycle: {' -> '.join((*chain, name))}")
        if name in seen:
            if requested:
                index = seen[name]
                ordered[index] = (ordered[index][0], True)
            return
        config = get_config(name)
        if isinstance(config, TvmConfig) and config.budget_of:
            add(config.budget_of, False, (*chain, name))
        seen[name] = len(ordered)
        ordered.append((config, requested))

    for name in names:
        add(name, True, ())
    return ordered


def stock_pipeline_factory(target: Any) -> Any:
    """TVM's default pipeline for ``target`` (legalize, fusion, lowering; no blade_relax pass)."""
    from ..pipeline import stock_pipeline

    return stock_pipeline(target)


_STOCK = FlagsPipeline(PipelineFlags.stock())


# ---------------------------------------------------------------------------------------------
# Stock baselines.
register_config(
    TvmConfig(
        "tvm-dynamic",
        pipeline=_STOCK,
        description="stock TVM pipeline, compiled once, upper bounds dropped "
        "(buffers sized by the actual length)",
    )
)
register_config(
    TvmConfig(
        "tvm-bounded",
        pipeline=_STOCK,
        keep_bounds=True,
        description="stock TVM pipeline, compiled once, planned at the upper bound "
        "(tir_var_upper_bound kept)",
    )
)
register_config(
    TvmConfig(
        "tvm-static",
        pipeline=_STOCK,
        static=True,
        description="stock TVM pipeline recompiled for every exact length (the static oracle)",
    )
)
register_config(TorchConfig("torch-eager", description="PyTorch eager"))
register_config(
    TorchConfig(
        "torch-compile",
        compile=True,
        description="torch.compile(dynamic=True), default partitioner budget",
    )
)
register_config_family(
    "torch-compile",
    lambda argument: TorchConfig(
        f"torch-compile@{argument}",
        compile=True,
        activation_memory_budget=_fraction(argument, f"torch-compile@{argument}"),
        description=f"torch.compile(dynamic=True), activation_memory_budget={argument}",
    ),
    description="torch.compile(dynamic=True) with activation_memory_budget=B",
)
register_config(
    TorchConfig(
        "torch-eager-sdpa",
        attention="sdpa",
        description="PyTorch eager with scaled_dot_product_attention (transformers' default "
        "attention: no attention matrix kept for the backward pass)",
    )
)
register_config(
    TorchConfig(
        "torch-compile-sdpa",
        compile=True,
        attention="sdpa",
        description="torch.compile(dynamic=True) with scaled_dot_product_attention",
    )
)
register_config(
    TorchConfig(
        "torch-eager-ckpt",
        checkpointing=True,
        description="PyTorch eager with Hugging Face gradient checkpointing "
        "(model.gradient_checkpointing_enable(), non-reentrant)",
    )
)
register_config(
    TorchConfig(
        "torch-compile-ckpt",
        compile=True,
        checkpointing=True,
        description="torch.compile(dynamic=True) of PyTorch with Hugging Face gradient "
        "checkpointing (non-reentrant)",
    )
)
register_config_family(
    "torch-compile-ckpt",
    lambda argument: TorchConfig(
        f"torch-compile-ckpt@{argument}",
        compile=True,
        checkpointing=True,
        activation_memory_budget=_fraction(argument, f"torch-compile-ckpt@{argument}"),
        description=f"torch-compile-ckpt with activation_memory_budget={argument}",
    ),
    description="torch-compile-ckpt with activation_memory_budget=B",
)

# ---------------------------------------------------------------------------------------------
# blade_relax configurations: each pass adds its own below (a few lines each, see the module
# docstring), once the pass exists and passes its tests.


# The passes that clean up imported graphs and fused kernels; each configuration names the ones
# it runs, so that
# the memory passes' configurations below keep measuring those passes alone.
_NO_GRAPH_PASSES = dict.fromkeys(PipelineFlags.switches("graph"), False)


def _blade_factory(**flags: bool) -> FlagsPipeline:
    """``get_pipeline`` with ``flags`` (its defaults otherwise), the graph passes off unless named."""
    return FlagsPipeline(PipelineFlags.of({**_NO_GRAPH_PASSES, **flags}))


def _toposort_factory(target: Any) -> Any:
    from tvm import relax

    from ..pipeline import stock_pipeline

    sort = relax.transform.TopologicalSort(order="depth-first", direction="from-outputs")
    return stock_pipeline(target, after_fusion=(sort,))


register_config(
    TvmConfig(
        "tvm-toposort",
        pipeline=_toposort_factory,
        description="stock TVM + TopologicalSort(depth-first, from outputs), bounds dropped",
    )
)
register_config(
    TvmConfig(
        "blade-relax-schedule",
        pipeline=_blade_factory(schedule=True, remat=False, plan=False),
        description="stock + MemoryAwareSchedule, bounds dropped",
    )
)
register_config(
    TvmConfig(
        "blade-relax-plan",
        pipeline=_blade_factory(schedule=False, remat=False, plan=True),
        description="stock + PlanMemory (in place of StaticPlanBlockMemory), bounds dropped",
    )
)
register_config(
    TvmConfig(
        "blade-relax-schedule-remat",
        pipeline=_blade_factory(schedule=True, remat=True, plan=False),
        description="MemoryAwareSchedule + Rematerialize (no PlanMemory, no graph cleanup), "
        "no budget, bounds dropped",
    )
)
register_budget_family("blade-relax-schedule-remat")
# The default pipeline's passes beyond the three memory passes, by the flag that enables each.
_GRAPH_PASSES = {
    flag: name
    for flag, name in PipelineFlags.passes("graph").items()
    if PipelineFlags.defaults("graph")[flag]
}
_DEFAULT_FLAGS = {**PipelineFlags.defaults("memory"), **PipelineFlags.defaults("graph")}

register_config(
    TvmConfig(
        DEFAULT_CONFIG,
        pipeline=_blade_factory(**_DEFAULT_FLAGS),
        description="the default pipeline (blade_relax.get_pipeline(target)), no budget: "
        + " + ".join(_GRAPH_PASSES.values())
        + " + MemoryAwareSchedule + Rematerialize + PlanMemory, bounds dropped (DispatchGemm: "
        "GEMMs on ATen, its BLAS on a CPU, cuBLAS on a GPU; ExpandMathIntrinsics: exp and its "
        "kin vectorized on a CPU)",
    )
)
register_budget_family(DEFAULT_CONFIG)
for _flag, _pass in PipelineFlags.passes("graph").items():
    # What each pass does to the default pipeline's peak: the default without it (with it,
    # for an opt-in pass).
    _on = _flag in _GRAPH_PASSES
    register_config(
        TvmConfig(
            f"{DEFAULT_CONFIG}-{'no' if _on else 'with'}-{_flag.replace('_', '-')}",
            pipeline=_blade_factory(**{**_DEFAULT_FLAGS, _flag: not _on}),
            description=f"the default pipeline {'without' if _on else 'with'} {_pass}"
            + ("" if _on else " (opt-in)")
            + ", bounds dropped",
        )
    )
register_config(
    TvmConfig(
        "blade-relax-memory",
        pipeline=_blade_factory(schedule=True, remat=True, plan=True),
        description="MemoryAwareSchedule + Rematerialize + PlanMemory (no graph cleanup), "
        "bounds dropped",
    )
)
register_config(
    TvmConfig(
        "blade-relax-simplify",
        pipeline=_blade_factory(schedule=False, remat=False, plan=False, simplify=True),
        description="stock + SimplifyTransposes, bounds dropped",
    )
)
register_config(
    TvmConfig(
        "blade-relax-inline",
        pipeline=_blade_factory(schedule=False, remat=False, plan=False, inline_kernels=True),
        description="stock + InlineKernelIntermediates, bounds dropped",
    )
)
register_config(
    TvmConfig(
        "blade-relax-attention",
        pipeline=_blade_factory(
            schedule=False, remat=False, plan=False, fuse_attention=True, inline_kernels=True
        ),
        description="stock + FuseAttention + InlineKernelIntermediates (which computes the "
        "fused kernel row by row), bounds dropped",
    )
)
register_config(
    TvmConfig(
        "blade-relax-fold-scatter",
        pipeline=_blade_factory(schedule=False, remat=False, plan=False, fold_scatter=True),
        description="stock + FoldZeroScatter, bounds dropped",
    )
)


def _register_static_twin(name: str, base: str) -> None:
    """``base``'s pipeline recompiled for every exact length, registered as ``name``."""
    config = _CONFIGS[base]
    assert isinstance(config, TvmConfig)
    what = f"{base} (the default pipeline)" if base == DEFAULT_CONFIG else base
    register_config(
        TvmConfig(
            name,
            pipeline=config.pipeline,
            static=True,
            description=f"{what} recompiled for every exact length",
        )
    )


register_config(
    TvmConfig(
        "blade-relax-schedule-plan",
        pipeline=_blade_factory(schedule=True, remat=False, plan=True),
        description="MemoryAwareSchedule + PlanMemory, bounds dropped",
    )
)
_register_static_twin("blade-relax-static", DEFAULT_CONFIG)
_register_static_twin("blade-relax-schedule-static", "blade-relax-schedule")
_register_static_twin("blade-relax-schedule-plan-static", "blade-relax-schedule-plan")


def _bucketed(argument: str) -> TvmConfig:
    from .bucketing import parse_bucket

    bucket = parse_bucket(argument)
    what = "powers of two" if bucket == "pow2" else f"multiples of {bucket} tokens"
    return TvmConfig(
        f"tvm-bucketed@{argument}",
        pipeline=_STOCK,
        bucket=bucket,
        description=f"stock TVM compiled once per bucket ({what}), inputs padded to the "
        "bucket, padded labels ignored",
    )


register_config_family(
    "tvm-bucketed",
    _bucketed,
    description="stock TVM compiled once per bucket of K tokens (or pow2: powers of two), "
    "inputs padded to the bucket, padded labels ignored",
)
