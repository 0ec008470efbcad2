"""autopar_lab.validate.propagation: the four programs of notebook 06's question 3 (three propagated from input
annotations, the ILP's plan applied operator by operator) compile on a 2 x 4 mesh and compute the same step; the
timing helper runs them (what it measures is recorded by bench/bench_propagation.py, never asserted here)."""

import math

import jax
import numpy as np
import pytest

import autopar_lab as al
from autopar_lab.validate import PROPAGATION_NAMES, propagation_programs, time_programs

needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs JAX_NUM_CPU_DEVICES=8")


def _spec():
    return al.models.get("mlp", dtype="float32", **al.validate.SMALL_OVERRIDES["mlp"])


@needs8
def test_the_four_programs_compile_and_compute_the_same_step():
    spec = _spec()
    built = propagation_programs(spec, (2, 4))
    assert tuple(built.programs) == PROPAGATION_NAMES
    assert built.mesh.shape == {"x": 2, "y": 4} and built.logical_mesh.shape == (2, 4)
    args = spec.init(0)
    reference = jax.tree_util.tree_leaves(jax.jit(spec.step_fn)(*args))
    params_specs = {}
    for name, exe in built.programs.items():
        out = exe(*jax.device_put(tuple(args), tuple(exe.input_shardings[0])))
        leaves = jax.tree_util.tree_leaves(out)
        assert len(leaves) == len(reference), name
        for got, want in zip(leaves, reference):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4, err_msg=name)
        params_specs[name] = {s.spec for s in jax.tree_util.tree_leaves(exe.input_shardings[0][0])}
    # The annotations are what each name says: replicated weights, columns over y, FSDP over both axes.
    assert params_specs[PROPAGATION_NAMES[0]] == {jax.sharding.PartitionSpec()}
    assert jax.sharding.PartitionSpec(None, "y") in params_specs[PROPAGATION_NAMES[1]]
    assert jax.sharding.PartitionSpec(("x", "y")) in params_specs[PROPAGATION_NAMES[2]]
    # The ILP's program moves the bytes its plan predicts, within the one pattern validate's table explains.
    compiled = al.validate.total_bytes(al.validate.collectives_in_hlo(built.programs[PROPAGATION_NAMES[3]].as_text()))
    predicted = al.validate.total_bytes(al.validate.summarize_collectives(
        al.validate.predicted_collectives(built.graph, built.plan.strategies, built.logical_mesh)))
    assert 0.9 <= predicted / compiled <= 1.35

    medians = time_programs(built.programs, args, rounds=2)
    assert list(medians) == list(PROPAGATION_NAMES)
    assert all(isinstance(s, float) and math.isfinite(s) for s in medians.values())


def test_bad_meshes_and_rounds_are_refused_with_what_to_change():
    spec = _spec()
    with pytest.raises(ValueError, match="two positive sizes"):
        propagation_programs(spec, (8,))
    with pytest.raises(ValueError, match="JAX_NUM_CPU_DEVICES"):
        propagation_programs(spec, (len(jax.devices()), 2))
    with pytest.raises(ValueError, match="rounds >= 1"):
        time_programs({"a": None}, spec.init(0), rounds=0)
    with pytest.raises(ValueError, match="at least one program"):
        time_programs({}, spec.init(0))
