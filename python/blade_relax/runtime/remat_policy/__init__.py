"""The rematerialization decision on a concrete timeline: which tensors to evict for a budget.

Model
-----
A function compiled with ``Rematerialize`` has a timeline of *points* (every storage allocation
of the function, and every ``regenerate`` call). ``base[i]`` is the number of bytes live at
point ``i`` when nothing is evicted: at an allocation point, right after the allocation; at a
``regenerate`` point, right before the call.

Each evictable tensor (a *slot*) has:

* ``nbytes``: the bytes its storage frees;
* ``start``: the first point at which those bytes are gone when it is evicted (the VM has
  dropped its register right after the ``evict`` call);
* ``site``: the point of its own ``regenerate`` call;
* ``regen_peak``: the most bytes its regeneration allocates at once (its output included;
  for a slot offloaded to host memory, whose regeneration is a copy back, its own bytes:
  :func:`blade_relax.runtime.offload.eviction_timeline` builds that timeline);
* ``plan``: what its ``regenerate`` call materializes when it is evicted: a list of
  ``(slot, slot_inputs)`` in dependency order ending with the slot itself. An earlier entry is
  another evicted slot that the regeneration reads (a *chain*); it is materialized at this
  site, kept for its own ``regenerate`` call, and costs nothing more there.

A decision is an evicted set ``S`` and a *regime* for chained inputs:

``cache``
    A chained input is materialized at the first site that needs it and kept until its own
    ``regenerate`` call: each evicted slot is recomputed once, but its bytes come back early.
    A slot's bytes are missing on the points ``[start, end]``, where ``end`` is the first site
    that materializes it.
``temp``
    A chained input is recomputed as a temporary wherever it is needed and dropped after its
    last reader: more recomputation, less memory. A slot's bytes are missing on
    ``[start, site]``.
mixed
    A set of slots: a chained input in the set is kept (as in ``cache``), any other is a
    temporary (as in ``temp``).

At a site, each materialization ``x`` in order peaks at ``live[site] + (outputs of the
materializations still held) + regen_peak[x]``. The predicted peak is the largest of all those
values and of the live bytes at every point; the recompute cost is the sum of the costs of
every materialization.

Decision
--------
:func:`decide` returns, over both regimes, the evicted set of least recompute cost whose
predicted peak fits the budget: exact (every subset that can win) when few slots can free
memory, greedy otherwise (repeatedly the slot that removes the most bytes above the budget per
unit of cost, then a pruning pass that puts back every slot the budget does not need, dearest
first; in the temp regime, and in the cache regime too when the temp regime's fits). When no
greedy set fits, :func:`minimum_peak` searches for the smallest peak, also in a *mixed* regime
(each chained input kept or recomputed as a temporary, chosen per slot): a first pass of the
local searches alone, round by round, then the whole search when that pass neither fits the
budget nor reaches the floor (at once, and without the greedy, when the budget is below what
stays live at some point whatever is evicted). When one of its results fits the budget, the
first that does is the decision, else the decision runs at the smallest peak found and says
the budget is not reachable. A set that fits, from either path, is then made cheaper while it
still fits (cheapening: put back one of its dearest evictions, repair with cheaper ones
evaluated exactly, put back what is not needed; for the greedy's set, also swap a large
tensor in for what it makes unnecessary), since the greedy's choices one at a time and the
minimum search's choices by peak leave work that the budget does not need.

Parts
-----
``_timeline``
    :class:`ConcreteTimeline` and :class:`SlotTimeline`, the arrays the searches derive from
    them, and the caches a search fills.
``_floor``
    Lower bounds: the floor under every peak (``ConcreteTimeline.unevictable``), whether no
    eviction lowers the peak, the bytes no regime of a set goes below.
``_calls``
    The ``regenerate`` calls of an evicted set, in program order.
``_evaluation``
    :func:`evaluate` (live bytes, peak and cost of one set), :func:`predict_peak`, and
    :class:`Decision`.
``_neighbours``
    The temp regime's shortcut: sets one slot away from an evaluated one, from its evaluation.
``_greedy``
    The greedy by bytes above a target per unit of cost, and its pruning.
``_cheapening``
    Making a fitting set cheaper.
``_local_search``
    The local searches of the smallest peak.
``_search``
    :func:`decide` and :func:`minimum_peak`: the exhaustive search, the greedy, the rounds of
    the minimum search.
"""

from ._evaluation import Decision, Evaluation, evaluate, predict_peak
from ._search import EXACT_LIMIT, decide, minimum_peak
from ._timeline import ConcreteTimeline, Regime, SlotTimeline, effective_slots

__all__ = [
    "EXACT_LIMIT",
    "ConcreteTimeline",
    "Decision",
    "Evaluation",
    "Regime",
    "SlotTimeline",
    "decide",
    "effective_slots",
    "evaluate",
    "minimum_peak",
    "predict_peak",
]
