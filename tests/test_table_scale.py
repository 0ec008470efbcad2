"""The cost table at scale: meshes solved in worker processes give the same numbers as solved in place; the
"divisors" planning space; a table reused for another number of hosts."""

from __future__ import annotations

import pytest

import autopar_lab as al
from autopar_lab.pricing import CostTable, planning_submeshes
from autopar_lab.pricing.table_pool import LEAN, default_workers
from autopar_lab.solve.inter import StageProblem

SMALL = al.Cluster.preset("p3.16xlarge", hosts=2).with_(devices_per_host=4)


def small_problem(table, kw):
    """The stage problem of ``table``'s layers on SMALL, with the stage DP's settings ``kw``."""
    return StageProblem(len(table.layer_names), SMALL.hosts, SMALL.devices_per_host, **kw)


@pytest.fixture(scope="module")
def model():
    return al.models.get("gpt-1.3b", batch_size=8, seq_len=32)


@pytest.fixture(scope="module")
def solved_small(model):
    """(table, plan): GPT-1.3B's table on SMALL with every planned mesh solved here, in this process, and the auto
    plan on it (which adds the lean solutions and stage blocks it wants). Built once: the in-place solve and the fresh
    plan several tests below compare to (each of them solved its own, ~10 CPU-s apiece); they only read it."""
    table = CostTable.build(model, SMALL)
    assert table.solve_meshes(workers=1) == len(table.planned_meshes())
    return table, al.auto_plan(table.graph, SMALL, table=table)


@pytest.fixture(scope="module")
def fresh_plan(model, solved_small):
    """``fresh_plan(cluster)``: GPT-1.3B's auto plan of ``cluster`` from a table built for it, each cluster planned
    once for the module (SMALL's is solved_small's)."""
    plans = {SMALL: solved_small[1]}

    def get(cluster):
        if cluster not in plans:
            plans[cluster] = al.auto_plan(model, cluster)
        return plans[cluster]
    return get


def _same_plan(a, b):
    return ({o: s.name for o, s in a.strategies.items()} == {o: s.name for o, s in b.strategies.items()}
            and (a.compute_s, a.comm_s, a.reshard_s, a.static_bytes, a.act_bytes, dict(a.role_s), a.sync_s)
            == (b.compute_s, b.comm_s, b.reshard_s, b.static_bytes, b.act_bytes, dict(b.role_s), b.sync_s))


@pytest.mark.slow
def test_meshes_solved_in_workers_equal_meshes_solved_here(model, solved_small):
    """Two worker processes (the pool's threshold lowered to this small table): every layer cost and every
    IntraPlan rebuilt from the workers' strategy indices equal the in-process solve to the bit, and so do the plans."""
    here, there = solved_small[0], CostTable.build(model, SMALL)  # here: solved in this process (the fixture)
    seen = []
    there.on_progress = lambda msg, done, total: seen.append((done, total))
    import autopar_lab.pricing.table as table_module
    old = table_module.POOL_MIN_MESHES
    table_module.POOL_MIN_MESHES = 1
    try:
        assert there.solve_meshes(workers=2) == len(there.planned_meshes())
    finally:
        table_module.POOL_MIN_MESHES = old
    n = len(there.planned_meshes())
    assert sorted(seen) == [(k, n) for k in range(1, n + 1)]  # progress: each mesh once, with the total
    for key in here.planned_meshes():
        (ca, pa), (cb, pb) = here.mesh_costs(*key), there.mesh_costs(*key)
        assert ca == cb and _same_plan(pa, pb)
    a, b = al.auto_plan(model, SMALL, table=here), al.auto_plan(model, SMALL, table=there)
    assert a.cost.to_dict() == b.cost.to_dict()


def test_default_workers_is_small_and_positive():
    assert 1 <= default_workers() <= 4


