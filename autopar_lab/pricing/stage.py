"""The stage-cost formula: what a pipeline stage costs per microbatch, from its layers' costs.

A stage running layers ``a..b`` on a microbatch of ``batch / B`` samples costs ``sum(layer costs) / B`` plus the
launch of every kernel it runs per microbatch (:attr:`~autopar_lab.pricing.layers.LayerCost.launch_fwd_s`: the term
that stops more microbatches from being free) and the latency of every collective it issues per microbatch
(:attr:`~autopar_lab.pricing.layers.LayerCost.latency_fwd_s`: the alpha term, paid by each microbatch, not shared);
each forward and each backward task, and the stage's update once a step, also cost the device's ``task_overhead_s``
(:func:`task_overhead_s`).
Communication that systems overlap is charged only where it shows
(:func:`hidden_comm_s`): the data-parallel gradient reduction runs in buckets behind the backward of the step's last
microbatch, and parameters gathered from their shards are prefetched behind the forward; tensor-parallel collectives
and other resharding stay on the critical path. With rematerialisation (Megatron-LM's full recomputation) a stage
keeps each layer's input per microbatch in flight, recomputes one layer's forward at a time in the backward (that
layer's activations are its working set), and runs its forward pass twice. With selective recomputation
(Korthikanti et al. 2022) it keeps every activation but the attention internals (``attn_act_bytes``: the scores and
the softmax, s^2 per head), recomputes those one layer at a time in the backward and runs their forward again
(``attn_fwd_s``). Keeping only the matmuls' outputs (``"dots"``: MaxText's ``minimal``, torchtitan's op-level
selective checkpointing) is priced the same way over every other forward operator of the blocks (``dots_*``);
torchtitan's op-level policy as written (``"selective-op"``) drops every other matmul's output of a block besides and
runs those matmuls' forward again too (``dots_*`` plus ``op_*``: :func:`partial_keys`).

:func:`stage_cost` is the one place this is written: the cost table calls it with floats for one stage
(:meth:`~autopar_lab.pricing.table.CostTable.stage`) and with numpy arrays for every layer range of a submesh at
once (:class:`~autopar_lab.pricing.table.StageBlock`), so both give the same numbers to the bit.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from ..backends import task_devices
from ..rematmode import is_dots, is_full, is_selective, is_selective_op
from ..solve.inter import StageCandidate

if TYPE_CHECKING:
    from ..cluster import Cluster

#: Seconds per kernel launch of the operator-by-operator model (kept for code that imports it; the device's
#: ``efficiency.kernel_launch_s`` is what prices a launch now).
LAUNCH_OVERHEAD_S = 5e-6

#: The layer-cost fields a stage adds up over its layers (running sums of them make any range O(1)).
SUM_FIELDS = ("fwd_s", "bwd_s", "static_bytes", "act_bytes", "heavy_fwd", "heavy_bwd", "fwd_compute_s",
              "bwd_compute_s", "sync_s", "gather_s", "launch_fwd_s", "launch_bwd_s", "ckpt_bytes", "temp_bytes",
              "layers", "attn_act_bytes", "attn_fwd_s", "attn_launch_s", "dots_act_bytes", "dots_fwd_s",
              "dots_launch_s", "op_act_bytes", "op_fwd_s", "op_launch_s", "latency_fwd_s", "latency_bwd_s",
              "collectives_fwd", "collectives_bwd", "task_arrays_s", "reread_s", "opt_bytes", "attn_kernels",
              "dots_kernels", "op_kernels", "grad_bytes")

#: The layer-cost fields a stage takes the largest of over its layers, not the sum (:func:`range_max`): the
#: backend's float32 copies of a matmul, whose buffers the next matmul reuses; a layer's backward resharding buffers,
#: freed before the next layer's backward.
MAX_FIELDS = ("f32_copies_act_bytes", "f32_copies_weight_bytes", "reshard_dst_act_bytes", "reshard_dst_weight_bytes")


#: The layer-cost fields read at a stage's boundaries, neither summed nor maximised (:func:`range_edges`): what its
#: first layer receives, what its last layer sends.
EDGE_FIELDS = ("recv_bytes", "sent_act_bytes", "sent_attn_act_bytes", "sent_dots_act_bytes", "sent_op_act_bytes")


def partial_keys(remat: Any) -> tuple[str, ...]:
    """The layer-cost field prefixes (``<key>_act_bytes``, ``<key>_fwd_s``, ``<key>_launch_s``) whose sum a stage that
    recomputes part of its forward drops from its activations and runs again in its backward: ``("attn",)``
    (selective), ``("dots",)``, ``("dots", "op")`` (selective-op: the elementwise operators and every other matmul);
    ``()`` for none and full.

    >>> partial_keys("selective-op"), partial_keys(True)
    (('dots', 'op'), ())
    """
    if is_selective(remat):
        return ("attn",)
    if is_dots(remat):
        return ("dots",)
    if is_selective_op(remat):
        return ("dots", "op")
    return ()


def prefix_sums(costs: Sequence[Any]) -> dict[str, list[float]]:
    """Running sums of each :data:`SUM_FIELDS` field over a list of LayerCosts: ``sums[f][b + 1] - sums[f][a]`` is
    the total over layers ``a..b``; also of ``k x reread_s`` of layer k (``reread_rank_s``, for
    :func:`~autopar_lab.backends.program_rereads_s`). Each of :data:`MAX_FIELDS` is kept as it is, not summed, under
    ``"max:" + field`` (layer k at index k + 1, aligned with the sums): :func:`range_max` reads it; each of
    :data:`EDGE_FIELDS` so under ``"edge:" + field``: :func:`range_edges` reads it."""
    sums: dict[str, list[float]] = {f: [0.0] for f in (*SUM_FIELDS, "reread_rank_s", *_MAX_KEYS, *_EDGE_KEYS)}
    for k, c in enumerate(costs):
        for f in SUM_FIELDS:
            sums[f].append(sums[f][-1] + getattr(c, f))
        sums["reread_rank_s"].append(sums["reread_rank_s"][-1] + k * c.reread_s)
        for f, key in zip((*MAX_FIELDS, *EDGE_FIELDS), (*_MAX_KEYS, *_EDGE_KEYS)):
            sums[key].append(getattr(c, f))
    shared = {t for c in costs for t, _home, _b in getattr(c, "shared", ())}
    for t in sorted(shared):
        # per shared parameter, running sums: layers holding it, layers reading it, and those readers' bytes
        home, reads, nbytes = [0.0], [0.0], [0.0]
        for c in costs:
            mine = [(h, b) for u, h, b in getattr(c, "shared", ()) if u == t]
            home.append(home[-1] + sum(1.0 for h, _b in mine if h))
            reads.append(reads[-1] + len(mine))
            nbytes.append(nbytes[-1] + sum(b for _h, b in mine))
        sums[f"{SHARED}home:{t}"], sums[f"{SHARED}reads:{t}"], sums[f"{SHARED}bytes:{t}"] = home, reads, nbytes
    return sums


#: The prefix of :func:`prefix_sums`' running sums for a parameter read in more than one layer
#: (:attr:`~autopar_lab.pricing.layers.LayerCost.shared`): ``home:t``, ``reads:t``, ``bytes:t``.
SHARED = "shared:"


def shared_weight_bytes(totals: Mapping[str, Any]) -> Any:
    """Bytes per device a stage holds, while its tasks run, of the parameters it reads but another stage holds
    (each one's weight and gradient, :func:`~autopar_lab.pricing.layers.shared_weights`), from a range's totals of
    :func:`prefix_sums`' ``shared:`` sums: a parameter counts once where some layer of the range reads it and none
    holds it (floats or broadcastable arrays).

    >>> t = {"shared:home:7": 0.0, "shared:reads:7": 1.0, "shared:bytes:7": 75.0}
    >>> shared_weight_bytes(t), shared_weight_bytes({**t, "shared:home:7": 1.0})   # the last stage; the first
    (75.0, 0.0)
    """
    out: Any = 0.0
    for t in shared_names(tuple(totals)):
        home, reads = totals[f"{SHARED}home:{t}"], totals[f"{SHARED}reads:{t}"]
        # every reading layer carries the same bytes (the parameter's one sharding on the mesh): bytes / reads
        each = totals[f"{SHARED}bytes:{t}"] / np.maximum(reads, 1.0)
        out = out + np.where((home == 0) & (reads > 0), each, 0.0)
    return float(out) if np.ndim(out) == 0 else out


@functools.lru_cache(maxsize=256)
def shared_names(keys: tuple[str, ...]) -> tuple[str, ...]:
    """The parameters with ``shared:`` sums among a sums dict's ``keys`` (one tuple per model and mesh: cached, as
    the stage DP and brute force ask it of every candidate range)."""
    home = f"{SHARED}home:"
    return tuple(k[len(home):] for k in keys if k.startswith(home))


@functools.lru_cache(maxsize=256)
def running_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    """The running sums among a sums dict's ``keys`` (:func:`is_running_sum`; cached like :func:`shared_names`)."""
    return tuple(k for k in keys if is_running_sum(k))


