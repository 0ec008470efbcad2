"""The ``cpu`` preset: this machine's JAX CPU devices with the figures :mod:`autopar_lab.calibrate` measured (the
shipped profile, ``profiles/cpu.json``, or one written since). Returns the Cluster's fields, not a Cluster, so that
this module stays below :mod:`~autopar_lab.cluster.machine`, which builds it.

jax is imported only when a profile is read (the device count is the number of JAX CPU devices now).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from .values import Device, Efficiency, Link, is_power_of_two, shares_cores_of

__all__ = ["CPU_PROFILE_PATH", "CPU_PROFILE_KIND", "cpu_fields", "profile_fields"]

#: Where the ``cpu`` preset reads its measured figures (regenerate with ``python -m autopar_lab.calibrate``).
CPU_PROFILE_PATH = Path(__file__).resolve().parents[1] / "profiles" / "cpu.json"
#: The ``kind`` a profile written by :mod:`autopar_lab.calibrate` carries (``Cluster.from_json`` reads one as the
#: ``cpu`` preset with its figures).
CPU_PROFILE_KIND = "autopar-lab cpu profile"


def _local_cpu_device_count() -> int:
    import jax  # lazy: planning for GPU presets must not need jax initialised

    return len(jax.devices("cpu"))


def cpu_fields(hosts: int, path: str | os.PathLike | None = None) -> dict:
    """The ``cpu`` preset's Cluster fields from the shipped profile (or the one at ``path``)."""
    where = Path(path) if path is not None else CPU_PROFILE_PATH
    try:
        profile = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"the cpu preset needs the profile {where} ({e}); regenerate it with `python -m autopar_lab.calibrate"
            f" --out {where}`."
        ) from None
    return profile_fields(profile, hosts, str(where))


def profile_fields(profile: Any, hosts: int, where: str) -> dict:
    """The cpu preset's Cluster fields from a profile's contents (``where``: its file, for messages)."""
    if not isinstance(profile, Mapping) or not all(isinstance(profile.get(k), Mapping)
                                                   for k in ("device", "intra_host", "inter_host")):
        raise ValueError(f"{where} is not a cpu profile (it needs 'device', 'intra_host' and 'inter_host' objects); "
                         f"write one with `python -m autopar_lab.calibrate --out {where}`.")
    n = _local_cpu_device_count()
    if not is_power_of_two(n):
        raise ValueError(
            f"the cpu preset found {n} JAX CPU devices but needs a power of two; "
            "set JAX_NUM_CPU_DEVICES=8 (or 1, 2, 4, ...) before jax is imported."
        )
    dev = profile["device"]
    # Memory is the machine's RAM split across however many devices JAX exposes now, not at measurement time.
    total = float(profile.get("total_memory_bytes", dev["memory_bytes"] * profile.get("num_devices", 1)))
    device = Device(
        name=dev.get("name", "cpu"),
        peak_flops=dev["peak_flops"],
        memory_bytes=total / n,
        memory_bandwidth=dev["memory_bandwidth"],
        task_overhead_s=dev.get("task_overhead_s", 0.0),  # profiles written before it was measured: none
        shares_cores=bool(shares_cores_of(dev)),  # JAX's CPU devices share the machine's cores
        # Measured per-kernel overhead and the like (profiles written before they were measured: the defaults).
        efficiency=Efficiency.from_dict(dev.get("efficiency")),
    )
    return dict(hosts=hosts, devices_per_host=n, device=device, intra_host=Link(**profile["intra_host"]),
                inter_host=Link(**profile["inter_host"]), name="cpu")
