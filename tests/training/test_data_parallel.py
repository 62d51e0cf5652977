"""Data-parallel training with sharded optimizer state: the step's IR, its kernel, the batch
split, and two ranks on gloo against one process."""

from __future__ import annotations

import functools
import multiprocessing
import os
import socket

import numpy as np
import pytest
import tvm
from tvm import relax

from blade_relax.bench.workloads import ModelSizes, llama_model
from blade_relax.contract import GATHER_PARAMETER, REDUCE_GRADIENT, owned_rows, shard_rows
from blade_relax.frontend.hf import import_training_step
from blade_relax.training import AdamW, Trainer, ZeroSharding, build_training_step
from blade_relax.training.data_parallel import (
    DataParallelTrainer,
    rank_threads,
    rank_weights,
    threads_per_rank,
)

SIZES = ModelSizes(
    layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=64, max_seq_len=32
)
LENGTHS = (9, 16, 5, 12, 16)


@functools.cache
def _graph():
    """The step's graph, imported once per process (the tests and ranks only read it)."""
    return import_training_step(llama_model(SIZES, seed=0), max_seq_len=32, max_batch_size=4)


def _adamw() -> AdamW:
    return AdamW(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05)


def _batches() -> list[dict[str, np.ndarray]]:
    """Three rows a batch (the ranks get 2 and 1), labels -100 on parts of two rows: the
    ranks' shares of the loss differ from their shares of the rows."""
    rng = np.random.default_rng(0)
    out = []
    for s in LENGTHS:
        ids = rng.integers(0, SIZES.vocab, size=(3, s)).astype("int64")
        labels = ids.copy()
        labels[0, :4] = -100
        labels[2, 2:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


# ------------------------------------------------------------------------------ sharding
def test_blocks_of_rows():
    assert shard_rows(5, 2) == 3 and owned_rows(5, 2, 0) == (0, 3) and owned_rows(5, 2, 1) == (3, 5)
    assert owned_rows(1, 2, 1) == (1, 1)  # an empty block
    with pytest.raises(ValueError, match="outside a world"):
        owned_rows(4, 2, 2)
    sharding = ZeroSharding(2)
    for shape in [(5, 3), (4,), ()]:
        array = np.arange(int(np.prod(shape)), dtype="float32").reshape(shape) + 1
        blocks = [sharding.shard(array, r) for r in range(2)]
        assert all(b.shape == sharding.state_shape(shape) for b in blocks)
        np.testing.assert_array_equal(sharding.unshard(blocks, shape), array)
    assert ZeroSharding(2).state_shape((5, 3)) == (3, 3)
    with pytest.raises(ValueError, match="at least 1"):
        ZeroSharding(0)


def test_rank_weights_count_the_targets():
    labels = np.array([[1, 2, 3, 4], [1, -100, -100, -100], [5, 6, 7, -100]])
    ids = np.zeros_like(labels)
    # Targets after the shift: rows 0 and 1 hold 3 + 0, row 2 holds 2.
    assert rank_weights(["input_ids", "labels"], [ids, labels], 2) == [3 / 5, 2 / 5]
    assert rank_weights(["x"], [np.zeros((3, 4))], 2) == [2 / 3, 1 / 3]
    with pytest.raises(ValueError, match="cannot be shared"):
        rank_weights(["x"], [np.zeros((1, 4))], 2)
    with pytest.raises(ValueError, match="leading axis"):
        rank_weights(["x", "y"], [np.zeros((2, 4)), np.zeros((3, 4))], 2)


# ------------------------------------------------------------------------------ the IR
def test_sharded_step_reduces_updates_and_gathers_each_parameter():
    graph = _graph()
    step = build_training_step(graph, _adamw(), ZeroSharding(2))
    main = step.mod["main"]
    assert [p.name for p in main.params[-3:]] == ["optimizer_scalars", "grad_weight", "shard_rank"]
    trainable = graph.params[: graph.num_trainable]
    states = main.params[len(main.params) - 3 - 2 * len(trainable) : -3]
    for k, param in enumerate(trainable):
        for state in states[2 * k : 2 * k + 2]:
            assert [int(d) for d in state.ty.shape.values] == list(
                ZeroSharding(2).state_shape(np.asarray(param).shape)
            )
    calls = []
    for block in main.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and value.op.name == "relax.call_inplace_packed":
                calls.append(value.args[0].global_symbol)
            elif isinstance(value, relax.Call) and value.op.name == "relax.call_tir_inplace":
                calls.append("update")
    # Per parameter, in this order: reduce-scatter, update, all-gather.
    assert calls == [REDUCE_GRADIENT, "update", GATHER_PARAMETER] * len(trainable)


def test_sharded_step_adds_no_bytes_to_the_step():
    """The collectives write in place and the state blocks are inputs: the step's own bytes
    (above what it holds across steps) are the single-process step's at every shape."""
    import dataclasses

    from blade_relax.analysis import memory_timeline
    from blade_relax.bench.workloads import SMALL
    from blade_relax.pipeline import PipelineFlags, lower_to_memory_stage
    from blade_relax.transform import version_for

    flags = PipelineFlags()
    keywords = {f.name: getattr(flags, f.name) for f in dataclasses.fields(flags)}
    keywords["check_dims"] = False
    # The bench's small sizes: long enough for the schedule to search (a scalar input that
    # were taken for a dim would change its choices there).
    model = llama_model(SMALL, seed=0)
    graph = import_training_step(
        model, max_seq_len=SMALL.max_seq_len, min_seq_len=SMALL.min_seq_len, max_batch_size=3
    )
    lowered = [
        lower_to_memory_stage(build_training_step(graph, _adamw(), sharding).mod, **keywords)
        for sharding in (None, ZeroSharding(2))
    ]
    for dims in ({"b": 1, "s": 5}, {"b": 2, "s": 256}, {"b": 1, "s": 100}):
        peaks = [
            memory_timeline(mod[version_for(mod, "main", dims)], mod=mod).evaluate(dims).peak
            for mod in lowered
        ]
        assert peaks[0] == peaks[1]


def _update(kernel, arrays):
    func = kernel.with_attr("global_symbol", "update")
    ex = tvm.compile(tvm.IRModule({"update": func}), "llvm")
    tensors = [tvm.runtime.tensor(a) for a in arrays]
    ex["update"](*tensors)
    return [t.numpy() for t in tensors]


@pytest.mark.parametrize("shape", [(5, 3), (4,)])
def test_sharded_kernel_updates_the_rows_a_rank_owns(shape):
    opt = _adamw()
    rng = np.random.default_rng(1)
    p, g, m, v = (rng.standard_normal(shape).astype("float32") for _ in range(4))
    v = np.abs(v)
    h = opt.scalars(3)
    ty = relax.TensorType(shape, "float32")
    whole = _update(opt.kernel(ty), [p.copy(), g, m.copy(), v.copy(), h])
    sharding, got = ZeroSharding(2), p.copy()
    for rank in range(2):
        out = _update(
            opt.kernel(ty, sharded=True),
            [got, g, sharding.shard(m, rank), sharding.shard(v, rank), h, np.array([rank])],
        )
        got = out[0]
        start, stop = owned_rows(shape[0], 2, rank)
        np.testing.assert_array_equal(out[2][: stop - start], whole[2][start:stop])
    np.testing.assert_array_equal(got, whole[0])


# ------------------------------------------------------------------------------ two ranks
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world: int, port: int, queue) -> None:
    """One rank: trains with updates at the step's end, then again with ``updates="auto"``
    (one process for both: the export, the imports and the process group are paid once)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        graph = _graph()
        queue.put((rank, {u: _train_rank(graph, rank, world, u) for u in ("end", "auto")}))
    finally:
        dist.destroy_process_group()


def _train_rank(graph, rank: int, world: int, updates: str) -> tuple:
    trainer = DataParallelTrainer(graph, _adamw(), updates=updates)
    # Rank 1's one row counts no target: every rank refuses the batch, none waits in a
    # collective, and nothing changes (the training below still matches one process).
    empty_rank = _batches()[0]
    empty_rank["labels"][2] = -100
    try:
        trainer.step(empty_rank)
        refused = ""
    except ValueError as err:
        refused = str(err)
    history = trainer.fit(_batches(), progress=False)
    if updates == "auto":
        predicted = [trainer.predicted_batch_peak(batch) for batch in _batches()]
    else:
        start, stop = owned_rows(3, world, rank)
        predicted = [trainer.predicted_peak({"b": stop - start, "s": s}) for s in LENGTHS]
    return (
        rank,
        history.losses,
        history.peaks,
        predicted,
        trainer.parameters(),
        trainer.full_state(),
        [record.updates for record in history.records],
        refused,
    )


def _run_two_ranks() -> dict[str, list[tuple]]:
    """Per ``updates`` mode, each rank's results in rank order."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, queue)) for r in range(2)]
    with rank_threads(2):
        for proc in procs:
            proc.start()
    by_rank = dict(queue.get(timeout=900) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    return {mode: [by_rank[r][mode] for r in sorted(by_rank)] for mode in ("end", "auto")}


@pytest.fixture(scope="module")
def two_ranks():
    runs = _run_two_ranks()
    single = Trainer(_graph(), _adamw())
    history = single.fit(_batches(), progress=False)
    return runs["end"], single, history, runs["auto"]


def test_two_ranks_train_as_one_process(two_ranks):
    results, single, history, _auto = two_ranks
    for _rank_id, losses, _peaks, _predicted, params, state, _updates, _refused in results:
        np.testing.assert_allclose(losses, history.losses, rtol=1e-6)
        # The gradients are summed in another order than in one process: equal to rounding.
        for got, want in zip([*params, *state], [*single.parameters(), *single.state()]):
            assert got.shape == want.shape
            assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


def test_each_rank_peaks_as_predicted_and_below_one_process(two_ranks):
    results, _single, history, _auto = two_ranks
    for _rank_id, _losses, peaks, predicted, _params, _state, _updates, _refused in results:
        assert peaks == predicted
        assert all(ours < one for ours, one in zip(peaks, history.peaks))


def test_every_rank_refuses_a_batch_whose_rows_leave_one_rank_no_target(two_ranks):
    results, _single, _history, auto = two_ranks
    messages = {result[-1] for result in [*results, *auto]}
    assert len(messages) == 1
    (message,) = messages
    assert message.startswith("rank 1's rows 2:3 of the batch count no target"), message


def test_ranks_with_auto_updates_run_one_program_per_step(two_ranks):
    """``updates="auto"`` with rows split 2 / 1: every rank runs the placement chosen for rank
    0's rows (their collectives must match), peaks as predicted, and trains as one process."""
    _end, _single, history, results = two_ranks
    (
        (_, losses0, peaks0, predicted0, *_rest0, updates0, _),
        (_, _, peaks1, predicted1, *_, updates1, _),
    ) = results
    assert updates0 == updates1 and set(updates0) <= {"end", "early"}
    assert peaks0 == predicted0 and peaks1 == predicted1
    np.testing.assert_allclose(losses0, history.losses, rtol=1e-6)


def test_rank_threads_shares_the_cores_unless_the_caller_chose(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    assert [threads_per_rank(n) for n in (1, 2, 3, 16, 32)] == [16, 8, 5, 1, 1]
    with rank_threads(2) as threads:
        assert threads == 8 and os.environ["OMP_NUM_THREADS"] == "8"
    assert "OMP_NUM_THREADS" not in os.environ  # restored
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with rank_threads(2) as threads:
        assert threads == 3 and os.environ["OMP_NUM_THREADS"] == "3"
    assert os.environ["OMP_NUM_THREADS"] == "3"
    with pytest.raises(ValueError, match="positive"):
        threads_per_rank(0)


def test_collectives_need_a_process_group():
    from blade_relax.runtime.collectives import reduce_gradient

    with pytest.raises(RuntimeError, match="init_process_group"):
        reduce_gradient(tvm.runtime.tensor(np.zeros(4, "float32")), 1.0)


def test_rematerialization_never_reruns_a_collective():
    """The remat runtime regenerates evicted tensors by running their kernels again: no
    regeneration function may call a collective (each runs once, on every rank)."""
    import dataclasses

    from blade_relax.contract import COLLECTIVE_FUNCS, REMAT_REGEN_ATTR
    from blade_relax.pipeline import PipelineFlags, lower_to_memory_stage

    step = build_training_step(_graph(), _adamw(), ZeroSharding(2))
    flags = PipelineFlags()
    lowered = lower_to_memory_stage(
        step.mod, "llvm", **{f.name: getattr(flags, f.name) for f in dataclasses.fields(flags)}
    )
    called: dict[str, list[str]] = {}
    for gv, func in lowered.functions.items():
        if not isinstance(func, relax.Function):
            continue
        names: list[str] = []

        def visit(node, names=names):
            if isinstance(node, relax.ExternFunc):
                names.append(str(node.global_symbol))

        relax.analysis.post_order_visit(func.body, visit)
        called[gv.name_hint] = names
    regenerators = [
        gv.name_hint
        for gv, func in lowered.functions.items()
        if isinstance(func, relax.Function) and func.attrs and REMAT_REGEN_ATTR in func.attrs
    ]
    assert regenerators  # the step is rematerialized
    assert not any(set(called[name]) & COLLECTIVE_FUNCS for name in regenerators)
    assert COLLECTIVE_FUNCS <= set(called["main__remat"])
