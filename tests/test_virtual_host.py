"""Virtual devices (JAX's CPU devices, the ``cpu`` preset): the stages on one machine share its cores and driver.

Measured on this machine (bench/RESULTS.md, issue 14): a pipelined plan's step is the sum of its tasks (each task's
time alone, summed over the step, is within a few percent of the step run asynchronously), and a task's fixed cost
grows with the devices it runs on. So on a virtual host the pipeline simulation runs one task at a time, the task
overhead is paid per device, and a one-stage, one-microbatch plan (run as one program) pays one task a step.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys

import pytest

import autopar_lab as al
from autopar_lab.cluster import Cluster, Device
from autopar_lab.pricing import task_overhead_s
from autopar_lab.simulate import COMPUTE_KINDS, SimOptions, simulate


def check_timeline(tl, hosts, fwd, bwd, sends=None):
    """Every rule of a shared-resource timeline, checked on its tasks."""
    compute = [t for t in tl.tasks if t.kind in COMPUTE_KINDS]
    # no two tasks of one host overlap
    for a, b in itertools.combinations(compute, 2):
        if hosts[a.stage] == hosts[b.stage]:
            assert a.end <= b.start + 1e-12 or b.end <= a.start + 1e-12, (a, b)
    at = {(t.stage, t.kind, t.microbatch): t for t in compute}
    S, B = len(fwd), tl.microbatches
    sends = sends or [0.0] * (S - 1)
    for (i, kind, j), t in at.items():
        assert t.end - t.start == pytest.approx(fwd[i] if kind == "fwd" else bwd[i])
        if kind == "fwd" and i > 0:  # waits for the previous stage's forward and its transfer
            assert t.start >= at[(i - 1, "fwd", j)].end + sends[i - 1] - 1e-12
        if kind == "bwd":
            after = at[(i + 1, "bwd", j)].end + sends[i] if i < S - 1 else at[(i, "fwd", j)].end
            assert t.start >= after - 1e-12
    # a host is never idle while it has nothing to wait for: its busy time bounds the step from below
    for h in set(hosts):
        work = sum(B * (fwd[i] + bwd[i]) for i in range(S) if hosts[i] == h)
        assert tl.makespan >= work - 1e-9


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(2, 1), (2, 3), (3, 4), (4, 2)])
def test_one_shared_host_runs_the_sum_of_its_tasks(schedule, stages, microbatches):
    fwd = [1.0 + 0.5 * i for i in range(stages)]
    bwd = [2.0 + 0.25 * i for i in range(stages)]
    hosts = [0] * stages
    tl = simulate(fwd, bwd, microbatches, schedule, options=SimOptions(hosts=hosts))
    check_timeline(tl, hosts, fwd, bwd)
    # one resource that always has a ready task (the first forward is ready at 0; every task makes the next ready)
    assert tl.makespan == pytest.approx(microbatches * (sum(fwd) + sum(bwd)))
    own = simulate(fwd, bwd, microbatches, schedule)
    # separate devices overlap the stages (with one microbatch there is nothing to overlap)
    assert own.makespan < tl.makespan if microbatches > 1 else own.makespan == tl.makespan


def test_two_hosts_against_brute_force():
    """Two stages per host, 2 microbatches of 1F1B: the simulated makespan is the best over every order in which
    the two hosts may interleave their stages' ready tasks (each stage's own order fixed) when the simulation's
    rule, the earliest-starting ready task first, is optimal here (brute force over list schedules)."""
    fwd, bwd, B = [1.0, 1.5, 0.5, 1.0], [2.0, 1.0, 1.5, 2.5], 2
    hosts = [0, 0, 1, 1]
    tl = simulate(fwd, bwd, B, "1f1b", options=SimOptions(hosts=hosts))
    check_timeline(tl, hosts, fwd, bwd)
    from autopar_lab.simulate import task_order

    orders = [task_order(i, 4, B, "1f1b") for i in range(4)]

    def makespan(priority):
        # list schedule: repeatedly start the ready task of highest priority on its host as early as possible
        done, pos, free, host_free = {}, [0] * 4, [0.0] * 4, {0: 0.0, 1: 0.0}
        while any(pos[i] < len(orders[i]) for i in range(4)):
            ready = []
            for i in range(4):
                if pos[i] >= len(orders[i]):
                    continue
                kind, _c, j = orders[i][pos[i]]
                dep = ((i - 1, "fwd", j) if i else None) if kind == "fwd" else \
                    ((i + 1, "bwd", j) if i < 3 else (i, "fwd", j))
                if dep is not None and dep not in done:
                    continue
                start = max(free[i], host_free[hosts[i]], done[dep] if dep is not None else 0.0)
                ready.append((priority(i, start), start, i, kind, j))
            _, start, i, kind, j = min(ready)
            end = start + (fwd[i] if kind == "fwd" else bwd[i])
            done[(i, kind, j)] = end
            free[i] = host_free[hosts[i]] = end
            pos[i] += 1
        return max(done.values())

    rules = [lambda i, s: (s, i), lambda i, s: (s, -i), lambda i, s: (-i, s), lambda i, s: (i, s)]
    assert tl.makespan == pytest.approx(makespan(rules[0]))
    assert tl.makespan <= min(makespan(r) for r in rules) + 1e-9


def test_hosts_of_their_own_change_nothing():
    fwd, bwd = [1.0, 2.0, 1.5], [2.0, 3.0, 2.5]
    for schedule in ("gpipe", "1f1b"):
        a = simulate(fwd, bwd, 4, schedule)
        b = simulate(fwd, bwd, 4, schedule, options=SimOptions(hosts=[7, 8, 9]))
        assert a.tasks == b.tasks and a.makespan == b.makespan
    with pytest.raises(ValueError, match="one per stage"):
        simulate(fwd, bwd, 4, "1f1b", options=SimOptions(hosts=[0, 0]))


def test_the_cpu_preset_shares_cores_and_pays_per_device():
    cpu = Cluster.preset("cpu")
    assert cpu.device.shares_cores and cpu.device.task_overhead_s > 0
    assert task_overhead_s(cpu, (1, 4)) == pytest.approx(2 * task_overhead_s(cpu, (1, 2)))
    gpu = Cluster.preset("dgx-a100")
    assert not gpu.device.shares_cores and task_overhead_s(gpu, (1, 8)) == 0.0
    # a real accelerator with a task overhead pays it once a task, whatever its devices
    gpu_plan = al.megatron_plan(_model(4), gpu.with_(devices_per_host=2), dp=1, tp=1, pp=2, microbatches=2)
    assert gpu_plan.cost.cpu is None and "share the cores" not in gpu_plan.cost.explain()
    flat = gpu.with_(device=dataclasses.replace(gpu.device, task_overhead_s=1e-3))
    assert task_overhead_s(flat, (1, 2)) == task_overhead_s(flat, (1, 8)) == 1e-3


def test_shares_cores_round_trips_and_is_checked():
    dev = Cluster.preset("cpu").device
    assert dev.to_dict()["shares_cores"] is True and "virtual" not in dev.to_dict()
    assert "shares_cores" not in Cluster.preset("dgx-a100").device.to_dict()
    c = Cluster.from_json(json.dumps(Cluster.preset("cpu").to_dict()))
    assert c.device.shares_cores and c.device == Cluster.preset("cpu").device
    assert hash(dataclasses.replace(dev, shares_cores=False)) != hash(dev)
    with pytest.raises(ValueError, match="shares_cores must be true or false"):
        Device("x", {"float32": 1e12}, 1e9, 1e11, shares_cores="yes")
    # a cluster file or plan file written before the rename says "virtual": read as shares_cores
    old = Cluster.preset("cpu").to_dict()
    old["device"]["virtual"] = old["device"].pop("shares_cores")
    assert Cluster.from_json(json.dumps(old)) == Cluster.preset("cpu")


def _model(layers):
    return al.models.get("gpt-tiny", batch_size=16, num_layers=layers, hidden_size=32)


@pytest.mark.parametrize("layers,pp,dp", [(4, 2, 4), (24, 4, 2)])
def test_a_pipeline_on_one_cpu_host_costs_the_sum_of_its_tasks(layers, pp, dp):
    """gpt-tiny's shape and a 24-layer model, Megatron pipelines on the cpu preset's one host: the step is every
    stage's B forward and backward tasks back to back, the task overhead paid per device of the stage."""
    cluster = Cluster.preset("cpu")
    B = 4
    plan = al.megatron_plan(_model(layers), cluster, dp=dp, tp=1, pp=pp, microbatches=B)
    assert len(plan.stages) == pp
    tasks = sum(B * (st.fwd_s + st.bwd_s) for st in plan.stages)
    # what the host waits for besides its tasks: at most the stage transfers (a microbatch's round trip each)
    assert tasks - 1e-12 <= plan.cost.step_time_s <= tasks + B * plan.cost.stage_comm_s + 1e-12
    assert plan.cost.stage_comm_s < 0.01 * tasks
    assert plan.cost.cpu.shared_host and "its devices share the cores" in plan.cost.explain()
    for st in plan.stages:
        d = st.submesh[0] * st.submesh[1]
        assert plan.table.task_overhead_s(st.submesh) == pytest.approx(d * cluster.device.task_overhead_s)


