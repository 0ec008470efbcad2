"""How much of the hardware a plan uses: MFU, HFU and the roofline bound, in the cost panel's words.

- **MFU** (model FLOPs utilisation, Chowdhery et al., "PaLM", 2022, appendix B): the step's model FLOPs (the traced
  step's forward, backward and update, each operator counted once) over what the devices could run in the plan's step
  time at their peak: ``flops / (step x devices x peak)``.
- **HFU** (hardware FLOPs utilisation, the same paper): the same with the FLOPs the plan's recomputation runs again
  (a fully rematerialised stage runs its layers' forward twice; a selective one its attention internals,
  :mod:`autopar_lab.graph.attention`). Shown only for a plan that recomputes.
- **Roofline bound**: the best MFU any plan of this model can reach on these devices. Its *ideal step* runs every
  kernel of the step (:mod:`autopar_lab.graph.fusion`: the operators grouped as the compiler fuses them, a tensor
  inside a kernel never written to memory) split evenly over all the devices, each kernel at
  ``max(matmul FLOPs / peak + other FLOPs / vector rate, its memory traffic / peak bandwidth)`` (Williams et al.,
  "Roofline", CACM 2009), with no communication, bubble, recomputation or launch cost. The cost model prices every
  kernel at achievable rates (never above peak) on at least its share of the work, so the plan's step is never
  shorter; where it is (the CPU devices of the ``cpu`` preset, whose kernels cost less on fewer devices) the
  ideal step is taken as the plan's, and the text says so.

The peak is the device's figure for the dtype of the step's largest matmul (what a mixed-precision step runs its
matmuls in).

    >>> u = utilisation(plan)                              # doctest: +SKIP
    >>> u["mfu"] <= u["bound"] <= 1                         # doctest: +SKIP
    True
"""

from __future__ import annotations

import html
import math

from ...backends import plan_note
from ...graph import opcost
from ...graph.attention import attention_internals
from ...graph.fusion import kernel_role, kernel_view
from ...graph.opgraph import FORWARD, dtype_size
from ...rematmode import is_full, is_selective
from .fmt import fmt_flops, fmt_pct, fmt_s

__all__ = ["compute_dtype", "ideal_step_s", "recomputed_flops", "utilisation", "utilisation_html", "utilisation_text",
           "cpu_text"]

_IDEAL_CACHE: dict = {}


def compute_dtype(graph) -> str:
    """The dtype of the step's matmuls (what the device's peak is quoted for): the widest-FLOP dot_general's."""
    best, dtype = -1.0, "float32"
    for n in graph:
        if n.primitive == "dot_general" and n.flops > best and n.out_dtypes:
            best, dtype = n.flops, n.out_dtypes[0]
    return dtype


def _nbytes(shapes, dtypes) -> list[float]:
    return [float(math.prod(s)) * dtype_size(d) for s, d in zip(shapes, dtypes)]


def ideal_step_s(graph, device, devices: int) -> float:
    """The roofline's ideal step of ``graph`` on ``devices`` of ``device`` (see the module docstring): the sum over
    its kernels of ``max(compute at peak, traffic at peak bandwidth)``, divided by the device count."""
    flash = bool(device.efficiency.flash_attention)
    view = kernel_view(graph, flash)
    compute: dict = {}
    traffic: dict = {}
    for node in graph:
        role = view.roles.get(node.id)
        if role is None:
            role = kernel_role(node, flash)
        if role is not None and role.kind in ("free", "dead"):
            continue  # a layout change or scalar folded into its readers, or removed
        k = role.kernel if role is not None else ("own", node.id)
        dtype = node.in_dtypes[0] if node.in_dtypes else (node.out_dtypes[0] if node.out_dtypes else "float32")
        if node.primitive in opcost.CONTRACTIONS:
            work = role.work if role is not None and role.root else 1.0  # a causal flash kernel skips half
            t = node.flops * work / device.peak(dtype)
        else:
            t = node.flops / device.vector_rate(dtype)
        compute[k] = compute.get(k, 0.0) + t
        if role is None:
            moved = float(node.bytes_accessed)
        elif role.absorbed:
            moved = 0.0  # its traffic is its kernel root's
        else:
            ins, outs = _nbytes(node.in_shapes, node.in_dtypes), _nbytes(node.out_shapes, node.out_dtypes)
            moved = (sum(f * b for f, b in zip(role.reads, ins)) + sum(f * b for f, b in zip(role.writes, outs))
                     + role.extra_bytes * sum(outs))
        traffic[k] = traffic.get(k, 0.0) + moved
    bw = device.memory_bandwidth
    total = sum(max(compute.get(k, 0.0), traffic.get(k, 0.0) / bw) for k in set(compute) | set(traffic))
    return total / int(devices)


