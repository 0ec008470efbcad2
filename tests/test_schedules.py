"""Interleaved 1F1B and ZB-H1 in the simulator: the papers' bubble formulas, memory in flight, every task after its
inputs, an independent longest-path evaluation of the same orders, and brute force over every order that keeps the
same memory on tiny pipelines."""

from __future__ import annotations

import itertools
import random

import pytest

from autopar_lab.schedules import check_layout, check_schedule, interleave
from autopar_lab.simulate import SimOptions, issue_order, simulate, stage_order, task_order

# --- the papers' formulas -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p,v", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 4)])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p, v):
    # Narayanan et al. (SC21): with each stage's forward f and backward b split over v chunks, the bubble over the
    # ideal time m(f + b) is (p - 1) / (v m); 1F1B's is (p - 1) / m.
    for m in (p, 2 * p, 3 * p):
        for f, b in ((1.0, 1.0), (1.0, 2.0), (0.5, 1.5)):
            tl = simulate([f / v] * (p * v), [b / v] * (p * v), m, "interleaved", virtual_stages=v)
            ideal = m * (f + b)
            assert (tl.makespan - ideal) / ideal == pytest.approx((p - 1) / (v * m), rel=1e-12)
            plain = simulate([f] * p, [b] * p, m, "1f1b")
            assert (plain.makespan - ideal) / ideal == pytest.approx((p - 1) / m, rel=1e-12)
            assert tl.busy_s == pytest.approx(plain.busy_s)


def test_interleaved_memory_in_flight():
    # Stage i warms up with 2(p - 1 - i) + (v - 1) p + 1 chunk-microbatches (Megatron-LM's count plus the first
    # steady forward): the interleaved schedule's price is more activations in flight than 1F1B's p - i stages'.
    for p, v in ((2, 2), (3, 2), (4, 3)):
        m = 4 * p
        act = [10.0 * (c + 1) for c in range(p * v)]  # chunk c holds 10(c + 1) bytes per microbatch
        tl = simulate([1.0] * (p * v), [2.0] * (p * v), m, "interleaved", virtual_stages=v,
                      options=SimOptions(act_bytes=act, static_bytes=[1.0] * (p * v)))
        want = [min(2 * (p - 1 - i) + (v - 1) * p + 1, m * v) for i in range(p)]
        assert tl.peak_inflight == tuple(want)
        for i in range(p):  # never more than every chunk's activations of that many microbatches, plus static
            mine = sorted((act[c] for c in range(i, p * v, p)), reverse=True)
            assert v * 1.0 < tl.peak_mem_bytes[i] <= v * 1.0 + want[i] * mine[0]
    # one group of p microbatches only: every forward first, as GPipe over the chunks
    tl = simulate([1.0] * 4, [1.0] * 4, 2, "interleaved", virtual_stages=2)
    assert tl.peak_inflight == (4, 4)


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_zb_h1_bubble_is_a_third_of_1f1b(p):
    # Qi et al. (ICLR 2024): 1F1B's bubble is (p-1)(F+B+W), ZB-H1's (p-1)(F+B-W); a third when F = B = W.
    for m in (p, 2 * p, 3 * p + 1):
        for F, B, W in ((1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0), (1.0, 1.0, 0.2)):
            zb = simulate([F] * p, [B] * p, m, "zb-h1", wgrad_s=[W] * p, options=SimOptions(act_bytes=[1.0] * p))
            one = simulate([F] * p, [B + W] * p, m, "1f1b", options=SimOptions(act_bytes=[1.0] * p))
            ideal = m * (F + B + W)
            assert zb.makespan - ideal == pytest.approx((p - 1) * (F + B - W), abs=1e-9)
            assert one.makespan - ideal == pytest.approx((p - 1) * (F + B + W), abs=1e-9)
            if F == B == W:
                assert (zb.makespan - ideal) / (one.makespan - ideal) == pytest.approx(1 / 3)
            # the same peak memory as 1F1B (p microbatches, from a forward to its W), on every stage
            assert max(zb.peak_inflight) == max(one.peak_inflight) == min(p, m)
            assert zb.busy_s == pytest.approx(one.busy_s)


def test_zb_h1_order_by_hand():
    # 3 stages, 4 microbatches: stage i runs F_x, B_{x-(2-i)}, W_{x-2} at each step x
    assert stage_order(0, 3, 4, "zb-h1") == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 0), ("wgrad", 0),
                                             ("fwd", 3), ("bwd", 1), ("wgrad", 1), ("bwd", 2), ("wgrad", 2),
                                             ("bwd", 3), ("wgrad", 3)]
    assert stage_order(2, 3, 4, "zb-h1") == [("fwd", 0), ("bwd", 0), ("fwd", 1), ("bwd", 1), ("fwd", 2), ("bwd", 2),
                                             ("wgrad", 0), ("fwd", 3), ("bwd", 3), ("wgrad", 1), ("wgrad", 2),
                                             ("wgrad", 3)]
    # without W, the forwards and B's are exactly 1F1B's
    for i in range(3):
        assert [t for t in stage_order(i, 3, 4, "zb-h1") if t[0] != "wgrad"] == stage_order(i, 3, 4, "1f1b")


