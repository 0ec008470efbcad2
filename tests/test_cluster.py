"""The cluster model: presets, validation, submeshes and their tiling, logical meshes, collective costs, calibration.

Run with JAX_NUM_CPU_DEVICES=8 JAX_PLATFORMS=cpu (the Makefile sets both).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from autopar_lab import cluster as cluster_mod
from autopar_lab.cluster import PRESETS, Cluster, Device, Link, LogicalMesh, send_recv

P3_NVLINK = Link(130e9, 3e-6)  # the figures the p3.16xlarge preset documents (achievable bus bandwidth)
P3_NET = Link(0.9 * 25e9 / 8, 50e-6)


def toy(hosts=2, m=4, **kw):
    args = dict(
        hosts=hosts,
        devices_per_host=m,
        device=Device("toy", {"float32": 1e12}, 2**30, 1e11),
        intra_host=Link(1e11, 1e-6),
        inter_host=Link(1e10, 1e-5),
    )
    args.update(kw)
    return Cluster(**args)


# ---------------------------------------------------------------------------------------------------------
# Collective costs, computed by hand


def test_all_reduce_1gb_over_nvlink_axis_on_p3_is_alpa_formula():
    c = Cluster.preset("p3.16xlarge")
    assert c.intra_host == P3_NVLINK
    mesh = c.logical_mesh((1, 8), (1, 8))
    assert mesh.axis_link(1) == P3_NVLINK
    # Alpa's formula, 2 (n-1)/n B at the bus bandwidth, with a tree's latency: log2(8) levels up and down
    assert mesh.all_reduce(1e9, 1) == 2 * 3 * 3e-6 + 2 * (7 / 8) * 1e9 / 130e9


A100_NVSWITCH = 0.78 * 300e9


@pytest.mark.parametrize(
    "method, factor",
    [("all_gather", 7 / 8), ("reduce_scatter", 7 / 8), ("all_reduce", 2 * 7 / 8), ("all_to_all", 7 / 64)],
)
def test_each_collective_formula_on_an_8_device_axis(method, factor):
    mesh = Cluster.preset("dgx-a100").logical_mesh((1, 8))
    got = getattr(mesh, method)(3e8, 1)
    # rings of 7 steps of 2 us (all-gather, reduce-scatter); a tree of log2(8) = 3 levels up and down (all-reduce);
    # an all-to-all: 7 messages, one per peer (NCCL's grouped send/recv)
    latency = {"all_reduce": 6 * 2e-6}.get(method, 7 * 2e-6)
    assert got == pytest.approx(latency + factor * 3e8 / A100_NVSWITCH, rel=1e-12)
    # both axes flattened: the same 8 devices in one group
    assert getattr(mesh, method)(3e8, (0, 1)) == got


def test_collectives_across_hosts_wait_for_the_network_and_one_all_reduce_beats_two_halves():
    c = Cluster.preset("dgx-a100", hosts=4)
    mesh = c.logical_mesh((4, 8), (1, 32))  # one group over 4 hosts x 8 devices
    bw, a_in, a_out = mesh.axis_link(1).bandwidth, 2e-6, 7e-6
    assert mesh.axis_hosts(1) == 4 and bw == c.inter_host.bandwidth
    # the tree: log2(8) levels in a host and log2(4) across, up and down (against the ring's 2 x (28 steps on NVLink
    # + 3 on InfiniBand)); a ring crosses hosts 3 times, its other 28 steps stay on NVLink (NCCL's tuning model)
    assert mesh.all_reduce(1e3, 1) == 2 * (3 * a_in + 2 * a_out) + 2 * (31 / 32) * 1e3 / bw
    assert mesh.all_gather(1e9, 1) == 28 * a_in + 3 * a_out + (31 / 32) * 1e9 / bw
    # an all-to-all: one message per peer, 7 in the host and 24 beyond it; each device sends B / 32^2 to each peer,
    # so 24 B / 1024 through its host's NICs, which the host's 8 devices share (8 x 24 / 1024 B at the host's
    # bandwidth), while 7 B / 1024 go over its NVLink at the same time: the NICs are the slower path
    for nbytes in (1e3, 1e9):
        beyond, inside = 8 * 24 / 1024 * nbytes / bw, 7 / 1024 * nbytes / c.intra_host.bandwidth
        assert beyond > inside
        assert mesh.all_to_all(nbytes, 1) == pytest.approx(7 * a_in + 24 * a_out + beyond, rel=1e-12)
    for nbytes in (1e3, 1e6, 1e9):
        assert mesh.all_reduce(nbytes, 1) < mesh.reduce_scatter(nbytes, 1) + mesh.all_gather(nbytes, 1)
    # a pair of devices: one ring step, or one tree level each way, cost the same
    pair = c.logical_mesh((1, 2))
    assert pair.all_reduce(1e6, 1) == 2 * a_in + 1e6 / c.intra_host.bandwidth


def test_an_all_to_all_across_hosts_shares_each_hosts_nics_among_its_devices_and_groups():
    """LogicalMesh.all_to_all by hand: n devices of which g share a host, B the full buffer. Each device sends
    (n-g) B/n^2 beyond its host and (g-1) B/n^2 inside it; the host's NICs carry its g devices' share for every
    group crossing from it at once, NVLink the rest concurrently (NCCL's grouped send/recv): the slower path."""
    c = Cluster.preset("dgx-a100", hosts=4)
    mesh = c.logical_mesh((4, 8), (8, 4))  # axis 0: columns of 8 devices 4 apart, 2 on each of the 4 hosts
    n, g, groups_per_host = 8, 2, 4  # each host holds 2 devices of each of the 4 columns
    assert mesh.axis_hosts(0) == 4 and mesh.axis_link(0).bandwidth == c.inter_host.bandwidth / groups_per_host
    B = 1e9
    beyond = groups_per_host * g * (n - g) / n**2 * B / c.inter_host.bandwidth
    inside = (g - 1) / n**2 * B / c.intra_host.bandwidth
    latency = (g - 1) * c.intra_host.latency + (n - g) * c.inter_host.latency
    assert mesh.all_to_all(B, 0) == pytest.approx(latency + max(beyond, inside), rel=1e-12)
    # the network's bytes are g (n-g) / (n-1) = 12/7 times what charging each device's own (n-1)/n^2 B at the
    # group's share of the NICs gave before
    assert (mesh.all_to_all(B, 0) - latency) / ((n - 1) / n**2 * B / mesh.axis_link(0).bandwidth) == \
        pytest.approx(g * (n - g) / (n - 1), rel=1e-12)
    # inside one host nothing changes: (n-1)/n^2 B over NVLink
    one = c.logical_mesh((1, 8), (1, 8))
    assert one.all_to_all(B, 1) == pytest.approx(7 * c.intra_host.latency + 7 / 64 * B / c.intra_host.bandwidth,
                                                 rel=1e-12)


@pytest.mark.parametrize("method", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"])
def test_single_device_axis_costs_exactly_zero(method):
    c = Cluster.preset("p3.16xlarge", hosts=2)
    assert getattr(c.logical_mesh((1, 8), (1, 8)), method)(1e9, 0) == 0.0
    assert getattr(c.logical_mesh((2, 8), (16, 1)), method)(1e9, 1) == 0.0
    assert getattr(c.logical_mesh((1, 1)), method)(1e9, (0, 1)) == 0.0


def test_axis_link_divides_host_nic_among_groups_crossing_it():
    c = Cluster.preset("p3.16xlarge", hosts=2)
    mesh = c.logical_mesh((2, 8), (2, 8))
    # axis 0: 8 pairs (d, d+8), each crossing hosts, all 8 through each host's 25 Gb/s NIC
    net = c.inter_host.bandwidth
    assert mesh.axis_link(0) == Link(net / 8, 50e-6)
    assert mesh.axis_link(1) == c.intra_host
    assert mesh.axis_link((0, 1)) == c.inter_host  # one group: it has the NIC to itself
    # a pair across 2 hosts: the tree's one level each way (= the ring's 2 steps)
    assert mesh.all_reduce(1e9, 0) == 2 * 50e-6 + 2 * (1 / 2) * 1e9 / (net / 8)
    square = c.logical_mesh((2, 8), (4, 4))
    assert square.axis_link(1) == c.intra_host
    assert square.axis_link(0) == Link(net / 4, 50e-6)  # 4 column groups share each host
    assert c.logical_mesh((2, 8), (1, 16)).axis_link(1) == c.inter_host
    assert c.logical_mesh((2, 8), (16, 1)).axis_link(0) == c.inter_host


def test_axis_link_with_three_hosts_and_offsets():
    c = toy(hosts=3, m=4)
    mesh = c.logical_mesh((3, 4), (3, 4))
    assert mesh.axis_link(0) == Link(1e10 / 4, 1e-5)
    assert mesh.axis_size(0) == 3 and mesh.axis_size(1) == 4 and mesh.axis_size((0, 1)) == 12
    # a one-host submesh placed on the last host stays on the intra-host link
    last = c.logical_mesh((1, 4), (2, 2), first_device=8)
    assert last.devices.tolist() == [[8, 9], [10, 11]]
    assert last.axis_link(0) == last.axis_link(1) == c.intra_host


def test_devices_are_host_major_and_axis_1_is_consecutive():
    mesh = Cluster.preset("p3.16xlarge", hosts=2).logical_mesh((2, 8), (4, 4))
    assert mesh.devices.shape == (4, 4)
    assert mesh.devices.tolist()[1] == [4, 5, 6, 7]
    assert mesh.num_devices == 16


def test_send_recv_and_p2p_link():
    c = Cluster.preset("p3.16xlarge", hosts=2)
    assert c.p2p_link([0, 1, 2, 3], [4, 5, 6, 7]) == c.intra_host
    assert c.p2p_link(range(8), range(8, 16)) == c.inter_host
    assert send_recv(1e9, c.inter_host) == 50e-6 + 1e9 / (0.9 * 25e9 / 8)
    assert c.send_recv(1e9, [0], [1]) == 3e-6 + 1e9 / 130e9
    assert send_recv(0, c.inter_host) == 0.0
    with pytest.raises(ValueError, match="outside this cluster"):
        c.p2p_link([0], [16])


# ---------------------------------------------------------------------------------------------------------
# Submeshes, logical meshes, tiling


def test_submesh_shapes_match_alpa():
    assert Cluster.preset("p3.16xlarge", hosts=2).submesh_shapes() == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]
    assert Cluster.preset("dgx-h100", hosts=4).submesh_shapes() == [
        (1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8), (4, 8)
    ]
    assert toy(hosts=1, m=1).submesh_shapes() == [(1, 1)]


def test_logical_mesh_shapes_documented_rule():
    c = Cluster.preset("p3.16xlarge", hosts=4)
    assert c.logical_mesh_shapes((1, 8)) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert c.logical_mesh_shapes((1, 2)) == [(1, 2), (2, 1)]
    assert c.logical_mesh_shapes((4, 8)) == [(1, 32), (2, 16), (4, 8), (8, 4), (16, 2), (32, 1)]
    # 3 hosts of 8: (8, 3) and (4, 6) would put groups across host boundaries, so they are not offered
    assert c.logical_mesh_shapes((3, 8)) == [(1, 24), (3, 8), (6, 4), (12, 2), (24, 1)]
    for sub in c.submesh_shapes():
        for shape in c.logical_mesh_shapes(sub):
            mesh = c.logical_mesh(sub, shape)
            hosts = mesh.devices // 8
            for row in hosts:  # axis-1 groups: inside one host, or whole hosts
                assert len(set(row)) == 1 or len(row) == 8 * len(set(row))


def test_logical_mesh_validation():
    c = toy(hosts=3, m=4)
    with pytest.raises(ValueError, match=r"not one of this cluster's submesh shapes; use one of \[\(1, 1\)"):
        c.logical_mesh((1, 3), (1, 3))
    with pytest.raises(ValueError, match="not one of"):
        c.logical_mesh((2, 2), (2, 2))
    with pytest.raises(ValueError, match="multiplying to the submesh's 12 devices; use one of"):
        c.logical_mesh((3, 4), (2, 4))
    with pytest.raises(ValueError, match="split hosts unevenly"):
        c.logical_mesh((3, 4), (4, 3))
    with pytest.raises(ValueError, match="first_device 2 cannot start a"):
        c.logical_mesh((1, 4), first_device=2)
    with pytest.raises(ValueError, match="mesh axis must be 0, 1 or"):
        c.logical_mesh((1, 4)).axis_size(2)
    with pytest.raises(ValueError, match="multiplying to"):
        LogicalMesh(c, (1, 4), (4, 4))


def test_place_sorts_sub_host_pieces_so_none_straddles_a_host():
    c = toy(hosts=2, m=4)
    pieces = [(1, 1), (1, 4), (1, 2), (1, 1)]
    # Naive left-to-right placement would put the (1, 4) piece on devices 1..4, across two hosts.
    placed = c.place(pieces)
    assert placed == [(6,), (0, 1, 2, 3), (4, 5), (7,)]
    with pytest.raises(ValueError, match="need 10 devices but the cluster has 8"):
        c.place([(2, 4), (1, 2)])


@st.composite
def cluster_and_pieces(draw):
    hosts = draw(st.integers(1, 6))
    m = 2 ** draw(st.integers(0, 4))
    c = toy(hosts=hosts, m=m)
    shapes = c.submesh_shapes()
    left, pieces = c.num_devices, []
    fill = draw(st.booleans())  # use every device (Alpa's DP) or leave some idle
    while left > 0:
        fitting = [s for s in shapes if s[0] * s[1] <= left]
        pieces.append(draw(st.sampled_from(fitting)))
        left -= pieces[-1][0] * pieces[-1][1]
        if not fill and draw(st.booleans()):
            break
    return c, draw(st.permutations(pieces))


@settings(max_examples=300, deadline=None)
@given(cluster_and_pieces())
def test_any_multiset_of_submesh_shapes_up_to_the_cluster_size_tiles_it(case):
    """Alpa's claim, for any multiset in any order: Cluster.place finds disjoint, host-respecting positions."""
    c, pieces = case
    placed = c.place(pieces)
    used = [d for devs in placed for d in devs]
    assert len(used) == len(set(used)) == sum(n * m for n, m in pieces)
    assert all(0 <= d < c.num_devices for d in used)
    M = c.devices_per_host
    for (n, m), devs in zip(pieces, placed):
        assert list(devs) == list(range(devs[0], devs[0] + n * m))  # contiguous
        if n == 1:
            assert devs[0] // M == devs[-1] // M  # a sub-host piece never crosses a host
        else:
            assert devs[0] % M == 0  # multi-host pieces take whole hosts
        # and every placed piece is a valid logical-mesh start
        assert c.logical_mesh((n, m), first_device=devs[0]).devices.ravel().tolist() == list(devs)


# ---------------------------------------------------------------------------------------------------------
# Presets, parsing, JSON


@pytest.mark.parametrize("name", ["p3.16xlarge", "dgx-a100", "dgx-h100"])
def test_gpu_presets_have_8_devices_and_sane_figures(name):
    c = Cluster.preset(name, hosts=2)
    assert (c.hosts, c.devices_per_host, c.num_devices, c.name) == (2, 8, 16, name)
    d = c.device
    assert d.peak("float16") > d.peak("float32") > 1e12
    assert d.memory_bytes >= 16 * 2**30 and d.memory_bandwidth >= 900e9
    assert c.intra_host.bandwidth > c.inter_host.bandwidth / 8  # NVLink beats one GPU's share of the network
    assert c.intra_host.latency < c.inter_host.latency


def test_preset_figures_from_datasheets():
    p3 = Cluster.preset("p3.16xlarge")
    assert (p3.device.peak("float32"), p3.device.peak("float16")) == (15.7e12, 125e12)
    assert (p3.device.memory_bytes, p3.device.memory_bandwidth) == (16 * 2**30, 900e9)
    assert (p3.intra_host, p3.inter_host) == (P3_NVLINK, P3_NET)
    a100 = Cluster.preset("dgx-a100")
    # links: achievable bus bandwidth, 94% of 8 x 200 Gb/s HDR InfiniBand per host
    assert a100.device.peak("bfloat16") == 312e12 and a100.inter_host.bandwidth == pytest.approx(0.94 * 200e9)
    h100 = Cluster.preset("dgx-h100")
    assert h100.device.peak("bfloat16") == 989.4e12 and h100.inter_host.bandwidth == pytest.approx(0.94 * 400e9)
    # achievable rates: the measured maximum achievable matmul FLOP/s (267.9 of 312 and 792.1 of 989 TFLOP/s)
    assert a100.device.efficiency.matmul * 312 == pytest.approx(267.9)
    assert h100.device.efficiency.matmul * 989 == pytest.approx(792.1)
    assert a100.device.efficiency.flash_attention and not p3.device.efficiency.flash_attention  # no FA on V100
    assert a100.device.vector_rate("float16") == 78e12 and a100.device.vector_rate("float32") == 19.5e12


def test_device_peak_accepts_dtypes_and_names_and_falls_back_to_float32():
    import jax.numpy as jnp

    d = Cluster.preset("dgx-a100").device
    assert d.peak(jnp.bfloat16) == d.peak("bfloat16") == 312e12
    assert d.peak(np.float16) == d.peak(np.dtype("float16")) == d.peak(jnp.dtype("float16")) == 312e12
    assert d.peak(np.float32) == 19.5e12
    assert d.peak("int8") == d.peak(np.int32) == 19.5e12  # unknown -> float32's figure
    assert d.peak() == 19.5e12


def test_parse_specs():
    assert Cluster.parse("p3.16xlarge:2") == Cluster.preset("p3.16xlarge", hosts=2)
    assert Cluster.parse("dgx-a100").hosts == 1
    assert Cluster.parse(" DGX-H100:3 ").num_devices == 24


@pytest.mark.parametrize("spec", ["tpu-v4:2", "p3.16xlarge:0", "p3.16xlarge:two", "dgx-a100:-1", "", ":3", "cpu:"])
def test_bad_spec_names_presets_and_form(spec):
    with pytest.raises(ValueError) as e:
        Cluster.parse(spec)
    msg = str(e.value)
    assert "PRESET:HOSTS" in msg and all(p in msg for p in PRESETS)


def test_preset_errors():
    with pytest.raises(ValueError, match="unknown cluster preset 'v100'; use PRESET:HOSTS"):
        Cluster.preset("v100")
    with pytest.raises(ValueError, match="hosts must be a positive whole number, got 0"):
        Cluster.preset("dgx-a100", hosts=0)


def test_cpu_preset_reads_profile_and_counts_jax_devices():
    import jax

    profile = json.loads(cluster_mod.CPU_PROFILE_PATH.read_text())
    c = Cluster.parse("cpu")
    n = len(jax.devices("cpu"))
    assert (c.name, c.hosts, c.devices_per_host) == ("cpu", 1, n)
    assert c.device.peak("float32") == profile["device"]["peak_flops"]["float32"]
    assert c.device.memory_bytes == pytest.approx(profile["total_memory_bytes"] / n)
    assert c.intra_host == Link(**profile["intra_host"])
    assert profile["measured_on"] and "python -m autopar_lab.calibrate" in profile["command"]
    assert Cluster.parse("cpu:2").num_devices == 2 * n
    assert c.inter_host.bandwidth <= c.intra_host.bandwidth  # the assumed network never beats the measured link


def test_cluster_module_does_not_import_jax():
    import subprocess
    import sys

    # Load the file alone: the package __init__ may import jax for other reasons, cluster.py must not.
    code = (
        "import sys, importlib.util as u; s = u.spec_from_file_location('cl', sys.argv[1]); c = u.module_from_spec(s); "
        "sys.modules['cl'] = c; s.loader.exec_module(c); c.Cluster.preset('dgx-h100', 2).to_json(); "
        "print('jax' in sys.modules)"
    )
    path = cluster_mod.__file__
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cpu_preset_with_odd_device_count_says_what_to_set(monkeypatch):
    monkeypatch.setattr(cluster_mod.cpuprofile, "_local_cpu_device_count", lambda: 6)
    with pytest.raises(ValueError, match="found 6 JAX CPU devices.*set JAX_NUM_CPU_DEVICES=8"):
        Cluster.preset("cpu")
    monkeypatch.setattr(cluster_mod.cpuprofile, "_local_cpu_device_count", lambda: 4)
    profile = json.loads(cluster_mod.CPU_PROFILE_PATH.read_text())
    assert Cluster.preset("cpu").device.memory_bytes == pytest.approx(profile["total_memory_bytes"] / 4)


@pytest.mark.parametrize("name", ["p3.16xlarge", "dgx-a100", "dgx-h100"])
def test_json_round_trip(name, tmp_path):
    c = Cluster.preset(name, hosts=3).with_(memory_bytes=12e9, inter_host_latency=1e-4, name="what-if")
    assert Cluster.from_json(c.to_json()) == c
    assert Cluster.from_json(json.loads(c.to_json())) == c
    assert Cluster.from_json(c.to_dict()) == c
    path = tmp_path / "c.json"
    c.to_json(path)
    assert Cluster.from_json(path) == c == Cluster.parse(str(path))
    assert hash(Cluster.from_json(path)) == hash(c)


def test_from_json_errors_say_what_to_add_or_fix(tmp_path):
    good = Cluster.preset("p3.16xlarge").to_dict()
    missing = dict(good)
    del missing["inter_host"]
    with pytest.raises(ValueError, match="missing 'inter_host'; add it"):
        Cluster.from_json(missing)
    no_mem = json.loads(json.dumps(good))
    del no_mem["device"]["memory_bytes"]
    with pytest.raises(ValueError, match="missing 'device.memory_bytes'"):
        Cluster.from_json(no_mem)
    bad_link = json.loads(json.dumps(good))
    bad_link["inter_host"]["bandwidth"] = 0
    with pytest.raises(ValueError, match="inter_host bandwidth must be a positive"):
        Cluster.from_json(bad_link)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        Cluster.parse(str(bad))
    with pytest.raises(ValueError, match="cannot read cluster file"):
        Cluster.parse(str(tmp_path / "absent.json"))


def test_with_and_scaled_inter_host():
    c = Cluster.preset("p3.16xlarge", hosts=2)
    slow = c.scaled_inter_host(4)
    assert slow.inter_host == Link(P3_NET.bandwidth / 4, 50e-6)
    assert slow.intra_host == c.intra_host and c.inter_host == P3_NET  # the original is untouched
    assert slow.logical_mesh((2, 8), (2, 8)).axis_link(0).bandwidth == P3_NET.bandwidth / 4 / 8
    bigger = c.with_(hosts=4, intra_host=Link(1e11, 1e-6), peak_flops={"float32": 1e13})
    assert (bigger.num_devices, bigger.intra_host.bandwidth, bigger.device.peak("float16")) == (32, 1e11, 1e13)
    with pytest.raises(ValueError, match="unknown change 'bandwith'; use one of"):
        c.with_(bandwith=1)
    with pytest.raises(ValueError, match="factor must be a positive"):
        c.scaled_inter_host(0)
    with pytest.raises(ValueError, match="must be a power of two"):
        c.with_(devices_per_host=6)


# ---------------------------------------------------------------------------------------------------------
# Every invalid cluster gets one sentence that says what to change


@pytest.mark.parametrize(
    "changes, pattern",
    [
        (dict(hosts=0), r"hosts must be a positive whole number, got 0; set it to 1 or more"),
        (dict(hosts=-2), r"hosts must be a positive whole number, got -2"),
        (dict(hosts=1.5), r"hosts must be a positive whole number, got 1.5"),
        (dict(devices_per_host=0), r"devices_per_host must be a positive whole number, got 0"),
        (
            dict(devices_per_host=6),
            r"devices_per_host must be a power of two .* got 6, because Alpa's submesh shapes \(1,1\), \(1,2\), "
            r"\(1,4\) \.\.\. \(1,M\) can only tile a host .*; use 4 \(or 8\) devices per host",
        ),
        (dict(devices_per_host=12), r"use 8 \(or 16\) devices per host"),
    ],
)
def test_invalid_cluster_shape_errors(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        toy(**changes)


@pytest.mark.parametrize(
    "build, pattern",
    [
        (lambda: Link(0, 1e-6), r"link bandwidth must be a positive finite number in bytes/s, got 0; set it above zero"),
        (lambda: Link(-1e9, 1e-6), r"link bandwidth must be a positive"),
        (lambda: Link(float("inf"), 0), r"link bandwidth must be a positive finite"),
        (lambda: Link(1e9, -1e-6), r"link latency must be a finite number of seconds >= 0, got -1e-06; set it to 0"),
        (lambda: Device("d", {"float32": 1e12}, 0, 1e11), r"memory_bytes must be a positive .* got 0; set it above zero"),
        (lambda: Device("d", {"float32": 1e12}, 2**30, -5), r"memory_bandwidth must be a positive"),
        (lambda: Device("d", {"float32": 0.0}, 2**30, 1e11), r"peak_flops\['float32'\] must be a positive"),
        (lambda: Device("d", {"float16": 1e12}, 2**30, 1e11), r"must .* includes 'float32'.*; add a 'float32' entry"),
        (lambda: toy(device="V100"), r"device must be a Device, got str; build one with Device"),
        (lambda: toy(inter_host=(1e9, 0)), r"inter_host must be a Link, got tuple; use Link\(bandwidth, latency\)"),
    ],
)
def test_invalid_device_and_link_errors(build, pattern):
    with pytest.raises(ValueError, match=pattern):
        build()


def test_clusters_are_frozen_and_hashable():
    c = Cluster.preset("dgx-a100")
    with pytest.raises(Exception):
        c.hosts = 3
    with pytest.raises(TypeError):
        c.device.peak_flops["float32"] = 1.0
    assert {c, Cluster.preset("dgx-a100")} == {c}
    assert hash(c.logical_mesh((1, 8), (2, 4))) == hash(c.logical_mesh((1, 8), (2, 4)))


# ---------------------------------------------------------------------------------------------------------
# Real jax meshes and calibration


def test_to_jax_mesh_on_local_cpu_devices():
    import jax

    devs = jax.devices()
    if len(devs) < 8:
        pytest.skip("needs JAX_NUM_CPU_DEVICES=8")
    c = Cluster.preset("p3.16xlarge")
    mesh = c.logical_mesh((1, 8), (2, 4)).to_jax_mesh(devs[:8])
    assert mesh.axis_names == ("x", "y") and dict(mesh.shape) == {"x": 2, "y": 4}
    assert [d.id for d in mesh.devices[1]] == [devs[i].id for i in (4, 5, 6, 7)]
    if hasattr(jax.sharding, "AxisType"):
        assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    # a (1, 4) submesh placed at device 4, picked out of the whole list
    part = c.logical_mesh((1, 4), (2, 2), first_device=4).to_jax_mesh(devs[:8])
    assert [d.id for d in part.devices.ravel()] == [devs[i].id for i in (4, 5, 6, 7)]
    with pytest.raises(ValueError, match="pass exactly 4 devices"):
        c.logical_mesh((1, 4), (2, 2), first_device=4).to_jax_mesh(devs[:3])


def test_fit_alpha_beta_recovers_a_line_and_stays_usable_on_noise():
    from autopar_lab.calibrate import fit_alpha_beta

    x = np.array([1e3, 1e5, 1e7])
    alpha, beta = fit_alpha_beta(x, 2e-5 + x / 4e9)
    assert alpha == pytest.approx(2e-5) and 1 / beta == pytest.approx(4e9)
    a, b = fit_alpha_beta(x, [3e-3, 2e-3, 1e-3])  # noise that slopes the wrong way
    assert a >= 0 and b > 0
    t = np.array([1e-9, 5e-5, 1e-3])  # the free fit has a negative intercept: clamped to zero,
    a, b = fit_alpha_beta(x, t)  # and beta becomes a weighted mean of the measured seconds per byte
    assert a == 0 and min(t / x) <= b <= max(t / x)


@pytest.mark.slow
def test_measure_cpu_quick_gives_positive_finite_figures_that_build_a_cluster():
    from autopar_lab.calibrate import measure_cpu

    p = measure_cpu(quick=True)
    figures = [
        p["device"]["peak_flops"]["float32"],
        p["device"]["memory_bandwidth"],
        p["device"]["memory_bytes"],
        p["intra_host"]["bandwidth"],
        p["total_memory_bytes"],
    ]
    assert all(math.isfinite(f) and f > 0 for f in figures)
    assert math.isfinite(p["intra_host"]["latency"]) and p["intra_host"]["latency"] >= 0
    assert p["num_devices"] >= 1 and p["measured_on"]
    if p["num_devices"] > 1:
        sizes = [m for m in p["measurements"]["collectives"] if m["kind"] == "all_reduce"]
        assert len(sizes) >= 3 and all(m["seconds"] > 0 for m in sizes)
    c = Cluster.from_json({**p, "hosts": 1, "devices_per_host": p["num_devices"]})
    assert c.device.peak("float32") == p["device"]["peak_flops"]["float32"]


def test_axis_link_counts_the_groups_sharing_a_host_as_by_its_definition():
    """The vectorised count of crossing groups per host against sets, on every view of every submesh of clusters
    of 1-12 hosts of 1-8 devices, and with the mesh placed off device 0."""

    def by_sets(mesh, axis):
        hosts = mesh._groups(axis) // mesh.cluster.devices_per_host
        if (hosts == hosts[:, :1]).all():
            return mesh.cluster.intra_host
        crossing = [set(row.tolist()) for row in hosts if len(set(row.tolist())) > 1]
        sharing = max(sum(h in g for g in crossing) for h in set().union(*crossing))
        link = mesh.cluster.inter_host
        return link if sharing == 1 else Link(link.bandwidth / sharing, link.latency)

    seen = set()
    for hosts in (1, 2, 3, 5, 12):
        for per_host in (1, 2, 4, 8):
            c = Cluster.preset("p3.16xlarge", hosts=hosts).with_(devices_per_host=per_host)
            for sub in c.submesh_shapes():
                for shape in c.logical_mesh_shapes(sub):
                    for first in {0, per_host * (hosts - sub[0]) if sub[0] > 1 else 0}:
                        mesh = c.logical_mesh(sub, shape, first_device=first)
                        for axis in (0, 1, (0, 1)):
                            got = mesh.axis_link(axis)
                            assert got == by_sets(mesh, axis), (hosts, per_host, sub, shape, first, axis)
                            seen.add(got.bandwidth)
    assert len(seen) > 4  # shared NICs: several bandwidths, not only the two links


def test_a_fully_connected_board_gives_a_group_only_the_links_between_its_devices():
    # an HGX 4-GPU board: each GPU's NVLink split evenly over its 3 peers, no switch
    board = toy(hosts=1, m=4, mesh_peers=3)
    bw = board.intra_host.bandwidth
    assert board.logical_mesh((1, 4), (1, 4)).axis_link(1) == board.intra_host  # all 4: every link
    pairs = board.logical_mesh((1, 4), (2, 2))
    assert pairs.axis_link(0).bandwidth == pairs.axis_link(1).bandwidth == pytest.approx(bw / 3)
    assert pairs.all_gather(1e9, 1) > toy(hosts=1, m=4).logical_mesh((1, 4), (2, 2)).all_gather(1e9, 1)
    assert board.p2p_link([0], [1]).bandwidth == pytest.approx(bw / 3)
    # two GPUs of the board, planned as a cluster of their own, still talk over a third of the links
    half = toy(hosts=1, m=2, mesh_peers=3)
    assert half.logical_mesh((1, 2), (1, 2)).axis_link(1).bandwidth == pytest.approx(bw / 3)
    # a switched fabric (the default) is unchanged, and the field survives the JSON form
    assert toy(hosts=1, m=4).scale_up_link(2) == toy(hosts=1, m=4).intra_host
    assert Cluster.from_json(board.to_json()) == board and "mesh_peers" not in toy().to_dict()


@pytest.mark.parametrize("peers", [1, -1, 2.5])
def test_mesh_peers_must_connect_every_device_of_the_host(peers):
    with pytest.raises(ValueError, match="mesh_peers"):
        toy(hosts=1, m=4, mesh_peers=peers)
