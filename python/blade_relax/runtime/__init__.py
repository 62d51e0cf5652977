"""Runtime: memory accounting, the memory budget and eviction mode, measuring one VM call
(``measure_call``), offloading to host memory, CUDA graphs per length bucket, the collectives of
a data-parallel step, and the builtins the VM calls.

Nothing here imports a pass: the compiled module talks to the runtime only through the packed
functions registered on import and through function attributes.
"""

from .accounting import *  # noqa: F403
from .accounting import __all__ as _accounting_all
from .budget import *  # noqa: F403
from .budget import __all__ as _budget_all
from .collectives import *  # noqa: F403
from .collectives import __all__ as _collectives_all
from .cuda_graphs import *  # noqa: F403
from .cuda_graphs import __all__ as _cuda_graphs_all
from .gemm import *  # noqa: F403
from .gemm import __all__ as _gemm_all
from .measure import *  # noqa: F403
from .measure import __all__ as _measure_all
from .offload import *  # noqa: F403
from .offload import __all__ as _offload_all
from .remat import *  # noqa: F403
from .remat import __all__ as _remat_all

__all__ = [
    *_accounting_all,
    *_budget_all,
    *_collectives_all,
    *_cuda_graphs_all,
    *_gemm_all,
    *_measure_all,
    *_offload_all,
    *_remat_all,
]