_MAX_KEYS = tuple(f"max:{f}" for f in MAX_FIELDS)
_EDGE_KEYS = tuple(f"edge:{f}" for f in EDGE_FIELDS)


def is_running_sum(key: str) -> bool:
    """Whether ``key`` of :func:`prefix_sums`'s dict is a running sum (a range's total is a difference)."""
    return not key.startswith(("max:", "edge:"))


def range_edges(sums: Mapping[str, Any], start: Any, end: Any) -> dict[str, Any]:
    """A stage's boundary terms from :func:`prefix_sums`'s dict: ``recv_bytes`` of its first layer ``start`` (0 for
    the first stage) and the ``sent_*`` fields of its last layer ``end`` (0 for the last stage, which sends nothing):
    ints, or integer arrays broadcastable against each other (the stage DP's blocks).

    >>> s = {"edge:recv_bytes": [0.0, 0.0, 8.0, 8.0], "edge:sent_act_bytes": [0.0, 4.0, 4.0, 0.0]}
    >>> e = range_edges(s, 1, 1)
    >>> e["recv_bytes"], e["sent_act_bytes"], range_edges(s, 0, 2)["recv_bytes"]
    (8.0, 4.0, 0.0)
    """
    out: dict[str, Any] = {}
    for f, key in zip(EDGE_FIELDS, _EDGE_KEYS):
        if key not in sums:  # running sums made before these fields: no boundary terms
            out[f] = 0.0
            continue
        at = start if f == "recv_bytes" else end
        if np.ndim(at) == 0:  # one range (no array made: the scalar path runs once per candidate)
            out[f] = float(sums[key][int(at) + 1])
            continue
        per = np.asarray(sums[key], dtype=float)[1:]  # layer k at k
        out[f] = per[np.asarray(at, dtype=np.int64)]
    return out


