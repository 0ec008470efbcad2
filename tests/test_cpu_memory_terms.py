"""The CPU backend's memory terms (issue 31 item 4: autopar_lab.backends.cpu, fitted to XLA's memory analysis).

- a half-precision matmul's float32 copies: priced by hand's formula (x + W + y at 4 bytes, per device) and held
  against the temporaries XLA's CPU backend allocates for the backward of the same matmul; none for float32, and none
  on a GPU;
- a pipeline stage's update program: its temporaries as XLA compiles them against the priced share of the stage's
  optimizer state;
- a deep model (24 layers, planned on its shallow copy): a stage holds its largest layer's copies, not their sum, and
  an H100 plan's memory does not move;
- a whole step run as one program (the runtime's "spmd" mode) holds no gradients at its peak: its static bytes less
  every gradient byte, counted by hand; a pipeline stage, and the same plan on GPUs, keep theirs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar_lab as al
from autopar_lab.backends import cpu
from autopar_lab.pricing.memory import PARTS, memory_breakdown, stage_memory
from autopar_lab.pricing.stage import prefix_sums, range_max
from autopar_lab.runtime.local import synthetic_batch

FAST = {"xla_backend_optimization_level": 0}
CPU = al.Cluster.preset("cpu", hosts=1)


def _backward_temp_bytes(m: int, k: int, n: int, dtype) -> int:
    """XLA's temporaries for the backward of y = x @ W (x m x k, W k x n), as the CPU backend compiles it."""
    x, w, dy = (jax.ShapeDtypeStruct(s, dtype) for s in ((m, k), (k, n), (m, n)))

    def bwd(x, w, dy):
        return jax.vjp(lambda a, b: a @ b, x, w)[1](dy)

    return int(jax.jit(bwd).lower(x, w, dy).compile().memory_analysis().temp_size_in_bytes)


@pytest.fixture(scope="module")
def fp16_head():
    """A float16 gpt whose vocabulary matmul is its largest, tensor-parallel over 8 CPU devices: per device the
    head multiplies x (batch x sequence, hidden) by its 1/8 of the vocabulary."""
    model = al.models.get("gpt-tiny", dtype="float16", batch_size=8, hidden_size=64, vocab_size=4096, num_layers=2)
    return model, al.megatron_plan(model, CPU, dp=1, tp=8, pp=1)


def test_half_precision_matmul_copies_priced_as_xla_allocates_them(fp16_head):
    model, plan = fp16_head
    head = plan.stages[0].layer_costs[-1]
    m, k, n = 8 * model.config.seq_len, 64, 4096 // 8
    # by hand: float32 copies of x and y (they grow with the batch) and of W, per device
    assert head.f32_copies_act_bytes == 4 * (m * k + m * n)
    assert head.f32_copies_weight_bytes == 4 * k * n
    priced = head.f32_copies_act_bytes + head.f32_copies_weight_bytes
    assert abs(_backward_temp_bytes(m, k, n, jnp.float16) / priced - 1) <= 0.05
    # the same matmul in float32 needs no copies, and none is priced
    assert _backward_temp_bytes(m, k, n, jnp.float32) == 0
    f32 = al.megatron_plan(al.models.get("gpt-tiny", dtype="float32", batch_size=8, hidden_size=64, vocab_size=4096,
                                         num_layers=2), CPU, dp=1, tp=8, pp=1)
    assert f32.stages[0].layer_costs[-1].f32_copies_act_bytes == 0.0
    # bfloat16 operands into a float32 result: computed without copies, and none priced
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    mixed = jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.float32)).lower(x, w).compile()
    assert mixed.memory_analysis().temp_size_in_bytes == 0


def test_the_copies_are_priced_only_on_the_cpu(fp16_head):
    model, _ = fp16_head
    gpu = al.megatron_plan(model, al.Cluster.preset("dgx-h100"), dp=1, tp=8, pp=1)
    assert all(c.f32_copies_act_bytes == c.f32_copies_weight_bytes == 0.0 for c in gpu.stages[0].layer_costs)


@pytest.mark.slow  # builds and compiles a two-stage pipeline's programs: 12-15 s on this shared machine
def test_a_pipeline_update_program_takes_the_priced_copies():
    """The update program of each stage of a dp4 x pp2 pipeline, compiled as the runner runs it: its temporaries
    are the priced share of the stage's Adam state (two float32 arrays a parameter) within 10%."""
    model = al.models.get("gpt-tiny", batch_size=16, num_layers=2)
    plan = al.megatron_plan(model, CPU, dp=4, tp=1, pp=2, microbatches=2)
    runner = al.execute(plan, model, compiler_options=FAST, timing=False)
    programs = []
    runner.staged.probe = lambda devices, fn, args: programs.append((fn, args))
    runner.step(synthetic_batch(model, 1))
    # each stage's update runs after every forward and backward
    updates = [int(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes) for fn, args in programs[-2:]]
    for k, got in enumerate(updates):
        # the stage's state on one of its devices, counted from its arrays: float32 parameters and Adam's two
        # moments of each (and a step count), replicated over the stage's 4 devices
        device = runner.staged.mesh(k).devices.flat[0]
        held = sum(s.data.nbytes for x in jax.tree_util.tree_leaves(runner._state[k]) for s in x.addressable_shards
                   if s.device == device)
        moments = 2 * held / 3
        assert abs(got / cpu.update_copies_bytes(moments) - 1) <= 0.10, (k, got, moments)
        assert abs(memory_breakdown(plan)[k]["optimizer_bytes"] / moments - 1) <= 0.03


@pytest.fixture(scope="module")
def deep_fp16():
    """gpt-tiny's blocks 24 deep in float16 (a vocabulary of 4,096 so that the head is the largest matmul)."""
    return al.models.get("gpt-tiny", dtype="float16", batch_size=8, hidden_size=64, vocab_size=4096, num_layers=24)


