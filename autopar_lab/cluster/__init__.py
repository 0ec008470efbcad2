"""The cluster model: devices, links, clusters, Alpa's submeshes, logical meshes and collective costs.

Units everywhere: bandwidth in bytes/s, latency in s, memory in bytes, compute in FLOP/s (floats).

>>> c = Cluster.preset("p3.16xlarge", hosts=2)
>>> c.num_devices, c.submesh_shapes()[:3]
(16, [(1, 1), (1, 2), (1, 4)])
>>> mesh = c.logical_mesh((2, 8), (2, 8))
>>> mesh.axis_link(1) == c.intra_host, mesh.axis_link(0).bandwidth == c.inter_host.bandwidth / 8
(True, True)

One module per job: :mod:`.values` (Efficiency, Device, Link), :mod:`.machine` (Cluster), :mod:`.mesh`
(LogicalMesh and the switched fabrics' collective formulas), :mod:`.torus` (a TPU slice's ICI torus and its
formulas), :mod:`.presets` (the named clusters, read from the data files in ``autopar_lab/presets/``),
:mod:`.cpuprofile` (the ``cpu`` preset, from this machine's measured profile).

Nothing here imports jax at module import time: presets, costs and JSON work on any machine, and the
``cpu`` preset and :meth:`LogicalMesh.to_jax_mesh` import jax only when called.
"""

from .cpuprofile import CPU_PROFILE_KIND, CPU_PROFILE_PATH
from .machine import MAX_DEVICES_PER_HOST, MAX_HOSTS, Cluster
from .mesh import LogicalMesh
from .presets import PRESETS
from .torus import Torus
from .values import Device, Efficiency, Link, NodeLimit, send_recv

__all__ = [
    "Device",
    "Efficiency",
    "Link",
    "NodeLimit",
    "Cluster",
    "LogicalMesh",
    "Torus",
    "send_recv",
    "PRESETS",
    "CPU_PROFILE_PATH",
    "CPU_PROFILE_KIND",
    "MAX_HOSTS",
    "MAX_DEVICES_PER_HOST",
]
