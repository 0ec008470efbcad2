"""Pipeline schedules: their names, what each asks of a plan, and where an interleaved plan puts its layers.

- ``"gpipe"``: every forward, then every backward.
- ``"1f1b"`` (PipeDream-flush): a warm-up of forwards, then one backward and one forward in turn.
- ``"interleaved"`` (Narayanan et al., SC21): each stage holds ``v`` *virtual stages* (model chunks) and runs 1F1B
  over them; the warm-up and the bubble shrink by ``v``, at the price of ``v`` times the transfers between stages.
- ``"zb-h1"`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the backward is split into its
  input-gradient part ``B`` (on the critical path between stages) and its weight-gradient part ``W`` (needed only
  by the update), and ``W`` is deferred to fill the bubbles; the same peak memory as 1F1B, about a third of its
  bubble when forward, ``B`` and ``W`` take equal time.

An interleaved plan keeps each stage's layer *count* and submesh (``Stage.layers`` is its range in the plan's
1F1B layout); the layers it runs are its chunks (:func:`interleave`): the model is cut into ``p * v`` chunks in
order and stage ``k`` runs chunks ``k, k + p, k + 2p, ...``, so stage 0 still starts the model and the last stage
still ends it.

The interleaved order runs the microbatches in groups of ``N`` per chunk (Megatron-LM's
``--microbatch-group-size-per-virtual-pipeline-stage``, Llama 3's tunable schedule, Dubey et al. 2024, 3.3.2): a
stage runs the forwards of ``N`` microbatches through its first chunk, the same ``N`` through its second, ...,
then the next ``N``. ``N = p`` (the default, Narayanan et al.'s depth-first order) holds the fewest microbatches;
``N = M`` is the breadth-first order. Megatron-LM asks ``p <= N <= M`` (a group smaller than the stage count would
wait on its own first microbatch coming round the pipeline) and a last group of 0 or at least ``p`` microbatches
(:func:`check_group`); stage ``i``'s warm-up is ``2(p - 1 - i) + (v - 1)N`` chunk forwards (:func:`warmup_chunks`).

Llama 3's schedule sets ``N`` flexibly (Dubey et al. 2024, 3.3.2, Figure 6), to run fewer microbatches than
stages (its case 1) or more in a row to hide transfers: :class:`FlexibleGroup`, which Megatron-LM cannot run below
``p`` (its export refuses one its checks would). Below ``p`` it is one group of all ``M < p`` microbatches, as
PyTorch's ``ScheduleInterleaved1F1B`` runs them, with the same warm-up formula: a group below ``p`` beside others
(``N < p <= M``) stalls this order for good unless a stage runs nearly all its forwards first (more in flight than
``N = p``, not less: ``tests/test_microbatch_group.py`` finds the warm-up it would need), and is refused.

    >>> interleave([(0, 3), (4, 7)], 2)
    [((0, 1), (4, 5)), ((2, 3), (6, 7))]
"""

from __future__ import annotations

from typing import Mapping, Sequence

__all__ = ["SCHEDULES", "DEFAULT_VIRTUAL_STAGES", "FlexibleGroup", "check_schedule", "check_layout", "check_group",
           "group_fits", "group_order", "interleave", "schedule_of", "warmup_chunks"]

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")
#: Virtual stages per stage of an interleaved plan when none are given (Megatron-LM's published runs use 2-4).
DEFAULT_VIRTUAL_STAGES = 2
MAX_VIRTUAL_STAGES = 1024


