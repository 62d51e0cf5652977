"""The scorer's fast paths give the figures of the plain computations they replace."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import sympy

from blade_relax.frontend.builtin import BUILTIN_MODELS
from blade_relax.pipeline import lower_to_memory_stage
from blade_relax.symbolic import ShapeGraph, SymbolicExpr
from blade_relax.transform.schedule import _model, _search
from blade_relax.transform.schedule._cost import ByteSpace


def _plain_rows(block, starts, start_sizes, ends, end_sizes):
    """``live_during`` by two cumulative sums of per-step sums (no float weights)."""
    allocated = np.zeros((block.n, block.space.size), dtype=object)
    np.add.at(allocated, starts, start_sizes.astype(object))
    freed = np.zeros((block.n, block.space.size), dtype=object)
    np.add.at(freed, ends, end_sizes.astype(object))
    live = block.initial.astype(object) + np.cumsum(allocated, axis=0)
    return live - (np.cumsum(freed, axis=0) - freed)


def _plain_inplace_ends(block, pos, free_step):
    """PlanMemory's placements by the plain greedy loop over the candidates."""
    at = pos[block.inplace_binding]
    inputs = block.inplace_input
    ends = free_step.copy()
    taken_in, taken_out = set(), set()
    for c in range(inputs.size):
        u, t = int(inputs[c]), int(block.inplace_output[c])
        if free_step[u] != at[c] or block.escaping[u]:
            continue
        if u not in taken_in and t not in taken_out:
            taken_in.add(u)
            taken_out.add(t)
            ends[u] = at[c] - 1
    return ends


def test_rows_equal_the_plain_sums():
    rng = np.random.default_rng(0)
    space = SimpleNamespace(size=3, dtype=np.int64, float_exact=True)
    for _ in range(50):
        n, count = int(rng.integers(1, 40)), int(rng.integers(0, 60))
        block = SimpleNamespace(n=n, space=space, initial=rng.integers(-5, 50, 3))
        starts, ends = rng.integers(0, n, count), rng.integers(0, n, count)
        sizes = rng.integers(-(2**40), 2**40, (count, 3))
        got = _model._rows(block, starts, sizes, ends, sizes[::-1].copy())
        want = _plain_rows(block, starts, sizes, ends, sizes[::-1])
        assert got.dtype == np.int64
        assert (got.astype(object) == want).all()


def test_inplace_ends_equal_the_plain_loop():
    rng = np.random.default_rng(1)
    for _ in range(200):
        n, buffers, count = 30, 20, int(rng.integers(1, 25))
        pos = rng.permutation(n)
        free_step = rng.integers(-1, n, buffers)
        block = SimpleNamespace(
            inplace_binding=rng.integers(0, n, count),
            inplace_input=rng.integers(0, buffers, count),
            inplace_output=rng.integers(0, buffers, count),
            escaping=rng.random(buffers) < 0.2,
            created_by=np.full(buffers, -1),
            sizes=np.zeros((buffers, 1), dtype=np.int64),
            plannable=np.zeros(buffers, dtype=bool),
            n=n,
            cache={},
        )
        # Make some candidates active: their binding is the input's last reader.
        hit = rng.random(count) < 0.7
        free_step[block.inplace_input[hit]] = pos[block.inplace_binding[hit]]
        want = _plain_inplace_ends(block, pos, free_step)
        assert (_model.inplace_ends(block, pos, free_step) == want).all()


def test_acceptance_values_through_float_are_exact():
    graph = ShapeGraph.from_ranges({"s": (1, 4096)})
    s = SymbolicExpr(sympy.Symbol("s"))
    space = ByteSpace(graph, [s * 4096, s * s * 16, s + 8])
    values = space._acceptance_values
    rng = np.random.default_rng(2)
    rows = rng.integers(-(2**20), 2**20, (100, space.size))
    assert (space.at_acceptance_points(rows) == rows @ values).all()
    # Too large for float64 to be exact: the int64 product, the same as before.
    big = np.full((2, space.size), 2**40, dtype=np.int64)
    assert (space.at_acceptance_points(big) == big @ values).all()
    assert (space.at_acceptance_points(rows[0]) == rows[0] @ values).all()


