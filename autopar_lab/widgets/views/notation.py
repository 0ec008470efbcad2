"""How to read what the views write in Alpa's notation (Zheng et al., "Alpa", OSDI 2022, section 4): a strategy such
as ``S0S1R = S0RS1 x S1R [reduce_scatter@1]``, and an ILP group such as ``layer_2: reused from layer_0 (in the 6-layer
copy ...)``. The sharding table shows :func:`notation_html` under its rows; the strategy dropdown and the graph's
legend carry :data:`STRATEGY_TIP`.

    >>> "S0" in STRATEGY_TIP and "replicated" in STRATEGY_TIP
    True
"""

from __future__ import annotations

__all__ = ["STRATEGY_TIP", "GROUP_TIP", "notation_html"]

#: One line on a strategy's name (tooltips and legends).
STRATEGY_TIP = ("strategy = output sharding = each input's, joined by x; one letter group per tensor dimension: "
                "S0 split over mesh axis 0, S1 over axis 1, S01 over both, R replicated; [collective@axis]: the "
                "collective the operator runs and the mesh axis it runs over")

#: One line on an ILP group.
GROUP_TIP = ("ILP group: the intra-op ILP solves layers with the same operators once; \"reused from layer_0\": "
             "this layer takes layer_0's solution; a deep model is solved on a shallow copy of itself (\"the 6-layer "
             "copy\") and every real layer of a kind shares the solution of that kind's layer in the copy")


def notation_html() -> str:
    """A collapsed "how to read" box (class ``autopar-notation``) explaining strategy names and ILP groups."""
    return (
        "<details class='autopar-notation'><summary><small>how to read a strategy "
        "(<code>S0S1R = S0RS1 x S1R [reduce_scatter@1]</code>) and an ILP group</small></summary><small>"
        "<b>A strategy</b> is written <i>output = input x input</i>: how the operator's output is laid out on the "
        "stage's logical mesh, then how each input must be. Each tensor gets one letter group per dimension, in "
        "order: <code>S0</code> split over mesh axis 0 (the mesh's first number: 2 in 2x4), <code>S1</code> split over "
        "axis 1, <code>S01</code> split over both, <code>R</code> replicated (every device holds it whole); "
        "<code>''</code> is a scalar. Brackets name the collective the operator runs to make its output and the mesh "
        "axis it runs over. So <code>S0S1R = S0RS1 x S1R [reduce_scatter@1]</code> is a matmul whose first input is "
        "split over axis 0 (its first dimension) and axis 1 (its last), whose second input is split over axis 1 on the "
        "dimension they contract: each device adds up part of every sum, and a reduce-scatter over axis 1 finishes "
        "the sums and leaves the output split over axis 0 and axis 1. The dropdown's change is the step time the "
        "plan gains or loses with it.<br>"
        "<b>An ILP group</b> is the set of operators one intra-op ILP solved: a layer (or the operators outside "
        "every layer). Layers with the same operators are solved once: <i>reused from layer_0</i> means this layer "
        "takes layer_0's solution; <i>solved</i>, its own ILP's; <i>N merged</i>, operators that only follow another "
        "were solved with it. A deep model is planned on a shallow copy of itself (<i>the 6-layer copy</i>): the "
        "group names that copy's layers, and every real layer of the same kind shares its solution, so an override "
        "applies to all of them unless you choose <i>this layer alone</i>."
        "</small></details>")