def range_max(sums: Mapping[str, Any], start: Any, end: Any) -> dict[str, Any]:
    """Each of :data:`MAX_FIELDS`' largest value over layers ``start..end`` from :func:`prefix_sums`'s dict: ints,
    or integer arrays broadcastable against each other (the stage DP's blocks: ``rows[:, None]``, ``cols[None, :]``;
    0 where ``end < start``).

    >>> s = {"max:f32_copies_act_bytes": [0.0, 1.0, 5.0, 2.0], "max:f32_copies_weight_bytes": [0.0, 0.0, 0.0, 3.0]}
    >>> range_max(s, 0, 1), range_max(s, 2, 2)
    ({'f32_copies_act_bytes': 5.0, 'f32_copies_weight_bytes': 0.0}, {'f32_copies_act_bytes': 2.0, \
'f32_copies_weight_bytes': 3.0})
    """
    out: dict[str, Any] = {}
    arrays = isinstance(start, np.ndarray) or isinstance(end, np.ndarray)
    for f, key in zip(MAX_FIELDS, _MAX_KEYS):
        if key not in sums:  # running sums made without this field: left out (stage_cost reads it as 0)
            continue
        if not arrays:  # layer k at k + 1
            out[f] = float(max(sums[key][int(start) + 1:int(end) + 2])) if end >= start else 0.0
            continue
        per = np.asarray(sums[key], dtype=float)[1:]  # layer k at k
        a, b = np.broadcast_arrays(np.asarray(start), np.asarray(end))
        if not per.any():  # every GPU and TPU, and a CPU model without half-precision matmuls
            out[f] = np.zeros(a.shape)
            continue
        # a sparse table: level j holds the largest of 2^j layers from each, so any range is two overlapping reads
        levels = [per]
        while 2 ** len(levels) <= len(per):
            half = 2 ** (len(levels) - 1)
            levels.append(np.maximum(levels[-1][:-half], levels[-1][half:]))
        table = np.zeros((len(levels), len(per)))
        for j, level in enumerate(levels):
            table[j, :len(level)] = level
        valid = b >= a
        width = np.where(valid, b - a + 1, 1)
        level_of = np.floor(np.log2(width)).astype(np.int64)
        last = np.where(valid, b, a) - (2 ** level_of) + 1
        out[f] = np.where(valid, np.maximum(table[level_of, a], table[level_of, last]), 0.0)
    return out


