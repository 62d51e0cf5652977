"""The ``gemm`` step: the GEMMs of the benchmark's Llama on TVM's kernels against cuBLAS.

On CUDA targets blade_relax leaves every matmul to TVM: ``DispatchGemm`` (ATen's GEMMs) runs
on CPU targets only, so a GPU GEMM is the kernel that dlight's ``Matmul`` rule schedules in
TVM's CUDA pipeline. This step measures what that costs against cuBLAS, which PyTorch eager
calls for the same ``nn.Linear``, at the shapes of the benchmarked Llama (the carried
manifest's sizes): each distinct projection of a decoder layer and the LM head, forward
(``x @ w.T``), at the shortest and the longest length the benchmark runs.

``python -m blade_relax.gpuprog gemm --carried .gpuprog --out $OUT/gemm.json``

Each GEMM is one Relax function ``linear(x: (m, k), w: (n, k))`` with ``m`` symbolic, as in
the imported graphs; one module holds them all and is compiled once by blade_relax's default
pipeline (:func:`blade_relax.get_pipeline`) before the GPU is taken (:data:`~.plan.LOCK_ENV`).
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

from .plan import LOCK_ENV, read_manifest

__all__ = ["GemmShape", "gemm_module", "llama_gemms", "main", "markdown"]


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
    """A module with one function per shape: ``linear(x: (m, k), w: (n, k))``, ``m``
    symbolic."""
    import tvm
    from tvm import relax

    bb = relax.BlockBuilder()
    for shape in shapes:
        m = tvm.tirx.Var("m", "int64")
        x = relax.Var("x", relax.TensorType([m, shape.k], dtype))
        w = relax.Var("w", relax.TensorType([shape.n, shape.k], dtype))
        with bb.function(shape.name, [x, w]):
            with bb.dataflow():
                out = bb.emit_output(relax.op.linear(x, w))
            bb.emit_func_output(out)
    return bb.get()


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
    """Each shape at each token count: TVM's and PyTorch's seconds per call and TFLOP/s, and
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
    for shape in shapes:
        weight = (rng.standard_normal((shape.n, shape.k)) / np.sqrt(shape.k)).astype("float32")
        for m in tokens:
            x = rng.standard_normal((m, shape.k), dtype="float32")
            tx, tw = tvm.runtime.tensor(x, device), tvm.runtime.tensor(weight, device)
            px, pw = torch.from_numpy(x).to(torch_device), torch.from_numpy(weight).to(torch_device)
            fn = vm[shape.name]
            ours = fn(tx, tw).numpy()
            want = torch.nn.functional.linear(px, pw).cpu().numpy()
            error = float(np.abs(ours - want).max() / max(float(np.abs(want).max()), 1e-30))
            tvm_s = _seconds_per_call(lambda: fn(tx, tw), sync_tvm, calls, repeat)  # noqa: B023
            torch_s = _seconds_per_call(
                lambda: torch.nn.functional.linear(px, pw),  # noqa: B023
                sync_torch,
                calls,
                repeat,
            )
            flops = 2.0 * m * shape.k * shape.n
            rows.append(
                {
                    **asdict(shape),
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
            _say(f"{shape.name} m={m} k={shape.k} n={shape.n}: TVM {row['tvm_tflops']} TFLOP/s, "
                 f"torch {row['torch_tflops']} TFLOP/s ({row['tvm_over_torch']}x the time), "
                 f"rel. error {error:.1e}")  # fmt: skip
    return rows


def markdown(doc: dict[str, Any]) -> str:
    """The step's table: per shape and token count, both times, both rates, their ratio."""
    other = doc["library"]
    lines = [
        f"| GEMM (projections) | m x k x n | TVM ms | {other} ms | TVM TFLOP/s | "
        f"{other} TFLOP/s | TVM / {other} time | max rel. error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        theirs = r.get("cublas_ms", r.get("torch_ms"))
        lines.append(
            f"| {r['name']} ({r['what']}) | {r['m']} x {r['k']} x {r['n']} | {r['tvm_ms']} | "
            f"{theirs} | {r['tvm_tflops']} | {r['torch_tflops']} | {r['tvm_over_torch']}x | "
            f"{r['rel_error']:.1e} |"
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

    import blade_relax

    from ..runtime.devices import configure_cuda_compiler
    from .__main__ import _bench_target, gpu_lock

    blade_relax.quiet()
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
    executable = tvm.compile(gemm_module(shapes), tgt, relax_pipeline=blade_relax.get_pipeline(tgt))
    compile_s = time.perf_counter() - start
    _say(f"built {len(shapes)} GEMMs for {where} in {compile_s:.1f} s; m in {tokens}")
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