def test_divisor_space_keeps_what_splits_the_batch_or_tiles_the_cluster():
    c = al.Cluster.preset("dgx-a100", hosts=64)
    full = planning_submeshes(c, 1536, "full")
    div = planning_submeshes(c, 1536, "divisors")
    assert planning_submeshes(c, 1536, "auto") == div and len(full) == 67
    hosts = sorted(n for n, m in div if m == 8)
    assert hosts == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]  # 8n divides 1536, or n divides 64
    assert [s for s in full if s[0] == 1] == [s for s in div if s[0] == 1]  # every shape inside a host
    small = al.Cluster.preset("dgx-a100", hosts=4)
    assert planning_submeshes(small, 1536, "auto") == planning_submeshes(small, 1536, "full")  # Alpa's up to 4
    with pytest.raises(ValueError, match="space"):
        planning_submeshes(c, 1536, "some")


def test_a_table_moved_to_more_hosts_reuses_every_mesh_and_plans_as_a_fresh_one(model, fresh_plan):
    small = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=4)
    bigger = small.with_(hosts=2)
    assert bigger == SMALL  # so the fresh plan of it is the module's
    table = CostTable.build(model, small)
    table.solve_meshes(workers=1)
    moved = table.for_cluster(bigger)
    assert moved.graph is table.graph and moved.trace_s == 0.0
    new = set(moved.planned_meshes()) - set(table.planned_meshes())
    assert new and moved.solve_meshes(workers=1) == len(new)  # only the two-host submeshes' ILPs run
    fresh = fresh_plan(bigger)
    again = al.auto_plan(table.graph, bigger, table=moved)
    assert again.cost.to_dict() == fresh.cost.to_dict()
    assert [(s.layers, s.submesh, s.logical_mesh, s.remat) for s in again.stages] == \
        [(s.layers, s.submesh, s.logical_mesh, s.remat) for s in fresh.stages]
    assert [sorted((o, s.name) for o, s in a.intra.strategies.items()) for a in again.stages] == \
        [sorted((o, s.name) for o, s in a.intra.strategies.items()) for a in fresh.stages]
    # A slower link inside the host: the traces carry over, and of the meshes only the one device's (no collective).
    slower = table.for_cluster(small.with_(intra_host_bandwidth=small.intra_host.bandwidth / 4))
    assert slower.graph is table.graph and slower.kept_meshes == {((1, 1), (1, 1))}
    assert slower.solve_meshes(workers=1) == len(slower.planned_meshes()) - 1


WHAT_IFS = {"hosts-3": dict(hosts=3), "hosts-1": dict(hosts=1),
            "inter-bw-0.1x": dict(inter_host_bandwidth=SMALL.inter_host.bandwidth * 0.1),
            "inter-bw-10x": dict(inter_host_bandwidth=SMALL.inter_host.bandwidth * 10),
            "intra-bw-0.5x": dict(intra_host_bandwidth=SMALL.intra_host.bandwidth * 0.5),
            "inter-latency-4x": dict(inter_host_latency=SMALL.inter_host.latency * 4),
            "devices-2": dict(devices_per_host=2)}


@pytest.fixture(scope="module")
def planned_small_table(solved_small):
    """GPT-1.3B's table on SMALL after an auto plan solved its meshes: built once for every what-if below
    (for_cluster copies what it keeps, so moving it leaves it as it was)."""
    return solved_small[0]


