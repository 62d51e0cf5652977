"""Reading TIR nodes generically: counting nodes as the program is written."""

from __future__ import annotations

from tvm import tirx

from blade_relax.analysis.tir_fields import occurrences


def _selects(node: object) -> bool:
    return isinstance(node, tirx.Select)


def test_a_shared_subexpression_counts_once_per_place_it_is_read():
    x = tirx.Var("x", "float32")
    clipped = tirx.Select(x > tirx.const(0.0, "float32"), x, tirx.const(0.0, "float32"))
    twice = clipped * clipped + clipped  # one object, read at three places
    assert occurrences(twice, _selects) == 3
    assert occurrences(clipped, _selects) == 1
    assert occurrences(x + x, _selects) == 0


def test_a_deep_chain_of_shared_nodes_is_counted_without_walking_every_path():
    x = tirx.Var("x", "int64")
    node = tirx.Select(x > 0, x, x + 1)
    for _ in range(60):  # 2**60 paths: only a walk that reads each node once finishes
        node = node + node
    assert occurrences(node, _selects) == 2**60
