"""What each mode of the command line does to a profile file: measure it whole (:func:`write_profile`), or measure
one figure again and store it, keeping every other (the task overhead, the collectives and links, the kernel and
state-array overheads, the gradient chain's re-reads)."""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path

from ..cluster import CPU_PROFILE_PATH
from .collectives import BETWEEN_COMPUTE_NOTE, measure_collectives, measure_collectives_between_compute
from .fits import refit_collectives
from .kernels import (CHAIN_DEPTHS, KERNEL_POINTS, QUICK_CHAIN_DEPTHS, QUICK_KERNEL_POINTS, measure_buffer_overhead,
                      measure_chain_reads, measure_kernel_overhead)
from .profile import measure_cpu
from .tasks import measure_task_overhead, per_device_task_overhead

__all__ = ["write_profile", "update_task_overhead", "update_collectives", "update_kernel_overhead",
           "update_chain_reads"]


def write_profile(path: str | os.PathLike | None = None, num_devices: int | None = None, quick: bool = False) -> dict:
    """Measure (see :func:`measure_cpu`) and write the JSON profile to ``path`` (default: the shipped one)."""
    profile = measure_cpu(num_devices=num_devices, quick=quick)
    out = Path(path) if path is not None else CPU_PROFILE_PATH
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    return profile


def update_task_overhead(path: str | os.PathLike | None = None, quick: bool = False) -> dict:
    """Measure only the per-task overhead (:func:`measure_task_overhead`, as :func:`measure_cpu` does) and store it
    in the profile at ``path`` (default: the shipped one), keeping every other figure; returns the profile."""
    out = Path(path) if path is not None else CPU_PROFILE_PATH
    profile = json.loads(out.read_text())
    task = measure_task_overhead(profile.get("num_devices"), repeats=21 if quick else 101)
    profile["device"]["task_overhead_s"] = per_device_task_overhead(task)
    profile["device"]["shares_cores"] = True
    profile["device"].pop("virtual", None)  # its name before issue 32 (cluster.values.shares_cores_of reads it)
    profile.setdefault("measurements", {})["task_overhead"] = task
    profile["task_overhead_measured_on"] = _dt.date.today().isoformat()
    out.write_text(json.dumps(profile, indent=2) + "\n")
    return profile


def update_collectives(path: str | os.PathLike | None = None, quick: bool = False, back_to_back: bool = False) -> dict:
    """Measure only the collectives and refit the links of the profile at ``path`` (default: the shipped one) from
    them (:func:`refit_collectives`), keeping every other figure; returns the profile.

    By default each collective is timed after a layer-like compute on every device, as a plan's step meets it
    (:func:`measure_collectives_between_compute`); ``back_to_back`` times chains of bare collectives instead
    (:func:`measure_collectives`: no barrier wait, a lower latency that the plans executed here do not see)."""
    out = Path(path) if path is not None else CPU_PROFILE_PATH
    profile = json.loads(out.read_text())
    n = int(profile.get("num_devices", 1))
    sizes = (1 << 12, 1 << 16, 1 << 20) if quick else (1 << 12, 1 << 16, 1 << 20, 1 << 23)
    repeats = 5 if quick else 41
    if back_to_back:
        rows = measure_collectives(n, sizes, repeats=repeats)
        note = ("each collective timed in chains of back-to-back collectives, the chains' difference over their "
                "lengths (the program call cancels)")
    else:
        rows = measure_collectives_between_compute(n, sizes, repeats=repeats)
        note = BETWEEN_COMPUTE_NOTE
    profile.setdefault("measurements", {})["collectives"] = rows
    profile = refit_collectives(profile)
    profile["collectives_measured_on"] = _dt.date.today().isoformat()
    profile["collectives_note"] = note
    profile.pop("collectives_refit_note", None)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    return profile


def update_kernel_overhead(path: str | os.PathLike | None = None, quick: bool = False) -> dict:
    """Measure only the per-kernel and per-state-array overheads (:func:`measure_kernel_overhead`,
    :func:`measure_buffer_overhead`) and store them in the profile at ``path`` (default: the shipped one), with the
    device's rates refitted from the profile's measured large-kernel rates (kept under "measurements"), keeping
    every other figure; returns the profile."""
    out = Path(path) if path is not None else CPU_PROFILE_PATH
    profile = json.loads(out.read_text())
    raw = profile.get("measurements", {})
    kern = measure_kernel_overhead(profile.get("num_devices"), repeats=7 if quick else 21,
                                   peak_flops=raw.get("matmul_flops_concurrent_per_device",
                                                      profile["device"]["peak_flops"]["float32"]),
                                   memory_bandwidth=raw.get("memory_bandwidth_concurrent_per_device",
                                                            profile["device"]["memory_bandwidth"]),
                                   points=QUICK_KERNEL_POINTS if quick else KERNEL_POINTS)
    profile["device"]["peak_flops"] = {"float32": kern["rates"]["peak_flops"] / kern["work_scale"]}
    profile["device"]["memory_bandwidth"] = kern["rates"]["memory_bandwidth"] / kern["work_scale"]
    chain = measure_chain_reads(kern, depths=QUICK_CHAIN_DEPTHS if quick else CHAIN_DEPTHS, repeats=5 if quick else 11)
    buf = measure_buffer_overhead(profile.get("num_devices"), repeats=7 if quick else 21)
    profile["device"].setdefault("efficiency", {}).update(kernel_launch_s=kern["kernel_launch_s"],
                                                          buffer_s=buf["buffer_s"], driver_share=kern["driver_share"],
                                                          chain_reads=chain["chain_reads"])
    profile.setdefault("measurements", {})["kernel_overhead"] = kern
    profile["measurements"]["chain_reads"] = chain
    profile["measurements"]["buffer_overhead"] = buf
    profile["kernel_overhead_measured_on"] = _dt.date.today().isoformat()
    profile["kernel_overhead_load_average"] = list(os.getloadavg()[:1])
    out.write_text(json.dumps(profile, indent=2) + "\n")
    return profile


def update_chain_reads(path: str | os.PathLike | None = None, quick: bool = False) -> dict:
    """Measure only ``chain_reads`` (:func:`measure_chain_reads`, against the profile's own kernel fit) and store it
    in the profile at ``path`` (default: the shipped one), keeping every other figure; returns the profile. A
    profile without a kernel fit is a ValueError that says what to run first."""
    out = Path(path) if path is not None else CPU_PROFILE_PATH
    profile = json.loads(out.read_text())
    kern = profile.get("measurements", {}).get("kernel_overhead")
    if not kern or "rates" not in kern:
        raise ValueError(f"{out} has no kernel fit to measure the gradient chain against; run "
                         f"`python -m autopar_lab.calibrate --kernel-overhead-only --out {out}` first")
    chain = measure_chain_reads(kern, depths=QUICK_CHAIN_DEPTHS if quick else CHAIN_DEPTHS, repeats=5 if quick else 11)
    profile["device"].setdefault("efficiency", {})["chain_reads"] = chain["chain_reads"]
    profile.setdefault("measurements", {})["chain_reads"] = chain
    profile["chain_reads_measured_on"] = _dt.date.today().isoformat()
    profile["chain_reads_load_average"] = list(os.getloadavg()[:1])
    out.write_text(json.dumps(profile, indent=2) + "\n")
    return profile
