"""The ``gemm`` step: the GEMMs of the benchmark's Llama on TVM's kernels against cuBLAS.

Without ``DispatchGemm`` (``dispatch_gemm=False``, and in stock TVM) a GEMM on a CUDA target is
the kernel dlight's ``Matmul`` rule schedules in TVM's CUDA pipeline (the default pipeline puts
those without a fused tail on cuBLAS instead). This step measures what dlight's kernels
cost against cuBLAS, which PyTorch eager calls for the same ``nn.Linear``, at the shapes of the
benchmarked Llama (the carried manifest's sizes): each distinct projection of a decoder layer
and the LM head, at the shortest and the longest length the benchmark runs, in the three GEMMs
a training step makes of it (:data:`PASSES`): forward ``x @ w.T``, the input's gradient
``dy @ w`` and the weight's ``dy.T @ x`` (which sums over the tokens). The first GPU run
measured the forward GEMMs only, and blade_relax's training step took 1.3-1.6x stock TVM's
time there, while its graph passes turn transposes and matmuls into ``NT_matmul`` /
``TN_matmul`` kernels: the three layouts tell which of them dlight schedules worst.

``python -m blade_relax.gpuprog gemm --carried .gpuprog --out $OUT/gemm.json``

Each GEMM is one Relax function (``x: (m, k)``, ``w: (n, k)``, ``dy: (m, n)``) with ``m``
symbolic, as in the imported graphs; one module holds them all and is compiled once by
blade_relax's pipeline without ``DispatchGemm`` (``get_pipeline(target, dispatch_gemm=False)``)
before the GPU is taken (:data:`~.plan.LOCK_ENV`).
Both sides are timed alike: ``calls`` back-to-back calls between two synchronisations, divided
by ``calls`` (launch overhead amortised, as in a training step's stream of kernels), the
median of ``repeat`` such batches. float32 on both sides, TF32 off (PyTorch's default for
matmuls), each result checked against PyTorch's. ``--target llvm`` runs the same on the CPU,
to check the step without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .cuda_graphs import max_relative_error
from .plan import LOCK_ENV, read_manifest

__all__ = [
    "PASSES",
    "GemmShape",
    "compile_tvm_gemms",
    "gemm_module",
    "llama_gemms",
    "main",
    "markdown",
]

#: The GEMMs of one linear layer in a training step: name -> (what it computes, its layout).
PASSES = {
    "fwd": ("x @ w.T", "NT"),
    "dx": ("dy @ w", "NN"),
    "dw": ("dy.T @ x", "TN"),
}


@dataclass(frozen=True)
class GemmShape:
    """One ``nn.Linear`` of the model: ``(m, k) @ (n, k).T`` for every token count ``m``.

    Attributes
    ----------
    name
        The function's name in the module (``"mlp_down"``).
    what
        The projections it stands for (``"down_proj"``).
    k, n
        Input and output features.
    """

    name: str
    what: str
    k: int
    n: int


def llama_gemms(sizes: dict[str, Any]) -> list[GemmShape]:
    """The distinct GEMM shapes of a Llama decoder layer and its LM head, from the
    :class:`~blade_relax.bench.workloads.ModelSizes` fields in ``sizes``."""
    hidden, heads = int(sizes["hidden"]), int(sizes["heads"])
    kv = int(sizes["kv_heads"]) * (hidden // heads)
    shapes = [
        GemmShape("attn_q_o", "q_proj, o_proj", hidden, hidden),
        GemmShape("attn_k_v", "k_proj, v_proj", hidden, kv),
        GemmShape("mlp_gate_up", "gate_proj, up_proj", hidden, int(sizes["intermediate"])),
        GemmShape("mlp_down", "down_proj", int(sizes["intermediate"]), hidden),
        GemmShape("lm_head", "lm_head", hidden, int(sizes["vocab"])),
    ]
    return [s for i, s in enumerate(shapes) if (s.k, s.n) not in {(t.k, t.n) for t in shapes[:i]}]


def gemm_module(shapes: Sequence[GemmShape], dtype: str = "float32") -> Any:
    """A module with one function per shape and pass (:data:`PASSES`), named
    ``<shape>_<pass>``: ``fwd(x: (m, k), w: (n, k))``, ``dx(dy: (m, n), w: (n, k))``,
    ``dw(dy: (m, n), x: (m, k))``, ``m`` symbolic."""
    import tvm
    from tvm import relax

    bb = relax.BlockBuilder()
    for shape in shapes:
        for name in PASSES:
            m = tvm.tirx.Var("m", "int64")
            x = relax.Var("x", relax.TensorType([m, shape.k], dtype))
            w = relax.Var("w", relax.TensorType([shape.n, shape.k], dtype))
            dy = relax.Var("dy", relax.TensorType([m, shape.n], dtype))
            params = {"fwd": [x, w], "dx": [dy, w], "dw": [dy, x]}[name]
            with bb.function(f"{shape.name}_{name}", params):
                with bb.dataflow():
                    if name == "fwd":
                        value = relax.op.linear(x, w)
                    elif name == "dx":
                        value = relax.op.matmul(dy, w)
                    else:
                        value = relax.op.matmul(relax.op.permute_dims(dy), x)
                    out = bb.emit_output(value)
                bb.emit_func_output(out)
    return bb.get()


def compile_tvm_gemms(shapes: Sequence[GemmShape], target: Any) -> Any:
    """:func:`gemm_module` compiled with TVM's own GEMM kernels (dlight's on CUDA), the side
    this step times against cuBLAS: blade_relax's pipeline without ``DispatchGemm``."""
    import tvm

    from ..pipeline import get_pipeline

    pipeline = get_pipeline(target, dispatch_gemm=False)
    return tvm.compile(gemm_module(shapes), target, relax_pipeline=pipeline)