@pytest.mark.parametrize("what_if", list(WHAT_IFS))
def test_a_moved_table_keeps_the_meshes_the_change_cannot_alter_and_plans_as_a_fresh_one(planned_small_table, model,
                                                                                         fresh_plan, what_if):
    """GPT-1.3B's 24 layers (planned on its shallow copy) on 2 hosts of 4, moved by each what-if of the sliders:
    the meshes carried over are exactly those whose mesh_signature is unchanged (an inter-host change keeps the
    one-host meshes, an intra-host one the meshes whose split axes all cross hosts), each equal to the fresh
    table's solve of it (layer costs, strategies and totals, to the bit), and the plan equals a fresh auto_plan."""
    from autopar_lab.pricing.table import mesh_signature

    base = planned_small_table
    new = SMALL.with_(**WHAT_IFS[what_if])
    moved = base.for_cluster(new)
    solved = set(base.planned_meshes()) | {(a, b, LEAN) for a, b in base.lean_solved()}
    subs = {tuple(s) for s in new.submesh_shapes()}
    unchanged = {k for k in solved if k[0] in subs and
                 mesh_signature(SMALL.logical_mesh(*k[:2])) == mesh_signature(new.logical_mesh(*k[:2]))}
    assert moved.kept_meshes == unchanged
    if what_if.startswith(("hosts", "inter-bw")):  # every mesh inside one host survives a change between hosts
        assert {k for k in unchanged if k[0][0] == 1} == {k for k in solved if k[0][0] == 1}
    assert what_if == "hosts-3" or len(unchanged) < len(solved)  # something re-solves
    fresh = fresh_plan(new)
    again = al.auto_plan(moved.graph, new, table=moved)
    for key in moved.kept_meshes:
        (ca, pa), (cb, pb) = moved.mesh_costs(*key), fresh.table.mesh_costs(*key)
        assert ca == cb and _same_plan(pa, pb)
    assert again.cost.to_dict() == fresh.cost.to_dict()
    assert [(s.layers, s.submesh, s.logical_mesh, s.remat) for s in again.stages] == \
        [(s.layers, s.submesh, s.logical_mesh, s.remat) for s in fresh.stages]
    assert [sorted((o, s.name) for o, s in a.intra.strategies.items()) for a in again.stages] == \
        [sorted((o, s.name) for o, s in a.intra.strategies.items()) for a in fresh.stages]


@pytest.mark.parametrize("what_if", list(WHAT_IFS))
def test_a_moved_table_takes_over_the_stage_blocks_it_would_build_the_same(planned_small_table, what_if):
    """The stage blocks the auto plan left on the table (one per submesh and microbatch count) that a what-if's table
    takes over are those whose every mesh carried over, each equal to the block the moved table builds itself
    (options and arrays, to the bit), its candidates priced with the moved table's IntraPlans."""
    import numpy as np

    from autopar_lab.pricing.blocks import StageBlock

    base = planned_small_table
    assert base.stage_blocks  # the auto plan's searches kept theirs
    moved = base.for_cluster(SMALL.with_(**WHAT_IFS[what_if]))
    for key, block in base.stage_blocks.items():
        meshes = {base.key(block.submesh, shape, sol) for shape, sol, _ in block.options}
        assert (key in moved.stage_blocks) == (key[0] in moved.submeshes() and meshes <= moved.kept_meshes)
    if what_if == "hosts-3":  # every submesh of 2 hosts is one of 3 hosts', every mesh kept: every block
        assert len(moved.stage_blocks) == len(base.stage_blocks)
    if what_if == "inter-bw-0.1x":  # the one-host submeshes' blocks, not the two-host one's
        assert 0 < len(moved.stage_blocks) < len(base.stage_blocks)
    for (sub, B, mem, grid), block in moved.stage_blocks.items():
        fresh = StageBlock(moved, sub, B, mem, grid=grid)
        assert block.options == fresh.options and block.table is moved
        for a, b in zip([*block.keys, block.keep], [*fresh.keys, fresh.keep]):
            np.testing.assert_array_equal(a, b)
        k, row, col = (int(x[0]) for x in np.nonzero(block.keep))
        assert block.make(k, row, col).payload is moved.mesh_costs(sub, block.options[k][0], block.options[k][1])[1]


def test_the_session_s_host_count_what_if_solves_only_the_new_meshes(model, fresh_plan):
    from autopar_lab.widgets.session import Session

    small = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=4)
    session = Session(fresh_plan(small), model=model)
    seen = []
    plan = session.set_cluster(hosts=2, on_progress=lambda msg, frac: seen.append(msg))
    assert plan.cluster.hosts == 2 and session.plan is plan
    solved = [m for m in seen if m.startswith("intra-op")]
    assert solved and all(m.startswith("intra-op 2x4") for m in solved)  # the one new submesh, nothing else
    assert plan.cost.step_time_s == fresh_plan(small.with_(hosts=2)).cost.step_time_s