def test_a_one_program_step_pays_one_task():
    """One stage, one microbatch: the runtime runs the step as one program, so the plan pays one task, not a
    forward, a backward and an update; with two microbatches it runs 2 forwards, 2 backwards and an update."""
    cluster = Cluster.preset("cpu")
    quiet = cluster.with_(device=dataclasses.replace(cluster.device, task_overhead_s=0.0))
    model = _model(4)
    for B, tasks in ((1, 1), (2, 5)):
        plan = al.data_parallel_plan(model, cluster, microbatches=B)
        free = al.data_parallel_plan(model, quiet, microbatches=B)
        task = plan.table.task_overhead_s(plan.stages[0].submesh)
        assert len(plan.stages) == 1 and task == 8 * cluster.device.task_overhead_s > 0
        assert plan.cost.step_time_s - free.cost.step_time_s == pytest.approx(tasks * task, rel=1e-9)


def test_state_arrays_cost_their_share_of_the_host():
    """The update's per-array cost (measured with each array on all 8 devices) is paid per shard: a stage on d of
    the host's 8 devices pays d / 8 of it for each state array it holds, and so does each task for each parameter
    array it takes."""
    cluster = Cluster.preset("cpu")
    b = cluster.device.efficiency.buffer_s
    assert b > 0
    model = _model(4)
    graph = model.trace()
    from autopar_lab.graph.opgraph import INPUT_PRIMITIVE, OPT_STATE, PARAM

    arrays = sum(1 for n in graph if n.primitive == INPUT_PRIMITIVE and graph.tensor(n.outputs[0]).kind in
                 (PARAM, OPT_STATE))
    delta = {}
    for dp, pp, B in ((8, 1, 1), (4, 2, 2), (2, 4, 4)):
        kw = dict(dp=dp, tp=1, pp=pp, microbatches=B)
        delta[pp] = (al.megatron_plan(model, cluster, **kw).cost.step_time_s
                     - al.megatron_plan(model, cluster.with_(buffer_s=0.0), **kw).cost.step_time_s)
    params = sum(1 for n in graph if n.primitive == INPUT_PRIMITIVE and graph.tensor(n.outputs[0]).kind == PARAM)
    assert delta[1] == pytest.approx(arrays * b, rel=1e-9)  # one program: the update takes each array once
    # A pipeline's tasks also take their stage's parameter arrays: the forward once, the backward three times, each
    # of B microbatches, at the stage's share d / 8. With d = 8 / pp and B = pp that is 4 P b a step at any depth.
    for pp in (2, 4):
        assert delta[pp] == pytest.approx(delta[1] / pp + 4 * params * b, rel=1e-9)


