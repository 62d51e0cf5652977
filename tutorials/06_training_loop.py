"""
Training a small Llama end to end
=================================

A Llama-architecture decoder (random weights, nothing downloaded) trained with AdamW on
sequences of varying length, on the CPU. The whole step (forward, backward and the optimizer
update) is one Relax function compiled once for every length; the parameters and the AdamW
moments are updated in place. The same batches then run through PyTorch's own loop from the
same initial weights: the losses agree, and the peak memory of every step is compared.

Run it with ``python tutorials/06_training_loop.py`` (``BLADE_RELAX_VERBOSE=1`` shows TVM's
native warnings, hidden by default; ``BLADE_RELAX_TUTORIAL_SMALL=1`` picks small sizes).
"""

######################################################################
# Import the training step
# ------------------------
# ``import_training_step`` exports the model's loss and the gradient of every parameter with a
# symbolic sequence length ``s`` in ``[2, max_len]``. ``keep_upper_bound=False`` drops the
# bound from the function's attributes (the graph still refuses longer inputs), so that buffers
# are sized by the actual length rather than planned at ``max_len``.
import os

import numpy as np
import torch
import transformers
import tvm
from tvm import relax

import blade_relax
from blade_relax.bench.trace import length_trace
from blade_relax.frontend import import_training_step
from blade_relax.runtime import last_remat_decision
from blade_relax.training import AdamW, Trainer, build_training_step, torch_fit

blade_relax.quiet()  # TVM's C++ warnings and transformers' notes; BLADE_RELAX_VERBOSE=1 shows them
small = os.environ.get("BLADE_RELAX_TUTORIAL_SMALL") == "1"
max_len = 64 if small else 256
steps = 8 if small else 300  # training steps
compare = steps if small else 16  # the first steps, which PyTorch runs too

config = transformers.LlamaConfig(
    hidden_size=64 if small else 256,
    intermediate_size=128 if small else 688,
    num_hidden_layers=1 if small else 4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=256 if small else 4096,
    max_position_embeddings=max_len,
    tie_word_embeddings=False,
)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config)
graph = import_training_step(model, max_seq_len=max_len, keep_upper_bound=False)
param_bytes = graph.param_bytes
print(
    f"{len(graph.param_names)} parameter tensors, {sum(p.size for p in graph.params):,} "
    f"weights, P = {param_bytes:,} bytes"
)


######################################################################
# One step, updated in place
# --------------------------
# ``build_training_step`` appends the optimizer to the training graph. The step takes the batch,
# the parameters, the optimizer state (AdamW: two moments per parameter) and a small vector of
# per-step scalars (learning rate and bias corrections, computed on the host as ``torch.optim``
# does, so a schedule needs no recompilation), and returns the loss with the updated parameters
# and state:
#
# ``main(input_ids, labels, *params, *state, scalars) -> (loss, *params, *state)``
#
# Each parameter's update is one ``call_tir_inplace`` kernel that reads the gradient and
# overwrites the parameter and its two moments: the returned tensors are the caller's buffers,
# no second copy exists. The updates sit in the same dataflow block as the backward pass, so the
# scheduler moves each one next to the kernel that produces its gradient: the gradient is
# applied and freed at once, instead of waiting for all the others.
optimizer = AdamW(lr=3e-3)
step = build_training_step(graph, optimizer)
main = step.mod["main"]
n_state = len(step.state_names)
inplace = tvm.ir.Op.get("relax.call_tir_inplace")
n_inplace = sum(
    isinstance(b.value, relax.Call) and b.value.op.same_as(inplace)
    for block in main.body.blocks
    for b in block.bindings
)
print(
    f"main({', '.join(graph.input_names)}, {step.num_params} params, {n_state} state tensors, "
    f"scalars[{optimizer.num_scalars}]) -> (loss, {step.num_params} params, {n_state} state tensors)"
)
print(f"in-place updates in the IR: {n_inplace} call_tir_inplace (one per parameter)")
print(f"updates share the gradients' dataflow block: {step.fused}")
assert n_inplace == step.num_params


######################################################################
# Data the model can learn
# ------------------------
# Tokens follow a fixed Markov chain over ``K`` token ids: each id is followed by one id with
# probability 0.8 and by another with probability 0.2. The best any model can do is predict
# those two: the chain's entropy is the lowest reachable loss.
#
# Sequence lengths come from ``length_trace``: log-normal with median ``max_len / 8`` and
# sigma 0.9, clipped to ``[2, max_len]``; most sequences are short, a few are long, and the
# last entry of a trace is ``max_len`` itself. The first ``compare`` steps (the ones PyTorch
# also runs) use a trace of their own, so that they include the longest sequence.
K = 16
rng = np.random.default_rng(0)
states = rng.choice(config.vocab_size, size=K, replace=False)  # the chain's token ids
transition = np.zeros((K, K))
for i in range(K):
    likely, other = rng.choice(K, size=2, replace=False)
    transition[i, likely], transition[i, other] = 0.8, 0.2
probs = transition[0][transition[0] > 0]  # every row holds 0.8 and 0.2
entropy = float(-(probs * np.log(probs)).sum())


def sequence(length: int) -> np.ndarray:
    chain = [rng.integers(K)]
    for _ in range(length - 1):
        chain.append(rng.choice(K, p=transition[chain[-1]]))
    return states[np.array(chain)][None].astype("int64")  # (batch 1, length)


head = length_trace(compare, 2, max_len, seed=0)
tail = length_trace(steps - compare, 2, max_len, seed=1).lengths if steps > compare else ()
lengths = list(head.lengths) + list(tail)
batches = [sequence(n) for n in lengths]  # the labels are the ids: the model shifts them
print(f"lengths of the first {compare} steps: {head.distribution}")
if tail:
    print(f"then {len(tail)} steps: the same distribution, seed 1")