def test_a_layer_grid_plans_as_the_full_search_restricted_to_its_cuts():
    """The coarse DP (blocks of layers, arrays cut from the fine ones) finds what the plain DP finds when only cuts on
    the grid are allowed: same latency, same stages."""
    import numpy as np

    from autopar_lab import planner
    from autopar_lab.solve import inter

    model = al.models.get("gpt-1.3b", batch_size=8, seq_len=32)
    table = CostTable.build(model, SMALL)
    L = len(table.layer_names)
    grid = planner.layer_grid(L, most=8)
    assert len(grid) <= 8 and grid[0] == 0 and grid[1] == 1 and grid[-1] == L - 1
    starts, ends = set(grid), {b - 1 for b in grid[1:]} | {L - 1}
    kw = dict(mem_limit_bytes=SMALL.device.memory_bytes, intra_link=SMALL.intra_host, inter_link=SMALL.inter_host)
    choices = planner.microbatch_choices(table.batch_size, "auto")

    def restricted(B, mem):
        fine = table.candidate_fn(B, mem)
        return lambda a, b, sub: fine(a, b, sub) if a in starts and b in ends else []

    coarse = planner.search_microbatches(table, small_problem(table, kw), choices, grid=grid)
    plain = planner.search_microbatches(table, small_problem(table, kw), choices, candidates=restricted)
    assert coarse.latency_s == pytest.approx(plain.latency_s, rel=1e-12)
    assert coarse.microbatches == plain.microbatches
    assert [(s.layers, s.submesh, s.logical_mesh, s.remat) for s in coarse.stages] == \
        [(s.layers, s.submesh, s.logical_mesh, s.remat) for s in plain.stages]
    assert planner.layer_grid(L) == list(range(L))  # at most 66 layers: every cut
    assert isinstance(coarse, inter.InterResult)
    # The blocks priced on the grid hold the full blocks' numbers at the grid's ranges, to the bit.
    rows, cols = sorted(starts), sorted(ends)
    for B, mem in ((choices[-1], kw["mem_limit_bytes"]), (1, None)):
        on_grid, full = table.candidate_fn(B, mem, grid=(rows, cols)), table.candidate_fn(B, mem)
        for sub in table.submeshes():
            g, f = on_grid.block(sub), full.block(sub)
            ix = np.ix_(np.arange(len(f.options)), rows, cols)
            for name in ("fwd_s", "bwd_s", "static_bytes", "act_bytes", "usable"):
                assert np.array_equal(getattr(g, name), getattr(f, name)[ix])
            a, b = rows[1], cols[-1]
            assert [(c.layers, c.fwd_s) for c in on_grid(a, b, sub)] == [(c.layers, c.fwd_s) for c in full(a, b, sub)]