def _minimum(a: Any, b: Any) -> Any:
    return np.minimum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else min(a, b)


def _maximum(a: Any, b: Any) -> Any:
    return np.maximum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)


def hidden_comm_s(totals: Mapping[str, Any], microbatches: int) -> tuple[Any, Any]:
    """(gradient reduction, parameter gathers) seconds per step hidden behind compute.

    The data-parallel gradient reduction (``sync_s``) is bucketed behind the backward of the step's last microbatch:
    every bucket but the last (one per layer) overlaps the backward compute still to run, so up to
    ``bwd_compute / B x (1 - 1/layers)`` of it is hidden. Parameter gathers (``gather_s``) are prefetched one layer
    ahead behind the forward of the first microbatch in the same way. Tensor-parallel collectives are not hidden.

    >>> t = dict(sync_s=3.0, gather_s=0.0, fwd_compute_s=4.0, bwd_compute_s=8.0, layers=4)
    >>> hidden_comm_s(t, 2)   # the last microbatch's backward (4 s) hides 3/4 of it: 3 s
    (3.0, 0.0)
    """
    B = microbatches
    n = totals["layers"]
    share = 1.0 - 1.0 / np.maximum(n, 1) if isinstance(n, np.ndarray) else 1.0 - 1.0 / max(n, 1)
    sync = _minimum(totals["sync_s"], totals["bwd_compute_s"] / B * share)
    gather = _minimum(totals["gather_s"], totals["fwd_compute_s"] / B * share)
    return sync, gather


