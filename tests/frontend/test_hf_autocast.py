"""Mixed-precision training steps (``import_training_step(..., autocast=...)``) match torch.

Tolerances. The reference is the same wrapper run by torch under the same ``torch.autocast``.
Both sides compute every product from the same bfloat16 operands, sum it in float32 and round
the sum to bfloat16 once; they differ only in the order of the float32 sums (TVM's loop order
against oneDNN's blocking). A different last float32 bit sometimes rounds to the neighbouring
bfloat16 value, one unit in the last place (2**-8 relative: bfloat16 keeps 8 bits of
mantissa), and such differences travel through the backward. Measured on the models below at
lengths 5, 17 and 48: the loss agrees to 1e-4 (it is computed from float32 logits), every
gradient to a norm-relative error of at most 1.1e-2 (median 4e-3). That is the size of
autocast's own error: torch's autocast gradients differ from its float32 ones by 5e-3 to 1e-2.
The bounds below leave a factor of two or more.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

import blade_relax
from blade_relax.bench.workloads import ModelSizes, gpt2_model, llama_model
from blade_relax.frontend import flatten_outputs, import_training_step, torch_to_numpy
from blade_relax.frontend.converters import custom_convert_map
from blade_relax.frontend.imported import drop_upper_bounds

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

MAX_LEN = 64
LENGTHS = (5, 17, 48)
LOSS_TOLERANCE = 1e-3
GRAD_TOLERANCE = 2.5e-2
TINY = ModelSizes(
    layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=96, max_seq_len=MAX_LEN
)


def relative_error(out, ref):
    out, ref = np.asarray(out, "float64"), np.asarray(ref, "float64")
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def run(graph, lengths, pipeline=None):
    """Compile once (``tvm.compile``, or with ``pipeline``) and return (outputs, reference)."""
    mod = drop_upper_bounds(graph.mod)
    if pipeline is None:
        exe = tvm.compile(mod, "llvm")
    else:
        exe = tvm.compile(mod, "llvm", relax_pipeline=pipeline)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    params = [tvm.runtime.tensor(p) for p in graph.params]
    results = []
    for length in lengths:
        inputs = graph.random_inputs({"s": length}, seed=length)
        out = vm["main"](*[tvm.runtime.tensor(a) for a in inputs], *params)
        results.append(([t.numpy() for t in flatten_outputs(out)], graph.reference(inputs)))
    return results


def assert_close(results, count):
    for outputs, reference in results:
        assert len(outputs) == len(reference) == count
        for out, ref in zip(outputs, reference):
            assert out.shape == ref.shape and out.dtype == ref.dtype == np.float32
        assert relative_error(outputs[0], reference[0]) <= LOSS_TOLERANCE
        errors = [relative_error(o, r) for o, r in zip(outputs[1:], reference[1:])]
        assert max(errors) <= GRAD_TOLERANCE, max(errors)


def matmul_operand_dtypes(graph):
    """(operand dtypes, result dtype) of every matmul in ``main``."""
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.matmul":
            found.append((tuple(str(a.ty.dtype) for a in expr.args), str(expr.ty.dtype)))

    relax.analysis.post_order_visit(graph.main.body, visit)
    return found


@pytest.fixture(scope="module")
def llama_step():
    return import_training_step(llama_model(TINY), max_seq_len=MAX_LEN, autocast="bfloat16")


def test_llama_autocast_keeps_float32_weights_and_gradients(llama_step):
    graph = llama_step
    assert graph.metadata["autocast"] == "bfloat16"
    main = graph.main
    assert {str(p.dtype) for p in graph.params} == {"float32"}
    assert {str(p.ty.dtype) for p in main.params[2:]} == {"float32"}
    assert {str(f.dtype) for f in main.ty.ret.fields} == {"float32"}
    products = matmul_operand_dtypes(graph)
    # Every product reads bfloat16 operands and sums in float32 (rounded to bfloat16 after).
    assert products and all(ins == ("bfloat16", "bfloat16") for ins, _ in products)
    assert {out for _, out in products} == {"float32"}


def test_llama_autocast_step_matches_torch_autocast(llama_step):
    results = run(llama_step, LENGTHS)
    assert_close(results, 1 + len(llama_step.param_names))
    assert len({float(out[0]) for out, _ in results}) == len(LENGTHS)


def test_llama_autocast_step_with_the_blade_relax_pipeline(llama_step):
    results = run(llama_step, LENGTHS[1:2], pipeline=blade_relax.get_pipeline("llvm"))
    assert_close(results, 1 + len(llama_step.param_names))


def test_gpt2_autocast_step_matches_torch_autocast():
    # GPT-2's Conv1D is an addmm, and gelu_new cubes a bfloat16 value.
    graph = import_training_step(gpt2_model(TINY), max_seq_len=MAX_LEN, autocast="bfloat16")
    assert {str(f.dtype) for f in graph.main.ty.ret.fields} == {"float32"}
    assert_close(run(graph, LENGTHS[::2]), 1 + len(graph.param_names))


def test_autocast_refuses_a_bad_dtype_and_a_model_that_is_not_float32():
    model = llama_model(TINY)
    with pytest.raises(ValueError, match="autocast must be None or one of"):
        import_training_step(model, max_seq_len=MAX_LEN, autocast="int8")
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="needs float32 parameters.*bfloat16"):
        import_training_step(model, max_seq_len=MAX_LEN, autocast="bfloat16")


def test_bfloat16_products_and_powers_round_as_torch_does():
    class Products(torch.nn.Module):
        def forward(self, bias, a, b):
            return torch.mm(a, b), torch.addmm(bias, a, b), a**3, a**2, a.abs() ** 1.5

    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(shape, generator=generator) for shape in ((8, 512), (512, 16)))
    bias = torch.randn(16, generator=generator)
    inputs = tuple(t.to(torch.bfloat16) for t in (bias, a, b))
    expected = Products()(*inputs)
    ep = torch.export.export(Products(), inputs)
    mod = from_exported_program(ep, custom_convert_map=custom_convert_map(accumulate="float32"))
    exe = tvm.compile(mod, "llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    got = flatten_outputs(vm["main"](*(tvm.runtime.tensor(torch_to_numpy(t)) for t in inputs)))
    assert len(got) == len(expected)
    outs = [out.numpy() for out in got]
    assert all(str(out.dtype) == "bfloat16" for out in outs)
    refs = [torch_to_numpy(ref) for ref in expected]
    # Products: sums of 512 terms in float32, then one rounding; another summation order may
    # round to the neighbouring value (at most 2**-7 relative apart).
    for out, ref in zip(outs[:2], refs[:2]):
        np.testing.assert_allclose(out.astype("float32"), ref.astype("float32"), rtol=2**-7)
    # Powers: the same roundings as torch's kernel, so the same bits.
    for out, ref in zip(outs[2:], refs[2:]):
        assert np.array_equal(out.view(np.int16), ref.view(np.int16))
    with pytest.raises(ValueError, match="accumulate"):
        custom_convert_map(accumulate="float16")
