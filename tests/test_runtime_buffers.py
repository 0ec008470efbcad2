"""What the pipeline runtime keeps on each stage's devices between steps, and what it compiles.

A stage sums its gradients over the microbatches inside its task programs (``StagedModel.run_task(acc=)``). The
running sums are donated to each task (XLA writes the new sums into their buffers) and the zeros a step's first
microbatch starts from are made for that step, so after a step a stage's devices hold its state (parameters,
optimizer state) and nothing else: a cached zeros buffer, one more copy of the stage's gradients, fails these tests.
Every program compiles in the first step and none in the second: the state the runner starts from is laid out and
spelled as the update returns it (a jit keys its programs on the sharding object, and ``P(None,)`` is not ``P()``).
Both drivers are checked: the local runner and the Ray stage workers (run here without Ray).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar_lab as al
from autopar_lab.runtime.actors import StageWorker
from autopar_lab.runtime.train_entry import job_spec

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")

FAST = {"xla_backend_optimization_level": 0}


@pytest.fixture(scope="module")
def cluster():
    return al.Cluster.preset("cpu", hosts=1)


@pytest.fixture(scope="module")
def model():
    # this file's own model object: split_stages caches per model, so its programs compile here, not in another file
    return al.models.get("gpt-tiny", batch_size=8, num_layers=2)


class _Compiles(logging.Handler):
    """The programs jax lowers and compiles (``jax.log_compiles`` logs each one as "Compiling <name> ...")."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Compiling "):
            self.seen.append(msg)


@contextmanager
def compiles():
    handler, logger = _Compiles(), logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            yield handler.seen
    finally:
        logger.removeHandler(handler)


def _new_on(before: list, devices) -> list:
    """The live arrays made since ``before`` (a list held by the caller, so no id is reused) on exactly ``devices``."""
    old, devs = {id(a) for a in before}, set(devices)
    return [a for a in jax.live_arrays() if id(a) not in old and set(a.sharding.device_set) == devs]


def _floating_bytes(arrays) -> int:
    return sum(a.nbytes for a in arrays if jnp.issubdtype(a.dtype, jnp.inexact))


def _model_state_bytes(model) -> int:
    """The floating bytes of the model's step inputs other than the batch: parameters and optimizer state (from the
    shapes: a 24-layer model's whole init compiled for this count alone took 8 CPU-s)."""
    args = model.abstract_args
    return sum(x.size * x.dtype.itemsize for i, a in enumerate(args) if i not in model.batch_argnums
               for x in jax.tree_util.tree_leaves(a) if jnp.issubdtype(x.dtype, jnp.inexact))


def _check_runner(model, plan, steps: int = 2, monkeypatch=None):
    before = jax.live_arrays()
    runner = al.execute(plan, model, compiler_options=FAST)
    sm = runner.staged
    sums_donated: list[bool] = []
    if monkeypatch is not None:  # every running sum handed to a task is consumed by it (its buffer reused)
        run_task = sm.run_task

        def watched(k, kind, *args, acc=None, **kw):
            sums = [v for v in (acc or {}).values() if jnp.issubdtype(v.dtype, jnp.inexact)]
            res = run_task(k, kind, *args, acc=acc, **kw)
            if sums:
                sums_donated.append(all(v.is_deleted() for v in sums))
            return res

        monkeypatch.setattr(sm, "run_task", watched)
    start = [{n: v.sharding for n, v in st.items()} for st in runner.stage_params]
    per_step = []
    for i in range(steps):
        with compiles() as seen:
            runner.step(al.runtime.local.synthetic_batch(model, i))
        per_step.append(list(seen))
    # step 1 compiles each task and update program (and the zeros makers) once; no later step compiles anything
    with_ops = sum(1 for k in range(sm.num_stages) for kind in sm.kinds if sm.task_ops(k, kind))
    assert len(per_step[0]) >= with_ops + sm.num_stages
    assert all(not s for s in per_step[1:]), [m[:80] for m in per_step[1]]
    # the state comes out of the update with the sharding objects it went in with (a jit keys its programs on them)
    for k, st in enumerate(runner.stage_params):
        moved = {n: (str(start[k][n].spec), str(v.sharding.spec)) for n, v in st.items() if v.sharding != start[k][n]}
        assert not moved, (k, sorted(moved.items())[:3])
    if monkeypatch is not None:
        tasks_with_sums = len(sums_donated) // (steps * (sm.microbatches - 1))
        assert tasks_with_sums >= sm.num_stages and len(sums_donated) == steps * (sm.microbatches - 1) * tasks_with_sums
        assert all(sums_donated)
    # after the step each stage's devices hold its state and nothing else
    total = 0
    for k in range(sm.num_stages):
        state = runner.stage_params[k]
        on_stage = _new_on(before, sm.mesh(k).devices.flat)
        assert {id(a) for a in on_stage} == {id(v) for v in state.values()}, \
            sorted((tuple(a.shape), a.nbytes) for a in on_stage if all(a is not v for v in state.values()))[:5]
        total += _floating_bytes(on_stage)
    assert total == _model_state_bytes(model)  # the model's parameters and Adam moments, once
    return runner.losses


