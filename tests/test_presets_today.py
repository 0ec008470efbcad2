"""Today's machines as presets: H200, B200, H800, GB200 NVL72 (72 GPUs in one NVLink domain) and TPU v5e / v5p / v6e
slices on their ICI torus; every preset a data file with its sources; the torus collectives against hand-computed
cases (the scaling-book's formulas); each new preset planned end to end.

Run with JAX_NUM_CPU_DEVICES=8 JAX_PLATFORMS=cpu (the Makefile sets both).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import autopar_lab as al
from autopar_lab.cluster import PRESETS, Cluster, Device, Efficiency, Link, Torus
from autopar_lab.cluster.presets import PRESET_DIR, TPU_PRESETS
from autopar_lab.pricing import CostTable
from autopar_lab.pricing.price import stage_transfers
from autopar_lab.solve.inter import transfer_s

GB, GIB, GBIT = 1e9, 2**30, 1e9 / 8
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------
# The existing presets, now data, keep every bit


def _old_preset(name: str) -> Cluster:
    """The presets as cluster.py built them in code before they became data files (its expressions, verbatim)."""
    if name == "p3.16xlarge":
        device = Device("V100-SXM2-16GB", {"float64": 7.8e12, "float32": 15.7e12, "float16": 125e12,
                                           "bfloat16": 15.7e12}, 16 * GIB, 900 * GB,
                        vector_flops={"float64": 7.8e12, "float32": 15.7e12, "float16": 31.4e12, "bfloat16": 15.7e12},
                        efficiency=Efficiency(matmul=0.80, matmul_k=2048, cores=80, tile=128, k_overhead=64,
                                              memory=0.9, attention=0.5, flash_attention=False, kernel_launch_s=3e-6))
        links = Link(130 * GB, 3e-6), Link(0.9 * 25 * GBIT, 50e-6)
    elif name == "dgx-a100":
        device = Device("A100-SXM-80GB", {"float64": 19.5e12, "float32": 19.5e12, "tfloat32": 156e12,
                                          "float16": 312e12, "bfloat16": 312e12}, 80 * GIB, 2039 * GB,
                        vector_flops={"float64": 9.7e12, "float32": 19.5e12, "float16": 78e12, "bfloat16": 39e12},
                        efficiency=Efficiency(matmul=267.9 / 312, matmul_k=2048, cores=108, tile=128, k_overhead=64,
                                              memory=0.9, attention=0.6, flash_attention=True, kernel_launch_s=3e-6))
        links = Link(0.78 * 300 * GB, 2e-6), Link(0.94 * 8 * 200 * GBIT, 7e-6)
    else:
        device = Device("H100-SXM5-80GB", {"float64": 67e12, "float32": 67e12, "tfloat32": 494.7e12,
                                           "float16": 989.4e12, "bfloat16": 989.4e12, "float8_e4m3fn": 1978.9e12,
                                           "float8_e5m2": 1978.9e12}, 80 * GIB, 3350 * GB,
                        vector_flops={"float64": 34e12, "float32": 60e12, "float16": 120e12, "bfloat16": 120e12},
                        efficiency=Efficiency(matmul=792.1 / 989, matmul_k=2816, cores=132, tile=128, k_overhead=64,
                                              memory=0.9, attention=0.5, flash_attention=True, kernel_launch_s=3e-6))
        links = Link(0.78 * 450 * GB, 2e-6), Link(0.94 * 8 * 400 * GBIT, 7e-6)
    return Cluster(hosts=3, devices_per_host=8, device=device, intra_host=links[0], inter_host=links[1], name=name)


@pytest.mark.parametrize("name", ["p3.16xlarge", "dgx-a100", "dgx-h100"])
def test_the_presets_from_data_equal_the_ones_built_in_code(name):
    new, old = Cluster.preset(name, 3), _old_preset(name)
    assert new == old and new.to_dict() == old.to_dict() and hash(new) == hash(old)
    assert new.device.efficiency.matmul == old.device.efficiency.matmul  # to the bit: the golden plans price with it


# ---------------------------------------------------------------------------------------------------------
# The data files: every figure sourced, the datasheet numbers as the reference gives them


def _leaves(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}.{k}" if path else k)
    elif isinstance(obj, list):
        for v in obj:
            yield from _leaves(v, path)
    else:
        yield path, obj


@pytest.mark.parametrize("name", [p for p in PRESETS if p != "cpu"])
def test_every_figure_in_a_preset_file_has_its_source(name):
    data = json.loads((PRESET_DIR / f"{name}.json").read_text())
    sources = data["sources"]
    assert data["name"] == name and data["count"] in ("hosts", "chips") and data["summary"]
    figures = [(p, v) for p, v in _leaves({k: v for k, v in data.items() if k not in ("sources", "summary", "name",
                                                                                       "count")})
               if not isinstance(v, str)]
    assert len(figures) > 10
    unsourced = [p for p, _ in figures
                 if not any(p == k or p.startswith(k + ".") for k in sources)
                 and p not in ("devices_per_host", "domain_hosts", "default_count")]  # structure, in the summary
    assert unsourced == [], f"{name}: figures without a source: {unsourced}"
    stale = [k for k in sources if not any(p == k or p.startswith(k + ".") for p, _ in figures)]
    assert stale == [], f"{name}: sources for figures the file does not have: {stale}"


def test_the_preset_files_are_the_presets_and_ship_in_the_wheel():
    files = sorted(p.stem for p in PRESET_DIR.glob("*.json"))
    assert files == sorted(p for p in PRESETS if p != "cpu")
    # hatch's wheel target ships the whole package directory, data files included (as profiles/cpu.json)
    assert PRESET_DIR.parent == ROOT / "autopar_lab"
    assert 'packages = ["autopar_lab"]' in (ROOT / "pyproject.toml").read_text()


# The reference's "Devices" table (published-measurements.md, runs of 2022-2026), as it prints them: BF16 and FP8
# TFLOP/s (None: no FP8), memory GB, memory bandwidth GB/s, scale-up link per device GB/s (both directions; TPU: one
# ICI link one way).
REFERENCE = {
    "dgx-h200": (989, 1979, 141, 4800, 900),
    "dgx-b200": (2250, 4500, 180, 8000, 1800),
    "gb200-nvl72": (2500, 5000, 186, 8000, 1800),
    "h800": (989, 1979, 80, 3350, None),
    "tpu-v5e": (197, None, 16, 819, 45),
    "tpu-v5p": (459, None, 95, 2765, 90),
    "tpu-v6e": (918, None, 32, 1638, 90),
}


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_new_presets_carry_the_references_datasheet_figures(name):
    bf16, fp8, mem_gb, hbm_gbs, link_gbs = REFERENCE[name]
    c = Cluster.preset(name)
    d = c.device
    assert round(d.peak("bfloat16") / 1e12) == bf16
    for f8 in ("float8_e4m3fn", "float8_e5m2"):
        assert (f8 in d.peak_flops) == (fp8 is not None)
        if fp8 is not None:
            assert round(d.peak(f8) / 1e12) == fp8
    assert d.memory_bytes == mem_gb * GIB  # HBM in GiB, as the other presets count it
    assert d.memory_bandwidth == hbm_gbs * GB
    if name.startswith("tpu"):
        assert c.intra_host.bandwidth == link_gbs * GB  # one ICI link, one way: the datasheet figure
    elif link_gbs is not None:
        assert c.intra_host.bandwidth == 0.78 * (link_gbs / 2) * GB  # NVSwitch: 0.78 of one direction
    else:
        assert c.intra_host.bandwidth == 160 * GB  # DeepSeek-V3's NVLink figure, as the report gives it
        assert c.inter_host.bandwidth == 0.94 * 8 * 50 * GB  # IB 50 GB/s per GPU, 8 per node


def test_torchtitans_h100_is_the_sxm_part_at_its_500_w_cap():
    """grand-teton-h100 (torchtitan's benchmark machine): the SXM5 die with 96 GB HBM2e at 2.4 TB/s and a 500 W power
    limit. Its peak is between the SXM's and the NVL's, as torchtitan's note says: linear in power between NVIDIA's
    two datasheet ratings of the same 132 SMs (989.4 dense BF16 TFLOP/s at 700 W, 835.5 at the NVL's 400 W), and
    every compute rate of the dgx-h100 scales by that one clock ratio; links and achievable fractions stay the
    dgx-h100's."""
    tt, sxm = Cluster.preset("grand-teton-h100", 16), Cluster.preset("dgx-h100", 16)
    nvl_bf16, sxm_bf16 = 835.5e12, sxm.device.peak("bfloat16")
    capped = nvl_bf16 + (sxm_bf16 - nvl_bf16) * (500 - 400) / (700 - 400)
    assert tt.device.peak("bfloat16") == pytest.approx(capped, abs=0.05e12)
    assert nvl_bf16 < tt.device.peak("bfloat16") < sxm_bf16
    clock = capped / sxm_bf16
    for rates in ("peak_flops", "vector_flops"):
        ours, theirs = getattr(tt.device, rates), getattr(sxm.device, rates)
        assert ours.keys() == theirs.keys()
        assert all(ours[k] == pytest.approx(theirs[k] * clock, abs=0.05e12) for k in ours), rates
    assert (tt.device.memory_bytes, tt.device.memory_bandwidth) == (96 * GIB, 2.4e12)
    assert tt.device.efficiency == sxm.device.efficiency
    assert (tt.intra_host, tt.inter_host, tt.devices_per_host) == (sxm.intra_host, sxm.inter_host, 8)
    sources = json.loads((PRESET_DIR / "grand-teton-h100.json").read_text())["sources"]
    assert "llama3_h100_202412_torchtitan" in sources["device.peak_flops"]


def test_measured_matmul_rates_and_the_h100s_kept_one():
    mamf = {"dgx-h200": (794.5, 989), "h800": (794.5, 989), "dgx-b200": (1745, 2250), "gb200-nvl72": (1822, 2500)}
    for name, (achieved, peak) in mamf.items():
        assert Cluster.preset(name).device.efficiency.matmul == achieved / peak
    # the dgx-h100 keeps its earlier 792.1 (the golden plans are priced with it); H200 and H800 take 794.5
    assert Cluster.preset("dgx-h100").device.efficiency.matmul == 792.1 / 989
    tpu = [Cluster.preset(n).device.efficiency for n in TPU_PRESETS]
    assert all(e.matmul == 0.8 and not e.flash_attention for e in tpu)  # above MaxText's 68.7-71.5% MFU on v5p


def test_gb200_is_trays_of_four_in_one_nvlink_domain_with_400_gbit_per_gpu_beyond():
    rack = Cluster.parse("gb200-nvl72:18")
    assert (rack.hosts, rack.devices_per_host, rack.domain_hosts, rack.num_devices) == (18, 4, 18, 72)
    assert rack == Cluster.preset("gb200-nvl72")  # the default count is one rack
    assert rack.inter_host.bandwidth == 0.94 * 4 * 400 * GBIT  # a tray's 4 GPUs x 400 Gb/s
    two = Cluster.parse("gb200-nvl72:36")
    assert two.p2p_link([0], [71]) == two.intra_host and two.p2p_link([70], [72]) == two.inter_host
    assert [two.domain_of(d) for d in (0, 71, 72, 143)] == [0, 0, 1, 1]
    # every other preset: one host, one domain, as before
    assert all(Cluster.preset(n).domain_hosts == 1 for n in PRESETS if n not in ("gb200-nvl72", "cpu"))


# ---------------------------------------------------------------------------------------------------------
# Parsing, JSON, bad specs


def test_new_specs_parse():
    assert Cluster.parse("dgx-h200:4").num_devices == 32
    v5p = Cluster.parse("tpu-v5p:128")
    assert (v5p.hosts, v5p.devices_per_host, v5p.torus) == (1, 128, Torus((4, 4, 8), (True, True, True)))
    assert Cluster.parse("tpu-v5e:256").torus == Torus((16, 16), (True, True))
    assert Cluster.parse("tpu-v5e:128").torus == Torus((8, 16), (False, True))  # wraparound on the 16 only
    assert Cluster.parse("tpu-v5p:32").torus == Torus((2, 4, 4), (False, False, False))  # no cube, no optical wrap
    multi = Cluster.parse("tpu-v5p:8192")  # past the largest slice: two slices over the data-center network
    assert (multi.hosts, multi.devices_per_host, multi.inter_host.bandwidth) == (2, 4096, 4096 * 50 * GBIT)
    assert Cluster.preset("tpu-v6e", 8) == Cluster.parse("tpu-v6e")  # default: one host's chips


@pytest.mark.parametrize("name", [p for p in PRESETS if p != "cpu"])
def test_json_round_trip_of_every_preset_with_its_domain_and_torus(name, tmp_path):
    counts = {"tpu-v5e": (16, 512), "tpu-v5p": (128, 8192), "tpu-v6e": (256,), "gb200-nvl72": (18, 36)}
    for n in counts.get(name, (1, 3)):
        c = Cluster.preset(name, n)
        assert Cluster.from_json(c.to_json()) == c
        c.to_json(tmp_path / "c.json")
        assert Cluster.parse(str(tmp_path / "c.json")) == c
    assert ("torus" in c.to_dict()) == name.startswith("tpu")
    assert ("domain_hosts" in c.to_dict()) == (name == "gb200-nvl72")


@pytest.mark.parametrize("spec, says", [
    ("tpu-v5p:96", "tpu-v5p has no standard slice of 96 chips; use one of 4, 8, 16"),
    ("tpu-v5e:2", "or a multiple of 256 (slices of 256 joined by the data-center network)"),
    ("tpu-v5p:6144", "multiple of 4096"),
    ("gb200-nvl72:0", "use PRESET:HOSTS"),
    ("tpu-v6e:0", "PRESET:CHIPS"),
    ("dgx-h200:x", "use PRESET:HOSTS"),
    ("dgx-h300:2", "use PRESET:HOSTS"),
])
def test_a_bad_spec_is_one_sentence_listing_what_is_valid(spec, says):
    with pytest.raises(ValueError) as e:
        Cluster.parse(spec)
    msg = str(e.value)
    assert says in msg and msg.endswith(".") and "\n" not in msg and not re.search(r"\. [A-Z]", msg)


def test_bad_torus_and_domain_are_refused_in_one_sentence():
    c = Cluster.preset("tpu-v5e", 16)
    with pytest.raises(ValueError, match=r"a torus of 4x4, no wraparound holds 16 chips, so it needs "
                                         r"devices_per_host=16"):
        c.with_(devices_per_host=8)
    with pytest.raises(ValueError, match="a wraparound needs a ring of at least 4 chips"):
        Torus((2, 4), (True, False))
    with pytest.raises(ValueError, match="domain_hosts must be a whole number of hosts from 1"):
        Cluster.preset("dgx-h100").with_(domain_hosts=0)
    with pytest.raises(ValueError, match="chips must be a positive whole number, got 0"):
        Cluster.preset("tpu-v5p", 0)


# ---------------------------------------------------------------------------------------------------------
# The ICI torus collectives, against the scaling-book's formulas computed by hand

ALPHA = 1e-6  # one ICI hop
V5E_LINK, V5P_LINK = 45e9, 90e9  # one link, one way
B = 3e8


def test_a_full_16_ring_of_a_v5e_pod_uses_both_directions_of_its_wraparound():
    mesh = Cluster.parse("tpu-v5e:256").logical_mesh((1, 256), (16, 16))
    for axis in (0, 1):  # x and y: each a whole 16-chip dimension with its wraparound
        # bidirectional ring: 16 / 2 = 8 hops, (n-1)/n B over both directions of one link
        ag = 8 * ALPHA + (15 / 16) * B / (2 * V5E_LINK)
        assert mesh.all_gather(B, axis) == pytest.approx(ag, rel=1e-12)
        assert mesh.reduce_scatter(B, axis) == pytest.approx(ag, rel=1e-12)
        assert mesh.all_reduce(B, axis) == pytest.approx(2 * ag, rel=1e-12)
        # all-to-all: a quarter of the all-gather's bytes ("AllGather / 4 for a bidirectional ring")
        assert mesh.all_to_all(B, axis) == pytest.approx(8 * ALPHA + B / (4 * 2 * V5E_LINK), rel=1e-12)
        assert mesh.axis_link(axis) == Link(2 * V5E_LINK, ALPHA)


def test_a_4_chip_sub_ring_has_no_wraparound_and_half_the_bandwidth():
    pod = Cluster.parse("tpu-v5e:256")
    small = Cluster.parse("tpu-v5e:16")  # a 4x4 slice: no wraparound on a dimension under 16
    for mesh in (pod.logical_mesh((1, 4), (1, 4), first_device=4), small.logical_mesh((1, 16), (4, 4))):
        # a line of 4: 3 hops end to end, one direction of one link carries (n-1)/n B
        assert mesh.all_gather(B, 1) == pytest.approx(3 * ALPHA + (3 / 4) * B / V5E_LINK, rel=1e-12)
        assert mesh.all_reduce(B, 1) == pytest.approx(2 * (3 * ALPHA + (3 / 4) * B / V5E_LINK), rel=1e-12)
        assert mesh.all_to_all(B, 1) == pytest.approx(3 * ALPHA + B / (4 * V5E_LINK), rel=1e-12)
    # the same 4 chips as a whole ring would take half the bandwidth term
    ring = pod.logical_mesh((1, 256), (16, 16)).torus_axis(1)
    line = pod.logical_mesh((1, 4), (1, 4)).torus_axis(1)
    assert ring.bandwidth == 2 * line.bandwidth


def test_the_scaling_books_worked_all_gather_on_a_v5e_slice():
    """Part 3, pop quiz 2: AllGather_Y([E_Y, F]) with E = 2048, F = 8192 in bf16 on a v5e mesh {X: 8, Y: 4}: no
    wraparound on an axis under 16, so 3 hops of an 8.4 MB shard at 4.5e10 bytes/s one way: about 560 us."""
    mesh = Cluster.parse("tpu-v5e:32").logical_mesh((1, 32), (8, 4))  # a 4x8 slice; axis 1: the x line of 4
    total = 2048 * 8192 * 2
    assert mesh.all_gather(total, 1) == pytest.approx(560e-6, rel=0.01)
    assert mesh.all_gather(total, 1) == pytest.approx(3 * ALPHA + 3 * (total / 4) / V5E_LINK, rel=1e-12)


def test_an_axis_over_two_torus_dimensions_of_a_v5p_slice_adds_their_bandwidth():
    mesh = Cluster.parse("tpu-v5p:128").logical_mesh((1, 128), (8, 16))  # 4x4x8: axis 1 is x and y, axis 0 is z
    # axis 1: two wrapped dimensions of 4: 2 + 2 hops, 2 x 2 one-way links' worth of bandwidth
    ag1 = 4 * ALPHA + (15 / 16) * B / (2 * 2 * V5P_LINK)
    assert mesh.all_gather(B, 1) == pytest.approx(ag1, rel=1e-12)
    assert mesh.all_reduce(B, 1) == pytest.approx(2 * ag1, rel=1e-12)
    # all-to-all over x and y: each dimension's bisection, B/4 each way over 16 / 4 lines x 2 links: B l / (4 n 2 W)
    assert mesh.all_to_all(B, 1) == pytest.approx(4 * ALPHA + B * 4 / (4 * 16 * 2 * V5P_LINK), rel=1e-12)
    # axis 0: the z ring of 8 with its wraparound
    ag0 = 4 * ALPHA + (7 / 8) * B / (2 * V5P_LINK)
    assert mesh.all_gather(B, 0) == pytest.approx(ag0, rel=1e-12)
    assert mesh.all_reduce(B, 0) == pytest.approx(2 * ag0, rel=1e-12)
    # all three dimensions at once: 2 + 2 + 4 hops, three rings
    assert mesh.all_reduce(B, (0, 1)) == pytest.approx(2 * (8 * ALPHA + (127 / 128) * B / (3 * 2 * V5P_LINK)),
                                                       rel=1e-12)


def test_an_axis_that_skips_chips_shares_the_links_with_its_neighbours():
    # logical (64, 2) of a 4x4x8 slice: axis 1 is the low half of x (a line of 2); axis 0 is the top bit of x (chips
    # 2 apart, closed by the wraparound), then y and z
    mesh = Cluster.parse("tpu-v5p:128").logical_mesh((1, 128), (64, 2))
    t = mesh.torus_axis(0)
    assert [(s.length, s.stride, s.wraps) for s in t.segments] == [(2, 2, True), (4, 1, True), (8, 1, True)]
    # x part: 2 links' worth over 2 interleaved groups (1 link), 1 logical hop of 2 links; y: 2 and 2; z: 2 and 4
    assert mesh.all_gather(B, 0) == pytest.approx((2 + 2 + 4) * ALPHA + (63 / 64) * B / (5 * V5P_LINK), rel=1e-12)
    assert mesh.all_gather(B, 1) == pytest.approx(ALPHA + (1 / 2) * B / V5P_LINK, rel=1e-12)


def test_an_axis_across_slices_crosses_the_data_center_network():
    c = Cluster.parse("tpu-v5e:512")  # two 16x16 pods
    mesh = c.logical_mesh((2, 256), (2, 256))
    dcn = 25 * GBIT  # per chip: the 256 pairs of a pod share its 256 chips' DCN
    assert mesh.torus_axis(0) is None and mesh.axis_link(0) == Link(dcn, 1e-5)
    # one step between the pods either way (a pair: the ring's one step is the tree's one level)
    assert mesh.all_reduce(B, 0) == pytest.approx(2 * 1e-5 + 2 * (1 / 2) * B / dcn, rel=1e-12)
    assert mesh.all_gather(B, 0) == pytest.approx(1e-5 + (1 / 2) * B / dcn, rel=1e-12)
    # inside a pod the torus still prices axis 1
    assert mesh.torus_axis(1) is not None and mesh.all_gather(B, 1) < mesh.all_gather(B, 0) / 20


# ---------------------------------------------------------------------------------------------------------
# GB200 NVL72: 72 GPUs on NVLink, the network beyond


def test_all_to_all_inside_an_nvl72_domain_against_one_across_domains():
    inside = Cluster.parse("gb200-nvl72:18").logical_mesh((18, 4), (9, 8))  # axis 1: 8 GPUs on 2 trays, one rack
    across = Cluster.parse("gb200-nvl72:144").logical_mesh((144, 4), (8, 72))  # axis 0: 8 GPUs in 8 racks
    assert inside.axis_size(1) == across.axis_size(0) == 8
    assert inside.axis_hosts(1) == 2 and inside.axis_domains(1) == 1 and across.axis_domains(0) == 8
    nvlink = 0.78 * 900 * GB
    beyond = 0.94 * 4 * 400 * GBIT / 4  # a tray's NICs shared by the 4 groups leaving it at once: 400 Gb/s a GPU
    assert inside.axis_link(1) == Link(nvlink, 2e-6) and across.axis_link(0) == Link(beyond, 7e-6)
    # (n-1)/n^2 B at the link, after one message per peer (NCCL's grouped send/recv): 7 on NVLink, or 7 between racks
    assert inside.all_to_all(B, 1) == pytest.approx(7 * 2e-6 + (7 / 64) * B / nvlink, rel=1e-12)
    assert across.all_to_all(B, 0) == pytest.approx(7 * 7e-6 + (7 / 64) * B / beyond, rel=1e-12)
    bw_inside = inside.all_to_all(B, 1) - inside.all_to_all(0.0, 1)
    bw_across = across.all_to_all(B, 0) - across.all_to_all(0.0, 0)
    assert bw_across / bw_inside == pytest.approx(nvlink / beyond, rel=1e-9)
    # on a DGX the same 8-way all-to-all across 2 hosts would already leave NVLink
    dgx = Cluster.parse("dgx-b200:2").logical_mesh((2, 8), (4, 4))
    assert dgx.axis_hosts(0) == 2 and dgx.axis_link(0).bandwidth < nvlink / 5


# ---------------------------------------------------------------------------------------------------------
# Every new preset plans


@pytest.fixture(scope="module")
def small():
    """A small GPT whose collectives matter (hidden 1024, sequence 256): (model, a table to share its traces)."""
    model = al.models.get("gpt-tiny", batch_size=144, hidden_size=1024, num_heads=16, seq_len=256, vocab_size=1024,
                          dtype="bfloat16")
    return model, CostTable.build(model, Cluster.parse("dgx-h200:2"))


@pytest.mark.parametrize("spec, dp, tp, pp", [
    ("dgx-h200:1", 2, 4, 1), ("dgx-b200:1", 4, 2, 1), ("h800:2", 2, 8, 1), ("gb200-nvl72:18", 9, 8, 1),
    ("tpu-v5e:16", 4, 4, 1), ("tpu-v5p:16", 2, 4, 2), ("tpu-v6e:8", 2, 4, 1),
])
def test_megatron_plans_on_every_new_preset(small, spec, dp, tp, pp):
    model, table = small
    c = Cluster.parse(spec)
    plan = al.megatron_plan(model, c, dp=dp, tp=tp, pp=pp, table=table.for_cluster(c))
    assert math.isfinite(plan.cost.step_time_s) and plan.cost.step_time_s > 0 and plan.cost.fits


def test_tensor_parallelism_across_trays_inside_the_nvl72_domain_is_priced_on_nvlink(small):
    model, table = small
    for spec, dp, tp in (("gb200-nvl72:18", 9, 8), ("gb200-nvl72:16", 4, 16)):
        c = Cluster.parse(spec)
        plan = al.megatron_plan(model, c, dp=dp, tp=tp, pp=1, table=table.for_cluster(c))
        st = plan.stages[0]
        mesh = c.logical_mesh(st.submesh, st.logical_mesh)
        assert mesh.axis_size(1) == tp and mesh.axis_hosts(1) == tp // 4 and mesh.axis_link(1) == c.intra_host
        assert plan.cost.comm_s > 0
        # slower NVLink, slower plan: its collectives are priced on that link
        slow = c.with_(intra_host_bandwidth=c.intra_host.bandwidth / 10)
        again = al.megatron_plan(model, slow, dp=dp, tp=tp, pp=1, table=table.for_cluster(slow))
        assert again.cost.step_time_s > plan.cost.step_time_s
    # each tray its own domain: tensor parallelism may not leave the tray
    with pytest.raises(ValueError, match=r"tp=8 exceeds the 4 devices of a scale-up domain"):
        al.megatron_plan(model, Cluster.parse("gb200-nvl72:18").with_(domain_hosts=1), dp=9, tp=8, pp=1)


def test_a_cut_between_stages_that_span_hosts_crosses_every_hosts_network_link(small):
    """Each device sends its own part of a microbatch's activations to its counterpart in the next stage, so a stage
    spread over h hosts sends over h hosts' links at once (the preset's inter_host bandwidth is one host's)."""
    model, table = small
    c = Cluster.parse("dgx-h200:4")  # 4 hosts of 8: two stages of 16 GPUs, 2 hosts each
    plan = al.megatron_plan(model, c, dp=2, tp=8, pp=2, table=table.for_cluster(c))
    assert [st.submesh for st in plan.stages] == [(2, 8), (2, 8)]
    nbytes = plan.table.cut_bytes[plan.stages[1].layers[0] - 1] / plan.microbatches
    assert nbytes > 0
    assert stage_transfers(plan.table, plan.stages, plan.microbatches) == [
        c.inter_host.latency + nbytes / (2 * c.inter_host.bandwidth)]
    assert plan.cost.stage_comm_s == pytest.approx(2 * (c.inter_host.latency + nbytes / (2 * c.inter_host.bandwidth)))
    # one host a stage: one host's link (2 hosts, two stages of 8)
    two = Cluster.parse("dgx-h200:2")
    one = al.megatron_plan(model, two, dp=1, tp=8, pp=2, table=table)
    nb = one.table.cut_bytes[one.stages[1].layers[0] - 1] / one.microbatches
    assert stage_transfers(one.table, one.stages, one.microbatches) == [transfer_s(nb, two.inter_host)]


def test_stage_transfers_inside_the_domain_take_nvlink(small):
    model, table = small
    c = Cluster.parse("gb200-nvl72:18")
    plan = al.megatron_plan(model, c, dp=9, tp=4, pp=2, table=table.for_cluster(c))  # the cut sits between trays
    per_tray = c.with_(domain_hosts=1)
    apart = al.megatron_plan(model, per_tray, dp=9, tp=4, pp=2, table=table.for_cluster(per_tray))
    nbytes = plan.table.cut_bytes[plan.stages[1].layers[0] - 1]
    assert nbytes > 0 and plan.stages[1].layers == apart.stages[1].layers
    assert stage_transfers(plan.table, plan.stages, 1) == [transfer_s(nbytes, c.intra_host)]
    # each stage's 36 GPUs sit on 9 trays of 4: the cut crosses 9 trays' network links at once
    assert stage_transfers(apart.table, apart.stages, 1) == [transfer_s(nbytes / 9, per_tray.inter_host)]
    # and the stage DP sees a cut between trays of one rack on NVLink too
    assert c.host_boundary_link == c.intra_host and per_tray.host_boundary_link == per_tray.inter_host
    assert Cluster.parse("gb200-nvl72:36").host_boundary_link.bandwidth < c.intra_host.bandwidth


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["dgx-h200:2", "tpu-v5e:16", "gb200-nvl72:18"])
def test_auto_plan_on_new_presets(small, spec):
    model, table = small
    c = Cluster.parse(spec)
    plan = al.auto_plan(model, c, table=table if spec == "dgx-h200:2" else table.for_cluster(c))
    assert math.isfinite(plan.cost.step_time_s) and plan.cost.fits
    # never slower than the data-parallel baseline the same table prices
    assert plan.cost.step_time_s <= al.data_parallel_plan(model, c, table=plan.table).cost.step_time_s * (1 + 1e-9)


@pytest.mark.slow
def test_a_deep_model_on_a_v5p_slice_and_an_nvl72_rack():
    """GPT-1.3B (24 layers, planned on its shallow copy) in bf16: Megatron layouts on 128 v5p chips and on 16 GB200
    trays fit and run near what the chips can do (model FLOPs over peak between 20% and the assumed matmul share)."""
    model = al.models.get("gpt-1.3b", dtype="bfloat16")
    table = CostTable.build(model, Cluster.parse("tpu-v5p:128"))
    cfg = model.config
    flops = 6 * 1.3e9 * cfg.batch_size * cfg.seq_len  # model FLOPs of a step, about: 6 N tokens
    # tp=4: since issue 31 megatron_plan pins Megatron-LM's tensor parallelism, and over 8 devices on a model of
    # hidden 2,048 its all-reduces outlast its matmuls on GB200 (MFU 15%, 25% on v5p)
    for spec, (dp, tp, pp) in (("tpu-v5p:128", (32, 4, 1)), ("gb200-nvl72:16", (16, 4, 1))):
        c = Cluster.parse(spec)
        plan = al.megatron_plan(model, c, dp=dp, tp=tp, pp=pp, microbatches=8, table=table.for_cluster(c))
        assert plan.cost.fits and len(plan.graph.ops_in_layer("layer_20")) > 0
        mfu = flops / plan.cost.step_time_s / (c.num_devices * c.device.peak("bfloat16"))
        assert 0.2 < mfu < c.device.efficiency.matmul, (spec, mfu)


# ---------------------------------------------------------------------------------------------------------
# As a user runs it: the command line, from another directory


def _cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    return subprocess.run([sys.executable, "-m", "autopar_lab", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_cli_refuses_a_bad_preset_in_one_sentence(tmp_path):
    out = _cli("plan", "gpt-tiny", "--cluster", "tpu-v5p:96", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "tpu-v5p has no standard slice of 96 chips" in lines[0]


@pytest.mark.slow
def test_cli_plans_on_a_v5p_slice_from_another_directory(tmp_path):
    out = _cli("plan", "gpt-tiny", "--cluster", "tpu-v5p:128", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["cluster"] == "tpu-v5p:128" and math.isfinite(res["step_time_s"]) and res["step_time_s"] > 0
