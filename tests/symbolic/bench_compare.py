"""Timing of ShapeGraph.compare on typical byte sizes (not collected by pytest).

Run: ``.venv/bin/python tests/symbolic/bench_compare.py``.
"""

from __future__ import annotations

import random
import time
from collections import Counter

from blade_relax.symbolic import ShapeGraph
from blade_relax.symbolic import SymbolicExpr as E


def main() -> None:
    graph = ShapeGraph.from_ranges({"s": (1, 2048), "b": (1, 64), "t": (1, None)})
    s, b, t = E.dim("s"), E.dim("b"), E.dim("t")
    exprs = []
    for h in (4096, 11008, 768, 3072, 32000):
        for dt in (2, 4):
            exprs += [
                s * h * dt,
                b * s * h * dt,
                s * s * 32 * dt,
                b * s * s * 32 * dt,
                t * h * dt,
                E.constant(h * h * dt),
            ]
    exprs += [
        E.max(s * 4096 * 4, s * s * 128),
        E.min(s * 16, 4096),
        (s // 4) * 16,
        s * t * 64,
        (s + t) * 4096,
    ]
    exprs = list(dict.fromkeys(exprs))
    rng = random.Random(0)
    pairs = [(rng.choice(exprs), rng.choice(exprs)) for _ in range(10000)]
    start = time.perf_counter()
    results = [graph.compare(x, y) for x, y in pairs]
    cold = time.perf_counter() - start
    start = time.perf_counter()
    for x, y in pairs:
        graph.compare(x, y)
    warm = time.perf_counter() - start
    print(f"{len(exprs)} expressions, {len(set(pairs))} distinct pairs")
    print(f"10,000 compares: {cold:.3f} s with cold caches, {warm:.4f} s cached")
    print(dict(Counter(r.name for r in results)))


if __name__ == "__main__":
    main()
