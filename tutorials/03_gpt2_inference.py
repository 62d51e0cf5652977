"""
A Hugging Face GPT-2 inference graph with a dynamic sequence length
====================================================================

We build a GPT-2 from a config (random weights: nothing is downloaded), export it with
``torch.export`` and a symbolic sequence length ``s``, import it into Relax, and compare
the peak bytes of stock TVM (with and without the exported upper bound) and blade_relax at
several lengths. The logits are checked against PyTorch.

Run it with ``python tutorials/03_gpt2_inference.py`` (``BLADE_RELAX_VERBOSE=1`` shows TVM's
native warnings, hidden by default).
"""

######################################################################
# Build and import the model
# --------------------------
import os

import numpy as np
import torch
import transformers
import tvm
from tvm import relax

import blade_relax
from blade_relax.analysis import memory_timeline
from blade_relax.frontend import import_inference
from blade_relax.pipeline import stock_pipeline
from blade_relax.runtime import memory_stats, reset_memory_stats

blade_relax.quiet()  # TVM's C++ warnings and transformers' notes; BLADE_RELAX_VERBOSE=1 shows them
small = os.environ.get("BLADE_RELAX_TUTORIAL_SMALL") == "1"
config = transformers.GPT2Config(
    n_layer=1 if small else 4,
    n_embd=64 if small else 256,
    n_head=4,
    vocab_size=256 if small else 4096,
    n_positions=256,
)
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(config).eval()
graph = import_inference(model, max_seq_len=128)
print("dims:", graph.dims, " params:", len(graph.params), f"({graph.param_bytes:,} B)")

######################################################################
# What the timeline predicts
# --------------------------
timeline = memory_timeline(graph.with_upper_bounds(False).main)
print("symbolic peak of the high-level graph:", timeline.peak)

######################################################################
# Compile three ways and measure
# ------------------------------
# ``tvm-bounded`` keeps ``tir_var_upper_bound``, so stock TVM plans every buffer at s=128;
# ``tvm-dynamic`` drops it and allocates per call; blade_relax plans on symbolic sizes.
executables = {
    "tvm-bounded": tvm.compile(
        graph.with_upper_bounds(True).mod, "llvm", relax_pipeline=stock_pipeline("llvm")
    ),
    "tvm-dynamic": tvm.compile(
        graph.with_upper_bounds(False).mod, "llvm", relax_pipeline=stock_pipeline("llvm")
    ),
    "blade_relax": tvm.compile(
        graph.with_upper_bounds(False).mod, "llvm", relax_pipeline=blade_relax.get_pipeline("llvm")
    ),
}
vms = {name: relax.VirtualMachine(exe, tvm.cpu()) for name, exe in executables.items()}
params = [tvm.runtime.tensor(p) for p in graph.params]

print(f"{'s':>5}" + "".join(f"{name:>14}" for name in vms))
rng = np.random.default_rng(0)
for length in (8, 32, 128):
    ids = rng.integers(0, config.vocab_size, size=(1, length)).astype("int64")
    expected = graph.reference([ids])[0]
    row = f"{length:>5}"
    for vm in vms.values():
        reset_memory_stats()
        base = memory_stats()["live_bytes"]
        logits = vm["main"](tvm.runtime.tensor(ids), *params)
        row += f"{memory_stats()['peak_bytes'] - base:>14,}"
        out = logits if hasattr(logits, "numpy") else logits[0]
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-4)
    print(row)
print("logits match PyTorch for every pipeline and length")
