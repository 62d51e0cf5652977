"""
A Llama training step on a GPU under a memory budget
====================================================

Tutorial 4 on an NVIDIA GPU: a Llama-architecture decoder (random weights) is exported with a
symbolic sequence length as one training step (loss and every gradient), compiled for CUDA by
TVM's stock pipeline and by blade_relax's, and run at several lengths. Then blade_relax's
executable runs again under memory budgets: the runtime evicts and regenerates tensors, on the
GPU, so that the peak stays under the budget, and the loss and gradients stay the same.

Memory is counted by blade_relax's runtime accounting on ``cuda:0``, and checked once against
the CUDA driver's own view of free memory. Step times are absolute here: they were measured
on a GPU.

The tutorial needs a CUDA GPU. Without one it says so and exits (status 0). Run it with
``python tutorials/05_gpu.py``; ``BLADE_RELAX_TUTORIAL_SMALL=1`` picks small sizes.
"""

######################################################################
# Find the GPU
# ------------
# ``blade_relax.runtime.devices`` has the helpers: whether a CUDA device exists, and which
# compiler TVM should use for the generated CUDA C (NVRTC from ``cuda-bindings``, or ``nvcc``).
# The target names the GPU's own architecture.
import os
import sys
import time

import numpy as np
import tvm
from tvm import relax

import blade_relax
from blade_relax.runtime import (
    current_live_bytes,
    devices,
    memory_stats,
    reset_memory_stats,
    set_memory_budget,
)

blade_relax.quiet()  # TVM's C++ warnings and transformers' notes; BLADE_RELAX_VERBOSE=1 shows them

if not devices.cuda_available():
    print("This tutorial needs a CUDA GPU, and none was found (tvm.cuda(0).exist is False).")
    print("Nothing to run here: tutorial 4 is the same story on the CPU.")
    sys.exit(0)

dev = tvm.cuda(0)
major, minor = dev.compute_version.split(".")
target = tvm.target.Target({"kind": "cuda", "arch": f"sm_{major}{minor}"})
compiler = devices.configure_cuda_compiler()
print(f"{dev.device_name}: compute capability {dev.compute_version}, CUDA C built with {compiler}")

######################################################################
# Export the training step
# ------------------------
# The same import as tutorial 4: torch's joint forward+backward graph with a symbolic sequence
# length ``s``, without the upper bound, so that buffers follow the actual length.
import torch
import transformers

from blade_relax.frontend import flatten_outputs, import_training_step

small = os.environ.get("BLADE_RELAX_TUTORIAL_SMALL") == "1"
max_len = 256 if small else 2048
config = transformers.LlamaConfig(
    hidden_size=64 if small else 1024,
    intermediate_size=128 if small else 2816,
    num_hidden_layers=1 if small else 4,
    num_attention_heads=4 if small else 16,
    num_key_value_heads=4 if small else 8,
    vocab_size=256 if small else 32000,
    max_position_embeddings=max_len,
)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config)
graph = import_training_step(model, max_seq_len=max_len, keep_upper_bound=False)
print(f"{len(graph.param_names)} parameters ({graph.param_bytes / 2**20:.1f} MiB)")

######################################################################
# Compile for CUDA
# ----------------
# ``blade_relax.get_pipeline(target)`` is TVM's CUDA pipeline (with dlight's GPU schedules) and
# our passes at their places; ``stock_pipeline(target)`` is the same without them.
started = time.perf_counter()
stock_exe = tvm.compile(
    graph.mod, target, relax_pipeline=blade_relax.pipeline.stock_pipeline(target)
)
print(f"stock TVM compiled in {time.perf_counter() - started:.1f} s")
started = time.perf_counter()
blade_exe = tvm.compile(graph.mod, target, relax_pipeline=blade_relax.get_pipeline(target))
print(f"blade_relax compiled in {time.perf_counter() - started:.1f} s")

# The parameters are the caller's: copied to the GPU once, outside the VM, so they are not
# part of the bytes the VM allocates during a step.
params = [tvm.runtime.tensor(p, dev) for p in graph.params]