def stage_cost(totals: Mapping[str, Any], entry_bytes: Any, microbatches: int, devices: int, remat: bool | str,
               task_s: float, arrays: Any = 1.0) -> tuple[Any, Any, Any, Any]:
    """(forward s, backward s, static bytes, activation bytes) of one stage per microbatch.

    ``totals``: each of :data:`SUM_FIELDS` summed over the stage's layers (per training step at the full batch);
    ``entry_bytes``, ``devices``: kept for callers of the earlier formula (a rematerialised stage now keeps every
    layer's input as sharded, ``ckpt_bytes``); ``task_s``: the per-task overhead (:func:`task_overhead_s`). Floats
    give one stage; numpy arrays (broadcastable) give many at once, with the same float operations.

    The backend's memory (:mod:`autopar_lab.backends`, set by the caller; 0 but on the CPU): ``f32_copies_*_bytes``
    (:func:`range_max` of the layers') are held during the backward beside its other transients; a stage's update
    program holds its state and ``update_copies_bytes``, once the microbatches' activations are gone (a stage with
    tasks: ``arrays``), so the static bytes are at least that less one microbatch's activations (the stage's peak,
    static bytes plus its microbatches in flight, holds at least one).

    The destination buffers of a layer's backward reshardings (``reshard_dst_act_bytes``, per step: one microbatch's
    is that over B, and ``reshard_dst_weight_bytes``; :func:`range_max` of the layers', set by the caller, 0 where
    absent) are live beside their sources in the backward's working set: the static bytes add the largest layer's
    (measured on 8 CPU devices: at the peak of gpt-tiny's dp2 x tp2 x pp2 stage backward, 152 KiB of collectives'
    outputs were live, a layer's reshardings of one microbatch being 132 KiB).

    A parameter the stage reads but another stage holds (a tied embedding's head): its weight and gradient are held
    beside the backward's working set (:func:`shared_weight_bytes`, from ``totals``' ``shared:`` sums; not during
    the update, which the holder runs).

    A pipeline's boundaries (``totals``' :data:`EDGE_FIELDS`, :func:`range_edges`, set by the caller; 0 where
    absent): the stage that receives a microbatch's input keeps it for its backward (``recv_bytes``, at the
    sharding it arrives in, per microbatch in flight; under full recomputation it is already the first layer's
    kept input) and writes its gradient there (one microbatch's at a time, in the working set); the stage that sent
    it keeps it no longer (``sent_act_bytes``, less what a partial recomputation drops anyway; under full
    recomputation it kept only its layers' inputs). So the boundary is priced where it is held, as on a GPU
    pipeline (Megatron-LM frees a sent output's data, the receiver keeps its copy), and on JAX's CPU devices
    (measured: bench/JOURNAL.md, 2026-12-07, the head stage's input).

    ``rereads_s`` (:func:`~autopar_lab.backends.program_rereads_s`, set by the caller, who has the running sums):
    what the backward program pays a step to read its layers' outputs again, paid by every microbatch's backward.
    ``task_arrays_s`` (the CPU, :mod:`autopar_lab.backends`): what one task pays to take the stage's parameter
    arrays; the forward task
    takes them once, the backward three times (the parameters, and the running gradient sums in and out). ``arrays``
    is 0 for a stage that is the whole step run as one program (no tasks: :meth:`CostTable.one_program`), else 1;
    such a stage holds ``one_program_grads_bytes`` (the backend's) less.

    Static bytes are what the stage holds all step (parameters, gradients, optimizer state) plus its transient
    working set: the stage's average layer's largest temporary tensor, the cotangents of one layer's activations
    (the backward's), and, with remat, one layer's activations recomputed (selective: one layer's attention
    internals; "dots": one layer's tensors other than the matmuls' outputs).
    ``remat``: False (none), True (full), "selective", "dots" or "selective-op" (:func:`partial_keys`).

    A plan whose framework launches every kernel from an eager host has these times stretched afterwards
    (:func:`host_stretch`, by :func:`~autopar_lab.pricing.price.price_stages`).

    >>> t = dict(fwd_s=4.0, bwd_s=8.0, static_bytes=10.0, act_bytes=6.0, heavy_fwd=2, heavy_bwd=4,
    ...          fwd_compute_s=4.0, bwd_compute_s=6.0, sync_s=2.0, gather_s=0.0, launch_fwd_s=1e-5,
    ...          launch_bwd_s=2e-5, ckpt_bytes=2.0, temp_bytes=0.0, layers=2)
    >>> stage_cost(t, 0.0, 2, 1, False, 0.0)   # 1.5 s of the gradient reduction hides behind the last backward
    (2.00001, 3.25002, 11.5, 3.0)
    >>> stage_cost(t, 0.0, 2, 1, True, 0.0)    # remat: keeps layer inputs, one layer's activations, runs fwd twice
    (2.00001, 5.25003, 13.0, 1.0)
    >>> t.update(attn_act_bytes=4.0, attn_fwd_s=1.0, attn_launch_s=0.0)
    >>> stage_cost(t, 0.0, 2, 1, "selective", 0.0)   # drops the internals (4 of 6), recomputes their forward (1 s)
    (2.00001, 3.75002, 12.5, 1.0)
    >>> t.update(dots_act_bytes=5.0, dots_fwd_s=0.5, dots_launch_s=1e-5)
    >>> stage_cost(t, 0.0, 2, 1, "dots", 0.0)   # keeps the matmuls' outputs (1 of 6), recomputes the rest (0.5 s)
    (2.00001, 3.50003, 12.75, 0.5)
    >>> t.update(op_act_bytes=0.5, op_fwd_s=0.5, op_launch_s=0.0)
    >>> stage_cost(t, 0.0, 2, 1, "selective-op", 0.0)   # and every other matmul: 0.5 more dropped, 0.25 s again
    (2.00001, 3.75003, 12.875, 0.25)
    >>> t.update(latency_fwd_s=0.5, latency_bwd_s=1.0)   # 0.5 s of forward latency once a step: 0.5 s a microbatch
    >>> stage_cost(t, 0.0, 2, 1, False, 0.0)
    (2.25001, 3.75002, 11.5, 3.0)
    """
    B = microbatches
    hidden_sync, hidden_gather = hidden_comm_s(totals, B)
    # The layer costs count each collective's latency once a step, like its bandwidth; every microbatch issues it
    # again, so the other B - 1 of B latencies are added back (a microbatch pays its collectives' latency in full).
    again = (B - 1) / B
    lat_fwd = totals.get("latency_fwd_s", 0.0) * again
    fwd = (totals["fwd_s"] - hidden_gather) / B + totals["launch_fwd_s"] + lat_fwd
    bwd = (totals["bwd_s"] - hidden_sync) / B + totals["launch_bwd_s"] + totals.get("latency_bwd_s", 0.0) * again
    bwd = bwd + totals.get("rereads_s", 0.0) / B
    n = totals["layers"]
    layers = np.maximum(n, 1) if isinstance(n, np.ndarray) else max(n, 1)
    # The backward's working set: besides the average layer's largest temporary, the cotangents of one layer's
    # activations live while that layer's backward runs (as large as its activations), on top of the microbatches
    # in flight (measured on 8 CPU devices: a two-layer stage's backward program took 160 KiB of temporaries for
    # 147 KiB of activations a layer; bench/RESULTS.md, execute-memory).
    static = totals["static_bytes"] + totals["temp_bytes"] / B / layers + totals["act_bytes"] / B / layers
    act = totals["act_bytes"] / B
    keys = partial_keys(remat)
    recv = totals.get("recv_bytes", 0.0) / B
    if not is_full(remat):
        # The boundaries: the input received is kept here, the output sent is not (that part of it kept so far).
        sent = totals.get("sent_act_bytes", 0.0)
        for key in keys:
            sent = sent - totals.get(f"sent_{key}_act_bytes", 0.0)
        act = act + recv - sent / B
    # The received input's gradient, written by the backward one microbatch at a time.
    static = static + recv
    if keys:
        # The attention internals (selective), everything but the matmuls' outputs (dots) or that and every other
        # matmul's output (selective-op) are dropped; in the backward one layer's are recomputed at a time (the
        # working set), for their forward time again.
        internals = sum(totals[f"{key}_act_bytes"] for key in keys) / B
        static = static + internals / layers
        act = act - internals
        for key in keys:  # summed one key at a time: one key's float operations as they always were
            bwd = bwd + totals[f"{key}_fwd_s"] / B + totals[f"{key}_launch_s"]
    elif is_full(remat):
        # Each layer's input is kept; in the backward one layer's forward runs again at a time (gathered parameters
        # are kept, so it gathers nothing again), its activations the working set.
        static = static + act / layers
        act = totals["ckpt_bytes"] / B
        bwd = bwd + (totals["fwd_s"] - totals["gather_s"]) / B + totals["launch_fwd_s"] + lat_fwd
    # Once per task: a rematerialised backward is still one task. The stage's update is a program of its own once a
    # step (one more task), spread over the microbatches as the update's work is. Each task also takes its state
    # arrays (measured on 8 CPU devices: a pipeline's tasks ran 3-5 ms a step slower than priced without it).
    args = totals.get("task_arrays_s", 0.0) * arrays
    copies = totals.get("f32_copies_act_bytes", 0.0) / B + totals.get("f32_copies_weight_bytes", 0.0)
    # A parameter the stage reads but another holds (a tied embedding): its weight and gradient while tasks run.
    static = static + copies + shared_weight_bytes(totals)
    # The largest layer's backward resharding buffers, beside their sources (one microbatch's; weights once).
    static = static + totals.get("reshard_dst_act_bytes", 0.0) / B + totals.get("reshard_dst_weight_bytes", 0.0)
    update = totals.get("update_copies_bytes", 0.0) * arrays
    if isinstance(update, np.ndarray) or update:
        static = _maximum(static, totals["static_bytes"] + update - act)
    # A whole step run as one program (``arrays`` 0) writes its gradients over the activations its backward frees
    # (the backend's, 0 but on the CPU; its static bytes still hold the state and the forward's working set).
    fused = totals.get("one_program_grads_bytes", 0.0) * (1.0 - arrays)
    if isinstance(fused, np.ndarray) or fused:
        static = static - fused
    return fwd + task_s + args, bwd + task_s + task_s / B + 3 * args, static, act


