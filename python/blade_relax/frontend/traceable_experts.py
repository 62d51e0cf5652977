"""Mixture-of-experts layers whose Python reads the routing back from a tensor, exported with
the routing kept as a tensor.

JetMoE's router counts the tokens each expert receives and turns the counts into Python ints
(``expert_size.tolist()``); its experts then split the sorted tokens by those ints
(``inputs.split(expert_size)``) and run one ``F.linear`` per expert. ``torch.export`` cannot
express a split by values read from a tensor (``torch.compile`` fails at the same line, as
transformers' own ``_can_compile_fullgraph = False`` says). The computation is the grouped GEMM
transformers runs for its other mixture-of-experts models: each expert's GEMM on its
contiguous run of the sorted rows, the runs given by the running sum of the counts. So, while
the model is exported, :func:`traceable_experts` runs JetMoE's router with the counts kept as a
tensor and its experts as ``transformers::grouped_mm_fallback`` on the running sum (the operator
:mod:`blade_relax.frontend.moe` converts), on the same weights and the same rows, so each
expert multiplies the rows it multiplied before. The model's own methods are restored on exit,
so the torch reference (and torch eager, in the benchmark) runs the model as written.

transformers has no traceable form of these layers (its ``experts_implementation`` switch
covers the experts classes of the ``@use_experts_implementation`` kind, not JetMoE's); nothing
in torch rewrites a ``tolist()`` split.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["traceable_experts"]


def _router_forward(self: Any, hidden_states: Any) -> tuple:
    """JetMoE's ``JetMoeTopKGating.forward`` with the tokens per expert as a tensor."""
    import torch

    logits = self.layer(hidden_states).float()
    top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
    top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
    chosen = torch.zeros(
        [top_k_gates.size(0), self.num_experts], dtype=top_k_gates.dtype, device=logits.device
    ).scatter(1, top_k_indices, 1)
    tokens_per_expert = chosen.long().sum(0)
    _, index_sorted_experts = top_k_indices.flatten().sort(0)
    batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
    batch_gates = top_k_gates.flatten()[index_sorted_experts]
    return index_sorted_experts, batch_index, batch_gates, tokens_per_expert, logits


def _experts_forward(self: Any, inputs: Any, tokens_per_expert: Any) -> Any:
    """JetMoE's ``JetMoeParallelExperts.forward`` as one grouped GEMM over the sorted rows."""
    import torch
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    # The weights are stored (experts, out, in); the grouped GEMM reads (experts, in, out).
    weight = self.weight.transpose(-2, -1)
    return torch.ops.transformers.grouped_mm_fallback(inputs.to(weight.dtype), weight, offsets)


def _dbrx_experts_forward(
    self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any
) -> Any:
    """DBRX's ``DbrxExperts.forward`` with the (token, expert) pairs sorted by expert and each
    expert's gated MLP as grouped GEMMs over its run of rows."""
    import torch
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    batch_size = hidden_states.shape[0]
    hidden_states = hidden_states.reshape(-1, self.hidden_size)
    top_k = top_k_index.shape[-1]
    expert_of_pair = top_k_index.flatten()
    _, pairs_by_expert = expert_of_pair.sort(0)
    token_of_pair = pairs_by_expert.div(top_k, rounding_mode="trunc")
    # Counted as JetMoE's router counts (one_hot would add a run-time assertion, which keeps
    # the imported function out of dataflow blocks, where TVM turns reshapes into views).
    chosen = torch.zeros(
        [hidden_states.shape[0], self.num_experts], dtype=torch.int64, device=top_k_index.device
    ).scatter(1, top_k_index, 1)
    offsets = torch.cumsum(chosen.sum(0), dim=0, dtype=torch.int32)
    # w1, v1 and w2 are stored (experts * ffn, hidden); per expert, x @ w1.T, x @ v1.T, y @ w2.
    experts = (self.num_experts, self.ffn_hidden_size, self.hidden_size)
    rows = hidden_states[token_of_pair]
    grouped = torch.ops.transformers.grouped_mm_fallback
    gate = grouped(rows, self.mlp.w1.view(experts).transpose(-2, -1), offsets)
    up = grouped(rows, self.mlp.v1.view(experts).transpose(-2, -1), offsets)
    states = grouped(self.mlp.activation_fn(gate) * up, self.mlp.w2.view(experts), offsets)
    states = states * top_k_weights.flatten()[pairs_by_expert, None]
    next_states = torch.zeros_like(hidden_states).index_add(0, token_of_pair, states)
    return next_states.view(batch_size, -1, self.hidden_size)


#: The forward methods replaced while exporting, by the class names of the modules.
_TRACEABLE: dict[str, Callable[..., Any]] = {
    "JetMoeTopKGating": _router_forward,
    "JetMoeParallelExperts": _experts_forward,
    "DbrxExperts": _dbrx_experts_forward,
}


@contextlib.contextmanager
def traceable_experts(model: Any) -> Iterator[int]:
    """``model``'s JetMoE routers and experts with the traceable forwards above (each module's
    own ``forward`` back on exit). Yields how many modules were switched (0 for other models,
    which are left as they are)."""
    switched = []
    for module in model.modules():
        forward = _TRACEABLE.get(type(module).__name__)
        if forward is not None:
            module.forward = types.MethodType(forward, module)
            switched.append(module)
    try:
        yield len(switched)
    finally:
        for module in switched:
            del module.forward
