"""Each stage's peak memory per device, split into what holds it.

A stage's peak is what the pipeline simulation charges it (:mod:`autopar_lab.simulate`): its static bytes (parameters,
their gradients and the optimizer state, as sharded on its mesh) plus the activations of every microbatch it holds
at once. :func:`memory_breakdown` splits that same figure:

* ``params_bytes``: the stage's parameter shards (the strategies the plan chose for its parameter inputs);
* ``grads_bytes``: their gradients, one per parameter byte, as the cost model counts them;
* ``optimizer_bytes``: the rest of the static bytes (Adam's two moments and its step count, sharded);
* ``activations_bytes``: ``act_per_microbatch_bytes`` x ``microbatches_in_flight`` (the most microbatches the
  schedule keeps alive on the stage at once).

``total_bytes`` is ``Stage.peak_mem_bytes`` itself, and the four parts add up to it. With rematerialisation a stage
keeps only its input per microbatch and runs the forward again in the backward pass; ``remat_saved_bytes`` is what
that saves (the activations it would hold without remat, less what it holds), 0 for a stage without remat.

    >>> parts = memory_breakdown(plan)[0]                                               # doctest: +SKIP
    >>> sum(parts[p] for p in PARTS) == plan.stages[0].peak_mem_bytes                     # doctest: +SKIP
    True
"""

from __future__ import annotations

from .graph.opgraph import INPUT_PRIMITIVE, PARAM

__all__ = ["memory_breakdown", "PARTS"]

#: The parts of a stage's peak memory, in the order they stack.
PARTS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")


def _layer_params(graph, intra, names: list[str]) -> list[float]:
    """Parameter bytes per device of each layer of ``graph`` under ``intra``'s strategies (operators outside layers
    count in the last layer, as the layer costs count them)."""
    index = {name: k for k, name in enumerate(names)}
    last = len(names) - 1
    out = [0.0] * len(names)
    for op in intra.ops:
        node = graph.op(op)
        if node.primitive == INPUT_PRIMITIVE and graph.tensor(node.outputs[0]).kind == PARAM:
            out[index.get(node.layer, last)] += intra.strategies[op].mem_bytes
    return out


def _unremat_act(plan, stage, graph, names: list[str], layer_map: list[int]) -> float:
    """The activation bytes per microbatch ``stage`` would keep without rematerialisation."""
    from .planner import layer_costs

    costs = layer_costs(graph, stage.intra, names)
    act = sum(costs[layer_map[k]].act_bytes for a, b in stage.layer_ranges for k in range(a, b + 1))
    return act / plan.microbatches


def memory_breakdown(plan) -> list[dict]:
    """Per stage of ``plan``: ``{stage, params_bytes, grads_bytes, optimizer_bytes, activations_bytes,
    act_per_microbatch_bytes, microbatches_in_flight, remat, remat_saved_bytes, total_bytes, limit_bytes}``
    (bytes per device; see the module docstring). Parts of stages without a solved mesh plan are 0 but for the
    total."""
    table = plan.table
    graph = table.solve_graph if table is not None else plan.graph
    names = list(graph.layers) or [""]
    layer_map = list(table.layer_map) if table is not None else list(range(len(plan.layer_names)))
    tl = plan.cost.timeline
    out = []
    params_by_intra: dict[int, list[float]] = {}
    for k, st in enumerate(plan.stages):
        if tl is not None:
            inflight = int(tl.peak_inflight[k])
        else:  # a timeline-less plan: the in-flight count its peak implies
            inflight = round((st.peak_mem_bytes - st.static_bytes) / st.act_bytes) if st.act_bytes else 0
        # an interleaved stage's chunks hold different amounts each: its activations are its peak over its static
        act = st.peak_mem_bytes - st.static_bytes if st.chunks else inflight * st.act_bytes
        params = 0.0
        saved = 0.0
        if st.intra is not None:
            per_layer = params_by_intra.get(id(st.intra))
            if per_layer is None:
                per_layer = params_by_intra[id(st.intra)] = _layer_params(graph, st.intra, names)
            params = sum(per_layer[layer_map[i]] for a, b in st.layer_ranges for i in range(a, b + 1))
            if st.remat:
                saved = max(_unremat_act(plan, st, graph, names, layer_map) - st.act_bytes, 0.0) * inflight
        out.append({"stage": k, "params_bytes": params, "grads_bytes": params,
                    "optimizer_bytes": st.static_bytes - 2 * params, "activations_bytes": act,
                    "act_per_microbatch_bytes": st.act_bytes, "microbatches_in_flight": inflight,
                    "remat": bool(st.remat), "remat_saved_bytes": saved,
                    "total_bytes": st.peak_mem_bytes, "limit_bytes": plan.cost.mem_limit_bytes})
    return out
