"""al.execute / split_stages: a plan run on the 8 local CPU devices trains exactly like the single-device step.

Every check compares against ``model.step_fn`` jitted on one device, in float32: the pipeline runs the step's own
jaxpr cut at the plan's stage boundaries, so layers from scopes, markers or clustering all run.
Programs are compiled with XLA's CPU backend optimisation off (several times faster to compile; same numbers up to
rounding), and plans share one cost table, so the file stays well under a minute.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import autopar_lab as al
from autopar_lab.graph.fusion import kernel_view
from autopar_lab.runtime.local import synthetic_batch
from autopar_lab.runtime.partition import split_stages
from reference import one_device_training, scanned

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")

FAST = {"xla_backend_optimization_level": 0}
STEPS = 3


@pytest.fixture(scope="module")
def model():
    return al.models.get("gpt-tiny", batch_size=8, num_layers=2)  # layers: embed, layer_0, layer_1, head


@pytest.fixture(scope="module")
def cluster():
    c = al.Cluster.preset("cpu", hosts=1)
    assert c.num_devices == 8
    return c


@pytest.fixture(scope="module")
def plan2(model, cluster):
    p = al.megatron_plan(model, cluster, dp=2, tp=2, pp=2, microbatches=2)
    assert [st.devices for st in p.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    return p


def _close(a, b, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=1e-7)


def test_two_stage_1f1b_trains_like_one_device(model, plan2, reference):
    runner = al.execute(plan2, model, compiler_options=FAST)
    assert runner.mode == "pipeline" and runner.staged.num_stages == 2
    assert [str(d) for d in runner.staged.mesh(1).devices.flat] == [str(d) for d in jax.devices()[4:8]]
    losses = runner.train(STEPS)
    _close(losses, reference[0])
    # the parameters after training, too (to Adam's resolution: a gradient that is rounding noise on both sides
    # still moves its weight by up to the learning rate, in either direction)
    for a, b in zip(jax.tree_util.tree_leaves(runner.params), jax.tree_util.tree_leaves(reference[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=STEPS * 2e-3)
    assert runner.params["wte"].shape == reference[1]["wte"].shape
    # stage 0 ran on its own devices, with the plan's (2, 2) mesh
    wte = runner.stage_params[0]["args[0]['wte']"]
    assert {d.id for d in wte.sharding.device_set} <= {d.id for d in jax.devices()[:4]}
    # per-stage timings: measured medians exist after the first step, next to the plan's predictions
    rows = runner.stage_times()
    assert [r["stage"] for r in rows] == [0, 1]
    assert all(r["measured_fwd_s"] > 0 and r["measured_bwd_s"] > 0 and r["predicted_fwd_s"] > 0 for r in rows)
    rep = runner.report()
    assert rep["losses"] == losses and rep["num_stages"] == 2 and rep["measured_step_s"] > 0


def test_gpipe_same_losses_and_its_order(model, cluster, plan2, reference):
    gpipe = al.megatron_plan(model, cluster, dp=2, tp=2, pp=2, microbatches=2, schedule="gpipe",
                             table=plan2.table)
    runner = al.execute(gpipe, model, compiler_options=FAST)
    _close(runner.train(STEPS), reference[0])
    # stage 0 ran every forward before any backward (GPipe), the schedule's own order
    order0 = [(kind, j) for k, kind, j in runner.last_tasks if k == 0]
    assert order0 == [("fwd", 0), ("fwd", 1), ("bwd", 0), ("bwd", 1)]


@pytest.mark.slow  # 4 stages x 4 programs to compile: ~15 s of CPU
def test_four_stages_one_layer_each(model, cluster, plan2, reference):
    plan4 = al.megatron_plan(model, cluster, dp=2, tp=1, pp=4, microbatches=4, table=plan2.table)
    runner = al.execute(plan4, model, compiler_options=FAST)
    sm = runner.staged
    assert sm.num_stages == 4
    assert [d["layers"] for d in sm.describe()] == [["embed", "embed"], ["layer_0", "layer_0"],
                                                    ["layer_1", "layer_1"], ["head", "head"]]
    # the tied embedding skips two stages: embed (stage 0) owns it, head (stage 3) reads it
    assert sm.producer("args[0]['wte']") == (0, "fwd") and "args[0]['wte']" in sm.inputs(3, "fwd")
    assert "args[0]['wte']" in sm.stage_state_paths(0) and "args[0]['wte']" not in sm.stage_state_paths(3)
    # the forward flows forward, the backward backward
    assert all(s < k for k in range(4) for s, kd in sm.sources(k, "fwd"))
    assert all(s > k for k in range(4) for s, kd in sm.sources(k, "bwd") if kd == "bwd")
    _close(runner.train(STEPS), reference[0])
    # 1F1B on 4 stages, 4 microbatches: stage 1 warms up with 3 forwards, then alternates
    order1 = [(kind, j) for k, kind, j in runner.last_tasks if k == 1]
    assert order1[:4] == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 0)]


def _run_step(sm, state, batch, inside: bool = False):
    """One step through StagedModel's task contract by hand (GPipe order): ``(new_state, outputs)``. ``inside``: each
    task adds its part to the running sums inside its program (``run_task(acc=)``, as the runner does), else the
    sums are made with :meth:`accumulate`."""
    exports, stash, acc = {}, {}, {}
    for j, mb in enumerate(sm.split_batch(batch)):
        for kind, stages in (("fwd", range(sm.num_stages)), ("bwd", reversed(range(sm.num_stages)))):
            for k in stages:
                received = {}
                for s, kd in sm.sources(k, kind):
                    received.update(exports[(s, kd, j)])
                res = sm.run_task(k, kind, state[k], received, mb, stash.pop((k, j), None),
                                  acc=acc.get((k, kind)) if inside else None)
                exports[(k, kind, j)] = res.exports
                if kind == "fwd":
                    stash[(k, j)] = res.stash
                acc[(k, kind)] = res.acc if inside else sm.accumulate(k, acc.get((k, kind)), res.acc)
    new, outs = [], {}
    for k in range(sm.num_stages):
        st, o = sm.update(k, state[k], {**acc.get((k, "fwd"), {}), **acc.get((k, "bwd"), {})})
        new.append(st)
        outs.update(o)
    return new, outs


def test_accumulation_inside_the_task_equals_summing_after(model, cluster, plan2):
    """Gradients summed over the microbatches inside each task's program (the runner's way) give the update that
    summing each task's own part afterwards gives, on the tensor-parallel stages (sums pinned to the plan's
    shardings) and on data-parallel ones; the sums keep one layout from microbatch to microbatch."""
    dp4 = al.megatron_plan(model, cluster, dp=4, tp=1, pp=2, microbatches=2, table=plan2.table)
    for plan in (plan2, dp4):
        sm = split_stages(model, plan, compiler_options=FAST)
        state = [sm.init_state(k, 0) for k in range(sm.num_stages)]
        batch = synthetic_batch(model, 1)
        new_a, outs_a = _run_step(sm, state, batch, inside=False)
        new_b, outs_b = _run_step(sm, state, batch, inside=True)
        assert outs_a.keys() == outs_b.keys() and outs_a
        for o in outs_a:
            _close(outs_b[o], outs_a[o])
        for a, b in zip(new_a, new_b):
            assert a.keys() == b.keys()
            for name in a:
                _close(b[name], a[name], rtol=1e-4)
        # a first microbatch's sum starts from zeros laid out like the sum the task returns
        mb = sm.split_batch(batch)[0]
        received = sm.run_task(0, "fwd", state[0], {}, mb).exports  # the last (second) stage reads stage 0's
        first = sm.run_task(1, "fwd", state[1], received, mb)
        kept = {n: (np.asarray(v, np.float64), v.sharding) for n, v in first.acc.items()}  # the sums are donated
        again = sm.run_task(1, "fwd", state[1], received, mb, acc=first.acc)
        assert first.acc and all(again.acc[n].sharding == kept[n][1] for n in kept)
        for n in first.acc:
            if jnp.issubdtype(first.acc[n].dtype, jnp.inexact):
                _close(again.acc[n], 2 * kept[n][0])


def test_tied_weight_gradient_sums_both_uses(model, plan2):
    """The gradient of wte (used by embed on stage 0 and by head on stage 1) is the sum of both uses: Adam's first
    moment after one step is (1 - b1) x the full batch's gradient, equal to the single-device step's."""
    sm = split_stages(model, plan2, compiler_options=FAST)
    assert "args[0]['wte']" in sm.exports(0, "fwd") and "args[0]['wte']" in sm.inputs(1, "fwd")
    assert "['wte']" in sm.stage_param_keys(0) and "['wte']" not in sm.stage_param_keys(1)
    params, opt_state, batch = model.init(0)
    state = [sm.init_state(k, 0) for k in range(2)]
    # init_state holds the same numbers as model.init
    np.testing.assert_array_equal(np.asarray(state[0]["args[0]['wte']"]), np.asarray(params["wte"]))
    new, outs = _run_step(sm, state, batch)
    ref = jax.jit(model.step_fn, compiler_options=FAST)(params, opt_state, batch)
    _close(outs[sm.loss_output], ref[2])
    merged = sm.merge_state(new)
    mu = [x for p, x in jax.tree_util.tree_flatten_with_path(merged[1])[0] if "mu" in jax.tree_util.keystr(p)
          and "wte" in jax.tree_util.keystr(p)]
    mu_ref = [x for p, x in jax.tree_util.tree_flatten_with_path(ref[1])[0] if "mu" in jax.tree_util.keystr(p)
              and "wte" in jax.tree_util.keystr(p)]
    assert len(mu) == len(mu_ref) == 1
    # float32 sums taken in the plan's order (its shardings) differ from one device's by a few ulps of the largest
    # terms: an entry near zero after cancellation (7.5e-6 where entries reach 1.7e-2) moves by 2e-9
    scale = float(np.abs(np.asarray(mu_ref[0])).max())
    np.testing.assert_allclose(np.asarray(mu[0]), np.asarray(mu_ref[0]), rtol=1e-4, atol=1e-6 * scale)
    assert float(jnp.max(jnp.abs(mu_ref[0]))) > 0


def test_stage_programs_run_the_plans_shardings(model, plan2):
    """Every value a stage program makes is laid out as the plan's strategy for its operator says (the plan priced
    those collectives), not as XLA would propagate from the stage's inputs: a Megatron plan stores the batch and the
    qkv weights replicated and slices them at their first use (free in the plan); left to propagate from the inputs,
    XLA kept the batch whole on every data-parallel device and split the hidden axis instead (bench_execute's
    dp2 tp2 pp2 plan: 2.4-4.2x the plan's collectives a microbatch, the compute repeated on both data-parallel rows)."""
    sm = split_stages(model, plan2, compiler_options=FAST)
    g = plan2.graph
    pinned = sm.op_shardings(0)
    assert len(pinned) > 100  # the stage's forward, backward and update operators
    mb = sm.split_batch(model.init(0)[2])[0]
    res = sm.run_task(0, "fwd", sm.init_state(0, 0), {}, mb)
    checked = split = 0
    for name, v in {**res.exports, **res.acc, **{f"%{t}": x for t, x in res.stash.items()}}.items():
        if not name.startswith("%"):
            continue  # a step input passed on (the tied embedding): stored as the plan stores it
        t = int(name[1:])
        op = g.tensor(t).producer
        want = pinned[op][0][g.op(op).outputs.index(t)]
        assert want is not None and v.sharding.is_equivalent_to(want, v.ndim), (name, v.sharding, want)
        checked += 1
        split += not v.sharding.is_fully_replicated
    assert checked > 10 and split > 0


def test_values_cross_stages_in_their_own_layout(model, plan2):
    """A value sent to a stage whose mesh has the sender's shape arrives in the sender's layout, on the receiver's
    devices (moving it to another devices *and* another layout would make jax.device_put wait for the value, and the
    driver with it); the receiving program, pinned to the plan, lays it out as the plan says. From the host (a Ray
    stage worker's numpy array) it takes the stage's own sharding."""
    sm = split_stages(model, plan2, compiler_options=FAST)
    mb = sm.split_batch(model.init(0)[2])[0]
    res = sm.run_task(0, "fwd", sm.init_state(0, 0), {}, mb)
    stage1 = {d.id for d in sm.mesh(1).devices.flat}
    names = [n for n in sm.inputs(1, "fwd") if n in res.exports]
    act = next(n for n in names if n.startswith("%"))
    # as the plan sends them (this plan's are replicated), and the activation split over the batch, as a plan may
    split = jax.device_put(res.exports[act], NamedSharding(sm.mesh(0), PartitionSpec("x")))
    for name, x in [(n, res.exports[n]) for n in names] + [(act, split)]:
        got = sm.receive(1, name, x)
        assert {d.id for d in got.sharding.device_set} == stage1
        assert got.sharding.spec == x.sharding.spec
        np.testing.assert_array_equal(np.asarray(got), np.asarray(x))
        host = sm.receive(1, name, np.asarray(x))
        assert host.sharding == sm.value_sharding(1, name)
    # and the stage runs on what it received that way
    out = sm.run_task(1, "fwd", sm.init_state(1, 0), res.exports, mb)
    assert np.isfinite(float(out.acc[next(iter(out.acc))]))


def test_remat_stage_recomputes_its_forward_in_the_backward(model, plan2):
    """A stage the plan rematerialises keeps nothing for its backward (the backward task runs the forward operators
    it needs again) and trains to the same numbers as one that keeps its activations."""
    sm = split_stages(model, plan2, compiler_options=FAST)
    remat = dataclasses.replace(plan2, stages=tuple(dataclasses.replace(st, remat=True) for st in plan2.stages))
    sm_r = split_stages(model, remat, compiler_options=FAST)
    roles = kernel_view(plan2.graph).roles
    for k in range(2):
        fwd_ops = set(sm_r.task_ops(k, "fwd"))
        # without remat the backward redoes only the work a fused step recomputes in its kernels (elementwise,
        # broadcasts): nothing a kernel writes (matmuls, reductions)
        cheap = fwd_ops & set(sm.task_ops(k, "bwd"))
        assert all(roles[i].kind in ("inline", "free") for i in cheap)
        assert len(fwd_ops & set(sm_r.task_ops(k, "bwd"))) > len(cheap) + 10  # the forward again, in the backward
    params, opt_state, batch = model.init(0)
    mb = sm_r.split_batch(batch)[0]
    res = sm_r.run_task(0, "fwd", sm_r.init_state(0, 0), {}, mb)
    assert res.stash == {} and sm.run_task(0, "fwd", sm.init_state(0, 0), {}, mb).stash
    a = _run_step(sm, [sm.init_state(k, 0) for k in range(2)], batch)
    b = _run_step(sm_r, [sm_r.init_state(k, 0) for k in range(2)], batch)
    _close(a[1][sm.loss_output], b[1][sm_r.loss_output])
    for k in range(2):
        for name, x in a[0][k].items():  # moments to rounding; weights to Adam's resolution (a noise gradient
            y = np.asarray(b[0][k][name])  # moves its weight by up to the learning rate either way)
            tol = 1e-4 * float(np.max(np.abs(y))) + 1e-9 if "mu" in name or "nu" in name else 2e-3
            np.testing.assert_allclose(np.asarray(x), y, atol=tol)


def test_plan_needing_more_devices_is_refused(model, plan2):
    with pytest.raises(ValueError, match=r"needs 8 devices .* only 4 are available"):
        al.execute(plan2, model, devices=jax.devices()[:4])


def test_plan_for_another_model_is_refused(plan2):
    other = al.models.get("gpt-tiny", batch_size=8, num_layers=2, hidden_size=64)
    with pytest.raises(ValueError, match="made for another model.*args\\[0\\]"):
        al.execute(plan2, other)
    deeper = al.models.get("gpt-tiny", batch_size=8, num_layers=3)
    with pytest.raises(ValueError, match="another model"):
        split_stages(deeper, plan2)


def test_bad_stage_index_and_batch(model, plan2):
    sm = split_stages(model, plan2, compiler_options=FAST)
    with pytest.raises(ValueError, match="stages 0..1"):
        sm.sources(2, "fwd")
    batch = model.init(0)[2]
    with pytest.raises(ValueError, match="traced for the plan's 2 microbatches, not 3"):
        sm.split_batch(batch, 3)
    with pytest.raises(ValueError, match="has 4 samples but the model .* take 8"):
        sm.split_batch(jax.tree_util.tree_map(lambda x: x[:4], batch))
    halves = sm.split_batch(batch)
    np.testing.assert_array_equal(np.concatenate([h[0] for h in halves]),
                                  np.asarray(jax.tree_util.tree_leaves(batch)[0]))


def _mlp_spec(marked: bool):
    """A model outside the zoo: 3 tanh layers, the last one reusing the first weight (tied), loss outside any layer.
    Layers come from named scopes, or (marked=True) from al.pipeline_boundary markers."""
    from autopar_lab.models.base import make_spec

    def init_params(key):
        return {"w": [0.5 * jax.random.normal(k, (16, 16)) for k in jax.random.split(key, 3)]}

    def make_batch(key):
        return {"x": jax.random.normal(key, (8, 16))}

    def layer(i, h, w, mask):
        h = jnp.tanh(h @ w)
        if i == 0:
            mask = (h > 0).astype(jnp.int32)  # an integer value the last layer reads: crosses the cut, no gradient
        if i == 2:
            h = h * (1 + 0.1 * mask)
        return h, mask

    def loss_fn(params, batch):
        h, mask = batch["x"], None
        for i, w in enumerate(params["w"]):
            w = w + params["w"][0] if i == 2 else w
            if marked:
                h, mask = layer(i, h, w, mask)
                h = al.pipeline_boundary(h) if i < 2 else h
            else:
                with jax.named_scope(f"dense_{i}"):
                    h, mask = layer(i, h, w, mask)
        return jnp.mean(h ** 2)

    return make_spec("mlp3-marked" if marked else "mlp3", "custom", None, init_params, make_batch, loss_fn)


@pytest.mark.parametrize("marked", [False, True], ids=["scopes", "markers"])
def test_any_model_with_scopes_or_markers(cluster, marked):
    spec = _mlp_spec(marked)
    graph = spec.trace()
    if marked:
        graph = al.relayer(graph, boundaries="markers")
    plan = al.megatron_plan(graph, cluster, dp=4, tp=1, pp=2, microbatches=2)
    assert len(plan.layer_names) == 3 and [st.layers for st in plan.stages] == [(0, 1), (2, 2)]
    # the pipeline runs the step's own optimizer: a ModelSpec need not say which it is
    bare = dataclasses.replace(spec, optimizer=None)
    runner = al.execute(plan, bare, compiler_options=FAST)
    sm = runner.staged
    if marked:
        assert sm.stage_param_keys(0) == ("['w'][0]", "['w'][1]") and sm.stage_param_keys(1) == ("['w'][2]",)
        assert "args[0]['w'][0]" in sm.inputs(1, "fwd")  # the tied weight crosses the cut
    else:  # `w[2] + w[0]` sits outside every scope; the graph puts it in dense_0 (its first input's layer)
        assert sm.stage_param_keys(0) == ("['w'][0]", "['w'][1]", "['w'][2]") and sm.stage_param_keys(1) == ()
    ints = [n for n in sm.inputs(1, "fwd") if "int" in sm.value_dtype(n)]
    assert len(ints) == 1 and sm.producer(ints[0]) == (0, "fwd")
    losses = runner.train(2)
    ref, _ = one_device_training(spec, 2, compiler_options=FAST)
    _close(losses, ref)


def _clipped_spec():
    """A model of one's own whose optimizer clips by global norm: every stage's update needs every gradient."""
    import optax

    opt = optax.chain(optax.clip_by_global_norm(1e-2), optax.adam(1e-2))  # the clip binds: the norm is larger

    def loss(ws, batch):
        h = batch[0]
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean((h - batch[1]) ** 2)

    def step(ws, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(ws, batch)
        updates, opt_state = opt.update(grads, opt_state, ws)
        return optax.apply_updates(ws, updates), opt_state, value

    def init(seed):
        keys = jax.random.split(jax.random.key(seed), 6)
        ws = [0.5 * jax.random.normal(k, (16, 16)) for k in keys[:4]]
        return ws, opt.init(ws), (jax.random.normal(keys[4], (8, 16)), jax.random.normal(keys[5], (8, 16)))

    return al.ModelSpec.from_step(step, init, batch_argnums=(2,), name="clipped-mlp")


def test_global_norm_clipping_runs_locally_and_in_stage_workers(cluster):
    """Clipping by global norm looks at every gradient at once: each stage's update reads the other stage's
    gradients. The local runner and the stage workers (Ray's contract, run here without Ray) both equal the
    single-device step."""
    from autopar_lab.runtime.actors import StageWorker
    from autopar_lab.runtime.train_entry import _Routes, _submit_step, job_spec, step_loss

    spec = _clipped_spec()
    graph = spec.trace()
    assert graph.layer_rule == "indexed-params" and len(graph.layers) == 4
    plan = al.megatron_plan(graph, cluster, dp=4, tp=1, pp=2, microbatches=2)
    runner = al.execute(plan, spec, compiler_options=FAST)
    assert runner.staged.update_crosses_stages  # the clip reads across the cut
    losses = runner.train(STEPS)
    ref, ref_params = one_device_training(spec, STEPS, compiler_options=FAST)
    _close(losses, ref)
    for a, b in zip(jax.tree_util.tree_leaves(runner.params), jax.tree_util.tree_leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    class Now:  # a worker behind Ray's call syntax, run at once
        def __init__(self, w):
            self.w = w

        def __getattr__(self, name):
            return type("M", (), {"remote": staticmethod(getattr(self.w, name))})

    job = job_spec(plan, spec, STEPS, options=al.RunOptions(compiler_options=FAST))
    assert job["model_spec"] is spec and len(job["op_layers"]) == len(graph)
    workers = [StageWorker(job, k) for k in range(2)]
    routes = _Routes([w.info() for w in workers])
    assert any(routes.update_from)
    got = [step_loss(_submit_step([Now(w) for w in workers], routes, i, 2, 2, plan.schedule)) for i in range(STEPS)]
    np.testing.assert_allclose(got, losses, rtol=1e-6)


@pytest.mark.slow  # a 24-layer model: two stages of ~6,000 operators each to compile
def test_deep_model_two_stages_trains_like_one_device(cluster, capfd):
    deep = al.models.get("gpt-tiny", batch_size=8, num_layers=24)
    plan = al.megatron_plan(deep, cluster, dp=2, tp=2, pp=2, microbatches=2)
    assert [st.layers for st in plan.stages] == [(0, 12), (13, 25)]
    losses = al.execute(plan, deep, compiler_options=FAST).train(2)
    # No stage program reshards its input through full replication (XLA's SPMD partitioner logs "Involuntary full
    # rematerialization" when a boundary's layout is not what the stage's first operator takes: issue 35).
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    ref, _ = one_device_training(scanned(deep), 2, compiler_options=FAST)  # the same model, compiled once a layer
    _close(losses, ref)
