"""
A Llama training step under a memory budget
===========================================

A Llama-architecture decoder (random weights), its joint forward+backward graph exported with
a symbolic sequence length, compiled with blade_relax. ``Rematerialize`` prepared evictions and
regenerations at compile time; at run time, :func:`blade_relax.runtime.set_memory_budget`
makes the runtime pick, from the concrete length, which tensors to evict and recompute so the
peak stays under the budget. Loss and gradients stay identical.

Run it with ``python tutorials/04_llama_training_budget.py`` (``BLADE_RELAX_VERBOSE=1`` shows
TVM's native warnings, hidden by default).
"""

######################################################################
# Import the training step
# ------------------------
import os
import warnings

import numpy as np
import torch
import transformers
import tvm
from tvm import relax

import blade_relax
from blade_relax.analysis import compile_keeping_module
from blade_relax.frontend import import_training_step
from blade_relax.runtime import (
    RematBudgetWarning,
    last_remat_decision,
    measure_memory,
    set_memory_budget,
)

blade_relax.quiet()  # TVM's C++ warnings and transformers' notes; BLADE_RELAX_VERBOSE=1 shows them
small = os.environ.get("BLADE_RELAX_TUTORIAL_SMALL") == "1"
config = transformers.LlamaConfig(
    hidden_size=64 if small else 256,
    intermediate_size=128 if small else 688,
    num_hidden_layers=1 if small else 4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=256 if small else 4096,
    max_position_embeddings=512,
)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config)
graph = import_training_step(model, max_seq_len=256, keep_upper_bound=False)
print(f"{len(graph.param_names)} parameters, outputs: loss + {len(graph.output_names) - 1} grads")

# ``compile_keeping_module`` is ``tvm.compile`` that also keeps the module it built: its table of
# kernel workspaces (scratch memory inside a kernel) lets the measurement count them while each
# kernel runs, as the runtime's timeline does.
build = compile_keeping_module(graph.mod, "llvm", blade_relax.get_pipeline("llvm"))
params = [tvm.runtime.tensor(p) for p in graph.params]


######################################################################
# One step, measured from one base
# --------------------------------
# The accounting counts every storage a VM allocates. A VM keeps what its last call returned
# (here loss and 39 gradients) until its next call, and a budgeted call drops it at its start:
# measured from "what was live before the call" the rows would not share a base. Each step
# therefore gets a fresh VM, and nothing allocated by a VM is live before it (the parameters
# are the caller's tensors, not counted): every peak below is the bytes the step itself
# allocates, the quantity the budget bounds and the warning speaks of.
def step(ids):
    vm = relax.VirtualMachine(build.executable, tvm.cpu())
    with measure_memory(vm, workspaces=build.workspaces) as measured:
        outs = vm["main"](tvm.runtime.tensor(ids), tvm.runtime.tensor(ids), *params)
    assert measured.live_before == 0, "every row is measured from an empty base"
    arrays = [o.numpy() for o in outs]
    del outs, vm
    return arrays, measured.peak_bytes, measured.stats


######################################################################
# Peak vs budget
# --------------
# Budgets are fractions of the unconstrained peak at each length. Where a budget is below what
# any eviction set can reach, the runtime warns (a ``RematBudgetWarning``, printed under the
# table here) and runs at the smallest reachable peak: that row's peak is the one the warning
# names, and ``last_remat_decision()`` predicted it before the step ran.
rng = np.random.default_rng(0)
print(
    f"{'s':>5} {'budget':>7} {'budget bytes':>12} {'peak bytes':>12} {'evictions':>9} "
    f"{'regens':>6}  {'budget met':<10}  identical"
)
notes = []
for length in (16, 64) if small else (64, 256):
    ids = rng.integers(0, config.vocab_size, size=(1, length)).astype("int64")
    reference, free_peak, _ = step(ids)
    print(f"{length:>5} {'none':>7} {'-':>12} {free_peak:>12,} {0:>9} {0:>6}  {'-':<10}  -")
    for fraction in (0.9, 0.7, 0.5):
        budget = int(free_peak * fraction)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RematBudgetWarning)
            with set_memory_budget(budget):
                arrays, peak, stats = step(ids)
        decision = last_remat_decision()
        # The runtime's prediction (the warning's "smallest reachable peak" when the budget is
        # out of reach) is the peak the accounting measured.
        assert decision["predicted_peak"] == peak, (decision["predicted_peak"], peak)
        same = all(np.array_equal(a, b) for a, b in zip(arrays, reference))
        met = "yes" if peak <= budget else "no (min)"
        print(
            f"{length:>5} {fraction:>7} {budget:>12,} {peak:>12,} {stats['evictions']:>9} "
            f"{stats['regenerations']:>6}  {met:<10}  {same}"
        )
        assert same, "rematerialization changed the numbers"
        assert (peak <= budget) == decision["reachable"]
        notes += [f"s={length} @{fraction}: {w.message}" for w in caught]
print()
print("budget met = no (min): the budget is below the smallest peak any eviction set reaches;")
print("the step ran at that minimum, as the runtime's warnings say:")
for note in notes:
    print(" ", note)
