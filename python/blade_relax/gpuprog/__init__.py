"""The GPU program: everything the GPU machine runs, as one command prepared on the CPU.

Time on the GPU machine is short (one command of at most 10 minutes, 64 MiB carried with it,
no package registry, another torch than ours), so the program is prepared and checked here and
runs there without a choice left to make:

* ``bash ci/gpu.sh --plan`` prints the steps and their estimated GPU-machine seconds
  (:mod:`.plan`).
* ``bash ci/gpu.sh --dry-run`` (on the CPU) does everything but execute on a GPU: imports the
  benchmark workloads with our torch and writes them, without weights, into ``.gpuprog/``
  (:mod:`.carried`), builds every CUDA executable the program will run from those files (and
  compiles their kernels to cubins where a CUDA compiler is found), collects the GPU tests,
  checks what travels against the 64 MiB, and prints the plan.
* ``. .gpukit/device-setup.sh && bash ci/gpu.sh`` (on the GPU machine) runs the steps
  (:mod:`.program`): each one a subprocess with its own time budget, a failure recorded and
  the next step run, ``$OUT/gpu-summary.json`` and ``$OUT/gpu-results.md`` rewritten after
  every step so that a killed run still leaves its results.
"""

from .plan import Costs, ProgramOptions, Step, format_plan, program_steps

__all__ = ["Costs", "ProgramOptions", "Step", "format_plan", "program_steps"]