def _say(message: str) -> None:
    print(message, flush=True)


def _seconds_per_call(call: Callable[[], Any], sync: Callable[[], None], calls: int,
                      repeat: int) -> float:  # fmt: skip
    """Median over ``repeat`` batches of the seconds per call of ``calls`` calls made back to
    back between two synchronisations (after one warm-up batch)."""
    batches = []
    for i in range(repeat + 1):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        if i:
            batches.append((time.perf_counter() - start) / calls)
    return statistics.median(batches)


def measure(
    shapes: Sequence[GemmShape],
    tokens: Sequence[int],
    executable: Any,
    target: dict[str, str],
    *,
    calls: int,
    repeat: int,
    tolerance: float,
) -> list[dict[str, Any]]:
    """Each shape, token count and pass: TVM's and PyTorch's seconds per call and TFLOP/s, and
    the relative error of TVM's result against PyTorch's."""
    import numpy as np
    import torch
    import tvm
    from tvm import relax

    from ..runtime.devices import device_for_target

    device = device_for_target(target)
    cuda = target["kind"] == "cuda"
    torch_device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    vm = relax.VirtualMachine(executable, device)
    sync_tvm = device.sync
    sync_torch = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    rng = np.random.default_rng(0)

    def torch_pass(name: str, a: Any, b: Any) -> Any:
        if name == "fwd":
            return torch.nn.functional.linear(a, b)
        return a @ b if name == "dx" else a.t() @ b

    for shape in shapes:
        weight = (rng.standard_normal((shape.n, shape.k)) / np.sqrt(shape.k)).astype("float32")
        for m in tokens:
            x = rng.standard_normal((m, shape.k), dtype="float32")
            dy = rng.standard_normal((m, shape.n), dtype="float32")
            operands = {"fwd": (x, weight), "dx": (dy, weight), "dw": (dy, x)}
            for name, (computes, layout) in PASSES.items():
                a, b = operands[name]
                ta, tb = tvm.runtime.tensor(a, device), tvm.runtime.tensor(b, device)
                pa, pb = (torch.from_numpy(v).to(torch_device) for v in (a, b))
                fn = vm[f"{shape.name}_{name}"]
                ours = fn(ta, tb).numpy()
                want = torch_pass(name, pa, pb).cpu().numpy()
                error = max_relative_error(ours, want)
                tvm_s = _seconds_per_call(lambda: fn(ta, tb), sync_tvm, calls, repeat)  # noqa: B023
                torch_s = _seconds_per_call(
                    lambda: torch_pass(name, pa, pb),  # noqa: B023
                    sync_torch,
                    calls,
                    repeat,
                )
                flops = 2.0 * m * shape.k * shape.n
                rows.append(
                    {
                        **asdict(shape),
                        "pass": name,
                        "computes": computes,
                        "layout": layout,
                        "m": m,
                        "tvm_ms": round(tvm_s * 1e3, 5),
                        "cublas_ms" if cuda else "torch_ms": round(torch_s * 1e3, 5),
                        "tvm_tflops": round(flops / tvm_s / 1e12, 3),
                        "torch_tflops": round(flops / torch_s / 1e12, 3),
                        "tvm_over_torch": round(tvm_s / torch_s, 3),
                        "rel_error": error,
                        "correct": error <= tolerance,
                    }
                )
                row = rows[-1]
                _say(f"{shape.name} {name} ({computes}) m={m} k={shape.k} n={shape.n}: TVM "
                     f"{row['tvm_tflops']} TFLOP/s, torch {row['torch_tflops']} TFLOP/s "
                     f"({row['tvm_over_torch']}x the time), rel. error {error:.1e}")  # fmt: skip
    return rows


