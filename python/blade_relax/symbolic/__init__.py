"""Symbolic shapes: dims, byte expressions over them, and the global shape graph of a function.

Knows nothing of passes: every other folder asks this one for facts about sizes.

>>> from blade_relax.symbolic import Ordering, ShapeGraph, SymbolicExpr
>>> g = ShapeGraph.from_ranges({"s": (1, 2048)})
>>> s = SymbolicExpr.dim("s")
>>> g.compare(s * 4096, s * 11008)
<Ordering.LT: '<'>
"""

from .compare import Ordering
from .concrete import UNBOUNDED_STAND_IN
from .dim import SymbolicDim
from .expr import SymbolicExpr, dtype_kind, is_integer
from .graph import ShapeGraph, TypeSizes
from .relax_ir import element_bits, element_bytes

__all__ = [
    "Ordering",
    "ShapeGraph",
    "SymbolicDim",
    "SymbolicExpr",
    "TypeSizes",
    "UNBOUNDED_STAND_IN",
    "dtype_kind",
    "element_bits",
    "element_bytes",
    "is_integer",
]