def recomputed_flops(plan) -> float:
    """The FLOPs a step of ``plan`` runs again to recompute what it did not keep: the forward of every layer a fully
    rematerialised stage runs, the attention internals of every layer a selective one runs (0 without remat)."""
    g = plan.graph
    index = {name: i for i, name in enumerate(plan.layer_names)}
    full: set[int] = set()
    selective: set[int] = set()
    for st in plan.stages:
        layers = {i for a, b in st.layer_ranges for i in range(a, b + 1)}
        if is_full(st.remat):
            full |= layers
        elif is_selective(st.remat):
            selective |= layers
    if not full and not selective:
        return 0.0
    internals = attention_internals(g) if selective else frozenset()
    out = 0.0
    for node in g:
        i = index.get(node.layer)
        if i is None or node.role != FORWARD:
            continue
        if i in full or (i in selective and node.id in internals):
            out += node.flops
    return out


def utilisation(plan) -> dict:
    """``{"flops", "recomputed_flops", "dtype", "peak", "devices", "step_s", "mfu", "hfu", "ideal_s", "bound",
    "at_roofline"}`` for ``plan`` (see the module docstring; ``at_roofline``: the ideal step was longer than the
    plan's and was taken as the plan's). The ideal step is cached per graph, device and device count."""
    g, c = plan.graph, plan.cluster
    n = c.num_devices
    key = (id(g), c.device, n)
    hit = _IDEAL_CACHE.get(key)
    if hit is None or hit[0] is not g:
        dtype = compute_dtype(g)
        if len(_IDEAL_CACHE) > 16:
            _IDEAL_CACHE.clear()
        hit = _IDEAL_CACHE[key] = (g, float(g.total_flops), dtype, c.device.peak(dtype), ideal_step_s(g, c.device, n))
    _, flops, dtype, peak, ideal = hit
    step = plan.cost.step_time_s
    at_roofline = 0 < step < ideal
    ideal = min(ideal, step) if step > 0 else ideal
    capacity = n * peak
    extra = recomputed_flops(plan)
    mfu = flops / (step * capacity) if step > 0 else 0.0
    return {"flops": flops, "recomputed_flops": extra, "dtype": dtype, "peak": peak, "devices": n, "step_s": step,
            "mfu": mfu, "hfu": (flops + extra) / (step * capacity) if step > 0 else 0.0, "ideal_s": ideal,
            "bound": flops / (ideal * capacity) if ideal > 0 else 0.0, "at_roofline": at_roofline}


def utilisation_text(u: dict) -> str:
    """The figures of :func:`utilisation` as the cost panel says them (plain text)."""
    n = u["devices"]
    text = (f"MFU {fmt_pct(u['mfu'])}: the step's {fmt_flops(u['flops'])} of model FLOPs in {fmt_s(u['step_s'])} "
            f"on {n} device{'s' if n != 1 else ''} of {fmt_flops(u['peak'])}/s "
            f"({u['dtype']} peak)")
    if u["recomputed_flops"]:
        text += (f"; HFU {fmt_pct(u['hfu'])}, counting the {fmt_flops(u['recomputed_flops'])} the recomputation "
                 "runs again")
    text += (f". Roofline bound {fmt_pct(u['bound'])} for this model on these devices, whatever the plan: an ideal "
             f"step of {fmt_s(u['ideal_s'])}, every kernel split evenly over all {n} devices at peak FLOP/s or peak "
             "memory bandwidth (whichever binds), with no communication, bubble or recomputation")
    if u["at_roofline"]:
        text += (" (the cost model prices this plan faster than that ideal, as it does on the CPU, whose devices' "
                 "kernels cost less on fewer devices: the ideal is taken as the plan's step)")
    return text + "."


def cpu_text(plan) -> str:
    """On the CPU (the ``cpu`` preset: JAX's CPU devices, slices of one machine's cores), how the cost model prices
    the plan's stages, which explains a plan of many stages and one microbatch
    (:func:`autopar_lab.backends.plan_note`); "" on a GPU or TPU."""
    sizes = [st.submesh[0] * st.submesh[1] for st in plan.stages]
    return plan_note(plan.cluster, sizes, plan.microbatches, fmt_pct)


def utilisation_html(plan) -> str:
    """The cost panel's utilisation paragraph for ``plan`` (class ``autopar-utilisation``) and, on the CPU, how its
    devices are priced (class ``autopar-cpu``, :func:`cpu_text`)."""
    out = f"<div class='autopar-utilisation'>{html.escape(utilisation_text(utilisation(plan)))}</div>"
    note = cpu_text(plan)
    return out + (f"<div class='autopar-cpu'><small>{html.escape(note)}</small></div>" if note else "")
