"""FuseAttention: an attention block becomes one kernel that never holds its score matrix.

An imported attention layer is a chain of whole-tensor operators: ``S = Q @ K^T`` (a
``(b, h, s, s)`` tensor), a scale and a mask, ``P = softmax(S)`` (another ``(b, h, s, s)``
tensor), ``O = P @ V``; around it the heads are cut out of a fused ``qkv`` projection by a
``split`` (three copies) and moved into place by ``permute_dims`` (three more), and the result
is moved back. ``FuseOps`` never puts two matmuls in one kernel, so every one of these tensors
is materialized: at long lengths the two score tensors dominate the peak of an inference step,
at short lengths the ``split`` copies next to ``qkv`` do. ``torch.compile`` reads the heads as
strided views and calls a flash-attention kernel, which holds neither.

This pass replaces the chain by one kernel (``call_tir``), built with TE and scheduled here:

* every layout operator of the group is an *index map*, so the kernel reads ``Q``, ``K`` and
  ``V`` where they lie in ``qkv`` and writes its result in the layout its reader wants. TVM's
  own route (group the operators, ``LegalizeOps``, ``FuseTIR``) was tried first: the legalized
  ``reshape`` ravels and unravels over the whole shape, leaving ``floormod(x, s)`` index terms
  that TVM's simplifier cannot remove for a symbolic ``s``, and no schedule can then relate
  the loops. Here reshape axes are matched in groups of equal size, so indices stay affine;
* the two matmuls are TE reductions in ascending ``k``, as ``relax.matmul`` legalizes, and the
  softmax computes what ``topi.nn.softmax`` computes, in the same order, so results are
  those of the unfused graph bit for bit;
* the kernel computes one row of scores at a time, for each head (batch axes) and query row
  ``i``, and keeps no ``(b, h, s, s)`` tensor.

The loop nest
-------------
Written for the CPU, where each inner loop should run over contiguous elements so that LLVM
vectorizes it (a scalar reduction chain is bound by the latency of its adds)::

    for each head:
        for i in s:                                # one row of scores
            S[j] = 0;  for j in s: for k in d: S[j] += Q[i, k] * K[j, k]
            M[l] = max over jo < s // 16 of X[16 jo + l]   (X = S scaled and masked)
            m = max(max over l of M[l], max over the last s % 16 of X)
            E[j] = exp(X[j] - m)                   # once per score
            z = sum over j of E[j]                 # in ascending j, as topi's softmax
            O[d] = 0;  for k in s: for d in dh: O[d] += E[k] / z * V[k, d]
            out[i, head, :] = O                    # in the layout of the reader

Per element the matmuls keep their ascending order (their loops are only interchanged), and
a maximum does not depend on the order, so the 16 lanes of ``M`` change no value: results
stay those of the unfused graph bit for bit (on a target without fused multiply-adds, where
LLVM cannot contract differently shaped loops differently). Lanes for the sum ``z``, or a
split of ``P @ V``, would make the kernel 16% (7%) faster at ``s = 256`` and change its
rounding, and were left out for that reason. ``E[k] / z`` is computed as ``P @ V`` reads it
(the quotient is invariant in the ``d`` loop), so no row of ``P`` is kept. The scratch is the
row of scores (``E`` takes its place after TVM's storage rewrite), 16 lanes for the maximum
and ``d`` accumulators: less than the plain kernel's two rows once ``s`` exceeds ``16 + d``.

With ``AttentionOptions.copy_keys`` the kernel first copies ``K^T`` of each head
(``keys[k, j] = K[j, k]``, under the head loop) and computes a row of scores as
``for k in d: for j in s: S[j] += Q[i, k] * keys[k, j]``: vector multiply-adds along the row
instead of ``s`` dot products of length ``d`` (the kernel 3.3 times faster on gpt2-infer's
attention at ``s = 256``, same results). It costs ``d * s`` elements of scratch while the
kernel runs, and the attention call is often the step's peak (it is in the benchmark's
gpt2-infer at every length). So by default (``copy_keys_within_mask``) the keys are copied
only where the kernel has taken the place of a mask tensor (below) and the copy fits in the
bytes that mask held: a branch on the dims (``s >= d`` for a float32 ``(1, 1, s, s)`` mask),
the keys read in place elsewhere; the copy's extent is ``s`` or 0 by the same test, so the
kernel's workspace says what it holds at every length.

The mask
--------
A Hugging Face model adds a mask to the scores that it builds from indices: an ``arange``
compared with another (causal), a padding mask indexed, a ``where`` of 0 and the lowest float.
Materialized, it is a ``(b, 1, s, s)`` tensor live from the first attention to the last, on the
peak of an inference step. With ``AttentionOptions.absorb_masks`` the bindings that build it
(operators of ``_attention_match.MASK_OPS``, followed upstream from the score operator) are
copied into every kernel that adds it, as accessors like the layout operators: each kernel
computes the mask element it adds, as TVM's kernels would (the same comparisons, ``Select`` and
casts: results unchanged), from tensors with fewer symbolic axes (an index, the ``(b, s)``
padding mask). The original bindings are left for their other readers and removed when none is
left.

Where the kernel computes a causal mask and proves it (``AttentionOptions.stop_rows``), row
``i`` stops at the diagonal: its scores, maximum, sum and ``P @ V`` run over ``i + 1`` keys,
the rest adding exact zeros (see ``_attention_kernel._masked_above_diagonal``); half the work
at the same results. The stages are written over a row length that the schedule, once done,
sets to ``i + 1`` under the row loop (the blocks made opaque first) and to ``s`` outside it.

The loops are built with TE and an ``s_tir.Schedule`` (``compute_at`` under the row loop,
``reorder`` and ``decompose_reduction`` of the reductions), which work for a symbolic ``s``.
Where a schedule step fails, the kernel is the plain TE one (``topi.nn.softmax``, keys read
in place), which ``InlineKernelIntermediates`` (its ``rows`` stage) computes row by row; it
finds nothing to do in the scheduled kernel.

The group
---------
*Core*: ``P = softmax(X, axis=-1)`` where ``X`` is reached from a matmul ``S`` through
elementwise operators with one other operand each (a scale, a mask) and
``reshape``/``broadcast_to``; and ``O = matmul(P', V)`` where ``P'`` is ``P`` through
``reshape``/``broadcast_to``. Every value of the core except ``O`` has exactly one reader, the
next one in the chain.

*Masks*: the bindings that build a mask the core adds (see above); they may be copied into
several groups.

*Extensions*: a binding of a layout operator (``reshape``, ``permute_dims``,
``broadcast_to``, ``expand_dims``, ``squeeze``, ``split`` and its items) joins the group when
every reader of its value is in the group (upstream); so does the layout reader of the result
while it is the only reader (downstream). A value read after its block or by a binding outside
the group never becomes internal to it. Other inputs (the mask) are read as tensors.

Where it runs
-------------
On high-level Relax, before ``LegalizeOps``; in :func:`blade_relax.get_pipeline` it is the
first pass (``SimplifyTransposes`` would turn the score matmul into an ``NT_matmul`` kernel
this pass does not match; the transposes it would cancel are index maps here anyway). On CPU
targets only: the loop nest is written for one, and on a GPU the kernel would need a schedule
dlight does not have.

What it assumes
---------------
A normalized module with dataflow blocks. Functions already marked ``Primitive`` or
``Codegen`` are left alone, as is every chain that does not match (a softmax whose result is
also read elsewhere, as in a training graph whose backward reads it; a chain without a
matmul, an operator or a reshape the kernel builder does not handle).

Where the code is
-----------------
This module holds the pass and its options. Which bindings form a group is
``_attention_match`` (the core, the extensions, the masks); how each operator of a group reads
as an index expression is ``_attention_access``; the TE stages, the kernel and its schedule
are ``_attention_kernel``.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax

from ..util.collection import pauses_collection
from ._attention_kernel import KeysCopy, build_kernel
from ._attention_match import (
    Block,
    Unsupported,
    attention_core,
    extend_group,
    freed_mask_bytes,
    mask_bindings,
    op_name,
    softmax_axis_is_last,
)
from ._block_edit import rewrite_dataflow_blocks, vars_read_after
from .result import PassResult, counted, function_results, publish

__all__ = ["AttentionOptions", "AttentionReport", "FuseAttention"]


@dataclass(frozen=True)
class AttentionOptions:
    """Options of :class:`FuseAttention`.

    Attributes
    ----------
    enabled
        Run the pass; when ``False`` it returns its input unchanged.
    absorb_inputs
        Let the group absorb the layout operators that only it reads (the ``split`` of
        ``qkv``, the head transposes) and the layout readers of its result; without it only
        the core chain is grouped.
    max_group
        The most bindings one group may have.
    absorb_masks
        Compute the mask added to the scores inside the kernel, from what it is built of (an
        ``arange`` compared with another, a padding mask indexed), instead of reading it as
        a ``(b, 1, s, s)`` tensor that lives from its producer to the last attention: the
        bindings that build it are copied into each kernel that reads it (see
        :func:`~blade_relax.transform._attention_match.mask_bindings`); the tensor is then no longer computed.
    copy_keys
        Copy the keys of one head, transposed, into the kernel's scratch, so that a row of
        scores is vector multiply-adds along the row (the score matmul about 3 times faster
        on an AVX-512 CPU at ``s = 256``; results unchanged). It costs ``d * s`` elements of
        scratch while the kernel runs, where the attention call is often the step's peak:
        off by default, so that the kernel never holds more than the rows it computes.
    copy_keys_within_mask
        Where the kernel computes its mask (``absorb_masks``) and that mask tensor then no
        longer exists, copy the keys of a head at run time where they take at most the
        mask's bytes (a float32 ``(1, 1, s, s)`` mask and heads of width ``d``: ``s >= d``)
        and read them in place elsewhere: the copy then fits in what the mask held, and no
        peak rises.
    stop_rows
        Where the kernel computes a causal mask without padding (the lowest float above the
        diagonal, 0 on it, proven from its expression), row ``i`` computes its first
        ``i + 1`` scores only: half the work, the same results (see
        :func:`~blade_relax.transform._attention_kernel._masked_above_diagonal`).
    """

    enabled: bool = True
    absorb_inputs: bool = True
    max_group: int = 96
    absorb_masks: bool = True
    copy_keys: bool = False
    copy_keys_within_mask: bool = True
    stop_rows: bool = True

    def __post_init__(self) -> None:
        if self.max_group < 4:
            raise ValueError(f"max_group must be at least 4, got {self.max_group}")


@dataclass
class AttentionReport:
    """What one run changed: attention chains ``fused``, with ``absorbed`` extra bindings, and
    ``masks`` bindings that build a mask copied into the kernels."""

    fused: int = 0
    absorbed: int = 0
    masks: int = 0


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention:
    """Compute each attention chain as one kernel (see the module docstring).

    Parameters
    ----------
    options
        An :class:`AttentionOptions` (``None``: defaults).

    After the pass ran, ``pass_obj.report`` is an :class:`AttentionReport` of the last run and
    ``pass_obj.last_result`` a :class:`~blade_relax.transform.result.PassResult` (no byte
    figures: the pass runs on whole imported graphs before legalization, where a memory
    timeline of each changed function would cost more than the pass; a fused chain holds
    neither score tensor).
    """

    def __init__(self, options: AttentionOptions | None = None) -> None:
        if options is not None and not isinstance(options, AttentionOptions):
            raise TypeError(f"FuseAttention expects AttentionOptions, got {type(options).__name__}")
        self.options = options or AttentionOptions()
        self.report = AttentionReport()
        self.last_result: PassResult | None = None

    @pauses_collection
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = AttentionReport()
        if not self.options.enabled:
            publish(self, PassResult("FuseAttention", notes=("disabled by its options",)))
            return mod
        builder = relax.BlockBuilder(mod)
        names = {func: gv.name_hint for gv, func in mod.functions.items()}
        # function: attention chains fused, layout bindings absorbed, mask bindings copied
        counts: dict[str, list[int]] = {}
        notes: dict[str, list[str]] = {}

        def rewrite(func, index, block, _blocks):
            attrs = func.attrs or {}
            if any(key in attrs for key in ("Primitive", "Codegen", "Composite")):
                notes[names[func]] = ["a Primitive, Codegen or Composite function: left alone"]
                return None
            before = (self.report.fused, self.report.absorbed, self.report.masks)
            new_block = self._fuse_block(block, vars_read_after(func, index), builder)
            after = (self.report.fused, self.report.absorbed, self.report.masks)
            count = counts.setdefault(names[func], [0, 0, 0])
            for i, (old, new) in enumerate(zip(before, after)):
                count[i] += new - old
            return new_block

        out = rewrite_dataflow_blocks(mod, rewrite, builder)
        if out is not mod:
            # The bindings the kernels replaced are now unused.
            out = relax.transform.DeadCodeElimination()(out)
        changes = {
            name: [f"{counted(fused, 'attention chain')} fused"]
            + ([f"{counted(absorbed, 'layout binding')} absorbed"] if absorbed else [])
            + ([f"{counted(masks, 'mask binding')} computed in the kernels"] if masks else [])
            for name, (fused, absorbed, masks) in counts.items()
            if fused
        }
        functions = function_results(mod, out, changes, notes=notes)
        publish(self, PassResult("FuseAttention", functions, detail=self.report))
        return out

    def _fuse_block(
        self,
        block: relax.DataflowBlock,
        read_after: set[relax.Var],
        builder: relax.BlockBuilder,
    ) -> relax.DataflowBlock | None:
        info = Block(block, read_after)
        taken: set[int] = set()
        replace_at: dict[int, relax.Binding] = {}
        for pos, binding in enumerate(info.bindings):
            if op_name(binding) != "relax.nn.softmax" or pos in taken:
                continue
            if not softmax_axis_is_last(binding):
                continue
            core = attention_core(info, pos)
            if core is None or taken & set(core):
                continue
            group = set(core)
            if self.options.absorb_inputs:
                group = extend_group(info, group, self.options.max_group) - taken
            if len(group) > self.options.max_group:
                continue
            masks, mask_vars = set(), []
            if self.options.absorb_masks:
                masks, mask_vars = mask_bindings(info, core, group)
            if len(group) + len(masks) > self.options.max_group:
                masks, mask_vars = set(), []
            copy_keys: KeysCopy = self.options.copy_keys
            if not copy_keys and self.options.copy_keys_within_mask and mask_vars:
                freed = freed_mask_bytes(info, mask_vars, info.bindings[max(group)].var)
                copy_keys = False if freed is None else freed
            try:
                kernel, inputs = build_kernel(
                    info, sorted(group | masks), copy_keys, mask_vars, self.options.stop_rows
                )
            except Unsupported:
                if not masks:
                    continue
                try:  # the mask as a tensor the kernel reads
                    masks = set()
                    kernel, inputs = build_kernel(info, sorted(group), self.options.copy_keys)
                except Unsupported:
                    continue
            gv = builder.add_func(kernel, "fused_attention")
            result = max(group)
            last = info.bindings[result]
            call = relax.call_tir(gv, inputs, last.var.ty)
            replace_at[result] = relax.VarBinding(last.var, call)
            # The mask's bindings are not taken: another attention may compute the same mask.
            taken |= group
            self.report.fused += 1
            self.report.absorbed += len(group) - len(core)
            self.report.masks += len(masks)
        if not replace_at:
            return None
        # Only the last binding of a group is replaced; the others are left for
        # DeadCodeElimination (nothing else reads them).
        return relax.DataflowBlock(
            [replace_at.get(pos, binding) for pos, binding in enumerate(info.bindings)]
        )