# --- every order: each task once, after its inputs; the simulator against an independent evaluation -----------------


def _deps(kind, c, j, C):
    if kind == "fwd":
        return [("fwd", c - 1, j)] if c > 0 else []
    if kind == "bwd":
        return [("bwd", c + 1, j)] if c < C - 1 else [("fwd", c, j)]
    return [("bwd", c, j)]


def _longest_path(orders, dur, C):
    """End times of every task when each stage runs its order and each task starts when its stage is free and its
    inputs are done (no transfers): the longest path through the order's DAG. None when the orders deadlock."""
    end, pos, free = {}, [0] * len(orders), [0.0] * len(orders)
    left = sum(map(len, orders))
    while left:
        moved = False
        for i, order in enumerate(orders):
            while pos[i] < len(order):
                kind, c, j = order[pos[i]]
                deps = _deps(kind, c, j, C)
                if any(d not in end for d in deps):
                    break
                end[(kind, c, j)] = max([free[i]] + [end[d] for d in deps]) + dur[kind][c]
                free[i] = end[(kind, c, j)]
                pos[i] += 1
                left -= 1
                moved = True
        if not moved:
            return None
    return end


CASES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3)]


@pytest.mark.parametrize("schedule,v", CASES)
def test_every_task_once_after_its_inputs_and_as_the_longest_path(schedule, v):
    rng = random.Random(7)
    for p, mult in itertools.product((2, 3, 4), (1, 2, 3)):
        m = p * mult if schedule == "interleaved" else p * mult - 1
        C = p * v
        dur = {k: [rng.uniform(0.2, 2.0) for _ in range(C)] for k in ("fwd", "bwd", "wgrad")}
        kw = dict(wgrad_s=dur["wgrad"]) if schedule == "zb-h1" else {}
        tl = simulate(dur["fwd"], dur["bwd"], m, schedule, virtual_stages=v, **kw)
        orders = [task_order(i, p, m, schedule, virtual_stages=v) for i in range(p)]
        kinds = ("fwd", "bwd", "wgrad") if schedule == "zb-h1" else ("fwd", "bwd")
        for i, order in enumerate(orders):  # each stage runs exactly its chunks' tasks, each once
            assert sorted(order) == sorted((k, c, j) for k in kinds for c in range(i, C, p) for j in range(m))
        by = {(t.kind, t.chunk, t.microbatch): t for t in tl.tasks}
        assert len(by) == len(tl.tasks) == len(kinds) * C * m
        for (kind, c, j), t in by.items():
            assert t.stage == c % p
            assert all(by[d].end <= t.start + 1e-12 for d in _deps(kind, c, j, C))
        for i in range(p):
            mine = sorted((t for t in tl.tasks if t.stage == i), key=lambda t: t.start)
            assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))
        ref = _longest_path(orders, dur, C)
        assert ref is not None
        assert {key: t.end for key, t in by.items()} == pytest.approx(ref, abs=1e-9)
        assert tl.makespan >= max(tl.busy_s) - 1e-9


def test_transfers_between_chunks_use_the_wrap_around_link():
    # 2 stages x 2 chunks: chunk 1 (stage 1) -> chunk 2 (stage 0) crosses the link from stage 1 back to stage 0
    tl = simulate([1.0] * 4, [1.0] * 4, 2, "interleaved", virtual_stages=2, send_fwd_s=[0.5] * 3,
                  send_bwd_s=[0.25] * 3)
    rows = tl.to_rows()
    assert {r["resource"] for r in rows} == {"stage 0", "stage 1", "link 0->1", "link 1->0", "link 0<-1", "link 1<-0"}
    wrap = [t for t in tl.tasks if t.kind == "send_fwd" and t.chunk == 1]
    assert [t.stage for t in wrap] == [1, 1]
    by = {(t.kind, t.chunk, t.microbatch): t for t in tl.tasks}
    for j in range(2):
        assert by[("fwd", 2, j)].start >= by[("fwd", 1, j)].end + 0.5
        assert by[("bwd", 1, j)].start >= by[("bwd", 2, j)].end + 0.25
    assert {r["round"] for r in rows if r["stage"] == 0 and r["kind"] == "fwd"} == {0, 1}


# --- brute force: no order of the same tasks that holds no more memory is faster ------------------------------------