def check_schedule(schedule, virtual_stages=None) -> tuple[str, int]:
    """``(schedule, virtual stages)`` checked: a name of :data:`SCHEDULES`; ``virtual_stages`` a whole number >= 2
    for ``"interleaved"`` (default :data:`DEFAULT_VIRTUAL_STAGES`) and None or 1 for the others (1 is returned).

    >>> check_schedule("interleaved"), check_schedule("zb-h1")
    (('interleaved', 2), ('zb-h1', 1))
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r:.60}.")
    if virtual_stages is None:
        return schedule, DEFAULT_VIRTUAL_STAGES if schedule == "interleaved" else 1
    v = virtual_stages
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_VIRTUAL_STAGES:
        raise ValueError(f"virtual_stages must be a whole number of model chunks per stage (2 or more for the "
                         f"interleaved schedule), got {v!r:.40}.")
    if schedule == "interleaved" and v < 2:
        raise ValueError("the interleaved schedule needs virtual_stages of 2 or more (1 chunk per stage is plain "
                         "1f1b); pass virtual_stages=2 or use schedule '1f1b'.")
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"virtual_stages={v} applies to the interleaved schedule only; use schedule='interleaved' "
                         f"or leave virtual_stages out for {schedule!r}.")
    return schedule, v


def schedule_of(schedule, virtual_stages=None, stage_pins: Mapping | None = None) -> tuple[str, int]:
    """The ``(schedule, virtual stages)`` a plan is priced with: ``virtual_stages`` as given, else the pinned one
    (``stage_pins["virtual_stages"]``, which :func:`~autopar_lab.overrides.with_schedule` records), else the
    default (:func:`check_schedule`)."""
    if virtual_stages is None and schedule == "interleaved" and stage_pins:
        virtual_stages = stage_pins.get("virtual_stages")
    return check_schedule(schedule, virtual_stages)


def check_layout(schedule: str, virtual_stages: int, layer_counts: Sequence[int], microbatches: int,
                 group: int | None = None) -> None:
    """A ValueError unless a plan whose stages hold ``layer_counts`` layers can run ``schedule``: interleaving needs
    2 or more stages, a microbatch count that is a multiple of the stage count (each stage cycles through its chunks
    in groups of that many microbatches) or, with a microbatch ``group`` size, one :func:`check_group` accepts, and
    at least ``virtual_stages`` layers on every stage."""
    if schedule != "interleaved":
        return
    p, v = len(layer_counts), virtual_stages
    if p < 2:
        raise ValueError("the interleaved schedule needs at least 2 pipeline stages; this plan has 1 (use '1f1b', or "
                         "split the layers into stages first).")
    if group is not None:
        check_group(group, p, microbatches)
    elif microbatches % p:
        raise ValueError(f"the interleaved schedule runs the microbatches in groups of the stage count ({p}); "
                         f"{microbatches} microbatch(es) is not a multiple of it: choose a multiple of {p} "
                         "(plan.with_microbatches) or another number of stages first.")
    short = [k for k, n in enumerate(layer_counts) if n < v]
    if short:
        k = short[0]
        raise ValueError(f"stage {k} holds {layer_counts[k]} layer(s), fewer than the {v} virtual stages (chunks) each "
                         f"stage runs; use virtual_stages={min(layer_counts)} or fewer, or give stage {k} more layers.")


class FlexibleGroup(int):
    """A microbatch group ``N`` of Llama 3's flexible interleaved schedule (the module docstring): what Megatron-LM
    accepts, or one group of all ``M`` microbatches below the stage count. An ``int`` (it travels wherever a group
    does); a plan keeps it in ``stage_pins["microbatch_group"]`` and its file says so (``"flexible_group": true``).

    >>> FlexibleGroup(2) + 1, repr(FlexibleGroup(2))
    (3, 'FlexibleGroup(2)')
    """

    def __repr__(self) -> str:
        return f"FlexibleGroup({int(self)})"

    def __str__(self) -> str:  # the count, as in messages and plan names
        return str(int(self))


def check_group(group, num_stages: int, microbatches: int, name: str = "microbatch_group=") -> int:
    """The interleaved schedule's microbatch group size ``N`` (None: the stage count ``p``, Megatron-LM's default)
    checked as Megatron-LM checks ``--microbatch-group-size-per-virtual-pipeline-stage``: a whole number with
    ``p <= N <= M`` (``M`` microbatches), and ``M mod N`` either 0 or at least ``p`` (a shorter last group would
    wait on its own microbatches coming round the pipeline). A :class:`FlexibleGroup` (Llama 3's schedule) may also
    be ``N = M`` below ``p``: one group of fewer microbatches than stages. ``name``: how the messages name it.

    >>> check_group(None, 4, 8), check_group(8, 4, 8), check_group(6, 4, 10), check_group(FlexibleGroup(3), 4, 3)
    (4, 8, 6, FlexibleGroup(3))
    """
    p, m = int(num_stages), int(microbatches)
    if group is None:
        return p
    n = group
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"{name.rstrip('= ')} must be a whole number of microbatches, got {n!r:.40}.")
    if isinstance(n, FlexibleGroup) and 1 <= n == m:
        return n  # one group of every microbatch (below the stage count: Llama 3's fewer microbatches than stages)
    if isinstance(n, FlexibleGroup) and 1 <= n < p:
        raise ValueError(f"{name}{int(n)} below the stage count ({p}) runs only as one group of all the microbatches "
                         f"(pass {name.rstrip('= ')}={m} with {m} < {p} microbatches); beside other groups the "
                         f"interleaved order stalls unless nearly every forward runs first, holding more than {p}.")
    # Llama 3's schedule runs it (Megatron-LM cannot): say how to ask for that one
    hint = (f" (with {m} < {p} microbatches, FlexibleGroup({m}) or --flexible-group runs them as one group: Llama "
            "3's schedule, which Megatron-LM cannot run)" if 1 <= n <= m < p else "")
    if not p <= n <= m:
        raise ValueError(f"{name}{n}: the interleaved schedule's group of contiguous microbatches per "
                         f"chunk must be between the stage count ({p}) and the microbatch count ({m}), as Megatron-LM "
                         f"requires; pass {name.rstrip('= ')} between {p} and {m}, or leave it out for {p}{hint}.")
    if 0 < m % n < p:
        fits = [k for k in range(p, m + 1) if m % k == 0 or m % k >= p]
        raise ValueError(f"{name}{n} leaves a last group of {m % n} of the {m} microbatches, fewer than the "
                         f"{p} stages (Megatron-LM refuses the dependency bubbles that makes); pass one of "
                         f"{', '.join(map(str, fits[:12]))}{', ...' if len(fits) > 12 else ''}.")
    return n


def group_fits(group, num_stages: int, microbatches: int) -> bool:
    """Whether :func:`check_group` accepts ``group`` for ``num_stages`` stages and ``microbatches`` microbatches.

    >>> group_fits(8, 4, 8), group_fits(2, 4, 2), group_fits(FlexibleGroup(2), 4, 2), group_fits(FlexibleGroup(2), 4, 8)
    (True, False, True, False)
    """
    try:
        check_group(group, num_stages, microbatches)
    except ValueError:
        return False
    return True


def warmup_chunks(stage: int, num_stages: int, microbatches: int, virtual_stages: int,
                  group: int | None = None) -> int:
    """Chunk forwards stage ``stage`` (of ``p = num_stages``) runs before its first backward under the interleaved
    schedule with ``v`` chunks and microbatch groups of ``N`` (None: ``p``): Megatron-LM's warm-up
    ``2(p - 1 - stage) + (v - 1)N`` plus the steady state's first forward, at most all ``M v`` of them (and all of
    them when ``M == N == p``, as Megatron-LM's schedule of that case ran). The most chunk-microbatches it holds at
    once. A :class:`FlexibleGroup` below ``p`` runs the same formula (PyTorch's ``ScheduleInterleaved1F1B``'s).

    >>> warmup_chunks(1, 4, 8, 2), warmup_chunks(1, 4, 8, 2, group=8)     # 2 * 2 + 4 + 1; 2 * 2 + 8 + 1
    (9, 13)
    >>> warmup_chunks(1, 4, 2, 2, group=FlexibleGroup(2))                 # 2 * 2 + 2 + 1 of the 4 there are
    4
    """
    p, m, v = int(num_stages), int(microbatches), int(virtual_stages)
    n = check_group(group, p, m)
    total = m * v
    return total if m == p == n else min(2 * (p - 1 - stage) + (v - 1) * n + 1, total)


def group_order(microbatches: int, virtual_stages: int, group: int) -> list[tuple[int, int]]:
    """The interleaved schedule's forward order on every stage as ``(chunk round, microbatch)``: the microbatches
    in groups of ``group``, each group through round 0, then round 1, ... (the last group: what is left). The
    backward runs the same order with the rounds reversed.

    >>> group_order(5, 2, 3)
    [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (0, 3), (0, 4), (1, 3), (1, 4)]
    """
    m, v, n = int(microbatches), int(virtual_stages), int(group)
    return [(r, j) for g in range(0, m, n) for r in range(v) for j in range(g, min(g + n, m))]


def interleave(ranges: Sequence[Sequence[int]], virtual_stages: int) -> list[tuple[tuple[int, int], ...]]:
    """Each stage's chunks ``((first, last), ...)`` when the stages of ``ranges`` (their (first, last) layers, in
    order) run ``virtual_stages`` chunks each: stage ``k`` keeps its layer count, split as evenly as possible into
    ``v`` chunks (the larger ones first), and chunk ``r`` of stage ``k`` is virtual stage ``r * p + k``, the layers
    taken in virtual-stage order."""
    p, v = len(ranges), int(virtual_stages)
    counts = [int(b) - int(a) + 1 for a, b in ranges]
    sizes = [[n // v + (1 if r < n % v else 0) for r in range(v)] for n in counts]
    out: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    first = int(ranges[0][0]) if ranges else 0
    for r in range(v):
        for k in range(p):
            n = sizes[k][r]
            out[k].append((first, first + n - 1))
            first += n
    return [tuple(c) for c in out]

