"""The named clusters, read from ``autopar_lab/presets/NAME.json``: one data file per preset, every figure in SI
units (bytes, bytes/s, s, FLOP/s) with its source in the file's ``sources`` object (keyed by the figure's path,
e.g. ``"intra_host.bandwidth"``).

Two kinds of file, told apart by ``count``, what the number after the colon counts:

- ``"hosts"`` (the GPU presets): the Cluster's own fields (``devices_per_host``, ``domain_hosts``, ``device``,
  ``intra_host``, ``inter_host``), as :meth:`Cluster.to_dict <autopar_lab.cluster.Cluster.to_dict>` writes them;
  ``dgx-h100:4`` is 4 hosts, ``gb200-nvl72:18`` 18 trays of 4 GPUs (one NVL72 rack, one NVLink domain).
- ``"chips"`` (the TPU presets): the ``device``, one ICI link (``ici``: one way, latency per hop), the data-center
  network per chip (``dcn_per_chip``) and the standard slice shape for each chip count (``slices``: torus
  dimensions, first fastest, and their wraparound links). ``tpu-v5p:128`` is one slice of 128 chips; a count
  beyond the largest slice is slices of the largest joined by the data-center network. The Cluster model's host is
  then one slice (its devices share the fast fabric), and ``inter_host`` the slice's DCN bandwidth (per chip x chips).

Returns the Cluster's fields, not a Cluster, so that this module stays below
:mod:`~autopar_lab.cluster.machine`, which builds it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Mapping

from .torus import Torus
from .values import Device, Link, is_whole

__all__ = ["PRESET_DIR", "PRESETS", "GPU_PRESETS", "TPU_PRESETS", "SPEC_HELP", "preset_fields", "preset_data",
           "count_word", "slice_counts"]

#: Where the preset data files live (shipped in the wheel with the package).
PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"
GPU_PRESETS = ("p3.16xlarge", "dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200", "h800", "gb200-nvl72",
               "grand-teton-h100")
TPU_PRESETS = ("tpu-v5e", "tpu-v5p", "tpu-v6e")
#: The names :meth:`Cluster.preset` and :meth:`Cluster.parse` accept (``cpu``: this machine, see
#: :mod:`~autopar_lab.cluster.cpuprofile`).
PRESETS = GPU_PRESETS + TPU_PRESETS + ("cpu",)

SPEC_HELP = (
    "use PRESET:HOSTS with PRESET one of " + ", ".join(p for p in PRESETS if p not in TPU_PRESETS)
    + " and HOSTS a positive integer (e.g. 'dgx-h100:2'; gb200-nvl72 counts trays of 4 GPUs, 18 to a rack), "
    "PRESET:CHIPS with PRESET one of " + ", ".join(TPU_PRESETS) + " (e.g. 'tpu-v5p:128'), or a path to a JSON "
    "cluster file"
)


@functools.lru_cache(maxsize=None)
def preset_data(name: str) -> Mapping:
    """The parsed data file of preset ``name`` (read once; do not modify it)."""
    return json.loads((PRESET_DIR / f"{name}.json").read_text())


def count_word(name: str) -> str:
    """What the number after ``name:`` counts: "chips" for a TPU preset, else "hosts"."""
    return "chips" if name in TPU_PRESETS else "hosts"


def slice_counts(name: str) -> list[int]:
    """The chip counts a TPU preset has a standard slice shape for, ascending.

    >>> slice_counts("tpu-v5e")
    [1, 4, 8, 16, 32, 64, 128, 256]
    """
    return sorted(int(k) for k in preset_data(name)["slices"])


def preset_fields(name: str, count: int | None = None) -> dict:
    """The Cluster fields of preset ``name`` (a GPU or TPU preset, lower case) with ``count`` hosts or chips (None:
    the file's ``default_count``).

    >>> f = preset_fields("tpu-v5p", 8192)              # two slices of 4,096 chips over the data-center network
    >>> f["hosts"], f["devices_per_host"], f["torus"].dims, f["inter_host"].bandwidth == 4096 * 50e9 / 8
    (2, 4096, (16, 16, 16), True)
    """
    data = preset_data(name)
    n = data["default_count"] if count is None else count
    device = Device(**data["device"])
    if data["count"] == "hosts":
        return dict(hosts=n, devices_per_host=data["devices_per_host"], domain_hosts=data["domain_hosts"],
                    device=device, intra_host=Link(**data["intra_host"]), inter_host=Link(**data["inter_host"]),
                    name=name)
    hosts, chips = _slices_for(name, n)
    shape = data["slices"][str(chips)]
    dcn = data["dcn_per_chip"]
    return dict(hosts=hosts, devices_per_host=chips, device=device, intra_host=Link(**data["ici"]),
                inter_host=Link(dcn["bandwidth"] * chips, dcn["latency"]), name=name,
                torus=Torus(tuple(shape["dims"]), tuple(shape["wrap"])))


def _slices_for(name: str, chips: Any) -> tuple[int, int]:
    """(slices, chips per slice) for ``chips`` chips of TPU preset ``name``: one standard slice, or several of the
    largest one."""
    counts = slice_counts(name)
    largest = counts[-1]
    if is_whole(chips) and chips in counts:
        return 1, int(chips)
    if is_whole(chips) and chips > largest and chips % largest == 0:
        return int(chips) // largest, largest
    raise ValueError(f"{name} has no standard slice of {chips!r} chips; use one of {', '.join(map(str, counts))} "
                     f"(one slice) or a multiple of {largest} (slices of {largest} joined by the data-center "
                     f"network).")
