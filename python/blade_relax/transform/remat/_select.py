"""Candidates of ``Rematerialize`` and their regeneration recipes.

A *candidate* is a tensor (a root of :mod:`._ir`) computed by a kernel, never mutated,
not returned, whose uses leave a gap (``evict_after`` < ``regen_before``) that spans a hot
binding of the symbolic timeline: one whose live bytes reach a given fraction of the peak at
some representative shape.

A *recipe* recomputes a candidate at ``regen_before`` (its *site*) from *inputs* that cost no
memory there:

* parameters;
* tensors live anyway at the site (defined before it, last used at or after it), that are not
  candidates themselves;
* other candidates (a *chain*), resolved per site: the original tensor when the site comes
  before its eviction, its regenerated tensor when that exists and is still used, and the
  runtime's copy (kept or materialized on demand) while it is evicted.

Anything else the recomputation needs is recomputed inside the recipe (*interior* bindings:
fresh allocations, kernels, views, constants), up to ``max_ops`` kernels. Only PrimFunc kernels
are replayed: packed functions and Relax calls are opaque (possibly random or in-place), and
tensors they touch are never recomputed nor read by a recipe.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tvm import relax

from ._ir import FunctionModel, Op, RecipeError

__all__ = ["Candidate", "Recipe", "build_recipe", "classify_at", "find_gaps"]

# Member kinds that can be renamed or rebuilt after a regeneration.
_SUBSTITUTABLE = frozenset({"alloc", "alias", "view", "getitem"})


@dataclass
class Recipe:
    """How to recompute one candidate at its site.

    Attributes
    ----------
    ops
        Interior bindings, in program order.
    inputs
        Boundary variables, in the order the regeneration function takes them.
    resolved
        Interior aliases: variable -> the variable it stands for inside the recipe.
    kernels
        Number of kernel calls among ``ops``.
    """

    ops: list[Op]
    inputs: list[relax.Var]
    resolved: dict[relax.Var, relax.Var] = field(default_factory=dict)
    kernels: int = 0


@dataclass
class Candidate:
    """A tensor that may be evicted after ``evict_after`` and regenerated before ``regen_before``."""

    root: relax.Var
    evict_after: int
    regen_before: int
    recipe: Recipe | None = None
    slot: int = -1


def find_gaps(
    model: FunctionModel, hot: set[int], min_gap: int
) -> dict[relax.Var, tuple[int, int]]:
    """For each tensor that can be a candidate, its gap spanning the hottest stretch.

    Parameters
    ----------
    model
        The classified function.
    hot
        Binding positions whose live bytes may reach the peak.
    min_gap
        Minimum number of kernel (or opaque) calls strictly inside a gap.

    Returns
    -------
    dict
        root -> ``(evict_after, regen_before)``.
    """
    gaps: dict[relax.Var, tuple[int, int]] = {}
    # computing[i]: kernels and opaque calls among the bindings before position i.
    computing = [0]
    for op in model.ops:
        computing.append(computing[-1] + (op.kind in ("kernel", "opaque")))
    computing.append(computing[-1])
    # Hot positions in order: the ones strictly inside a gap are counted by bisection.
    ordered = sorted(hot)
    for op in model.ops:
        if op.kind != "alloc":
            continue
        root = op.var
        if root in model.mutable or root not in model.writer:
            continue
        positions = [model.writer[root], *model.uses.get(root, [])]
        if positions[-1] >= model.end:
            continue  # returned
        best: tuple[int, int, int] | None = None
        for a, b in zip(positions, positions[1:]):
            # Only computations count: an allocation alone in a gap is no reason to evict.
            if computing[b] - computing[a + 1] < min_gap:
                continue
            covered = bisect.bisect_left(ordered, b) - bisect.bisect_right(ordered, a)
            if covered == 0:
                continue
            key = (covered, b - a)
            if best is None or key > best[:2]:
                best = (covered, b - a, a)
        if best is None:
            continue
        a = best[2]
        b = next(p for p in positions if p > a)
        if not _members_substitutable(model, root, b):
            continue
        gaps[root] = (a, b)
    return gaps


def _members_substitutable(model: FunctionModel, root: relax.Var, site: int) -> bool:
    """Every variable holding ``root`` that is read from ``site`` on can be renamed or rebuilt."""
    for member in model.members.get(root, []):
        if not any(p >= site for p in model.var_uses.get(member, ())):
            continue
        op = model.op_of[member]
        if op.kind not in _SUBSTITUTABLE:
            return False
        if model.holds.get(member) != frozenset({root}):
            return False  # a view sharing memory with another tensor too
    return True


def classify_at(cand: Candidate, site: int, model: FunctionModel) -> str:
    """How candidate ``cand`` is reachable at binding position ``site``.

    Returns
    -------
    str
        ``"orig"`` (not evicted yet: the original variable), ``"slot"`` (inside its window: the
        runtime's copy), ``"regen"`` (its regenerated variable, emitted before at the same site
        or earlier and still used), ``"dead"`` (regenerated but no longer used: recompute it).
    """
    if site <= cand.evict_after:
        return "orig"
    if site < cand.regen_before:
        return "slot"
    if site == cand.regen_before or model.root_last_use(cand.root) >= site:
        return "regen"
    return "dead"


def _available(model: FunctionModel, var: relax.Var, site: int, candidates) -> bool:
    """``var`` costs no memory at ``site``: defined before, its memory used at or after it."""
    if model.defined_at(var) >= site:
        return False
    for root in model.holds.get(var, ()):
        if root in candidates or root in model.mutable:
            return False
        if root in model.params:
            continue
        if model.root_last_use(root) < site:
            return False
    return True


def build_recipe(
    model: FunctionModel,
    cand: Candidate,
    candidates: dict[relax.Var, Candidate],
    max_ops: int,
) -> Recipe:
    """The recipe of ``cand`` at its site, given the current candidate set.

    Raises
    ------
    RecipeError
        When the recomputation needs an opaque or mutated value, or more than ``max_ops``
        kernels.
    """
    builder = _RecipeBuilder(model, cand, candidates, max_ops)
    builder.compute(cand.root)
    ops = [builder.interior[i] for i in sorted(builder.interior)]
    return Recipe(
        ops=ops, inputs=builder.inputs, resolved=builder.resolved, kernels=builder.kernels
    )


class _RecipeBuilder:
    """The walk back from a candidate to the values that cost no memory at its site.

    Each variable the recomputation reads is *resolved* once: it is an input of the recipe
    (:meth:`boundary`), recomputed by its kernel (:meth:`compute`), or an interior binding that
    reads other variables (a view, a constant, a ``match_cast``).
    """

    def __init__(
        self,
        model: FunctionModel,
        cand: Candidate,
        candidates: dict[relax.Var, Candidate],
        max_ops: int,
    ) -> None:
        self.model = model
        self.cand = cand
        self.candidates = candidates
        self.max_ops = max_ops
        self.site = cand.regen_before
        self.params = set(model.params)
        # Position -> binding of the recomputation; its inputs in order; variable -> the
        # variable it stands for inside the recipe; kernels replayed so far.
        self.interior: dict[int, Op] = {}
        self.inputs: list[relax.Var] = []
        self.resolved: dict[relax.Var, relax.Var] = {}
        self.kernels = 0

    def boundary(self, var: relax.Var) -> relax.Var:
        """``var`` is an input of the recipe."""
        if var not in self.inputs:
            self.inputs.append(var)
        return var

    def compute(self, root: relax.Var) -> relax.Var:
        """Replay the kernel that writes ``root`` (and resolve what that kernel reads)."""
        model = self.model
        if root in model.mutable:
            raise RecipeError(f"{root.name} may be mutated")
        kernel_index = model.writer.get(root)
        if kernel_index is None:
            raise RecipeError(f"{root.name} is not computed by a kernel")
        kernel = model.ops[kernel_index]
        if model.writes is not None:
            for v in kernel.reads:
                if model.writes.written_between(v, kernel_index, self.site):
                    raise RecipeError(f"{v.name} is overwritten in place before {root.name}'s site")
        if kernel_index not in self.interior:
            self.kernels += 1
            if self.kernels > self.max_ops:
                raise RecipeError(f"more than {self.max_ops} kernels")
            self.interior[kernel_index] = kernel
            for out in kernel.outputs:
                alloc = model.op_of[out]
                self.interior[alloc.index] = alloc
                for v in alloc.reads:
                    self.resolve(v)
            for v in kernel.reads:
                self.resolve(v)
        return root

    def resolve(self, var: relax.Var) -> relax.Var:
        """What the recipe reads for ``var`` (resolved once)."""
        if var in self.resolved:
            return self.resolved[var]
        if var in self.params:
            result = self.boundary(var)
        else:
            op = self.model.op_of.get(var)
            if op is None:
                raise RecipeError(f"{var.name} is not defined in the function")
            result = self._resolve_op(op, var)
        self.resolved[var] = result
        return result

    def _resolve_op(self, op: Op, var: relax.Var) -> relax.Var:
        if op.kind == "inert":
            self.interior[op.index] = op
            return var
        if op.kind == "alloc":
            return self._resolve_tensor(var)
        if op.kind in ("alias", "getitem"):
            return self._resolve_alias(op, var)
        if op.kind == "view":
            roots = self.model.holds.get(var, frozenset())
            if not (roots & set(self.candidates)) and self._available(var):
                return self.boundary(var)
            self.interior[op.index] = op
            for v in op.reads:
                self.resolve(v)
            return var
        if self._available(var):
            return self.boundary(var)
        raise RecipeError(f"{var.name} comes from an opaque {op.kind} binding")

    def _resolve_tensor(self, var: relax.Var) -> relax.Var:
        """A fresh tensor: an input when it costs nothing at the site (a candidate the runtime
        holds or hands back there, a tensor live anyway), else recomputed."""
        other = self.candidates.get(var)
        if var is self.cand.root:
            return self.compute(var)
        if other is not None:
            if classify_at(other, self.site, self.model) != "dead":
                return self.boundary(var)
            return self.compute(var)
        if self._available(var):
            return self.boundary(var)
        return self.compute(var)

    def _resolve_alias(self, op: Op, var: relax.Var) -> relax.Var:
        """An alias or a tuple field: what it names (a ``match_cast`` stays a binding)."""
        source = op.source
        if op.kind == "getitem":
            fields = self.model.tuple_fields.get(op.source)
            if fields is None or not isinstance(fields[int(op.value.index)], relax.Var):
                raise RecipeError(f"{var.name} reads a tuple that is not a literal")
            source = fields[int(op.value.index)]
        if op.is_match_cast:
            self.interior[op.index] = op
            self.resolve(source)
            return var
        return self.resolve(source)

    def _available(self, var: relax.Var) -> bool:
        return _available(self.model, var, self.site, self.candidates)