def _orders(i, m, kinds, chunks):
    """Every order of stage i's tasks that keeps each kind's microbatches in order per chunk and F < B < W."""
    items = [(k, c, j) for k in kinds for c in chunks for j in range(m)]
    out: list[list] = []

    def rec(seq, done):
        if len(seq) == len(items):
            out.append(list(seq))
            return
        for k, c, j in items:
            if (k, c, j) in done or (j and (k, c, j - 1) not in done):
                continue
            if (k == "bwd" and ("fwd", c, j) not in done) or (k == "wgrad" and ("bwd", c, j) not in done):
                continue
            done.add((k, c, j))
            seq.append((k, c, j))
            rec(seq, done)
            seq.pop()
            done.discard((k, c, j))

    rec([], set())
    return out


def _peak(order, last):
    alive = best = 0
    for k, _, _ in order:
        alive += (k == "fwd") - (k == last)
        best = max(best, alive)
    return best


@pytest.mark.parametrize("schedule,p,m,v", [("zb-h1", 2, 3, 1), ("zb-h1", 2, 4, 1), ("1f1b", 3, 3, 1),
                                            ("1f1b", 3, 4, 1), ("interleaved", 2, 2, 2)])
def test_no_order_with_the_same_memory_is_faster(schedule, p, m, v):
    C = p * v
    kinds = ("fwd", "bwd", "wgrad") if schedule == "zb-h1" else ("fwd", "bwd")
    times = {"fwd": 1.0, "bwd": 1.0 if schedule == "zb-h1" else 2.0, "wgrad": 1.0}
    dur = {k: [times[k]] * C for k in kinds}
    kw = dict(wgrad_s=dur["wgrad"]) if schedule == "zb-h1" else {}
    tl = simulate(dur["fwd"], dur["bwd"], m, schedule, virtual_stages=v, **kw)
    caps = tl.peak_inflight
    per = [[o for o in _orders(i, m, kinds, range(i, C, p)) if _peak(o, kinds[-1]) <= caps[i]] for i in range(p)]
    best = min(max(e.values()) for combo in itertools.product(*per) for e in [_longest_path(combo, dur, C)] if e)
    assert tl.makespan == pytest.approx(best)


# --- the schedules' vocabulary ---------------------------------------------------------------------------------------


def test_interleave_keeps_each_stage_count_and_the_ends():
    chunks = interleave([(0, 2), (3, 5), (6, 9)], 2)  # 3, 3 and 4 layers
    assert chunks == [((0, 1), (6, 6)), ((2, 3), (7, 7)), ((4, 5), (8, 9))]
    assert [sum(b - a + 1 for a, b in c) for c in chunks] == [3, 3, 4]
    flat = sorted(r for c in chunks for r in c)
    assert flat[0][0] == 0 and flat[-1][1] == 9 and all(a[1] + 1 == b[0] for a, b in zip(flat, flat[1:]))


def test_bad_schedules_say_what_to_change():
    assert check_schedule("interleaved", 4) == ("interleaved", 4)
    with pytest.raises(ValueError, match="'1f1b', 'gpipe', 'interleaved', 'zb-h1'"):
        check_schedule("zigzag")
    with pytest.raises(ValueError, match="2 or more"):
        check_schedule("interleaved", 1)
    with pytest.raises(ValueError, match="applies to the interleaved schedule only"):
        check_schedule("zb-h1", 2)
    with pytest.raises(ValueError, match="whole number"):
        check_schedule("interleaved", 2.5)
    with pytest.raises(ValueError, match="choose a multiple of 2"):
        check_layout("interleaved", 2, [3, 3], 5)
    with pytest.raises(ValueError, match="stage 1 holds 1 layer"):
        check_layout("interleaved", 2, [3, 1], 4)
    with pytest.raises(ValueError, match="wgrad_s"):
        simulate([1, 1], [1, 1], 2, "zb-h1")
    with pytest.raises(ValueError, match="wgrad_s"):
        simulate([1, 1], [1, 1], 2, "1f1b", wgrad_s=[1, 1])
    with pytest.raises(ValueError, match="use task_order"):
        stage_order(0, 2, 2, "interleaved")


def test_issue_order_walks_chunk_tasks():
    # the runtimes' walk over (kind, chunk, microbatch) tasks reproduces a valid dependency order
    p, v, m = 2, 2, 4
    orders = [task_order(i, p, m, "interleaved", virtual_stages=v) for i in range(p)]
    done: set = set()

    def ready(k, kind, c, j):
        return all(d in done for d in _deps(kind, c, j, p * v))

    walked = []
    for k, kind, c, j in issue_order(orders, ready):
        done.add((kind, c, j))
        walked.append((k, kind, c, j))
    assert len(walked) == 2 * p * v * m and all(k == c % p for k, _, c, _ in walked)
