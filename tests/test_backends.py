"""The backend hooks (issue 32 item 2): the CPU's fitted quirks live in ``autopar_lab.backends.cpu`` alone, the
general cost model reaches them only through ``autopar_lab.backends``'s hooks, and a GPU or TPU plan never does.

The proof for GPU and TPU plans: with every public name of ``backends.cpu`` removed (any use raises), a plan on
``dgx-h100`` and one on ``tpu-v5p`` price to the same bits as with the module in place, and their reports, explain()
and JSON carry no CPU line. On the CPU each hook answers by the module's formula (checked by hand here; the formulas
themselves by tests/test_virtual_share.py, test_virtual_host.py and test_gradient_chain.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import autopar_lab as al
from autopar_lab import backends
from autopar_lab.backends import cpu
from autopar_lab.cluster import Cluster, Efficiency
from autopar_lab.pricing import CostTable


def _small_gpu() -> Cluster:
    return Cluster.preset("dgx-h100", hosts=2).with_(devices_per_host=2)


def _small_tpu() -> Cluster:
    return Cluster.parse("tpu-v5p:8")


def _price(cluster: Cluster, layers: int) -> dict:
    """A pipelined Megatron plan and a data-parallel one of gpt-tiny with ``layers`` layers, solved in this process
    (workers=1, so a patched module is the one the ILPs run with), as everything their pricing decides."""
    model = al.models.get("gpt-tiny", batch_size=8, num_layers=layers)
    table = CostTable.build(model, cluster, workers=1)
    pp = al.megatron_plan(model, cluster, table=table, dp=1, tp=cluster.num_devices // 2, pp=2, microbatches=2)
    dp = al.data_parallel_plan(model, cluster, table=table, microbatches=2)
    out: dict = {"on_a_copy": table.solve_graph is not table.graph}
    for name, plan in (("pp", pp), ("dp", dp)):
        out[name] = {"cost": plan.cost.to_dict(), "explain": plan.cost.explain(), "cpu": plan.cost.cpu,
                     "stages": [(s.layers, s.submesh, s.fwd_s, s.bwd_s, s.static_bytes, s.act_bytes,
                                 tuple(dataclasses.astuple(c) for c in s.layer_costs)) for s in plan.stages]}
    return out


@pytest.mark.parametrize("make,layers", [
    pytest.param(_small_gpu, 2, id="dgx-h100"), pytest.param(_small_tpu, 2, id="tpu-v5p"),
    pytest.param(_small_gpu, 24, id="dgx-h100-24-layers-on-a-copy", marks=pytest.mark.slow)])  # ~25 s
def test_gpu_and_tpu_pricing_never_reaches_the_cpu_module(make, layers, monkeypatch):
    cluster = make()
    assert not backends.on_cpu(cluster)
    for where in ("autopar_lab.pricing.table", "autopar_lab.planner"):
        monkeypatch.setattr(f"{where}.default_workers", lambda: 1)  # the ILPs in this process, which is patched
    want = _price(cluster, layers)
    for name in cpu.__all__:
        monkeypatch.delattr(cpu, name)  # any use now raises AttributeError
    got = _price(cluster, layers)
    assert got == want
    assert got.pop("on_a_copy") == (layers >= 24)  # a deep model is planned on its shallow copy
    for plan in got.values():
        assert plan["cpu"] is None
        assert "task_s" not in plan["cost"] and "chain_s" not in plan["cost"]
        assert "gradient chain" not in plan["explain"] and "fixed cost" not in plan["explain"]


def test_the_hooks_answer_identity_off_the_cpu_and_the_formula_on_it():
    gpu = _small_gpu()
    mesh = gpu.logical_mesh((1, 2), (1, 2))
    assert backends.kernel_share(mesh) == 1.0 and backends.buffer_share(mesh) == 1.0
    assert backends.task_array_s(gpu, 1e-5, "param") == 0.0 and backends.task_devices(gpu, (1, 2)) == 1
    assert backends.one_program_share(gpu) is None and backends.runs_serially(gpu) is False
    assert backends.host_of_stages(gpu, [0, 2]) is None and backends.reshard_buffers_held(gpu) is False
    assert backends.program_rereads_s(gpu, {}, 0, 3) == 0.0
    assert backends.cpu_cost(gpu, shared_host=True, task_s=1.0, rereads_s=1.0) is None
    assert backends.cost_note({"step_time_s": 1.0}) == "" and backends.plan_note(gpu, [2], 1, str) == ""
    # the same hooks on a cluster whose devices share one machine's cores (figures chosen here, not the profile's)
    c = gpu.with_(device=dataclasses.replace(gpu.device, shares_cores=True, task_overhead_s=1e-4,
                                             efficiency=Efficiency(driver_share=2.0, chain_reads=3.0)))
    c = c.with_(hosts=1, devices_per_host=8)
    m2 = c.logical_mesh((1, 2), (1, 2))
    assert backends.on_cpu(c) and backends.reshard_buffers_held(c) is True
    assert backends.kernel_share(m2) == (2 + 2.0) / (8 + 2.0)
    assert backends.buffer_share(m2) == 2 / 8
    assert backends.task_array_s(c, 1e-5, "param") == 1e-5 and backends.task_array_s(c, 1e-5, "opt_state") == 0.0
    assert backends.task_devices(c, (1, 4)) == 4 and backends.task_devices(c, (1, 16)) == 8
    assert backends.one_program_share(c) == 1 / 3 and backends.runs_serially(c) is True
    assert backends.host_of_stages(c, [0, 2, 4]) == [0, 0, 0]
    assert backends.host_of_stages(c.with_(hosts=2), [0, 8]) == [0, 1] and not backends.runs_serially(c.with_(hosts=2))
    # 1 s a layer over 3 layers in one program: layer 0 read again by 2 later layers, layer 1 by 1
    sums = {"reread_s": [0.0, 1.0, 2.0, 3.0], "reread_rank_s": [0.0, 0.0, 1.0, 3.0]}
    assert backends.program_rereads_s(c, sums, 0, 2) == 3.0
    assert cpu.chain_read_s_per_byte(m2) == 3.0 / c.device.achievable_bandwidth * (4 / 10)
    report = backends.cpu_cost(c, shared_host=True, task_s=2e-3, rereads_s=1e-3)
    assert report.to_dict() == {"task_s": 2e-3, "chain_s": 1e-3}
    assert backends.cost_note(report.to_dict()) == (", 0.002 s of it its programs' fixed cost, 0.001 s of it "
                                                    "re-reading the gradient chain")
    assert backends.plan_note(c, [2, 2], 1, lambda x: f"{x:.2f}").count("S1 on 2: 0.40") == 1


def test_every_hook_of_the_cpu_module_says_what_fitted_it():
    """Each function and figure of backends.cpu that prices something is marked empirical with its measurement."""
    priced = {"kernel_share", "buffer_share", "task_array_s", "task_devices", "ONE_PROGRAM_SHARE", "runs_serially",
              "host_of_stages", "chain_read_s_per_byte", "read_again_s", "chain_pairs", "UPDATE_COPIES_SHARE",
              "update_copies_bytes", "dot_f32_copies", "one_program_grads_bytes", "RESHARD_BUFFERS_HELD"}
    assert priced <= set(cpu.__all__)
    assert set(cpu.EMPIRICAL) == priced
    assert all(len(why) > 40 for why in cpu.EMPIRICAL.values())
    # the hooks module answers for each of them (no general module calls backends.cpu directly)
    assert {"kernel_share", "buffer_share", "task_array_s", "task_devices", "one_program_share", "runs_serially",
            "host_of_stages", "read_again_s", "program_rereads_s", "update_copies_bytes",
            "dot_f32_copies", "one_program_grads_bytes", "reshard_buffers_held"} <= set(backends.__all__)


def test_an_old_profile_key_is_read_once(tmp_path):
    """A cluster file saved with the device key ``virtual`` (before it was ``shares_cores``) loads as before."""
    c = Cluster.preset("dgx-a100")
    data = c.to_dict()
    data["device"]["virtual"] = True
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    loaded = Cluster.from_json(path)
    assert loaded.device.shares_cores and backends.on_cpu(loaded)
    assert loaded.device.to_dict()["shares_cores"] is True and "virtual" not in loaded.device.to_dict()


@pytest.mark.slow  # two command-line runs, each starting JAX: ~12 s
def test_the_cli_shows_cpu_lines_only_on_the_cpu(tmp_path):
    """As a user runs it, from another directory: a GPU plan's text and JSON carry no CPU term."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    args = [sys.executable, "-m", "autopar_lab", "plan", "gpt-tiny", "--cluster", "dgx-h100", "--method", "data"]
    js = subprocess.run(args + ["--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert js.returncode == 0, js.stderr
    out = json.loads(js.stdout)
    assert out["step_time_s"] > 0 and "task_s" not in out and "chain_s" not in out
    text = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert text.returncode == 0 and "fixed cost" not in text.stdout and "gradient chain" not in text.stdout


def test_the_cost_panel_shows_cpu_rows_only_on_the_cpu():
    pytest.importorskip("ipywidgets")
    from autopar_lab.widgets.views.cost_panel import breakdown_html, explain_text
    from autopar_lab.widgets.views.utilisation import utilisation_html

    gpu = al.data_parallel_plan(al.models.get("gpt-tiny"), _small_gpu())
    assert "fixed cost" not in breakdown_html(None, gpu.cost) and "gradient chain" not in breakdown_html(None, gpu.cost)
    assert "fixed cost" not in explain_text(gpu.cost) and "autopar-cpu" not in utilisation_html(gpu)
    fake = SimpleNamespace(**{f.name: getattr(gpu.cost, f.name) for f in dataclasses.fields(gpu.cost)})
    fake.cpu = cpu.CpuCost(shared_host=False, task_s=1e-3, chain_s=2e-3)
    assert "of which the programs' fixed cost" in breakdown_html(None, fake)
    assert "of which re-reading the gradient chain" in breakdown_html(gpu.cost, fake)