@pytest.mark.parametrize("dp,tp,microbatches", [(2, 2, 4), (4, 1, 2)])
def test_local_runner_keeps_only_the_state_and_compiles_once(model, cluster, monkeypatch, dp, tp, microbatches):
    plan = al.megatron_plan(model, cluster, dp=dp, tp=tp, pp=2, microbatches=microbatches)
    _check_runner(model, plan, monkeypatch=monkeypatch)


def test_deep_model_four_stages(cluster):
    """gpt-tiny with 24 layers, planned on a shallower copy, as a pipeline of 4 stages (4 microbatches)."""
    deep = al.models.get("gpt-tiny", batch_size=8, num_layers=24)
    plan = al.megatron_plan(deep, cluster, dp=2, tp=1, pp=4, microbatches=4)
    assert plan.table is not None and plan.table.solve_graph is not plan.graph  # solved on the copy
    assert len(plan.stages) == 4
    losses = _check_runner(deep, plan, steps=2)
    assert np.all(np.isfinite(losses)) and losses[1] < losses[0]


def test_stage_workers_keep_only_the_state_and_compile_once(model, cluster):
    """The Ray driver's stage workers (here called directly, in GPipe order) hold what the local runner holds, compile
    nothing in the second step, and give the local runner's losses."""
    plan = al.megatron_plan(model, cluster, dp=4, tp=1, pp=2, microbatches=4)
    S, B, steps = 2, 4, 2
    before = jax.live_arrays()
    workers = [StageWorker(job_spec(plan, model, steps, options=al.RunOptions(compiler_options=FAST)),
                           k) for k in range(S)]
    infos = [w.info() for w in workers]
    sources = {(c, kind): [tuple(x) for x in src] for info in infos for c, kind, src in info["tasks"]}
    updates = {c: [tuple(x) for x in src] for info in infos for c, src in info["updates"]}
    losses, per_step = [], []
    for step in range(steps):
        with compiles() as seen:
            out: dict = {}
            for j in range(B):
                for kind, order in (("fwd", range(S)), ("bwd", reversed(range(S)))):
                    for c in order:
                        out[(c, kind, j)] = workers[c].run(kind, c, step, j, *[out[(s, kd, j)]
                                                                               for s, kd in sources[(c, kind)]])
            rows = [w.finish_step(step, *[out[(s, kd, j)] for s, kd in updates[c] for j in range(B)])
                    for c, w in enumerate(workers)]
        per_step.append(list(seen))
        losses.append(next(r["loss"] for r in rows if "loss" in r))
    assert per_step[0] and not per_step[1], [m[:80] for m in per_step[1]]
    # each worker takes the first devices of its process; here both processes are this one, so both stages share
    # them: together they hold the two stages' state and nothing else
    devices = {tuple(w.staged.mesh(w.stage).devices.flat) for w in workers}
    assert len(devices) == 1
    on_stage = _new_on(before, next(iter(devices)))
    assert {id(a) for a in on_stage} == {id(v) for w in workers for v in w.state.values()}
    assert _floating_bytes(on_stage) == _model_state_bytes(model)
    local = al.execute(plan, model, compiler_options=FAST).train(steps)
    np.testing.assert_allclose(losses, local, rtol=1e-6)


