"""The random program generator: well-typed, deterministic, and covering what it promises."""

from __future__ import annotations

import random

import numpy as np
import pytest
import tvm
import tvm_ffi
from hypothesis import HealthCheck, given, settings
from tvm import relax

from blade_relax.testing import GeneratorConfig, program_from_seed, programs

SEEDS = range(60)


@pytest.fixture(scope="module")
def fixed_programs():
    return [program_from_seed(seed) for seed in SEEDS]


def test_programs_are_well_formed(fixed_programs):
    for program in fixed_programs:
        assert relax.analysis.check_well_formed(program.mod), program


def test_same_seed_same_program():
    a, b = program_from_seed(17), program_from_seed(17)
    tvm.ir.assert_structural_equal(a.mod, b.mod)
    assert a.ops == b.ops
    assert not tvm_ffi.structural_equal(a.mod, program_from_seed(18).mod)


def test_fixed_seeds_cover_every_feature(fixed_programs):
    features = set().union(*(p.features for p in fixed_programs))
    expected = {
        "unary",
        "binary",
        "matmul",
        "reduce",
        "reshape",
        "concat",
        "broadcast_to",
        "permute_dims",
        "astype",
        "tuple",
        "opaque",
        "call",
        "helper",
        "if",
        "output",
    }
    assert expected <= features, expected - features

    declared = [d for p in fixed_programs for d in p.dims if d.declared_upper or d.declared_lower]
    undeclared = [d for p in fixed_programs for d in p.dims if not d.declared_upper]
    assert declared and undeclared
    assert any(len(p.dims) >= 2 for p in fixed_programs)

    def blocks(program):
        return [
            b
            for f in program.mod.functions.values()
            if isinstance(f, relax.Function)
            for b in f.body.blocks
        ]

    kinds = {isinstance(b, relax.DataflowBlock) for p in fixed_programs for b in blocks(p)}
    assert kinds == {True, False}


def test_bound_attributes_match_declared_ranges(fixed_programs):
    for program in fixed_programs:
        attrs = program.mod["main"].attrs
        upper = (
            dict(attrs["tir_var_upper_bound"]) if attrs and "tir_var_upper_bound" in attrs else {}
        )
        lower = (
            dict(attrs["tir_var_lower_bound"]) if attrs and "tir_var_lower_bound" in attrs else {}
        )
        for dim in program.dims:
            assert (dim.name in upper) == dim.declared_upper
            assert (dim.name in lower) == dim.declared_lower
            if dim.declared_upper:
                assert int(upper[dim.name]) == dim.upper


def test_every_dim_is_defined_by_a_parameter(fixed_programs):
    for program in fixed_programs:
        names = {
            v.name
            for p in program.mod["main"].params
            for v in p.ty.shape.values
            if isinstance(v, tvm.tirx.Var)
        }
        assert {d.name for d in program.dims} <= names


def test_arguments_follow_sampled_dims(fixed_programs):
    rng = random.Random(0)
    for program in fixed_programs[:20]:
        dims = program.sample_dims(rng)
        for d in program.dims:
            assert d.lower <= dims[d.name] <= d.upper
        for param, arg in zip(program.mod["main"].params, program.arguments(dims)):
            assert str(arg.dtype) == str(param.ty.dtype)
            assert np.all(np.abs(arg) <= 1.0)


@settings(
    max_examples=25, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(programs(GeneratorConfig(max_ops=6)))
def test_hypothesis_programs_are_well_formed(program):
    assert relax.analysis.check_well_formed(program.mod)
    assert 1 <= len(program.dims) <= 3
