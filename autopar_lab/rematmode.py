"""A stage's rematerialisation (activation recomputation) choice: none, selective or full.

The value a plan, a stage candidate and every ``remat=`` argument carry is one of :data:`REMAT_CHOICES`:
``False`` (keep every activation the backward reads), ``True`` (Megatron-LM's full recomputation: keep each
layer's input, recompute the layer's forward in the backward) or ``"selective"`` (Korthikanti et al. 2022: keep
everything but the attention internals -- the scores, the softmax and what lies between the two batched matmuls --
and recompute those). ``True``/``False`` keep meaning full/none, as they always did, so plans, plan files and code
written before selective recomputation read the same; the strings ``"none"`` and ``"full"`` are accepted too.

``"dots"`` (not among the planner's choices: a framework's policy that a layout names) keeps every matmul's output
in the transformer blocks and recomputes the rest (norms, activations, rotary embeddings): MaxText's ``minimal``
(JAX's ``checkpoint_dots``) and torchtitan's op-level selective checkpointing. With flash attention, which stores no
scores, Megatron-LM's selective recomputation saves next to nothing; this policy saves the elementwise tensors.

``"selective-op"`` (a layout's policy too: torchtitan's ``[activation_checkpoint] mode = "selective"`` with
``selective_ac_option = "op"``, named as its two settings read) is torchtitan's op-level policy as it is written: it
saves the outputs of SDPA and of the matmuls (``aten.mm``) but of every second one, counted per transformer block in
the forward's order, and recomputes everything else. On a Llama block (wq, wk, wv, wo, w1, w3, w2) it keeps wq's,
wv's, w1's and w2's outputs and the attention's, and recomputes wk, wo and w3 besides the elementwise operators:
"dots" plus every other matmul (:func:`~autopar_lab.graph.attention.alternate_matmuls`).

Never test a remat value for truth (``"selective"`` is truthy): use :func:`is_full` / :func:`is_selective`.

>>> remat_value("full"), remat_value(False), remat_value("selective")
(True, False, 'selective')
>>> remat_label(True), remat_label("selective"), remat_label(False)
('full', 'selective', 'none')
"""

from __future__ import annotations

from typing import Any, Union

#: A remat value: False (none), True (full) or "selective".
Remat = Union[bool, str]

#: Every choice, in the order the planner offers them (none, full, selective).
REMAT_CHOICES: tuple[Remat, ...] = (False, True, "selective")

#: The names of the choices, as the plan shows them.
REMAT_NAMES = ("none", "selective", "full")

#: Keep the matmuls' outputs, recompute the rest (see the module docstring): a layout's policy, not a planner choice.
DOTS = "dots"

#: torchtitan's op-level selective checkpointing: "dots" less every other matmul's output (the module docstring).
SELECTIVE_OP = "selective-op"

#: Every name a remat value may be given by, canonical or not.
_BY_NAME: dict[str, Remat] = {"none": False, "full": True, "selective": "selective", DOTS: DOTS,
                              SELECTIVE_OP: SELECTIVE_OP}

#: The string values a plan, a plan file and a stage pin may hold (besides True/False).
REMAT_STRINGS = ("none", "selective", DOTS, SELECTIVE_OP, "full")


def remat_value(value: Any, what: str = "remat") -> Remat:
    """The canonical remat value of ``value``: True/False (numpy's bools too), or one of "none", "selective",
    "full" (any case). Anything else raises one ValueError that says what to pass."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_":  # numpy.bool_, without importing numpy here
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _BY_NAME:
        return _BY_NAME[value.strip().lower()]
    raise ValueError(f"{what} must be True or False, got {value!r:.60}; or one of 'none', 'selective', 'dots', "
                     "'selective-op', 'full' "
                     "(True is full recomputation, False none).")


def is_full(value: Any) -> bool:
    """Whether ``value`` (a canonical remat value) is full recomputation."""
    return value is True or (type(value).__name__ == "bool_" and bool(value))


def is_selective(value: Any) -> bool:
    """Whether ``value`` is selective recomputation."""
    return isinstance(value, str) and value == "selective"


def is_dots(value: Any) -> bool:
    """Whether ``value`` keeps only the matmuls' outputs (``"dots"``)."""
    return isinstance(value, str) and value == DOTS


def is_selective_op(value: Any) -> bool:
    """Whether ``value`` is torchtitan's op-level policy (``"selective-op"``)."""
    return isinstance(value, str) and value == SELECTIVE_OP


def remat_label(value: Any) -> str:
    """"none", "selective", "dots", "selective-op" or "full" for a remat value."""
    if isinstance(value, str) and value in (DOTS, SELECTIVE_OP, "selective"):
        return value
    return "full" if is_full(value) else "none"


def recomputes(value: Any) -> bool:
    """Whether the stage recomputes anything in its backward (selective, dots, selective-op or full)."""
    return is_full(value) or is_selective(value) or is_dots(value) or is_selective_op(value)


__all__ = ["DOTS", "SELECTIVE_OP", "Remat", "REMAT_CHOICES", "REMAT_NAMES", "REMAT_STRINGS", "remat_value",
           "is_full", "is_selective", "is_dots", "is_selective_op", "remat_label", "recomputes"]