def test_a_deep_stage_holds_its_largest_layers_copies_not_their_sum(deep_fp16):
    plan = al.megatron_plan(deep_fp16, CPU, dp=1, tp=4, pp=2)
    assert plan.table.solve_graph is not plan.graph  # planned on its shallow copy, as a deep model is
    table, B = plan.table, plan.microbatches
    for st in plan.stages:
        a, b = st.layers
        costs = list(st.layer_costs)
        mine = costs[a:b + 1]
        copies = [c.f32_copies_act_bytes / B + c.f32_copies_weight_bytes for c in mine]
        assert len(mine) >= 12 and sum(copies) > 2 * max(copies) > 0
        bare = [dataclasses.replace(c, f32_copies_act_bytes=0.0, f32_copies_weight_bytes=0.0) for c in costs]
        without = table.stage_from_sums(prefix_sums(bare), a, b, st.submesh, st.logical_mesh, B, st.remat)
        # the copies of one matmul at a time: the stage's largest layer's, on top of what it held without them
        assert st.static_bytes - without.static_bytes == pytest.approx(max(copies), rel=1e-9)
    # the last stage's largest is the vocabulary matmul's: x, W and y of the head, per device (tp 4), at 4 bytes
    m, k, n = 8 * deep_fp16.config.seq_len, 64, 4096 // 4
    last = plan.stages[-1].layer_costs[-1]
    assert last.f32_copies_act_bytes + last.f32_copies_weight_bytes == 4 * (m * k + k * n + m * n)


def test_an_h100_plan_never_reaches_the_cpu_module(deep_fp16, fp16_head, monkeypatch):
    """GPU memory as before: pricing a plan on H100s never asks backends.cpu for its memory terms (and so gives the
    figures tests/test_golden.py holds to the bit)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a GPU plan asked the CPU module")

    monkeypatch.setattr(cpu, "update_copies_bytes", refuse)
    monkeypatch.setattr(cpu, "dot_f32_copies", refuse)
    monkeypatch.setattr(cpu, "one_program_grads_bytes", refuse)
    plan = al.megatron_plan(deep_fp16, al.Cluster.preset("dgx-h100"), dp=1, tp=4, pp=2)
    rows = memory_breakdown(plan)
    assert all(r["total_bytes"] == st.peak_mem_bytes > 0 for r, st in zip(rows, plan.stages))
    assert all(c.f32_copies_act_bytes == c.f32_copies_weight_bytes == 0.0 for c in plan.stages[0].layer_costs)
    with pytest.raises(AssertionError, match="asked the CPU module"):  # where a CPU plan does
        al.megatron_plan(fp16_head[0], CPU, dp=1, tp=8, pp=1)


def test_range_max_against_brute_force():
    """The stage DP's blocks read each range's largest layer copies at once (a sparse table): every range of a few
    depths, on a grid of some first and last layers too, against Python's max over the slice."""
    rng = np.random.default_rng(0)
    for layers in (1, 2, 3, 5, 8, 13, 33):
        per = rng.random(layers) * (rng.random(layers) > 0.3)
        sums = {"max:f32_copies_act_bytes": [0.0, *per], "max:f32_copies_weight_bytes": [0.0] * (layers + 1)}
        grids = ((np.arange(layers), np.arange(layers)), (np.arange(0, layers, 2), np.arange(layers - 1, -1, -3)))
        for rows, cols in grids:
            got = range_max(sums, rows[:, None], cols[None, :])
            assert not got["f32_copies_weight_bytes"].any()
            for (i, a), (j, b) in itertools.product(enumerate(rows), enumerate(cols)):
                want = max(per[a:b + 1]) if b >= a else 0.0
                assert got["f32_copies_act_bytes"][i, j] == want
                assert range_max(sums, int(a), int(b))["f32_copies_act_bytes"] == want


def _param_bytes(model) -> int:
    """Bytes of the model's parameters, counted from its arrays' shapes (the step's first argument)."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(model.abstract_args[0]))


def test_a_one_program_step_holds_no_gradients():
    """Data parallelism on 8 CPU devices with one microbatch runs as one program: every device holds the whole model
    (float32, replicated), and the stage's peak leaves out its gradients (all of its parameter bytes); its parts
    still add up to its peak, with no gradients among them. The same stage on H100s, and a pipeline stage on the
    CPU (its backward task returns its gradient sums), keep theirs."""
    model = al.models.get("gpt-tiny", batch_size=16, num_layers=2)
    plan = al.data_parallel_plan(model, CPU)
    st, grads = plan.stages[0], _param_bytes(model)
    assert plan.microbatches == 1 and plan.table.one_program(0, len(plan.table.layer_names) - 1, st.submesh, 1)
    held = stage_memory(st.layer_costs, st.layers, 1, st.remat)
    assert held["grads_bytes"] == grads == held["params_bytes"]  # float32, replicated: one gradient a parameter
    parts = sum(held[p] for p in PARTS[:-2])  # everything static the stage formula adds (no remat here)
    assert st.static_bytes == pytest.approx(parts - grads, rel=1e-12)
    row = memory_breakdown(plan)[0]
    assert row["grads_bytes"] == 0.0 and sum(row[p] for p in PARTS) == pytest.approx(st.peak_mem_bytes, rel=1e-12)
    gpu = al.data_parallel_plan(model, al.Cluster.preset("dgx-h100", hosts=1))
    assert memory_breakdown(gpu)[0]["grads_bytes"] == grads
    pipe = al.megatron_plan(model, CPU, dp=4, tp=1, pp=2, microbatches=2, table=plan.table)
    assert all(r["grads_bytes"] > 0 for r in memory_breakdown(pipe))
