"""Frontends: Hugging Face models and Relax-native graphs to Relax modules with symbolic dims.

* :func:`import_inference`: ``input_ids -> logits`` of a Hugging Face causal LM.
* :func:`import_training_step`: ``(input_ids, labels) -> (loss, *gradients)`` from torch's joint
  forward+backward export.
* :func:`relax_training_step`: the same for a Relax-native forward function, through
  ``relax.transform.Gradient``.

All return an :class:`ImportedGraph`. torch and transformers are imported only when a Hugging
Face importer is called.
"""

from .guards import GuardError
from .hf import (
    TiedParameterError,
    UnsupportedOperatorError,
    import_inference,
    import_training_step,
    torch_to_numpy,
)
from .imported import (
    DimOutOfRangeError,
    DimRange,
    ImportedGraph,
    drop_upper_bounds,
    flatten_outputs,
    set_dim_bounds,
    specialize,
)
from .relax_native import relax_training_step

__all__ = [
    "DimOutOfRangeError",
    "DimRange",
    "GuardError",
    "ImportedGraph",
    "TiedParameterError",
    "UnsupportedOperatorError",
    "drop_upper_bounds",
    "flatten_outputs",
    "import_inference",
    "import_training_step",
    "relax_training_step",
    "set_dim_bounds",
    "specialize",
    "torch_to_numpy",
]