@pytest.mark.parametrize("name,kw", [("gpt-tiny", dict(batch_size=16, num_layers=4, hidden_size=32)),
                                     ("gpt-tiny", dict(batch_size=16, num_layers=24))])
def test_auto_is_never_slower_than_data_parallel_on_the_cpu_preset(name, kw):
    """The stage DP prices a virtual host as the simulation does (the sum of its tasks, one program for a whole
    step): before it did, auto chose an 8-stage pipeline for the 24-layer model, 3x data parallel's step."""
    cluster = Cluster.preset("cpu")
    model = al.models.get(name, **kw)
    auto = al.auto_plan(model, cluster)
    dp = al.data_parallel_plan(model, cluster, table=auto.table)
    assert auto.cost.step_time_s <= dp.cost.step_time_s * (1 + 1e-9)


def test_cli_plan_on_the_cpu_preset_from_another_directory(tmp_path):
    """As a user runs it: `plan --json` on the cpu preset, a 2-stage pipeline's step equals the sum of its tasks."""
    env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "autopar_lab", "plan", "gpt-tiny", "--cluster", "cpu", "--method",
                          "megatron", "--dp", "4", "--tp", "1", "--pp", "2", "--microbatches", "2", "--json"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    stages = data["stages"]
    assert len(stages) == 2
    B = data["microbatches"]
    assert data["step_time_s"] == pytest.approx(sum(B * (s["fwd_s"] + s["bwd_s"]) for s in stages),
                                                        rel=1e-2)