def host_kernels(totals: Mapping[str, Any], remat: Any) -> Any:
    """Kernels a stage's host launches per microbatch (its forward's, its backward's and what the backward
    recomputes: the whole forward again (full), or the attention internals', "dots"' or "selective-op"'s kernels),
    from a range's totals of :data:`SUM_FIELDS` (floats or broadcastable arrays). The optimizer's update, once a
    step in a few fused multi-tensor kernels, is left out.

    >>> host_kernels(dict(heavy_fwd=10, heavy_bwd=20, attn_kernels=3), "selective"), host_kernels(dict(heavy_fwd=10,
    ...     heavy_bwd=20), True)
    (33, 40)
    """
    again = totals["heavy_fwd"] if is_full(remat) else sum((totals[f"{key}_kernels"] for key in partial_keys(remat)),
                                                           0)
    return totals["heavy_fwd"] + totals["heavy_bwd"] + again


def host_stretch(totals: Mapping[str, Any], fwd_s: Any, bwd_s: Any, remat: Any) -> Any:
    """How much a stage's forward and backward of one microbatch stretch when a host launches each of their kernels
    one by one (eager PyTorch; ``totals["host_launch_s"]`` seconds a kernel, 0: never host-bound): the host runs
    ahead of the GPU as far as the kernels let it (a microbatch's forward and backward are launched without waiting
    for the GPU), so the pair takes ``max(fwd_s + bwd_s, kernels x host_launch_s)`` (:func:`host_kernels`), each
    task stretched by the same factor (1: the GPU is the bound).

    >>> t = dict(heavy_fwd=100, heavy_bwd=200, host_launch_s=1e-4)
    >>> host_stretch(t, 0.015, 0.03, False), host_stretch(t, 0.001, 0.002, False)   # 45 ms of GPU time; 3 ms
    (1.0, 10.0)
    """
    host = host_kernels(totals, remat) * totals["host_launch_s"]
    pair = fwd_s + bwd_s
    if isinstance(pair, np.ndarray) or isinstance(host, np.ndarray):
        return np.where(pair > 0, np.maximum(host / np.where(pair > 0, pair, 1.0), 1.0), 1.0)
    return max(host / pair, 1.0) if pair > 0 else 1.0


