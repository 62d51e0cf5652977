"""The configuration registry: fixed names, families, budget references."""

from __future__ import annotations

import inspect

import pytest

from blade_relax.bench import configs
from blade_relax.bench.configs import (
    TorchConfig,
    TvmConfig,
    available_configs,
    canonical_name,
    deprecated_aliases,
    get_config,
    register_budget_family,
    register_config,
    register_config_family,
    resolve_configs,
    stock_pipeline_factory,
)


@pytest.fixture(autouse=True)
def restore_registry():
    saved = dict(configs._CONFIGS), dict(configs._FAMILIES)
    yield
    configs._CONFIGS.clear()
    configs._CONFIGS.update(saved[0])
    configs._FAMILIES.clear()
    configs._FAMILIES.update(saved[1])


def test_stock_configs_are_registered():
    dynamic, bounded, static = (get_config(n) for n in ("tvm-dynamic", "tvm-bounded", "tvm-static"))
    assert (dynamic.static, dynamic.keep_bounds) == (False, False)
    assert (bounded.static, bounded.keep_bounds) == (False, True)
    assert (static.static, static.keep_bounds) == (True, False)
    assert get_config("torch-eager") == TorchConfig("torch-eager", description="PyTorch eager")
    assert get_config("torch-compile").compile


def test_family_argument_becomes_the_budget():
    config = get_config("torch-compile@0.5")
    assert isinstance(config, TorchConfig)
    assert config.name == "torch-compile@0.5"
    assert config.compile and config.activation_memory_budget == 0.5
    with pytest.raises(ValueError, match="expected a number"):
        get_config("torch-compile@half")
    with pytest.raises(ValueError, match="must be positive"):
        get_config("torch-compile@-1")


def test_checkpointing_configs_are_registered():
    eager, compiled = get_config("torch-eager-ckpt"), get_config("torch-compile-ckpt")
    assert isinstance(eager, TorchConfig) and isinstance(compiled, TorchConfig)
    assert eager.checkpointing and not eager.compile
    assert compiled.checkpointing and compiled.compile
    assert compiled.activation_memory_budget is None
    assert not get_config("torch-eager").checkpointing
    assert not get_config("torch-compile@0.5").checkpointing
    budgeted = get_config("torch-compile-ckpt@0.25")
    assert budgeted.name == "torch-compile-ckpt@0.25"
    assert budgeted.checkpointing and budgeted.compile
    assert budgeted.activation_memory_budget == 0.25
    with pytest.raises(ValueError, match="expected a number"):
        get_config("torch-compile-ckpt@all")
    assert "torch-compile-ckpt@B" in available_configs()