def test_plans_of_one_model_and_microbatch_count_share_one_captured_step(cluster, monkeypatch):
    """The split captures the step once per model and microbatch count: another stage layout of the same model cuts
    the same program (a deep model's trace took seconds for each new layout); another count captures its own."""
    import autopar_lab.runtime.partition as partition

    captured = []
    real = partition.capture_program
    monkeypatch.setattr(partition, "capture_program", lambda *a, **k: captured.append(a[1:]) or real(*a, **k))
    model = al.models.get("gpt-tiny", batch_size=8, num_layers=2)  # a fresh object: nothing captured for it yet
    tp = al.megatron_plan(model, cluster, dp=2, tp=2, pp=2, microbatches=2)
    dp = al.megatron_plan(model, cluster, dp=4, tp=1, pp=2, microbatches=2, table=tp.table)
    four = al.megatron_plan(model, cluster, dp=4, tp=1, pp=2, microbatches=4, table=tp.table)
    a, b, c = (partition.split_stages(model, p, compiler_options=FAST, cache=False) for p in (tp, dp, four))
    assert len(captured) == 2 and a._prog is b._prog and c._prog is not a._prog
    assert [st.layers for st in a.plan.stages] == [st.layers for st in b.plan.stages]
    assert a.op_shardings(0) != b.op_shardings(0)  # the same program, cut and laid out by each plan
    # each microbatch count's own shapes: the batch leaves are 4 and 2 rows
    assert {x.shape[0] for x in jax.tree_util.tree_leaves(captured[0][2])} == {4}
    assert {x.shape[0] for x in jax.tree_util.tree_leaves(captured[1][2])} == {2}


def test_an_init_that_needs_a_python_seed_is_traced_once():
    """A model whose init uses the seed as a Python int runs it eagerly; that is found out once, not by tracing the
    init up to the same error again for every stage's state and every step's batch."""
    import optax

    from autopar_lab.runtime.initpart import init_batch, init_leaves

    opt = optax.sgd(0.1)
    calls = []

    def step(w, s, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        u, s = opt.update(g, s, w)
        return optax.apply_updates(w, u), s, loss

    def init(seed):
        calls.append(seed)
        w = jax.random.normal(jax.random.key(int(seed)), (4, 2))  # int(): refuses a traced seed
        return w, opt.init(w), jnp.full((8, 4), float(int(seed)))

    spec = al.ModelSpec.from_step(step, init, batch_argnums=(2,), name="python-seed")
    start = len(calls)
    first = init_leaves(spec, 1, [0])
    assert len(calls) - start == 3  # the jitted attempt and the shape check, both refused; then the eager init
    np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(spec.init(1)[0]))
    before = len(calls)
    batch = init_batch(spec, 3)
    again = init_leaves(spec, 2, [0])
    assert len(calls) - before == 2  # the eager init alone, once each
    np.testing.assert_array_equal(np.asarray(batch), np.full((8, 4), 3.0))
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(spec.init(2)[0]))


def test_a_stage_init_computes_its_leaves_alone_with_the_inits_numbers():
    """init_leaves runs only the part of the init its leaves need, in one program, never the whole init on one device
    (a jax API change once made every call fall back to it, silently), with the init's numbers bit for bit."""
    import dataclasses

    from jax.sharding import NamedSharding, PartitionSpec

    from autopar_lab.runtime.initpart import init_leaves

    deep = al.models.get("gpt-tiny", batch_size=8, num_layers=6)
    whole = []

    def init(seed):
        if not isinstance(seed, jax.core.Tracer):
            whole.append(seed)
        return deep.init(seed)

    spec = dataclasses.replace(deep, init_fn=init)
    avals = jax.tree_util.tree_leaves(spec.abstract_args)
    mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[:4])
    index = list(range(1, len(avals), 2))  # every other leaf: some of each layer's weights, moments and the batch
    shardings = [NamedSharding(mesh, PartitionSpec(None, "y") if avals[i].ndim == 2 and avals[i].shape[1] % 2 == 0
                               else PartitionSpec()) for i in index]
    got = init_leaves(spec, 5, index, shardings)
    assert not whole  # the init never ran whole
    want = jax.tree_util.tree_leaves(deep.init(5))
    assert len(got) == len(index) > 100
    for i, x, sh in zip(index, got, shardings):
        assert x.sharding == sh
        np.testing.assert_array_equal(np.asarray(x), np.asarray(want[i]))
