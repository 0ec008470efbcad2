"""Why a run's measured step is far from the plan's prediction: what differed from what the plan was priced with.

A plan for the ``cpu`` preset is priced with figures one ``python -m autopar_lab.calibrate`` measured on this machine
(the shipped profile, :data:`~autopar_lab.cluster.CPU_PROFILE_PATH`), at the load the machine had then; a run shares
the cores with whatever runs now. When measured ÷ predicted is past :data:`FAR` either way, :func:`mismatch_note`
says what differs: this machine's load during the run against the profile's, the profile's date, what the measured
median leaves out (the first step compiles), and for a Ray job that each stage ran as a process of its own.

    >>> mismatch_note(session.training.runs[-1])           # doctest: +SKIP
    'run 3: measured 6.02× the prediction. What differs from what its plan was priced with: ...'
"""

from __future__ import annotations

import json
import os

from ...backends import on_cpu
from ...cluster import CPU_PROFILE_PATH
from .fmt import fmt_ratio, fmt_s

__all__ = ["FAR", "profile_facts", "mismatch_note"]

#: Measured ÷ predicted at or past this factor (or its inverse) is "far off".
FAR = 2.0


def profile_facts(plan) -> dict | None:
    """``{"measured_on", "load_average" (start, end), "cpu_count"}`` of the shipped cpu profile when ``plan`` was
    priced with it (a ``cpu`` cluster with its figures), else None (a GPU preset, or another profile)."""
    device = plan.cluster.device
    if plan.cluster.name != "cpu" or not on_cpu(plan.cluster):
        return None
    try:
        profile = json.loads(CPU_PROFILE_PATH.read_text())
        same = profile["device"]["peak_flops"] == dict(device.peak_flops)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not same:
        return None
    return {"measured_on": profile.get("measured_on", "an unknown date"),
            "load_average": list(profile.get("load_average", [])),
            "cpu_count": (profile.get("machine") or {}).get("cpu_count")}


def _loads_text(loads: list) -> str:
    vals = sorted(x for x in loads if x is not None)
    if not vals:
        return ""
    lo, hi = vals[0], vals[-1]
    return f"{lo:.2f}" if hi - lo < 0.05 else f"{lo:.2f} to {hi:.2f}"


def mismatch_note(run) -> str:
    """One sentence on a run whose measured step is far from its prediction (see the module docstring); "" when it
    is within :data:`FAR`, or nothing was measured."""
    measured, predicted = run.measured_step_s, run.predicted_step_s
    if not measured or not predicted or 1 / FAR < measured / predicted < FAR:
        return ""
    parts = []
    facts = profile_facts(run.plan)
    if not run.remote:
        now = _loads_text(run.loads)
        cores = os.cpu_count()
        if now:
            then = _loads_text(facts["load_average"]) if facts else ""
            parts.append(f"this machine's load average was {now} during the run ({cores} cores)"
                         + (f" against {then} when the plan's cpu profile was measured" if then else ""))
    if facts:
        parts.append(f"that profile was measured on {facts['measured_on']}: the machine's speed moves with its load, "
                     "so re-measure it (python -m autopar_lab.calibrate --out now.json) and plan with "
                     "al.Cluster.from_profile('now.json') to price it as the machine is now")
    times = [t for t in run.step_times if t is not None]
    if len(times) > 1:
        parts.append(f"compilation is left out: the first step ({fmt_s(times[0])}) compiled, the measured median is "
                     f"of the {len(times) - 1} step(s) after it")
    elif times:
        parts.append("only one step ran, and it compiled: its time is mostly compilation (run more steps)")
    if run.kind == "ray":
        parts.append("on Ray each stage ran as a process of its own (its own XLA runtime and threads, activations "
                     "through Ray's object store), where the profile timed one process driving every device")
    ratio = measured / predicted
    head = (f"run {run.run}: measured {fmt_ratio(ratio)} the prediction ({fmt_s(measured)} against "
            f"{fmt_s(predicted)} a step)")
    return head + (". What differs from what its plan was priced with: " + "; ".join(parts) if parts else "") + "."