def markdown(doc: dict[str, Any]) -> str:
    """The step's table: per shape and token count, both times, both rates, their ratio."""
    other = doc["library"]
    lines = [
        f"| GEMM (projections) | pass | m x k x n | TVM ms | {other} ms | TVM TFLOP/s | "
        f"{other} TFLOP/s | TVM / {other} time | max rel. error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        theirs = r.get("cublas_ms", r.get("torch_ms"))
        lines.append(
            f"| {r['name']} ({r['what']}) | {r['computes']} ({r['layout']}) | "
            f"{r['m']} x {r['k']} x {r['n']} | {r['tvm_ms']} | {theirs} | {r['tvm_tflops']} | "
            f"{r['torch_tflops']} | {r['tvm_over_torch']}x | {r['rel_error']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """The step's command line; 0 when every result matched PyTorch's."""
    parser = argparse.ArgumentParser(prog="python -m blade_relax.gpuprog gemm")
    parser.add_argument("--carried", required=True, help="the folder with the manifest")
    parser.add_argument("--out", required=True)
    parser.add_argument("--workload", default="llama-train")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tolerance", type=float, default=5e-4)
    parser.add_argument("--target", default="cuda", help="cuda (the GPU's arch) or llvm")
    args = parser.parse_args(list(argv))

    import tvm

    from .. import quiet
    from ..runtime.devices import configure_cuda_compiler
    from .__main__ import _bench_target, gpu_lock

    quiet()
    manifest = read_manifest(Path(args.carried))
    if not manifest:
        raise SystemExit(f"no manifest in {args.carried}: run bash ci/gpu.sh --dry-run first")
    sizes = manifest["sizes"]
    lengths = manifest["lengths"][args.workload]
    tokens = sorted({int(sizes.get("batch", 1)) * n for n in (min(lengths), max(lengths))})
    shapes = llama_gemms(sizes)
    target, where = _bench_target(args.target)
    if target["kind"] == "cuda":
        configure_cuda_compiler()
    tgt = tvm.target.Target(target)
    start = time.perf_counter()
    executable = compile_tvm_gemms(shapes, tgt)
    compile_s = time.perf_counter() - start
    _say(f"built {len(shapes) * len(PASSES)} GEMMs for {where} in {compile_s:.1f} s; "
         f"m in {tokens}")  # fmt: skip
    with gpu_lock(os.environ.get(LOCK_ENV)):
        rows = measure(shapes, tokens, executable, target, calls=args.calls, repeat=args.repeat,
                       tolerance=args.tolerance)  # fmt: skip
    doc = {
        "workload": args.workload,
        "device": where,
        "library": "cuBLAS" if target["kind"] == "cuda" else "torch",
        "dtype": "float32",
        "tf32": False,
        "calls": args.calls,
        "repeat": args.repeat,
        "compile_s": round(compile_s, 2),
        "rows": rows,
        "all_correct": all(r["correct"] for r in rows),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    table = (
        f"GEMMs of {args.workload} on {where}: TVM's kernels (blade_relax's pipeline) against "
        f"{doc['library']} (torch.nn.functional.linear), float32\n\n{markdown(doc)}"
    )
    out.with_suffix(".md").write_text(table + "\n")
    _say(table)
    return 0 if doc["all_correct"] else 1
