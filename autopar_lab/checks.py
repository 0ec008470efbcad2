"""Checks of values where they enter the public API, each a one-sentence ValueError that says what to pass.

Python lets ``True`` pass as the integer 1, ``"113"`` look like operator 113 in a message, and ``-1`` index the last
stage; these checks refuse each at the entry point, before it can mean something else further in. They are kept
here, apart from the modules that call them, so each entry point needs one line.

    >>> whole(2, "dp")
    2
    >>> whole(True, "dp")
    Traceback (most recent call last):
    ValueError: dp must be a whole number, got True.
"""

from __future__ import annotations

import numbers

__all__ = ["whole", "flag", "stage_index", "op_id"]


def whole(value, what: str, lo: int = 1, hi: int | None = None) -> int:
    """``value`` as an int if it is a whole number (not a bool) in ``lo..hi``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{what} must be a whole number, got {value!r:.60}.")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        span = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise ValueError(f"{what} must be {span}, got {value}.")
    return value


def flag(value, what: str) -> bool:
    """``value`` if it is True or False (numpy's bools too); a string such as ``"false"`` is refused, not truthy."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_":  # numpy.bool_, without importing numpy here
        return bool(value)
    raise ValueError(f"{what} must be True or False, got {value!r:.60}.")


def stage_index(plan, stage) -> int:
    """A stage number ``0..S-1`` of ``plan``; negative indices are refused (``-1`` is not "the last stage" here)."""
    S = len(plan.stages)
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or not 0 <= int(stage) < S:
        raise ValueError(f"stage must be a stage index 0..{S - 1} of this {S}-stage plan, got {stage!r:.60}.")
    return int(stage)


def op_id(op) -> int:
    """An operator id (an int from ``graph.ops``); a string such as ``"113"`` is refused with the fix."""
    if isinstance(op, str) and op.strip().isdigit():
        raise ValueError(f"operator ids are whole numbers, got the string {op!r:.40}; pass {int(op.strip())}.")
    if isinstance(op, bool) or not isinstance(op, numbers.Integral):
        raise ValueError(f"an operator id must be a whole number from graph.ops, got {op!r:.60}.")
    return int(op)