def _link_by_counting(mesh, axis):
    """The axis' link worked out from scratch: the hosts each collective group touches, and how many crossing groups
    share the busiest host's NICs (the definition in LogicalMesh.axis_link's docstring)."""
    M = mesh.cluster.devices_per_host
    groups = mesh.devices.T if axis == 0 else mesh.devices
    hosts = [{int(d) // M for d in row} for row in groups]
    crossing = [h for h in hosts if len(h) > 1]
    if not crossing:
        return mesh.cluster.intra_host
    busiest = max(sum(h in g for g in crossing) for h in range(mesh.cluster.hosts))
    link = mesh.cluster.inter_host
    return link if busiest == 1 else al.Link(link.bandwidth / busiest, link.latency)


def test_axis_links_are_remembered_per_mesh_and_equal_the_counted_ones():
    """The per-mesh memo of axis_link (it was recomputed for every collective priced: 90 s of a 1T table) answers
    what counting gives, on every view of every submesh of a 12-host cluster, asked once or twice."""
    c = al.Cluster.preset("dgx-a100", hosts=12)
    for sub in c.submesh_shapes():
        for shape in c.logical_mesh_shapes(sub):
            mesh = c.logical_mesh(sub, shape)
            for axis in (0, 1):
                want = _link_by_counting(mesh, axis)
                assert mesh.axis_link(axis) == want and mesh.axis_link(axis) == want
            assert mesh.axis_link((0, 1)) == _link_by_counting(c.logical_mesh(sub, (1, sub[0] * sub[1])), 1)


@pytest.mark.slow
def test_meshes_solved_while_the_model_traces_equal_meshes_solved_later(model, solved_small, monkeypatch):
    """CostTable.build(workers=2) starts the shallow copy's ILPs before tracing the full model: solve_meshes then
    collects them (progress: each mesh once, with the total) and every layer cost equals the table solved in place;
    a progress hook that raises stops the workers, and the meshes left are solved when asked, with the same numbers."""
    import autopar_lab.pricing.table as table_module

    monkeypatch.setattr(table_module, "POOL_MIN_MESHES", 1)
    here = solved_small[0]  # every mesh solved in this process
    seen = []
    ahead = CostTable.build(model, SMALL, workers=2, on_progress=lambda m, done, total: seen.append((done, total)))
    n = len(ahead.planned_meshes())
    assert ahead.solve_meshes(workers=1) == n and sorted(seen) == [(k, n) for k in range(1, n + 1)]
    for key in here.planned_meshes():
        assert ahead.mesh_costs(*key)[0] == here.mesh_costs(*key)[0]

    def stop(msg, done, total):
        raise KeyboardInterrupt("cancel")

    cancelled = CostTable.build(model, SMALL, workers=2, on_progress=stop)
    with pytest.raises(KeyboardInterrupt):
        cancelled.solve_meshes(workers=1)
    cancelled.on_progress = None
    assert cancelled.solve_meshes(workers=1) == n - 1  # one mesh was collected before the hook raised
    for key in here.planned_meshes():
        assert cancelled.mesh_costs(*key)[0] == here.mesh_costs(*key)[0]


def test_a_deferred_plan_is_the_rebuilt_plan_built_on_first_read_and_pickles(solved_small):
    """A mesh solved elsewhere comes back as strategy indices; its LazyIntraPlan.from_choice is plan_from_choice's plan
    (which is the solve's own, to the bit), built only when a field is read, and pickles (a plain IntraPlan does
    not) as what rebuilds it."""
    import pickle

    from autopar_lab.pricing.incremental import LazyIntraPlan
    from autopar_lab.pricing.table_pool import plan_from_choice, solve_one

    table, planned = solved_small  # solve_one below solves on its own memo: the table's solutions play no part
    key = next(k for k in table.planned_meshes() if k[1][0] > 1 and k[1][1] > 1)
    _, solved, choice = solve_one(table.solve_graph, SMALL, key, table.solver, {})
    deferred = LazyIntraPlan.from_choice(table.solve_graph, SMALL, key, choice)
    back = pickle.loads(pickle.dumps(deferred))
    assert not deferred.is_filled and not back.is_filled
    assert _same_plan(deferred, solved) and deferred.is_filled
    assert deferred == plan_from_choice(table.solve_graph, SMALL, key, choice)  # every field, the solve's record too
    assert _same_plan(back, solved) and deferred.total_s == solved.total_s
    with pytest.raises(AttributeError):
        deferred.no_such_field  # noqa: B018 - not a field: nothing to build it from
    # A table moved to another cluster hands out deferred plans; planning with it reads none of its stages' plans.
    moved = table.for_cluster(SMALL)
    plan = al.auto_plan(moved.graph, SMALL, table=moved)
    assert all(isinstance(s.intra, LazyIntraPlan) and not s.intra.is_filled for s in plan.stages)
    assert plan.cost.to_dict() == planned.cost.to_dict()


def test_the_blocks_pareto_mask_is_pareto_on_random_options_with_ties():
    """StageBlock's vectorised filter against pricing.stage.pareto, option by option, on random small integer
    fields (many ties and equal options, where "ties to the first" decides)."""
    import numpy as np

    from autopar_lab.pricing.stage import pareto
    from autopar_lab.pricing.stage import pareto_mask
    from autopar_lab.solve.inter import StageCandidate

    rng = np.random.default_rng(7)
    for _ in range(40):
        K, P = int(rng.integers(1, 9)), 25
        fields = [rng.integers(0, 3, (K, P)).astype(float) for _ in range(4)]
        mask = pareto_mask(fields)
        for p in range(P):
            cands = [StageCandidate((0, 0), (1, 1), (1, 1), False, *(float(f[k, p]) for f in fields),
                                    payload=k) for k in range(K)]
            assert sorted(c.payload for c in pareto(cands)) == list(np.flatnonzero(mask[:, p]))


def test_the_pareto_mask_among_options_that_fit_equals_the_full_mask_cut_to_them():
    """Comparing only the options that fit a memory limit (``alive``) keeps the same options as the full filter
    then cut to those that fit, on random small integer fields with many ties, at limits from none fitting to all;
    and an ``alive`` that is not closed upwards can differ (so the test can tell the two apart)."""
    import numpy as np

    from autopar_lab.pricing.stage import pareto_mask

    rng = np.random.default_rng(11)
    for _ in range(60):
        K, P = int(rng.integers(1, 9)), 30
        fields = [rng.integers(0, 4, (K, P)).astype(float) for _ in range(4)]
        for limit in (-1.0, 1.0, 2.0, 3.0, 4.0, 6.0, 9.0):
            fits = fields[2] + fields[3] <= limit
            assert np.array_equal(pareto_mask(fields, fits), pareto_mask(fields) & fits)
    # The one option that dominates the other dead: the other survives, which the full filter would drop.
    fields = [np.array([[0.0], [1.0]]) for _ in range(4)]
    alive = np.array([[False], [True]])
    assert pareto_mask(fields, alive)[1, 0] and not pareto_mask(fields)[1, 0]


def test_the_workers_take_the_two_pass_meshes_first_and_solve_as_in_place(model, solved_small, monkeypatch):
    """The pool's order (table_pool.longest_first): every mesh with both axes split (two ILP passes) before the
    one-axis meshes, more devices first within each; the order changes when a mesh arrives, not what it is: layer
    costs and strategy indices equal the serial solve's to the bit."""
    import autopar_lab.pricing.table as table_module

    monkeypatch.setattr(table_module, "POOL_MIN_MESHES", 1)
    here = solved_small[0]  # every mesh solved in this process
    ahead = CostTable.build(model, SMALL, workers=2)
    assert ahead._ahead is not None
    order = list(ahead._ahead.keys)
    assert sorted(order) == sorted(here.planned_meshes())
    two = [k[1][0] > 1 and k[1][1] > 1 for k in order]
    assert any(two) and not all(two) and two == sorted(two, reverse=True)
    for group in (True, False):
        sizes = [k[0][0] * k[0][1] for k, t in zip(order, two) if t == group]
        assert sizes == sorted(sizes, reverse=True)
    assert ahead.solve_meshes(workers=1) == len(order)
    for key in here.planned_meshes():
        assert ahead.mesh_costs(*key)[0] == here.mesh_costs(*key)[0]
        assert (ahead._choices[key] == here._choices[key]).all()


def test_one_pool_solves_the_fast_and_then_the_lean_ilps_as_the_two_calls_do():
    """``solve_planned``: the workers that ``build`` starts go on to each mesh's lean ILP as its fast one arrives.
    At a memory limit where some meshes but not all need a lean solution, the same meshes are solved, fast and
    lean, with the same layer costs to the bit as ``solve_meshes`` then ``solve_lean(lean_meshes(...))`` in one
    process; the progress hook sees every mesh once, its total growing as lean meshes are queued."""
    import autopar_lab.pricing.table as table_module

    # Activations large enough that a layer's least memory differs from mesh to mesh (split by data parallelism).
    model = al.models.get("gpt-tiny", num_layers=24, hidden_size=64, batch_size=64, seq_len=128)
    cluster = SMALL  # 7 meshes to solve (2 hosts of 8 GPUs: 11), each fast and lean, here and in the pool
    ref = CostTable.build(model, cluster)
    ref.solve_meshes(workers=1)
    keys = ref.planned_meshes()
    B = 1
    mem = next(m for m in (1e4 * 1.25 ** e for e in range(80)) if 0 < len(ref.lean_meshes(m, B)) < len(keys))
    ref.solve_lean(ref.lean_meshes(mem, B), workers=1)
    old = table_module.POOL_MIN_MESHES
    table_module.POOL_MIN_MESHES = 1
    try:
        there = CostTable.build(model, cluster, workers=2)
        seen = []
        there.on_progress = lambda msg, done, total: seen.append((msg, done, total))
        n = there.solve_planned(mem, B, workers=2)
    finally:
        table_module.POOL_MIN_MESHES = old
    assert sorted(there.lean_solved()) == sorted(ref.lean_solved())
    assert n == len(keys) + len(ref.lean_solved()) == len(seen) == len({m for m, _, _ in seen})
    assert [d for _, d, _ in seen] == list(range(1, n + 1)) and seen[-1][2] == n
    for sub, shape in keys:
        for sol in ref.solutions(sub, shape):
            assert there.mesh_costs(sub, shape, sol)[0] == ref.mesh_costs(sub, shape, sol)[0]
        assert there.solutions(sub, shape) == ref.solutions(sub, shape)


def test_the_workers_of_a_table_never_collected_stop_with_it():
    """build's workers wait for more meshes (a lean ILP may follow a fast one) until their pool closes: a table
    dropped without collecting them takes them down with it."""
    import gc

    import autopar_lab.pricing.table as table_module

    old = table_module.POOL_MIN_MESHES
    table_module.POOL_MIN_MESHES = 1
    try:
        t = CostTable.build(al.models.get("gpt-tiny", num_layers=8), SMALL, workers=2)
    finally:
        table_module.POOL_MIN_MESHES = old
    assert t._ahead is not None
    procs = [w.proc for w in t._ahead._pool]
    del t
    gc.collect()
    for p in procs:
        p.wait(timeout=30)  # raises if a worker is still running


@pytest.mark.slow
def test_a_mesh_s_fast_and_lean_ilps_solved_together_equal_the_two_solved_apart():
    """Where every lean solution is wanted (``lean="all"``; "auto" in the scale space), a worker solves a mesh's
    lean ILP right after its fast one on one StrategyCache: build's workers solve them ahead, kept aside until asked
    (collecting alone adds no lean solution), and solve_planned pairs them too, in its pool or here. Layer costs,
    strategy indices and solutions equal the in-process solves, one fresh cache each, to the bit."""
    import autopar_lab.pricing.table as table_module

    model = al.models.get("gpt-tiny", num_layers=8)
    ref = CostTable.build(model, SMALL, lean="all")
    ref.solve_meshes(workers=1)
    ref.solve_lean(workers=1)
    keys = ref.planned_meshes()
    old = table_module.POOL_MIN_MESHES
    table_module.POOL_MIN_MESHES = 1
    try:
        ahead = CostTable.build(model, SMALL, workers=2, lean="all")
        assert ahead._ahead is not None and len(ahead._ahead.keys) == 2 * len(keys)  # fast and lean, paired
        ahead.collect()
        assert ahead.lean_solved() == []  # solved, but not asked for yet
        later, here = CostTable.build(model, SMALL, lean="all"), CostTable.build(model, SMALL, lean="all")
        counts = [t.solve_planned(1e30, 1, workers=w) for t, w in ((ahead, 2), (later, 2), (here, 1))]
    finally:
        table_module.POOL_MIN_MESHES = old
    assert counts == [len(keys), 2 * len(keys), 2 * len(keys)]  # ahead: its fast solutions were collected before
    for t in (ahead, later, here):
        assert sorted(t.lean_solved()) == sorted(keys)
        for sub, shape in keys:
            assert t.solutions(sub, shape) == ref.solutions(sub, shape)
            for sol in ("fast", LEAN):
                key = ref.key(sub, shape, sol)
                assert t.mesh_costs(sub, shape, sol)[0] == ref.mesh_costs(sub, shape, sol)[0]
                assert (t._choices[key] == ref._choices[key]).all()
