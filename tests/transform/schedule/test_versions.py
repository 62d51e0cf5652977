"""Choosing the ranges of range versions from a pool of scored orders (``choose_ranges``)."""

from __future__ import annotations

import numpy as np

from blade_relax.transform.dispatch import DimRange
from blade_relax.transform.schedule._search import Pool
from blade_relax.transform.schedule._versions import choose_ranges

# The dim's value at each acceptance point.
VALUES = [4, 8, 16, 32, 64, 128]


def _pool(**peaks: list[int]) -> Pool:
    """A pool of given peaks (no block: nothing is scored), the input order first."""
    pool = Pool(None, np.array(peaks["input"]))
    for name, row in peaks.items():
        pool.add(name, [len(pool.orders)], np.array(row))
    return pool


def test_an_order_better_from_one_length_on_gets_a_range_of_its_own():
    pool = _pool(input=[100] * 6, long=[100, 101, 100, 90, 80, 80])
    ranges = choose_ranges(pool, VALUES, "s", 2, None, max_versions=3, min_gain=0.01)
    # Equal at 16: the first cut of equal gain, at 8, is taken.
    assert ranges == [DimRange("s", 2, 8), DimRange("s", 9, None)]


def test_no_cut_where_no_order_gains_enough():
    pool = _pool(input=[100] * 6, middle=[101, 101, 99.5, 99.5, 101, 101])
    assert choose_ranges(pool, VALUES, "s", 2, None, 3, min_gain=0.01) == [DimRange("s", 2, None)]
