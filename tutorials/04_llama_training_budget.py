"""
A Llama training step under a memory budget
===========================================

A Llama-architecture decoder (random weights), its joint forward+backward graph exported with
a symbolic sequence length, compiled with blade_relax. ``Rematerialize`` prepared evictions and
regenerations at compile time; at run time, :func:`blade_relax.runtime.set_memory_budget`
makes the runtime pick, from the concrete length, which tensors to evict and recompute so the
peak stays under the budget. Loss and gradients stay identical.

Run it with ``python tutorials/04_llama_training_budget.py``.
"""

######################################################################
# Import the training step
# ------------------------
import os

import numpy as np
import torch
import transformers
import tvm
from tvm import relax

import blade_relax
from blade_relax.frontend import import_training_step
from blade_relax.runtime import memory_stats, reset_memory_stats, set_memory_budget

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

exe = tvm.compile(graph.mod, "llvm", relax_pipeline=blade_relax.get_pipeline("llvm"))
vm = relax.VirtualMachine(exe, tvm.cpu())
params = [tvm.runtime.tensor(p) for p in graph.params]


def step(ids):
    reset_memory_stats()
    base = memory_stats()["live_bytes"]
    outs = vm["main"](tvm.runtime.tensor(ids), tvm.runtime.tensor(ids), *params)
    stats = memory_stats()
    arrays = [o.numpy() for o in outs]
    return arrays, stats["peak_bytes"] - base, stats


######################################################################
# Peak vs budget
# --------------
# Budgets are fractions of the unconstrained peak at each length. Where a budget is below what
# any eviction set can reach, the runtime warns once and runs at the smallest reachable peak.
rng = np.random.default_rng(0)
print(f"{'s':>5} {'budget':>7} {'peak bytes':>12} {'evictions':>9} {'regens':>6}  identical")
for length in (16, 64) if small else (64, 256):
    ids = rng.integers(0, config.vocab_size, size=(1, length)).astype("int64")
    reference, free_peak, _ = step(ids)
    print(f"{length:>5} {'none':>7} {free_peak:>12,} {0:>9} {0:>6}  -")
    for fraction in (0.9, 0.7, 0.5):
        with set_memory_budget(int(free_peak * fraction)):
            arrays, peak, stats = step(ids)
        same = all(np.array_equal(a, b) for a, b in zip(arrays, reference))
        print(
            f"{length:>5} {fraction:>7} {peak:>12,} {stats['evictions']:>9} "
            f"{stats['regenerations']:>6}  {same}"
        )
        assert same, "rematerialization changed the numbers"