def recompute_s(stage: Any, sums: Mapping[str, Sequence[float]], microbatches: int, task_s: float) -> float:
    """Seconds of a priced stage's backward (``stage``: its StageCandidate) that recompute forward work per
    microbatch: its whole forward less the task overhead (full), its attention internals' forward (selective, from
    the running sums ``sums`` of its mesh's layer costs), or 0."""
    if is_full(stage.remat):
        return stage.fwd_s - task_s
    a, b = stage.layers
    # 0.0 for none; one key's float operations as they always were
    return sum(((sums[f"{key}_fwd_s"][b + 1] - sums[f"{key}_fwd_s"][a]) / microbatches
                + sums[f"{key}_launch_s"][b + 1] - sums[f"{key}_launch_s"][a] for key in partial_keys(stage.remat)),
               0.0)


def recomputed_kernels(span: Mapping[str, float], cluster: Cluster, remat: Any = "selective") -> float:
    """Kernels a selective (or "dots", "selective-op") stage launches again per microbatch (its attention
    internals', or its tensors' but the matmuls', and every other matmul's), from the span's summed
    ``attn_launch_s`` (``dots_launch_s``, ``op_launch_s``)."""
    launch = cluster.device.efficiency.kernel_launch_s
    again = sum(span[f"{key}_launch_s"] for key in partial_keys(remat) or ("attn",))
    return again / launch if launch > 0 else 0.0