print(
    f"{steps} batches, {len(set(lengths))} distinct lengths, median {int(np.median(lengths))}; "
    f"the chain's entropy (lowest reachable loss): {entropy:.3f}"
)


######################################################################
# Train
# -----
# The ``Trainer`` compiles the step once (the blade_relax pipeline), keeps the parameters and
# the AdamW state on the device, checks every batch before it runs, and measures each step:
# ``StepRecord.peak_bytes`` is the full step's peak, the parameters and state (held across
# steps, counted once) plus the most bytes the step allocated. The progress bar goes to stderr.
trainer = Trainer(step)
history = trainer.fit(batches, steps=steps, progress=True)
print(
    f"{len(history.records)} steps, {len(set(history.lengths))} lengths, "
    f"compilations: {history.compilations} ({history.compile_time_s:.1f} s)"
)
window = max(2, steps // 10)
first, last = np.mean(history.losses[:window]), np.mean(history.losses[-window:])
print(f"mean loss of the first {window} steps {first:.3f}, of the last {window} steps {last:.3f}")


######################################################################
# The same loop in PyTorch
# ------------------------
# ``torch_fit`` runs ``zero_grad(set_to_none=True); loss = model(batch); loss.backward();
# opt.step()`` with ``torch.optim.AdamW`` of the same hyperparameters, from the same initial
# weights, on the first ``compare`` batches. Its peak is counted the same way: parameters and
# optimizer state plus the most bytes the step allocated (a dispatch counter: PyTorch has no
# CPU allocator statistics). Rounding differences between the two grow as training goes on;
# over these first steps the losses agree to 1e-4.
reference = torch_fit(graph, optimizer, batches, steps=compare)
pairs = list(zip(history.records[:compare], reference.records))
worst = max(abs(a.loss - b.loss) / abs(b.loss) for a, b in pairs)
print(f"losses of the {len(pairs)} steps both ran agree: max relative difference {worst:.1e}")
assert worst <= 1e-4, worst

######################################################################
# Peak memory per length
# ----------------------
# Both loops hold the parameters ``P`` and the two AdamW moments ``2P`` across steps. PyTorch
# also holds every gradient at once (``P`` more) when ``opt.step()`` runs, plus the update's
# temporaries. The compiled step applies each gradient as soon as it is produced, so at short
# lengths (small activations) the ratio is about ``3P / 4P = 0.75`` (the last line gives both
# peaks in units of ``P``). At longer lengths the activations, which both loops need, take a
# larger share of the peak and the ratio rises.
peaks: dict[int, list[int]] = {}
for ours, theirs in pairs:
    row = peaks.setdefault(ours.length, [0, 0])
    row[0], row[1] = max(row[0], ours.peak_bytes), max(row[1], theirs.peak_bytes)
print(f"{'s':>5} {'blade_relax':>12} {'torch':>12} {'ratio':>6}")
for length in sorted(peaks):
    ours, theirs = peaks[length]
    print(f"{length:>5} {ours:>12,} {theirs:>12,} {ours / theirs:>6.3f}")
shortest = min(peaks)
print(
    f"at s={shortest}: blade_relax {peaks[shortest][0] / param_bytes:.2f}P, "
    f"torch {peaks[shortest][1] / param_bytes:.2f}P"
)

######################################################################
# A memory budget
# ---------------
# With a budget set, the step runs the copy of itself that ``Rematerialize`` prepared: it gives
# each evictable tensor storage of its own, so that tensor can be freed early, and without
# evictions it peaks above the plain step. ``budget=0.8`` allows the step 0.8 times that
# copy's peak without evictions, at the batch's length; the runtime picks from the concrete
# length which tensors to evict and recompute. Below what any eviction set reaches, the step
# runs at the smallest peak the runtime can reach and its record says the budget was not
# reachable (``Trainer.fit`` sums such steps up in one ``RematBudgetWarning``).
free = trainer.step(batches[-1])  # the longest batch, no budget
budgeted = trainer.step(batches[-1], budget=0.8)
decision = last_remat_decision()
live = decision["live_at_entry"]  # the previous step's loss, released when the call starts
print(f"s={budgeted.length}, bytes the step adds to the parameters and state:")
print(f"  no budget (plain step):                 {free.step_peak_bytes:>12,}")
print(f"  rematerializing copy, no evictions:     {decision['no_remat_peak'] - live:>12,}")
print(f"  budget 0.8 of that:                     {decision['budget'] - live:>12,}")
print(
    f"  with the budget: {budgeted.step_peak_bytes:>12,} ({budgeted.evictions} evictions, "
    f"{budgeted.regenerations} regenerations)"
)
print(f"full-step peak: {free.peak_bytes:,} bytes without a budget, {budgeted.peak_bytes:,} with")
if budgeted.budget_reachable:
    print("  the budget is reachable at this length")
    assert budgeted.step_peak_bytes <= decision["budget"] - live
else:
    print("  the budget is not reachable at this length: the smallest reachable peak instead")

######################################################################
# Plot
# ----
# Loss and full-step peak per step, both loops (PyTorch for the steps it ran).
try:
    import matplotlib.pyplot as plt
except ImportError:
    plt = None
if plt is not None:
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    for h, style in ((history, "-"), (reference, "--")):
        xs = [r.step for r in h.records]
        top.plot(xs, h.losses, style, label=h.label)
        bottom.plot(xs, [p / 2**20 for p in h.peaks], style, label=h.label)
    top.axhline(entropy, color="gray", lw=0.8, label="chain entropy")
    top.set_ylabel("loss")
    top.legend()
    bottom.set_ylabel("peak (MiB)")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig("training_loop.png", dpi=100)
    print("saved training_loop.png")
