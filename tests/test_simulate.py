"""The pipeline simulator against hand-computed schedules and closed forms."""

from __future__ import annotations

import itertools

import pytest

from autopar_lab.simulate import SimOptions, simulate, stage_order


def spans(tl, stage, kind):
    return [(t.microbatch, t.start, t.end) for t in tl.tasks if t.stage == stage and t.kind == kind]


def test_gpipe_by_hand():
    # 2 stages, 2 microbatches, fwd 1, bwd 2.
    tl = simulate([1, 1], [2, 2], 2, "gpipe")
    assert spans(tl, 0, "fwd") == [(0, 0, 1), (1, 1, 2)]
    assert spans(tl, 1, "fwd") == [(0, 1, 2), (1, 2, 3)]
    assert spans(tl, 1, "bwd") == [(0, 3, 5), (1, 5, 7)]
    assert spans(tl, 0, "bwd") == [(0, 5, 7), (1, 7, 9)]
    assert tl.makespan == 9
    assert tl.busy_s == (6, 6)
    assert tl.bubble_fraction == pytest.approx(1 - 12 / 18)
    assert tl.peak_inflight == (2, 2)


def test_1f1b_by_hand():
    tl = simulate([1, 1], [2, 2], 2, "1f1b")
    # Stage 1 runs F0 B0 F1 B1; stage 0 runs F0 F1 B0 B1.
    assert spans(tl, 0, "fwd") == [(0, 0, 1), (1, 1, 2)]
    assert spans(tl, 1, "fwd") == [(0, 1, 2), (1, 4, 5)]
    assert spans(tl, 1, "bwd") == [(0, 2, 4), (1, 5, 7)]
    assert spans(tl, 0, "bwd") == [(0, 4, 6), (1, 7, 9)]
    assert tl.makespan == 9
    assert tl.peak_inflight == (2, 1)


def test_transfers_by_hand():
    # Same pipeline, activation transfer 0.5 s and gradient transfer 1 s over the single cut (GPipe).
    tl = simulate([1, 1], [2, 2], 2, "gpipe", send_fwd_s=[0.5], send_bwd_s=[1.0])
    assert spans(tl, 0, "send_fwd") == [(0, 1, 1.5), (1, 2, 2.5)]
    assert spans(tl, 1, "fwd") == [(0, 1.5, 2.5), (1, 2.5, 3.5)]
    assert spans(tl, 1, "bwd") == [(0, 3.5, 5.5), (1, 5.5, 7.5)]
    assert spans(tl, 0, "send_bwd") == [(0, 5.5, 6.5), (1, 7.5, 8.5)]
    assert spans(tl, 0, "bwd") == [(0, 6.5, 8.5), (1, 8.5, 10.5)]
    assert tl.makespan == 10.5  # 9 + 0.5 + 1
    # A slow link serialises transfers: each activation takes 3 s, so stage 1 waits on the link.
    slow = simulate([1, 1], [2, 2], 2, "gpipe", send_fwd_s=[3.0])
    assert spans(slow, 0, "send_fwd") == [(0, 1, 4), (1, 4, 7)]
    assert spans(slow, 1, "fwd") == [(0, 4, 5), (1, 7, 8)]
    assert slow.makespan == 14  # stage 1: B0 8-10, B1 10-12; stage 0: B0 10-12, B1 12-14
    rows = slow.to_rows()
    assert {r["resource"] for r in rows} == {"stage 0", "stage 1", "link 0->1"}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uniform_closed_forms(schedule):
    for S, B, f, b in itertools.product([1, 2, 3, 5], [1, 2, 4, 7], [1.0, 0.5], [1.0, 2.0, 0.25]):
        tl = simulate([f] * S, [b] * S, B, schedule)
        assert tl.makespan == pytest.approx((S + B - 1) * (f + b))
        assert tl.bubble_fraction == pytest.approx((S - 1) / (S + B - 1))
        if schedule == "1f1b":
            assert tl.peak_inflight == tuple(min(S - i, B) for i in range(S))
        else:
            assert tl.peak_inflight == (B,) * S


def test_memory():
    tl = simulate([1, 1, 1], [1, 1, 1], 4, "1f1b", options=SimOptions(act_bytes=[10, 20, 30], static_bytes=[1, 2, 3]))
    assert tl.peak_mem_bytes == (1 + 3 * 10, 2 + 2 * 20, 3 + 1 * 30)
    gp = simulate([1, 1, 1], [1, 1, 1], 4, "gpipe", options=SimOptions(act_bytes=[10, 20, 30], static_bytes=[1, 2, 3]))
    assert gp.peak_mem_bytes == (41, 82, 123)


def test_stage_order():
    assert stage_order(1, 2, 3, "1f1b") == [("fwd", 0), ("bwd", 0), ("fwd", 1), ("bwd", 1), ("fwd", 2), ("bwd", 2)]
    assert stage_order(0, 4, 2, "1f1b") == [("fwd", 0), ("fwd", 1), ("bwd", 0), ("bwd", 1)]


def test_every_task_respects_dependencies_and_resources():
    tl = simulate([1, 3, 2], [2, 1, 4], 5, "1f1b", send_fwd_s=[0.5, 1], send_bwd_s=[2, 0.25])
    by = {(t.stage, t.kind, t.microbatch): t for t in tl.tasks}
    for i in range(3):
        mine = sorted((t for t in tl.tasks if t.stage == i and t.kind in ("fwd", "bwd")), key=lambda t: t.start)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))
        for j in range(5):
            if i > 0:
                assert by[(i, "fwd", j)].start >= by[(i - 1, "send_fwd", j)].end
            if i < 2:
                assert by[(i, "bwd", j)].start >= by[(i, "send_bwd", j)].end
    assert sum(1 for t in tl.tasks if t.kind in ("fwd", "bwd")) == 30


def test_bad_inputs():
    with pytest.raises(ValueError, match="microbatches"):
        simulate([1], [1], 0)
    with pytest.raises(ValueError, match="non-negative"):
        simulate([1, -1], [1, 1], 2)
    with pytest.raises(ValueError, match="bwd_s has 1"):
        simulate([1, 1], [1], 2)
    with pytest.raises(ValueError, match="send_fwd_s"):
        simulate([1, 1], [1, 1], 2, send_fwd_s=[1, 1])
    with pytest.raises(ValueError, match="schedule"):
        simulate([1], [1], 2, schedule="zigzag")
    with pytest.raises(ValueError, match="at least 2 pipeline stages"):
        simulate([1, 1], [1, 1], 2, schedule="interleaved", virtual_stages=2)


def test_deeper_warmup_hides_a_slow_link_round_trip():
    # 2 stages of 1 s fwd + 1 s bwd, transfers of 1 s each way: the standard warm-up (2 on stage 0) waits for each
    # gradient's round trip; warming up with 2 more microbatches (the cut counted as pipeline positions) does not.
    args = dict(fwd_s=[1.0, 1.0], bwd_s=[1.0, 1.0], microbatches=8, send_fwd_s=[1.0], send_bwd_s=[1.0])
    held = SimOptions(act_bytes=[1.0, 1.0])
    standard = simulate(**args, options=held)
    deep = simulate(**args, options=held.with_warmup([4, 1]))
    assert deep.makespan < standard.makespan
    assert deep.peak_mem_bytes[0] == 4 and standard.peak_mem_bytes[0] == 2
    with pytest.raises(ValueError, match="warmup"):
        simulate(**args, options=held.with_warmup([1]))