def step(exe, ids, budget=None):
    """One training step on a fresh VM; returns the outputs, the step's peak and the stats.

    A VM keeps its last result until its next call: a fresh one holds nothing, so the peak is
    the step's own. ``budget`` is in bytes on top of what is live before the call.
    """
    vm = relax.VirtualMachine(exe, dev)
    args = [tvm.runtime.tensor(ids, dev), tvm.runtime.tensor(ids, dev)]
    reset_memory_stats()
    base = current_live_bytes()
    with set_memory_budget(None if budget is None else base + budget):
        outs = vm["main"](*args, *params)
        dev.sync()
    stats = memory_stats()
    arrays = [o.numpy() for o in flatten_outputs(outs)]
    return arrays, stats["peak_bytes"] - base, stats


def step_time(exe, ids, budget=None, repeat=5):
    """Median time of ``repeat`` steps (after one warm-up) on one VM, in milliseconds."""
    vm = relax.VirtualMachine(exe, dev)
    args = [tvm.runtime.tensor(ids, dev), tvm.runtime.tensor(ids, dev)]
    times = []
    with set_memory_budget(None if budget is None else current_live_bytes() + budget):
        for i in range(repeat + 1):
            dev.sync()
            start = time.perf_counter()
            vm["main"](*args, *params)
            dev.sync()
            if i:
                times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def rel_err(outputs, reference):
    """Largest normwise relative error over the outputs (loss and gradients)."""
    return max(
        float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))
        for o, r in zip(outputs, reference)
    )


######################################################################
# Peak, budget, evictions, time
# -----------------------------
# Per length: stock TVM, blade_relax, and blade_relax under budgets that are fractions of its
# own peak at that length. Where a budget is below what any eviction set can reach, the runtime
# warns once and runs with the smallest peak it can reach. Outputs are compared with stock TVM's.
rng = np.random.default_rng(0)
lengths = (16, 64, 256) if small else (256, 1024, 2048)
print(
    f"{'s':>5} {'pipeline':<18} {'peak MiB':>9} {'vs stock':>8} {'evict':>5} {'regen':>5} "
    f"{'step ms':>8} {'rel err':>8}"
)
for length in lengths:
    ids = rng.integers(0, config.vocab_size, size=(1, length)).astype("int64")
    reference, stock_peak, _ = step(stock_exe, ids)
    runs = [("stock TVM", stock_exe, None), ("blade_relax", blade_exe, None)]
    _, blade_peak, _ = step(blade_exe, ids)
    for fraction in (0.8, 0.6):
        runs.append((f"blade_relax @{fraction}", blade_exe, int(fraction * blade_peak)))
    for name, exe, budget in runs:
        outputs, peak, stats = step(exe, ids, budget)
        err = rel_err(outputs, reference)
        print(
            f"{length:>5} {name:<18} {peak / 2**20:>9.2f} {peak / stock_peak:>8.3f} "
            f"{stats['evictions']:>5} {stats['regenerations']:>5} "
            f"{step_time(exe, ids, budget):>8.2f} {err:>8.1e}"
        )
        assert err <= 1e-5, f"{name} at s={length} changed the outputs (relative error {err})"

######################################################################
# The driver agrees
# -----------------
# With the VM's ``"naive"`` allocator every storage is a ``cudaMalloc`` of its own, so the
# drop of free memory the driver reports at the peak of a step must match the counted peak up
# to the driver's 2 MiB pages. ``measure_driver_memory`` reads free memory after every VM
# instruction of one call.
ids = rng.integers(0, config.vocab_size, size=(1, lengths[-1])).astype("int64")
vm = relax.VirtualMachine(blade_exe, dev, memory_cfg="naive")
args = [tvm.runtime.tensor(ids, dev), tvm.runtime.tensor(ids, dev), *params]
vm["main"](*args)  # load the kernels before measuring
dev.sync()
reset_memory_stats()
before = current_live_bytes()
out, driver = devices.measure_driver_memory(vm, "main", args, dev)
stats = memory_stats()
counted = stats["peak_bytes"] - before
agree = devices.agrees_with_driver(counted, driver, stats["allocations"])
print(
    f"s={lengths[-1]}: counted peak {counted / 2**20:.2f} MiB, driver {driver.peak_bytes / 2**20:.2f}"
    f" MiB over {driver.samples} readings; agree: {agree}"
)
assert agree, (counted, driver)