@pytest.mark.parametrize("seed", range(4))
def test_serial_stage_dp_against_brute_force(seed):
    """The stage DP on one host of virtual devices minimises B (sum t + sum c), as the brute force over every
    partition and submesh assignment does, and its plan's latency is the simulation of the plan on one host."""
    import random

    from autopar_lab.solve.inter import StageCandidate, StageProblem, brute_force_stages, serial_latency, stage_dp

    rng = random.Random(seed)
    table = {}

    def cands(a, b, sub):
        key = (a, b, sub)
        if key not in table:  # a stage is cheaper per device on more devices, plus a fixed cost per task
            d = sub[0] * sub[1]
            work = sum(rng.uniform(0.5, 2.0) for _ in range(a, b + 1))
            table[key] = [StageCandidate((a, b), sub, sub, False, work / d + 0.3 * d, 2 * work / d + 0.3 * d, 0, 0)]
        return table[key]

    B = rng.choice([1, 2, 4])
    kw = dict(cut_bytes=[rng.uniform(0, 1e6) for _ in range(4)], intra_link=Cluster.preset("cpu").intra_host,
              inter_link=Cluster.preset("cpu").inter_host, serial_stages=True)
    dp = stage_dp(StageProblem(5, 1, 4, microbatches=B, **kw), cands)
    bf = brute_force_stages(StageProblem(5, 1, 4, microbatches=B, **kw), cands)
    assert dp.latency_s == pytest.approx(bf.latency_s, rel=1e-9)
    times = [c.fwd_s + c.bwd_s for c in dp.stages]
    # at least the stages' own work, at most that and every cut's round trip
    assert serial_latency(times, [], B) <= dp.latency_s <= serial_latency(times, [], B) + B * 2 * sum(
        kw["cut_bytes"]) / kw["intra_link"].bandwidth + B * 2 * 4 * kw["intra_link"].latency + 1e-12
    tl = simulate([c.fwd_s for c in dp.stages], [c.bwd_s for c in dp.stages], B, "1f1b",
                  options=SimOptions(hosts=[0] * len(dp.stages)))
    assert tl.makespan == pytest.approx(B * sum(times), rel=1e-9)
    # separate devices would overlap the stages: Alpa's formula is never above the serial one
    plain = stage_dp(StageProblem(5, 1, 4, microbatches=B, **dict(kw, serial_stages=False)), cands)
    assert plain.latency_s <= dp.latency_s * (1 + 1e-12)