def test_unknown_and_duplicate_names_are_clear_errors():
    with pytest.raises(ValueError, match="unknown config 'nope'.*tvm-dynamic"):
        get_config("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_config(TvmConfig("tvm-dynamic", pipeline=stock_pipeline_factory))
    with pytest.raises(ValueError, match="register a family"):
        register_config(TvmConfig("x@1", pipeline=stock_pipeline_factory))
    with pytest.raises(ValueError, match="needs budget_of"):
        TvmConfig("x", pipeline=stock_pipeline_factory, budget=0.5)


def test_budget_family_resolves_its_reference_first():
    register_config(TvmConfig("my-pass", pipeline=stock_pipeline_factory, description="mine"))
    register_budget_family("my-pass")
    config = get_config("my-pass@0.25")
    assert (config.budget, config.budget_of, config.name) == (0.25, "my-pass", "my-pass@0.25")
    assert config.pipeline is stock_pipeline_factory
    plan = resolve_configs(["torch-eager", "my-pass@0.25"])
    assert [(c.name, requested) for c, requested in plan] == [
        ("torch-eager", True),
        ("my-pass", False),
        ("my-pass@0.25", True),
    ]
    # Asking for the reference too marks it requested, once.
    plan = resolve_configs(["my-pass@0.25", "my-pass"])
    assert [(c.name, requested) for c, requested in plan] == [
        ("my-pass", True),
        ("my-pass@0.25", True),
    ]


def test_budget_family_takes_an_eviction_mode():
    offload, auto = get_config("blade-relax@0.7:offload"), get_config("blade-relax@0.7:auto")
    base = get_config("blade-relax@0.7")
    assert (base.eviction, offload.eviction, auto.eviction) == ("recompute", "offload", "auto")
    assert offload.name == "blade-relax@0.7:offload" and offload.budget == 0.7
    assert offload.budget_of == "blade-relax" and offload.pipeline is base.pipeline
    assert "offload" in offload.description
    with pytest.raises(ValueError, match="eviction mode 'swap'"):
        get_config("blade-relax@0.7:swap")
    with pytest.raises(ValueError, match="needs a budget"):
        TvmConfig("x", pipeline=stock_pipeline_factory, eviction="offload")


def test_custom_family():
    register_config_family(
        "static-at",
        lambda arg: TvmConfig(f"static-at@{arg}", pipeline=stock_pipeline_factory, static=True),
    )
    assert get_config("static-at@x").static
    with pytest.raises(ValueError, match="already registered"):
        register_config_family("static-at", lambda arg: None)


@pytest.mark.parametrize(
    ("twin", "base"),
    [
        ("blade-relax-static", "blade-relax"),
        ("blade-relax-schedule-static", "blade-relax-schedule"),
        ("blade-relax-schedule-plan-static", "blade-relax-schedule-plan"),
    ],
)
def test_static_twins_compile_their_base_pipeline_per_length(twin, base):
    twin_config, base_config = get_config(twin), get_config(base)
    assert twin_config.static and not base_config.static
    assert twin_config.pipeline is base_config.pipeline


def test_registered_tvm_pipelines_say_which_flags_they_compile_with():
    from blade_relax.bench.configs import FlagsPipeline
    from blade_relax.pipeline import PipelineFlags

    for name in ("tvm-dynamic", "tvm-static", "tvm-bucketed@64", "blade-relax"):
        assert isinstance(get_config(name).pipeline, FlagsPipeline), name
    assert get_config("tvm-static").pipeline.flags == PipelineFlags.stock()
    full = get_config("blade-relax").pipeline.keywords()
    assert full["schedule"] and full["remat"] and full["plan"] and full["simplify"]
    schedule = get_config("blade-relax-schedule").pipeline.keywords()
    assert schedule["schedule"] and not schedule["remat"] and not schedule["simplify"]
    # A budget variant keeps its reference's pipeline (the predicted mode shares the lowering).
    assert get_config("blade-relax@0.8").pipeline == get_config("blade-relax").pipeline


def test_a_bucketed_config_is_neither_static_nor_bounded():
    with pytest.raises(ValueError, match="neither static nor bounded"):
        TvmConfig("x", pipeline=stock_pipeline_factory, bucket=64, static=True)
    with pytest.raises(ValueError, match="neither static nor bounded"):
        TvmConfig("x", pipeline=stock_pipeline_factory, bucket="pow2", keep_bounds=True)


# ------------------------------------------------------------------------------------------------
# Names: `blade-relax` is the default pipeline; the old `blade-relax-full*` names are aliases.
GRAPH_FLAGS = ["fuse-attention", "simplify", "fold-scatter", "clone-generated", "dispatch-gemm",
               "inline-kernels", "recompute"]  # fmt: skip


@pytest.fixture
def warned(monkeypatch):
    """A process that has printed no deprecation line yet."""
    monkeypatch.setattr(configs, "_WARNED", set())


def test_blade_relax_is_the_default_pipeline():
    from blade_relax.pipeline import PipelineFlags, get_pipeline

    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(get_pipeline).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert defaults["schedule"] and defaults["dispatch_gemm"] and defaults["expand_math"]
    config = get_config("blade-relax")
    assert config.pipeline.keywords() == defaults
    assert config.pipeline.flags == PipelineFlags()
    assert (config.static, config.keep_bounds, config.budget) == (False, False, None)
    assert config.description.startswith("the default pipeline")
    assert "static oracle" not in config.description
    assert get_config("blade-relax-static").description.startswith(
        "blade-relax (the default pipeline)"
    )


def test_blade_relax_compiles_what_get_pipeline_compiles():
    import tvm
    import tvm_ffi
    from tvm.script import ir as I
    from tvm.script import relax as R

    from blade_relax.pipeline import get_pipeline

    @I.ir_module
    class Tiny:
        @R.function
        def main(x: R.Tensor(("n", 8), "float32"), w: R.Tensor((8, 8), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                z = R.nn.relu(y)
                out = R.add(z, x)
                R.output(out)
            return out

    target = tvm.target.Target("llvm")
    with target:
        ours = get_config("blade-relax").pipeline(target)(Tiny)
        default = get_pipeline(target)(Tiny)
        schedule_remat = get_config("blade-relax-schedule-remat").pipeline(target)(Tiny)
    tvm.ir.assert_structural_equal(ours, default)
    # The renamed schedule + remat config plans with TVM's planner, not PlanMemory.
    assert not tvm_ffi.structural_equal(schedule_remat, default)


def test_schedule_remat_keeps_the_old_meaning_of_blade_relax():
    flags = get_config("blade-relax-schedule-remat").pipeline.keywords()
    assert flags["schedule"] and flags["remat"] and not flags["plan"]
    assert not any(flags[name.replace("-", "_")] for name in GRAPH_FLAGS)
    budgeted = get_config("blade-relax-schedule-remat@0.5")
    assert (budgeted.budget, budgeted.budget_of) == (0.5, "blade-relax-schedule-remat")
    assert budgeted.pipeline == get_config("blade-relax-schedule-remat").pipeline


def test_the_default_without_each_graph_pass():
    default = get_config("blade-relax").pipeline.keywords()
    for flag in GRAPH_FLAGS:
        without = get_config(f"blade-relax-no-{flag}").pipeline.keywords()
        assert without == {**default, flag.replace("-", "_"): False}, flag
    # An opt-in pass is measured the other way round: the default with it.
    assert not default["softmax_backward"]
    with_it = get_config("blade-relax-with-softmax-backward").pipeline.keywords()
    assert with_it == {**default, "softmax_backward": True}
    with pytest.raises(ValueError, match="unknown config 'blade-relax-no-softmax-backward'"):
        get_config("blade-relax-no-softmax-backward")


@pytest.mark.usefixtures("warned")
def test_old_names_resolve_to_the_new_configs():
    assert get_config("blade-relax-full") is get_config("blade-relax")
    for flag in GRAPH_FLAGS:
        old, new = get_config(f"blade-relax-full-no-{flag}"), get_config(f"blade-relax-no-{flag}")
        assert old is new and old.name == f"blade-relax-no-{flag}"
    budgeted = get_config("blade-relax-full@0.7")
    assert budgeted == get_config("blade-relax@0.7")
    assert (budgeted.name, budgeted.budget, budgeted.budget_of) == (
        "blade-relax@0.7",
        0.7,
        "blade-relax",
    )
    # Run under the new names: an old and a new name of one config are one entry.
    plan = resolve_configs(["blade-relax-full@0.5", "blade-relax-full", "blade-relax"])
    assert [(c.name, requested) for c, requested in plan] == [
        ("blade-relax", True),
        ("blade-relax@0.5", True),
    ]
    assert canonical_name("blade-relax-full@0.25") == "blade-relax@0.25"
    assert canonical_name("blade-relax-schedule") == "blade-relax-schedule"
    assert canonical_name("nope") == "nope"


@pytest.mark.usefixtures("warned")
def test_an_old_name_prints_one_line_once_per_process(capsys):
    for _ in range(3):
        get_config("blade-relax-full")
    resolve_configs(["blade-relax-full", "blade-relax"])
    get_config("blade-relax")  # the new name: nothing to say
    assert capsys.readouterr().err.splitlines() == [
        "blade-relax bench: config 'blade-relax-full' is now 'blade-relax' (the default "
        "pipeline); the old name will be removed"
    ]
    get_config("blade-relax-full-no-simplify")
    get_config("blade-relax-full-no-simplify")
    get_config("blade-relax-full@0.5")
    (without, budgeted) = capsys.readouterr().err.splitlines()
    assert without.startswith(
        "blade-relax bench: config 'blade-relax-full-no-simplify' is now "
        "'blade-relax-no-simplify' (the default pipeline without SimplifyTransposes)"
    )
    assert "'blade-relax-full@0.5' is now 'blade-relax@0.5'" in budgeted
    for name in ("blade-relax-schedule-remat", "blade-relax@0.5", "tvm-dynamic"):
        get_config(name)
    assert capsys.readouterr().err == ""


def test_aliases_are_listed_and_cannot_be_registered():
    aliases = deprecated_aliases()
    assert aliases["blade-relax-full"] == "blade-relax"
    assert aliases["blade-relax-full@B"] == "blade-relax@B"
    assert {f"blade-relax-full-no-{flag}" for flag in GRAPH_FLAGS} < set(aliases)
    for old, new in aliases.items():
        assert new.removesuffix("@B") in configs._CONFIGS, (old, new)
    assert not set(aliases) & set(available_configs())
    with pytest.raises(ValueError, match="deprecated name of 'blade-relax'"):
        register_config(TvmConfig("blade-relax-full", pipeline=stock_pipeline_factory))
    with pytest.raises(ValueError, match="deprecated name"):
        register_budget_family("blade-relax-full")


def test_list_configs_marks_the_old_names_deprecated(capsys):
    from blade_relax.bench.cli import main

    assert main(["--list-configs"]) == 0
    lines = {line.split(maxsplit=1)[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["blade-relax"].split(maxsplit=1)[1].startswith("the default pipeline")
    assert lines["blade-relax-full"].endswith("deprecated: now blade-relax")
    assert lines["blade-relax-full@B"].endswith("deprecated: now blade-relax@B")
    assert "blade-relax-schedule-remat@B" in lines
