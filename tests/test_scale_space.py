"""The "scale" planning space (issue 36): what it keeps at 16,384 GPUs, that it stays off below its size, that the
published layouts of a power-of-two cluster lie in it, and a plan made in it end to end."""

from __future__ import annotations

import pytest

import autopar_lab as al
from autopar_lab.pricing import distinct_mesh_shapes, mesh_signature, planning_submeshes, scale_space
from autopar_lab.pricing.space import SCALE_SPACE_MIN_HOSTS


def meshes(cluster, batch, space):
    return [(sub, shape) for sub in planning_submeshes(cluster, batch, space)
            for shape in distinct_mesh_shapes(cluster, sub, space)]


def test_llama3_on_2048_dgx_h100_hosts_plans_on_47_meshes_counted_by_hand():
    """2,048 hosts of 8: submeshes of whole hosts, (1, 8) and (2^k, 8) for k = 1..11. Views: (1, 8) three ((1, 8),
    (2, 4), (4, 2)); each (n, 8) four: the one-axis view and axis 1 of 2, 4 or 8 devices (inside the host);
    3 + 11 x 4 = 47 (106 in the divisors space)."""
    c = al.Cluster.parse("dgx-h100:2048")
    assert scale_space(c, "auto")
    subs = planning_submeshes(c, 2048, "auto")
    assert subs == [(1, 8)] + [(2 ** k, 8) for k in range(1, 12)]
    assert len(meshes(c, 2048, "auto")) == 47
    assert len(meshes(c, 2048, "divisors")) == 106
    for sub, (a, b) in meshes(c, 2048, "auto"):
        assert a == 1 or b == 1 or b <= c.devices_per_domain


def test_deepseek_on_256_h800_hosts_keeps_power_of_two_submeshes_only():
    """15,360 sequences split over 3, 5, 6, 10 ... hosts too (the divisors space keeps 30 submeshes); the scale
    space keeps 1, 2, 4 ... 256 hosts: 9, and 3 + 8 x 4 = 35 meshes."""
    c = al.Cluster.parse("h800:256")
    assert len(planning_submeshes(c, 15360, "divisors")) == 30
    assert planning_submeshes(c, 15360, "auto") == [(1, 8)] + [(2 ** k, 8) for k in range(1, 9)]
    assert len(meshes(c, 15360, "auto")) == 35


@pytest.mark.parametrize("spec", ["dgx-a100:128", "dgx-a100:384", "dgx-a100:315", "p3.16xlarge:8"])
def test_auto_is_the_divisors_space_below_its_size_or_off_a_power_of_two(spec):
    """The clusters of the golden plans and of the 1T (384 hosts) and 530B (315 hosts) rows plan as before."""
    c = al.Cluster.parse(spec)
    assert not scale_space(c, "auto")
    if c.hosts > 4:
        assert meshes(c, 1536, "auto") == meshes(c, 1536, "divisors")
    assert scale_space(al.Cluster.parse(f"dgx-a100:{SCALE_SPACE_MIN_HOSTS}"), "auto")
    assert scale_space(c, "scale")


@pytest.mark.parametrize("spec", ["dgx-h100:2048", "h800:256", "dgx-h100:256"])
def test_every_megatron_layout_of_the_cluster_is_in_the_scale_space(spec):
    """Each stage of pp equal stages (pp a power of two dividing the hosts) viewed as (dp, tp), tp inside the
    host: the space holds a view with the same ILP (mesh_signature), so the auto plan can be that layout."""
    c = al.Cluster.parse(spec)
    space = {(sub, mesh_signature(c.logical_mesh(sub, shape))) for sub, shape in meshes(c, 15360 * 8, "auto")}
    pp = 1
    while pp <= c.hosts:
        sub = (c.hosts // pp, c.devices_per_host)
        for tp in (1, 2, 4, 8):
            shape = (sub[0] * sub[1] // tp, tp)
            assert (sub, mesh_signature(c.logical_mesh(sub, shape))) in space, (sub, shape)
        pp *= 2


@pytest.mark.slow
def test_a_model_planned_on_256_hosts_plans_in_the_scale_space_end_to_end():
    """gpt-tiny on 256 DGX A100 hosts: the table solves only the scale space's meshes and the plan's stages lie
    in it."""
    c = al.Cluster.parse("dgx-a100:256")
    model = al.models.get("gpt-tiny", batch_size=2048)
    table = al.CostTable.build(model, c, workers=1)
    plan = al.auto_plan(model, c, table=table, microbatches=256)
    keys = set(meshes(c, 2048, "auto"))
    assert set(table.planned_meshes()) == keys
    for st in plan.stages:
        assert (tuple(st.submesh), tuple(st.logical_mesh)) in keys
    assert sum(st.submesh[0] * st.submesh[1] for st in plan.stages) <= c.num_devices


@pytest.mark.parametrize("spec", ["dgx-h100:16", "gb200-nvl72:36", "p3.16xlarge:6", "tpu-v5p:128"])
def test_hosts_and_domains_an_axis_spans_equal_counting_each_group(spec):
    """axis_hosts / axis_domains (counted on sorted rows, for all groups at once) against a set per group."""
    import numpy as np

    c = al.Cluster.parse(spec)
    for sub in c.submesh_shapes()[-4:]:
        for shape in c.logical_mesh_shapes(sub):
            m = c.logical_mesh(sub, shape)
            d = np.asarray(m.devices)
            for axis, groups in ((0, d.T), (1, d), ((0, 1), d.reshape(1, -1))):
                for unit, got in ((c.devices_per_host, m.axis_hosts(axis)), (c.devices_per_domain,
                                                                              m.axis_domains(axis))):
                    assert got == max(len(set((row // unit).tolist())) for row in groups), (sub, shape, axis)
