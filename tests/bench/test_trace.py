"""The seeded sequence-length trace."""

from __future__ import annotations

import numpy as np
import pytest

from blade_relax.bench.trace import length_trace


def test_same_arguments_same_trace():
    assert length_trace(12, 2, 512, seed=3) == length_trace(12, 2, 512, seed=3)
    assert length_trace(12, 2, 512, seed=3).lengths != length_trace(12, 2, 512, seed=4).lengths


def test_range_tail_and_unique():
    trace = length_trace(40, 16, 1024, seed=0)
    assert len(trace.lengths) == 40
    assert all(16 <= n <= 1024 for n in trace.lengths)
    assert trace.lengths[-1] == 1024
    assert trace.unique == sorted(set(trace.lengths))
    assert "log-normal" in trace.distribution


def test_mostly_short_with_a_long_tail():
    lengths = np.array(length_trace(4001, 2, 2048, seed=0).lengths[:-1])
    assert 200 <= np.median(lengths) <= 312  # median near max / 8 = 256
    assert np.mean(lengths < 512) > 0.7
    assert lengths.max() > 1024


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one"):
        length_trace(0, 2, 10)
    with pytest.raises(ValueError, match="min_len <= max_len"):
        length_trace(3, 20, 10)