def task_overhead_s(cluster: Cluster, submesh: Sequence[int]) -> float:
    """Seconds charged per stage task (the forward, or the backward, of one microbatch): the device's
    ``task_overhead_s`` times the backend's count for a task on ``submesh`` (:func:`~autopar_lab.backends.task_devices`:
    once, but on the CPU once per device of the task). 0 on the GPU presets.

    >>> import dataclasses
    >>> from autopar_lab.cluster import Cluster
    >>> c = Cluster.preset("p3.16xlarge")
    >>> flat = c.with_(device=dataclasses.replace(c.device, task_overhead_s=1e-4))
    >>> task_overhead_s(flat, (1, 4)), task_overhead_s(flat, (1, 2))   # a GPU's: once a task, whatever its devices
    (0.0001, 0.0001)
    """
    return cluster.device.task_overhead_s * task_devices(cluster, submesh)


def pareto(cands: Sequence[StageCandidate]) -> list[StageCandidate]:
    """The candidates no other candidate beats on every count (forward time, backward time, static and activation
    memory): the stage DP and the simulation can never prefer a dominated one, so dropping them changes no plan.

    >>> a = StageCandidate((0, 0), (1, 2), (1, 2), False, 1.0, 2.0, 10.0, 5.0)
    >>> b = StageCandidate((0, 0), (1, 2), (2, 1), False, 1.5, 2.0, 10.0, 5.0)
    >>> [c.logical_mesh for c in pareto([a, b])]
    [(1, 2)]
    """
    keys = [(c.fwd_s, c.bwd_s, c.static_bytes, c.act_bytes) for c in cands]
    out = []
    for i, ki in enumerate(keys):
        dominated = any(all(x <= y for x, y in zip(kj, ki)) and (kj != ki or j < i)
                        for j, kj in enumerate(keys) if j != i)
        if not dominated:
            out.append(cands[i])
    return out


def pareto_mask(fields: Sequence[np.ndarray], alive: np.ndarray | None = None) -> np.ndarray:
    """``keep[k, p]``: option k is Pareto-optimal at position p over ``fields`` (each (K, P), lower is better),
    as :func:`~autopar_lab.pricing.stage.pareto` decides: an option no worse on every field than another, and
    better on one or equal on all and later, is dropped. One option against all at a time: (K, P) temporaries
    rather than (K, K, P), a quarter faster for the 1T table's blocks.

    ``alive`` (bool, (K, P)): only these options are compared and kept (``keep`` is False elsewhere). It must be
    closed upwards under dominance (an option no worse than an alive one on every field is alive), as "fits in the
    memory limit" is: then a dead option can dominate no alive one, so comparing the alive ones among themselves
    gives ``pareto_mask(fields) & alive`` exactly, and only at the positions and against the options alive (1T on
    3,072 GPUs: most layer ranges fit on no option)."""
    K, P = fields[0].shape
    if alive is None:
        alive = np.ones((K, P), dtype=bool)
    keep = np.zeros((K, P), dtype=bool)
    cols = np.flatnonzero(alive.any(axis=0))
    if cols.size == 0:
        return keep
    vals = [v[:, cols] for v in fields]
    live = alive[:, cols]
    dominated = np.zeros(live.shape, dtype=bool)
    later = np.arange(K)[:, None]
    for j in range(K):
        at = np.flatnonzero(live[j])  # where option j is alive: only there can it dominate
        if at.size == 0:
            continue
        le = np.ones((K, at.size), dtype=bool)  # option j is <= option i on every field
        eq = np.ones_like(le)
        for v in vals:
            vj, vi = v[j, at], v[:, at]
            le &= vj <= vi
            eq &= vj == vi
        dominated[:, at] |= le & (~eq | (later > j)) & (later != j)
    keep[:, cols] = live & ~dominated
    return keep
