"""Layer costs: an intra-operator plan's cost split by layer, and the bytes crossing each cut between layers.

These are what the stage-cost formula (:mod:`autopar_lab.pricing.stage`) adds up over a stage's layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ..backends import (buffer_share, dot_f32_copies, kernel_share, on_cpu, read_again_s, reshard_buffers_held,
                        task_array_s)
from ..graph.attention import alternate_matmuls, attention_internals, dots_recomputed, output_matmuls
from ..graph.fusion import attach_kernel_roles, kernel_view
from ..graph.opgraph import BATCH, FORWARD, INPUT_PRIMITIVE, OPT_STATE, PARAM, UPDATE, OpGraph, cast_kernels
from ..sharding.reshard import collective_time
from ..sharding.strategies import COLLECTIVE_KINDS
from ..solve.intra import StrategyCache, conversions, weight_gradient_ops
from ..solve.memterms import STATIC_KINDS, held_copies, kept_outputs, memory_terms, reshard_buffer_bytes

if TYPE_CHECKING:
    from ..solve.intra import IntraPlan

#: Operators that launched a kernel of their own in the operator-by-operator model (kept for code that imports it;
#: launches are now counted per kernel, :mod:`autopar_lab.graph.fusion`).
HEAVY_PRIMITIVES = frozenset(["dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "gather",
                              "scatter-add", "scatter_add", "argmax", "cumsum"])


@dataclass(frozen=True)
class LayerCost:
    """One layer on one logical mesh, per training step at the graph's batch (bytes per device).

    Times: ``fwd_s`` (forward work: compute, collectives, resharding), ``bwd_s`` (backward and optimizer update,
    with the update's kernel launches and its state arrays' dispatch, ``Efficiency.buffer_s`` each, which run once
    per step); of those, ``compute_s``, ``comm_s`` and
    ``reshard_s`` by kind, ``fwd_compute_s``/``bwd_compute_s`` the compute of each pass, ``sync_s`` the
    weight-gradient collectives (data-parallel gradient reduction: it can overlap the backward of the step's last
    microbatch) and ``gather_s`` the gathers of parameters from their shards (they can be prefetched behind the
    forward). ``heavy_fwd``/``heavy_bwd``: kernels launched per microbatch in each pass, ``launch_fwd_s``/
    ``launch_bwd_s`` what they cost per microbatch.

    Memory: ``static_bytes`` (held all step) = ``param_bytes`` + ``grad_bytes`` + ``master_bytes`` +
    ``opt_bytes`` + ``copies_bytes`` + ``fp8_bytes`` (an FP8 format's weight copies; 0 otherwise;
    :data:`~autopar_lab.solve.memterms.STATIC_KINDS`); ``act_bytes``: the forward
    tensors the backward reads; ``ckpt_bytes``: the activations entering the layer (what it keeps when
    rematerialised); ``temp_bytes``: its largest tensor written and not kept (a transient buffer); ``layers``: 1 (so
    that running sums count layers).

    Selective recomputation (:mod:`autopar_lab.graph.attention`): ``attn_act_bytes``, the part of ``act_bytes`` that
    the attention internals hold (scores, softmax: s^2 per head; 0 when a flash-attention kernel keeps none),
    ``attn_fwd_s`` the forward time of the operators that make them, ``attn_launch_s`` their kernels' launches per
    microbatch. Keeping only the matmuls' outputs (remat ``"dots"``, :func:`~autopar_lab.graph.attention.
    dots_recomputed`): ``dots_act_bytes``, ``dots_fwd_s``, ``dots_launch_s``, the same for every other forward
    operator of a transformer block, net of the matmul outputs that only a recomputed operator reads (q before its
    rotary embedding), which the policy keeps for the recomputation. torchtitan's op-level policy (remat
    ``"selective-op"``, :func:`~autopar_lab.graph.attention.alternate_matmuls`) drops, beyond "dots", every other
    matmul of a block: ``op_act_bytes`` (those matmuls' outputs that "dots" keeps; on an eager PyTorch host, net of
    the block's output projection's, which its SAC caches besides the block's input: :func:`~autopar_lab.graph.
    attention.output_matmuls`), ``op_fwd_s`` (their forward,
    which the backward runs again), ``op_launch_s`` (their kernels' launches per microbatch). ``attn_kernels``,
    ``dots_kernels``, ``op_kernels``: those kernels' counts per microbatch (what a host launching each kernel pays
    for again: :func:`~autopar_lab.pricing.stage.host_stretch`).

    Collective latency: ``collectives_fwd``/``collectives_bwd``, the collectives a microbatch issues in each pass
    (tensor-parallel all-reduces, activation resharding: every collective but the once-a-step ones, the weight-gradient
    reduction, parameter gathers and the optimizer's); ``latency_fwd_s``/``latency_bwd_s``, their latency (the alpha
    term of each, by the link class its axis crosses). ``fwd_s``/``bwd_s`` count it once a step, as they count the
    bandwidth; a microbatch pays it in full (:func:`~autopar_lab.pricing.stage.stage_cost`).

    Backend terms (:mod:`autopar_lab.backends`; 0 on a GPU or TPU): ``task_arrays_s``, what each forward and
    backward task pays to take the layer's state arrays; ``reread_s``, what one later layer of the same backward
    program pays a step to read the layer's output again (a backward program over layers a..b pays
    ``sum over k of (b - k) x reread_s[k]``: :func:`~autopar_lab.backends.program_rereads_s`);
    ``f32_copies_act_bytes``/``f32_copies_weight_bytes``, the float32 copies of the layer's largest half-precision
    matmul's backward (:func:`~autopar_lab.backends.dot_f32_copies`), the part that grows with the microbatch (per
    step at the full batch) and the weights' part: a stage's backward holds its largest layer's at once
    (:func:`~autopar_lab.pricing.stage.stage_cost`, the layers' maximum, not their sum).

    Resharding buffers: ``reshard_dst_act_bytes`` / ``reshard_dst_weight_bytes``, the destination buffers
    (:func:`~autopar_lab.solve.memterms.reshard_buffer_bytes`) of the layer's backward reshardings of activations (per
    step at the full batch: a microbatch's is that over the count) and of weights (once). They are live beside their
    sources in the backward's working set, the layer's together where XLA:CPU issues a layer's collectives ahead of
    the operators reading them (priced on the CPU only: :func:`~autopar_lab.backends.reshard_buffers_held`; 0
    elsewhere), which no other term counts; a stage holds its largest layer's
    (:func:`~autopar_lab.pricing.stage.range_max`). The forward's are not held into the backward: a stage's stash
    keeps each tensor as its producer wrote it and the backward reshards it again (one of its own).

    A parameter read in more than one layer (GPT's tied token embedding: the lookup in the first layer, the logits
    in the last): ``shared``, one ``(parameter, home, bytes)`` per such parameter the layer reads, ``home`` True in
    the layer that holds it (its input's layer); ``bytes`` what a stage that reads it without holding it keeps while
    its tasks run (:func:`shared_weights`): :func:`~autopar_lab.pricing.stage.shared_weight_bytes` prices it.

    A pipeline's boundaries (read at a stage's first and last layer, not summed: :data:`~autopar_lab.pricing.stage.
    EDGE_FIELDS`): ``recv_bytes``, the forward tensors of earlier layers this layer reads (its ``ckpt_bytes`` less
    the batch's inputs), at their producers' sharding: what a stage starting here receives, keeps for its backward
    and writes the gradient of; ``sent_act_bytes``, the part of ``act_bytes`` that only later layers read (the
    layer's outputs no operator of it or an earlier layer reads again): what a stage ending here sends and does not
    keep (the receiver does); ``sent_attn_act_bytes``, ``sent_dots_act_bytes``, ``sent_op_act_bytes``: the part of
    it in ``attn_act_bytes``, ``dots_act_bytes``, ``op_act_bytes`` (dropped anyway by that recomputation).
    """

    fwd_s: float
    bwd_s: float  # backward + optimizer update
    compute_s: float
    comm_s: float
    reshard_s: float
    static_bytes: float
    act_bytes: float
    heavy_fwd: int
    heavy_bwd: int
    fwd_compute_s: float = 0.0
    bwd_compute_s: float = 0.0
    sync_s: float = 0.0
    gather_s: float = 0.0
    launch_fwd_s: float = 0.0
    launch_bwd_s: float = 0.0
    ckpt_bytes: float = 0.0
    temp_bytes: float = 0.0
    param_bytes: float = 0.0
    grad_bytes: float = 0.0
    master_bytes: float = 0.0
    opt_bytes: float = 0.0
    copies_bytes: float = 0.0
    fp8_bytes: float = 0.0
    layers: int = 1
    attn_act_bytes: float = 0.0
    attn_fwd_s: float = 0.0
    attn_launch_s: float = 0.0
    dots_act_bytes: float = 0.0
    dots_fwd_s: float = 0.0
    dots_launch_s: float = 0.0
    op_act_bytes: float = 0.0
    op_fwd_s: float = 0.0
    op_launch_s: float = 0.0
    attn_kernels: int = 0
    dots_kernels: int = 0
    op_kernels: int = 0
    latency_fwd_s: float = 0.0
    latency_bwd_s: float = 0.0
    collectives_fwd: int = 0
    collectives_bwd: int = 0
    task_arrays_s: float = 0.0
    reread_s: float = 0.0
    f32_copies_act_bytes: float = 0.0
    f32_copies_weight_bytes: float = 0.0
    shared: tuple[tuple[int, bool, float], ...] = ()
    recv_bytes: float = 0.0
    sent_act_bytes: float = 0.0
    sent_attn_act_bytes: float = 0.0
    sent_dots_act_bytes: float = 0.0
    sent_op_act_bytes: float = 0.0
    reshard_dst_act_bytes: float = 0.0
    reshard_dst_weight_bytes: float = 0.0


def collective_latency_s(mesh: Any, kind: str, axis: Any) -> float:
    """The latency (alpha) term of one collective of ``kind`` over ``axis`` of ``mesh``: its time for an empty
    buffer (0 on an axis of one device). A ring strategy's send/recv steps overlap the compute they rotate behind
    (:func:`~autopar_lab.sharding.ring.ring_exposed_s` prices what shows): 0 here."""
    if kind not in COLLECTIVE_KINDS:
        return 0.0
    return collective_time(mesh, kind, 0.0, axis)


def shared_weights(graph: OpGraph, plan: IntraPlan, index: dict[str | None, int]) -> dict[int, list]:
    """layer index -> its ``(parameter, home, bytes)`` entries for :attr:`LayerCost.shared`: each parameter whose
    forward readers (its own operators or its compute copy's cast) lie in a layer other than its input's.

    A stage that reads such a parameter without holding it receives it, and returns its gradient, every microbatch
    (:mod:`autopar_lab.runtime.partition`: the earliest reader owns a step input; a later stage receives it from the
    owner's forward, and its backward's gradient of that input is summed with the owner's); Megatron-LM likewise
    keeps a copy of the word embedding on the last stage and all-reduces its gradient with the first's. While its
    backward runs the stage holds the weight as its layers compute with it (the ``param`` term of
    :func:`~autopar_lab.solve.memterms.memory_terms`: the compute copy of an fp32 master) and that input's gradient
    as stored (its own bytes as sharded: float32 for a master weight; measured on gpt-350m's tp4 x pp2 last stage,
    8 CPU devices: 25 MiB of float16 weight and 50 MiB of float32 gradient a device)."""
    last = len(index) - 1
    out: dict[int, list] = {}
    for op in plan.ops:
        node = graph.op(op)
        if node.primitive != INPUT_PRIMITIVE or graph.tensor(node.outputs[0]).kind != PARAM:
            continue
        t = node.outputs[0]
        home = index.get(node.layer, last)
        readers = {index.get(graph.op(c).layer, last) for c in graph.consumers.get(t, ())
                   if graph.op(c).role == FORWARD}
        if not readers - {home}:
            continue
        s = plan.strategies[op]
        weight = sum(b for kind, b in memory_terms(graph, node, s, tuple(plan.mesh.shape)) if kind == "param")
        nbytes = float(weight + s.mem_bytes)
        for k in readers | {home}:
            out.setdefault(k, []).append((int(t), k == home, nbytes))
    return out


def layer_costs(graph: OpGraph, plan: IntraPlan, layer_names: Sequence[str],
                cache: StrategyCache | None = None) -> list[LayerCost]:
    """Split an intra plan's cost by layer: each operator counts in its layer (operators without one in the last
    layer), each resharding in its consumer's layer; each kernel's launch in its root's layer."""
    eager = not plan.mesh.cluster.device.efficiency.kernel_fusion
    attach_kernel_roles(graph, eager=eager)
    index: dict[str | None, int] = {name: k for k, name in enumerate(layer_names)}
    last = len(layer_names) - 1
    acc: list[dict[str, Any]] = [
        dict(fwd=0.0, bwd=0.0, compute=0.0, comm=0.0, reshard=0.0, act=0.0, hf=0, hb=0, fc=0.0, bc=0.0, sync=0.0,
             gather=0.0, lf=0.0, lb=0.0, ckpt=0.0, temp=0.0, attn_act=0.0, attn_fwd=0.0, attn_lf=0.0, latf=0.0,
             latb=0.0, cf=0, cb=0, arrays=0.0, reread=0.0, dots_act=0.0, dots_fwd=0.0, dots_lf=0.0, f32=(0.0, 0.0),
             op_act=0.0, op_fwd=0.0, op_lf=0.0, attn_k=0, dots_k=0, op_k=0, recv=0.0, sent=0.0, sent_attn=0.0,
             sent_dots=0.0, sent_op=0.0, rs_act=0.0, rs_weight=0.0,
             **{k: 0.0 for k in STATIC_KINDS})
        for _ in layer_names]
    cache = cache or StrategyCache(plan.mesh)
    mshape = tuple(plan.mesh.shape)
    device = plan.mesh.cluster.device
    fused = device.efficiency.flash_attention
    # The backends' shares of the calibrated launch and array costs (1 but on the CPU).
    launch = device.efficiency.kernel_launch_s * kernel_share(plan.mesh)
    per_buffer = device.efficiency.buffer_s * buffer_share(plan.mesh)
    view = kernel_view(graph, fused, eager=eager)
    library = device.efficiency.library_kernels
    keeps = view.kept(library)  # the forward tensors the backward keeps (a fused-kernel library's, or autodiff's)
    grads = weight_gradient_ops(graph, plan.ops)
    inside = set(plan.ops)
    internals = attention_internals(graph)
    elementwise = dots_recomputed(graph)
    alternate = alternate_matmuls(graph)
    # torchtitan's eager SAC (an eager PyTorch host: no kernel fusion, not this library's CPU runtime) also
    # keeps the block's output projection (graph.attention.output_matmuls); a compiled block does not
    cached = output_matmuls(graph) if eager and not on_cpu(plan.mesh.cluster) else frozenset()
    shared = shared_weights(graph, plan, index)

    def slot(op):
        return acc[index.get(graph.op(op).layer, last)]

    def count(a: dict[str, Any], fwd: bool, cols: Any) -> None:
        # Collectives every microbatch issues again: their latency is paid B times a step.
        for kind, axis in cols:
            lat = collective_latency_s(plan.mesh, kind, axis)
            if lat > 0:
                a["latf" if fwd else "latb"] += lat
                a["cf" if fwd else "cb"] += 1

    for op in plan.ops:
        node, s = graph.op(op), plan.strategies[op]
        a = slot(op)
        fwd = node.role == FORWARD
        a["fwd" if fwd else "bwd"] += s.cost
        a["fc" if fwd else "bc"] += s.compute_s
        a["compute"] += s.compute_s
        a["comm"] += s.comm_s
        if op in grads:
            a["sync"] += s.comm_s
        elif node.role != UPDATE:
            count(a, fwd, ((kind, axis) for kind, axis, _n in s.collectives))
        if per_buffer and node.primitive == INPUT_PRIMITIVE and \
                graph.tensor(node.outputs[0]).kind in (PARAM, OPT_STATE):
            a["bwd"] += per_buffer  # the update program takes and returns this state array once per step
            a["arrays"] += task_array_s(plan.mesh.cluster, per_buffer, graph.tensor(node.outputs[0]).kind)
        role = view.roles.get(op)
        if role is not None and role.root:
            if node.role == UPDATE:
                a["bwd"] += launch  # the optimizer's kernels run once per step
            elif fwd:
                a["hf"] += 1
                a["lf"] += launch
            else:
                a["hb"] += 1
                a["lb"] += launch
        casts = cast_kernels(node)  # an FP8 format's cast kernels, launched where the operator runs
        if casts:
            if node.role == UPDATE:
                a["bwd"] += casts * launch
            elif fwd:
                a["hf"] += casts
                a["lf"] += casts * launch
            else:
                a["hb"] += casts
                a["lb"] += casts * launch
        if fwd:
            copies = dot_f32_copies(plan.mesh, graph, node, s, view.weight_derived)
            if copies is not None and sum(copies) > sum(a["f32"]):
                a["f32"] = copies  # the layer's largest matmul's: the backend reuses the buffers of the others
        again = read_again_s(plan.mesh, graph, node, (s,))
        if again is not None:
            a["reread"] += again[0]
        internal, recomputed, matmul_again = op in internals, op in elementwise, op in alternate
        for key, inside_set in (("attn", internal), ("dots", recomputed), ("op", matmul_again)):
            if inside_set:
                a[f"{key}_fwd"] += s.cost
                if role is not None and role.root:
                    a[f"{key}_lf"] += launch
                    a[f"{key}_k"] += 1
        for kind, nbytes in memory_terms(graph, node, s, mshape, fused, library_kernels=library):
            a[kind] += nbytes
            if internal and kind == "act":
                a["attn_act"] += nbytes
            if recomputed and kind == "act":
                a["dots_act"] += nbytes
            if matmul_again and kind == "act":
                a["op_act"] += nbytes
        if fwd and elementwise and node.primitive == "dot_general" and not internal:
            # A matmul output only a recomputed operator reads (q before its rotary embedding, a projection before
            # the residual add): the policy keeps it for the recomputation, so it saves that much less. (Not the
            # scores: a flash-attention kernel never writes them.)
            for t, kept in zip(node.outputs, s.out_specs):
                if t not in keeps and any(c in elementwise for c in graph.consumers.get(t, ())):
                    info = graph.tensor(t)
                    a["dots_act"] -= kept.bytes_per_device(info.shape, info.dtype, mshape)
                    if matmul_again:  # recomputed itself under "selective-op": not kept for the recomputation
                        a["op_act"] += kept.bytes_per_device(info.shape, info.dtype, mshape)
                    elif op in cached:
                        # Eager SAC caches every saved op's output, this one (no backward operator reads it) besides
                        # the block's input its checkpoint saves, which the count drops with the residual add that
                        # writes it (this output, kept above, stands for it: a compiled block keeps that input only).
                        a["op_act"] -= kept.bytes_per_device(info.shape, info.dtype, mshape)

        if fwd:
            # An output only later layers read: a stage whose last layer this is sends it and keeps it no longer.
            here = index.get(node.layer, last)
            for t, kind, nbytes in kept_outputs(graph, node, s, mshape, fused, library_kernels=library):
                readers = [index.get(graph.op(c).layer, last) for c in graph.consumers.get(t, ())]
                if kind == "act" and readers and min(readers) > here:
                    a["sent"] += nbytes
                    for key, inside_set in (("attn", internal), ("dots", recomputed), ("op", matmul_again)):
                        if inside_set:
                            a[f"sent_{key}"] += nbytes
        if role is not None and role.kind != "dead":
            written = [b for w, t, spec in zip(role.writes, node.outputs, s.out_specs) if w and t not in keeps
                       for b in (spec.bytes_per_device(graph.tensor(t).shape, graph.tensor(t).dtype, mshape),)]
            a["temp"] = max(a["temp"], max(written, default=0.0))
        if fwd and node.primitive != INPUT_PRIMITIVE:
            here = index.get(node.layer, last)
            seen = a.setdefault("_ckpt_seen", set())
            for t in node.inputs:
                info = graph.tensor(t)
                p = info.producer
                if p is None or t in seen:
                    continue
                pn = graph.op(p)
                from_input = pn.primitive == INPUT_PRIMITIVE and info.kind == BATCH
                if not from_input and (pn.primitive == INPUT_PRIMITIVE or pn.role != FORWARD or
                                       index.get(pn.layer, last) >= here or t in view.weight_derived):
                    continue
                seen.add(t)
                spec = plan.strategies[p].out_specs[pn.outputs.index(t)] if p in inside else None
                held = spec.bytes_per_device(info.shape, info.dtype, mshape) if spec is not None else info.nbytes
                a["ckpt"] += held
                if not from_input:  # received from the stage before, where a stage starts here
                    a["recv"] += held
    convs = list(conversions(graph, plan.ops, plan.strategies, cache))
    held = reshard_buffers_held(plan.mesh.cluster)  # a layer's backward copies live together (the CPU's XLA)
    for v, nbytes in held_copies(graph, convs, mshape).values():
        slot(v)["copies"] += nbytes
    for _u, v, is_alias, t, src, dst, c in convs:
        a = slot(v)
        a["reshard"] += c
        a["fwd" if graph.op(v).role == FORWARD and not is_alias else "bwd"] += c
        if not is_alias:
            weight = t.kind == PARAM or t.id in view.weight_derived
            if held and graph.op(v).role not in (FORWARD, UPDATE):  # the backward's copy, beside its source
                a["rs_weight" if weight else "rs_act"] += reshard_buffer_bytes(graph, v, t, src, dst, mshape)
            if graph.op(v).role == FORWARD and weight:
                a["gather"] += c  # a parameter's gather for the forward: prefetchable behind earlier layers
            elif not weight and graph.op(v).role != UPDATE:  # gathered weights are kept: gathered once a step
                count(a, graph.op(v).role == FORWARD,
                      ((kind, axis) for kind, axis, _n in cache.reshard_collectives(src, dst, t.shape, t.dtype)))
    out = []
    for layer, a in enumerate(acc):
        static = sum(a[k] for k in STATIC_KINDS)
        out.append(LayerCost(a["fwd"], a["bwd"], a["compute"], a["comm"], a["reshard"], static, a["act"], a["hf"],
                             a["hb"], fwd_compute_s=a["fc"], bwd_compute_s=a["bc"], sync_s=a["sync"],
                             gather_s=a["gather"], launch_fwd_s=a["lf"], launch_bwd_s=a["lb"], ckpt_bytes=a["ckpt"],
                             temp_bytes=a["temp"], param_bytes=a["param"], grad_bytes=a["grad"],
                             master_bytes=a["master"], opt_bytes=a["opt"], copies_bytes=a["copies"],
                             fp8_bytes=a["fp8"],
                             attn_act_bytes=a["attn_act"], attn_fwd_s=a["attn_fwd"], attn_launch_s=a["attn_lf"],
                             dots_act_bytes=a["dots_act"], dots_fwd_s=a["dots_fwd"], dots_launch_s=a["dots_lf"],
                             op_act_bytes=a["op_act"], op_fwd_s=a["op_fwd"], op_launch_s=a["op_lf"],
                             attn_kernels=a["attn_k"], dots_kernels=a["dots_k"], op_kernels=a["op_k"],
                             latency_fwd_s=a["latf"], latency_bwd_s=a["latb"], collectives_fwd=a["cf"],
                             collectives_bwd=a["cb"], task_arrays_s=a["arrays"], reread_s=a["reread"],
                             f32_copies_act_bytes=a["f32"][0], f32_copies_weight_bytes=a["f32"][1],
                             shared=tuple(shared.get(layer, ())), recv_bytes=a["recv"], sent_act_bytes=a["sent"],
                             sent_attn_act_bytes=a["sent_attn"], sent_dots_act_bytes=a["sent_dots"],
                             sent_op_act_bytes=a["sent_op"], reshard_dst_act_bytes=a["rs_act"],
                             reshard_dst_weight_bytes=a["rs_weight"]))
    return out


def cut_bytes(graph: OpGraph, layer_names: Sequence[str]) -> list[float]:
    """Activation bytes (whole batch) crossing the cut in front of each layer 1..L-1 in the forward pass."""
    index: dict[str | None, int] = {name: k for k, name in enumerate(layer_names)}
    last = len(layer_names) - 1
    out = [0.0] * max(len(layer_names) - 1, 0)
    for node in graph:
        if node.role != FORWARD or node.primitive == INPUT_PRIMITIVE:
            continue
        src = index.get(node.layer, last)
        for t in node.outputs:
            far = max((index.get(graph.op(c).layer, last) for c in graph.consumers.get(t, ())
                       if graph.op(c).role == FORWARD), default=src)
            for k in range(src + 1, far + 1):
                out[k - 1] += graph.tensor(t).nbytes
    return out


def batch_size(graph: OpGraph) -> int:
    """The step's batch size: the largest leading dimension of its batch inputs (1 without any)."""
    sizes = [graph.tensor(t).shape[0] for t in graph.inputs if graph.tensor(t).kind == BATCH and graph.tensor(t).shape]
    return max(sizes) if sizes else 1


__all__ = ["HEAVY_PRIMITIVES", "LayerCost", "collective_latency_s",
           "layer_costs", "cut_bytes", "batch_size"]
