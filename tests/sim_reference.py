"""The pipeline simulator as it was before its fast placement (autopar_lab.simulate before 2026-12-06 16:30): the
oracle tests/test_simulate_fast.py checks today's :func:`autopar_lab.simulate.simulate` against, figure for figure
and task for task. It polls every stage for a ready task and picks, where stages share a host, the task that can
start first."""

from __future__ import annotations

from autopar_lab.simulate import COMPUTE_KINDS, Task, task_order


def max_overlap(intervals, weights=None):
    """The most intervals [start, end) alive at one instant (ends before starts at equal times); with ``weights``,
    the largest sum of the weights of those alive."""
    w = [1.0] * len(intervals) if weights is None else [float(x) for x in weights]
    events = [(s, 1, x) for (s, _), x in zip(intervals, w)] + [(e, -1, x) for (_, e), x in zip(intervals, w)]
    events.sort(key=lambda x: (x[0], x[1]))
    alive = best = 0.0
    for _, sign, x in events:
        alive += sign * x
        best = max(best, alive)
    return int(best) if weights is None else best


def old_simulate(fwd, bwd, B, schedule="1f1b", *, sf=None, sb=None, wgt=None, v=1, act=None, static=None,
                 warmup=None, hosts=None):
    """``(tasks, makespan, busy, peak, mem)`` as the old simulate computed them (inputs already checked: floats)."""
    C = len(fwd)
    S = C // v
    sf = sf or [0.0] * (C - 1)
    sb = sb or [0.0] * (C - 1)
    wgt = wgt or [0.0] * C
    act = act or [0.0] * C
    static = static or [0.0] * C
    orders = [task_order(i, S, B, schedule, None if warmup is None else warmup[i], v if v > 1 else None)
              for i in range(S)]
    split = schedule == "zb-h1"
    pos = [0] * S
    stage_free = [0.0] * S
    ready = {k: [[None] * B for _ in range(C)] for k in COMPUTE_KINDS}
    ready["fwd"][0] = [0.0] * B
    link_fwd_free = [0.0] * S
    link_bwd_free = [0.0] * S
    tasks = []
    fwd_start = [[0.0] * B for _ in range(C)]
    held_end = [[0.0] * B for _ in range(C)]
    resource = list(range(S)) if hosts is None else [int(h) for h in hosts]
    shared = len(set(resource)) < S
    resource_free = dict.fromkeys(resource, 0.0)

    def next_start(i):
        if pos[i] >= len(orders[i]):
            return None
        kind, c, j = orders[i][pos[i]]
        at = ready[kind][c][j]
        return None if at is None else max(stage_free[i], resource_free[resource[i]], at)

    def candidates():
        if not shared:
            for i in range(S):
                while next_start(i) is not None:
                    yield i
            return
        while True:
            starts = [(t, i) for i in range(S) for t in (next_start(i),) if t is not None]
            if not starts:
                return
            yield min(starts)[1]

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in candidates():
            kind, c, j = orders[i][pos[i]]
            start = next_start(i)
            end = start + (fwd[c] if kind == "fwd" else bwd[c] if kind == "bwd" else wgt[c])
            resource_free[resource[i]] = end
            tasks.append(Task(i, kind, j, start, end, c))
            stage_free[i] = end
            pos[i] += 1
            remaining -= 1
            progressed = True
            if kind == "fwd":
                fwd_start[c][j] = start
                if c == C - 1:
                    ready["bwd"][c][j] = end
                else:
                    t0 = max(end, link_fwd_free[i])
                    t1 = t0 + sf[c]
                    link_fwd_free[i] = t1
                    if sf[c] > 0:
                        tasks.append(Task(i, "send_fwd", j, t0, t1, c))
                    ready["fwd"][c + 1][j] = t1
            elif kind == "bwd":
                held_end[c][j] = end
                if split:
                    ready["wgrad"][c][j] = end
                if c > 0:
                    link = (c - 1) % S
                    t0 = max(end, link_bwd_free[link])
                    t1 = t0 + sb[c - 1]
                    link_bwd_free[link] = t1
                    if sb[c - 1] > 0:
                        tasks.append(Task(link, "send_bwd", j, t0, t1, c - 1))
                    ready["bwd"][c - 1][j] = t1
            else:
                held_end[c][j] = end
        assert progressed
    makespan = max(t.end for t in tasks)
    chunks = [range(i, C, S) for i in range(S)]
    busy = tuple(sum(B * (fwd[c] + bwd[c] + wgt[c]) for c in chunks[i]) for i in range(S)) if v > 1 else \
        tuple(B * (fwd[i] + bwd[i] + wgt[i]) if split else B * (fwd[i] + bwd[i]) for i in range(S))
    alive = [[(fwd_start[c][j], held_end[c][j]) for c in chunks[i] for j in range(B)] for i in range(S)]
    peak = tuple(max_overlap(a) for a in alive)
    if v == 1:
        mem = tuple(static[i] + peak[i] * act[i] for i in range(S))
    else:
        mem = tuple(sum(static[c] for c in chunks[i]) + max_overlap(alive[i], [act[c] for c in chunks[i]
                                                                                for _ in range(B)]) for i in range(S))
    tasks.sort(key=lambda t: (t.start, t.kind not in COMPUTE_KINDS, t.stage, t.end))
    return tuple(tasks), makespan, busy, peak, mem