def test_byte_counts_of_a_large_model_stay_int64_where_every_sum_fits():
    """A large constant (a 1.1B model's parameters) beside terms in ``s**2``: int64 holds
    every sum of these sizes at every point, so the space is int64 (not Python integers,
    whose products are slow), and its values are those of exact integer arithmetic."""
    graph = ShapeGraph.from_ranges({"s": (1, 2048)})
    s = SymbolicExpr(sympy.Symbol("s"))
    sizes = [SymbolicExpr(4_400_193_536), s * s * 128, s * 262_144, s * 8192 + 4096] * 1000
    space = ByteSpace(graph, sizes)
    assert space.dtype is np.int64
    everything = np.ones((1, len(sizes)), dtype=np.int64) @ space.vectors
    at_points = space.at_acceptance_points(everything)[0]
    for value, point in zip(at_points.tolist(), space.acceptance_points):
        assert value == sum(size.evaluate(point) for size in sizes)
    # Past what int64 holds, the exact Python integers, as before.
    huge = ByteSpace(graph, [SymbolicExpr(2**61), s * s * 2**40] * 4)
    assert huge.dtype is object


def _reference_timeline(block, order):
    """:func:`_model.timeline` as first written (``"none"`` and ``"plan"`` models)."""
    order_arr = np.asarray(order, dtype=np.int64)
    pos = np.empty(block.n, dtype=np.int64)
    pos[order_arr] = np.arange(block.n)
    free_step = _model._last_position(
        pos, block.cons_node, block.cons_start, block.sizes.shape[0], block.cons_buffer
    )
    own = block.created_by >= 0
    freeable = (~block.escaping) & (free_step >= 0)
    end_step = free_step
    if block.planner == "plan" and block.inplace_binding.size:
        end_step = _plain_inplace_ends(block, pos, free_step)
    during = _plain_rows(
        block,
        pos[block.created_by[own]],
        block.sizes[own],
        end_step[freeable],
        block.sizes[freeable],
    )
    if block.workspace is not None:
        during = during + block.workspace[order_arr]
    return pos, free_step, during, during @ block.space._acceptance_values.astype(object)


def _blocks(planner):
    mod = lower_to_memory_stage(BUILTIN_MODELS["mlp"](), "llvm", stop_before="fused")
    func = mod["main"]
    graph = ShapeGraph.from_function(func)
    from blade_relax.transform.schedule._blocks import dataflow_blocks as _dataflow_blocks

    for _, blk, used_after, params, defined in _dataflow_blocks(func):
        reader = _model.BlockReader(
            blk, graph, mod, params, used_after, defined, planner, inplace=True, workspaces=True
        )
        yield reader.build()


def test_timeline_and_moves_equal_the_plain_computation():
    rng = np.random.default_rng(3)
    for planner in ("plan", "none"):
        for block in _blocks(planner):
            orders = [list(range(block.n)), _search.depth_first(block)]
            orders += [_search.kick(block, orders[0], rng, 8) for _ in range(5)]
            for order in orders:
                tl = _model.timeline(block, order)
                pos, free_step, during, values = _reference_timeline(block, order)
                assert (tl.pos == pos).all() and (tl.free_step == free_step).all()
                assert (tl.during.astype(object) == during).all()
                assert (tl.by_point.T.astype(object) == values).all()
                assert tl.by_point.flags.c_contiguous
                assert (tl.peaks.astype(object) == values.max(axis=0)).all()
                assert tl.positions() == pos.tolist()
                k = int(np.argmax(tl.by_point[0]))
                sizes = _search._size_values(block)
                for nbytes, group, _ in _search.peak_moves(block, tl, k, 0, 8):
                    assert nbytes in sizes[:, 0].tolist()
                    assert list(group) == sorted(group)
            # The buffers' sizes at the points, taken once per block, are those of the rows.
            live = np.arange(block.sizes.shape[0])[::2]
            want = block.sizes[live].astype(object) @ block.space._acceptance_values.astype(object)
            assert (_search._size_values(block)[live].astype(object) == want).all()
