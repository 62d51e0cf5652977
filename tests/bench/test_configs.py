"""The configuration registry: fixed names, families, budget references."""

from __future__ import annotations

import pytest

from blade_relax.bench import configs
from blade_relax.bench.configs import (
    TorchConfig,
    TvmConfig,
    available_configs,
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
        ("blade-relax-static", "blade-relax-full"),
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

    for name in ("tvm-dynamic", "tvm-static", "tvm-bucketed@64", "blade-relax-full"):
        assert isinstance(get_config(name).pipeline, FlagsPipeline), name
    assert get_config("tvm-static").pipeline.flags == PipelineFlags.stock()
    full = get_config("blade-relax-full").pipeline.keywords()
    assert full["schedule"] and full["remat"] and full["plan"] and full["simplify"]
    schedule = get_config("blade-relax-schedule").pipeline.keywords()
    assert schedule["schedule"] and not schedule["remat"] and not schedule["simplify"]
    # A budget variant keeps its reference's pipeline (the predicted mode shares the lowering).
    assert get_config("blade-relax-full@0.8").pipeline == get_config("blade-relax-full").pipeline


def test_a_bucketed_config_is_neither_static_nor_bounded():
    with pytest.raises(ValueError, match="neither static nor bounded"):
        TvmConfig("x", pipeline=stock_pipeline_factory, bucket=64, static=True)
    with pytest.raises(ValueError, match="neither static nor bounded"):
        TvmConfig("x", pipeline=stock_pipeline_factory, bucket="pow2", keep_bounds=True)
