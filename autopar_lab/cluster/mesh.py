"""Logical meshes: a 2D view of a submesh, the link each axis' collectives use and what they cost.

Two kinds of fabric: switched links (NVLink / NVSwitch inside a scale-up domain, InfiniBand or Ethernet between
domains), priced by Alpa's alpha-beta formulas with the latency of NCCL's ring and tree algorithms as NCCL's own
tuning model counts it (``src/graph/tuning.cc``, ``ncclTopoTuneModel``: a ring of n ranks over k nodes takes n-1
steps, k-1 of them between nodes; an all-to-all is grouped send/recv, one message per peer; the tree's levels as
:meth:`LogicalMesh._tree_latency` says); and a TPU slice's ICI torus,
priced by :class:`~autopar_lab.cluster.torus.TorusAxis` for an axis that stays inside one slice. An axis that
leaves its domain (its host, or the hosts that share one NVLink fabric; a TPU slice) uses the scale-out link, shared
by the groups that cross from each host at once (an all-to-all's bytes beyond the domain also share it among the
group's devices on that host, :meth:`LogicalMesh.all_to_all`).

>>> from autopar_lab.cluster import Cluster
>>> c = Cluster.preset("p3.16xlarge")
>>> m = c.logical_mesh((1, 8), (1, 8))
>>> m.all_reduce(1e9, 1) == 2 * 3 * c.intra_host.latency + 2 * (7 / 8) * 1e9 / c.intra_host.bandwidth  # a tree
True
>>> m.all_gather(1e9, 1) == 7 * c.intra_host.latency + (7 / 8) * 1e9 / c.intra_host.bandwidth  # a ring
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence, Union

import numpy as np

from .torus import TorusAxis, axis_bits
from .values import Link, is_whole

if TYPE_CHECKING:
    from .machine import Cluster

__all__ = ["LogicalMesh", "Axis"]

Axis = Union[int, tuple]


@dataclass(frozen=True)
class LogicalMesh:
    """A 2D view (n0, n1) of a submesh; axis 1 is the fast axis (consecutive devices).

    ``first_device`` is where the submesh starts in the cluster's host-major numbering (see Cluster.place).
    Collective costs take B = bytes of the FULL buffer along the axis.
    """

    cluster: Cluster
    submesh: tuple
    shape: tuple
    first_device: int = 0

    def __post_init__(self) -> None:
        sub = self.cluster.checked_submesh(self.submesh)
        object.__setattr__(self, "submesh", sub)
        try:
            shape = tuple(int(s) for s in self.shape)
        except (TypeError, ValueError):
            shape = ()
        size = sub[0] * sub[1]
        if len(shape) != 2 or shape[0] * shape[1] != size or min(shape) < 1:
            raise ValueError(
                f"logical mesh shape {self.shape!r} must be two positive numbers multiplying to the submesh's "
                f"{size} devices; use one of {self.cluster.logical_mesh_shapes(sub)}."
            )
        if shape not in self.cluster.logical_mesh_shapes(sub):
            raise ValueError(
                f"logical mesh shape {shape} would split hosts unevenly along axis 1; "
                f"use one of {self.cluster.logical_mesh_shapes(sub)}."
            )
        object.__setattr__(self, "shape", shape)
        M = self.cluster.devices_per_host
        align = sub[1] if sub[0] == 1 else M  # a (1, m) piece sits at a multiple of m; bigger ones on host starts
        f = self.first_device
        if not is_whole(f) or f < 0 or f % align or f + size > self.cluster.num_devices:
            raise ValueError(
                f"first_device {f!r} cannot start a {sub} submesh; use a multiple of {align} no larger than "
                f"{self.cluster.num_devices - size} (Cluster.place computes valid starts)."
            )

    @property
    def num_devices(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def devices(self) -> np.ndarray:
        """Cluster device indices, shape (n0, n1), host-major and row-major (axis 1 = consecutive devices)."""
        return np.arange(self.first_device, self.first_device + self.num_devices).reshape(self.shape)

    def _groups(self, axis: Axis) -> np.ndarray:
        """Rows = the device groups a collective along ``axis`` runs in."""
        d = self.devices
        if axis in (0, 1):
            return d.T if axis == 0 else d  # axis 0 varies the row index: its groups are the columns
        if isinstance(axis, (tuple, list)) and tuple(axis) in ((0, 1), (1, 0)):
            return d.reshape(1, -1)
        raise ValueError(f"mesh axis must be 0, 1 or (0, 1), got {axis!r}; pick one of those.")

    def _memo(self, what: str, axis: Axis, make) -> Any:
        # Memoised per mesh and axis: every collective a strategy prices asks, and the answer is a function of the
        # mesh alone (at 3,072 devices working it out walks every group and host: tens of ms a call).
        key = (what, tuple(axis) if isinstance(axis, (tuple, list)) else axis)
        memo = self.__dict__.setdefault("_axis_links", {})
        if key not in memo:
            memo[key] = make(axis)
        return memo[key]

    def axis_size(self, axis: Axis) -> int:
        """Devices along ``axis`` (0, 1, or (0, 1) for both flattened)."""
        return int(self._groups(axis).shape[1])

    def axis_link(self, axis: Axis) -> Link:
        """The link a collective along ``axis`` uses.

        Inside one scale-up domain (every group in one host, or in the hosts sharing one NVLink fabric): the
        cluster's ``intra_host`` link (on a fully connected board, :meth:`Cluster.scale_up_link` of the group's
        size); on a TPU slice, one ICI link with the bandwidth of every torus dimension the
        axis runs along (:attr:`TorusAxis.bandwidth`). Otherwise ``inter_host``, with its bandwidth divided by the
        number of groups that cross the network from one host at the same time (they share that host's NICs):
        logical (2, 8) on 2 p3 hosts has 8 axis-0 pairs per host, so each gets 25/8 Gb/s.
        """
        return self._memo("link", axis, self._axis_link)

    def _axis_link(self, axis: Axis) -> Link:
        groups = self._groups(axis)
        hosts = groups // self.cluster.devices_per_host
        domains = hosts // self.cluster.domain_hosts
        if (domains == domains[:, :1]).all():
            torus = self.torus_axis(axis)
            if torus is None:
                return self.cluster.scale_up_link(groups.shape[1])
            return Link(torus.bandwidth, torus.link.latency)
        # How many crossing groups each host is in, the most of them: each row's distinct hosts (sorted, the
        # first of each run), counted over the rows that span more than one domain.
        ordered = np.sort(hosts, axis=1)
        first = np.ones(ordered.shape, dtype=bool)
        first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        crossing = (domains != domains[:, :1]).any(axis=1)
        sharing = int(np.bincount(ordered[crossing][first[crossing]]).max())
        link = self.cluster.inter_host
        return link if sharing == 1 else Link(link.bandwidth / sharing, link.latency)

    def axis_hosts(self, axis: Axis) -> int:
        """How many hosts each group along ``axis`` spans (1: the group sits inside one host)."""
        return self._memo("hosts", axis, lambda a: self._most_spanned(a, self.cluster.devices_per_host))

    def axis_domains(self, axis: Axis) -> int:
        """How many scale-up domains each group along ``axis`` spans (:attr:`Cluster.domain_hosts`; the hosts
        themselves where each is its own)."""
        return self._memo("domains", axis, lambda a: self._most_spanned(a, self.cluster.devices_per_domain))

    def _most_spanned(self, axis: Axis, unit: int) -> int:
        # The most distinct units (hosts or domains) of any group, counted on each row sorted, for every group at
        # once: every collective's price asks, and at 16,384 devices a Python set per group cost a second an ILP.
        units = np.sort(self._groups(axis) // unit, axis=1)
        return int((1 + (units[:, 1:] != units[:, :-1]).sum(axis=1)).max())

    def torus_axis(self, axis: Axis) -> TorusAxis | None:
        """``axis`` on its slice's ICI torus, when the cluster's hosts are TPU slices and every group along it stays
        inside one; None otherwise (switched links, or an axis that crosses slices over the data-center network).

        >>> from autopar_lab.cluster import Cluster
        >>> m = Cluster.preset("tpu-v5p", 128).logical_mesh((1, 128), (8, 16))    # a 4x4x8 slice
        >>> [(s.length, s.wraps) for s in m.torus_axis(1).segments], m.torus_axis(1).hops
        ([(4, True), (4, True)], 4)
        """
        return self._memo("torus", axis, self._torus_axis)

    def _torus_axis(self, axis: Axis) -> TorusAxis | None:
        torus = self.cluster.torus
        if torus is None or self.axis_size(axis) == 1 or self.axis_hosts(axis) > 1:
            return None
        lo, hi = axis_bits(self.shape, axis)
        return TorusAxis(torus.segments(lo, hi), self.cluster.intra_host)

    def axis_profile(self, axis: Axis) -> tuple:
        """What a collective along ``axis`` costs depends on, and nothing else: its size, the domains each group
        spans, the bottleneck link's bandwidth and the per-step latencies inside and between domains, and on a TPU
        slice the torus dimensions it runs along (hashable: the planner shares work between axes with the same
        profile)."""
        n = self.axis_size(axis)
        if n == 1:
            return (1,)
        link = self.axis_link(axis)
        k, hosts = self.axis_domains(axis), self.axis_hosts(axis)
        out: tuple = (n, k, float(link.bandwidth), float(self.cluster.intra_host.latency),
               float(self.cluster.inter_host.latency))
        if hosts != k:  # hosts sharing one domain: an all-to-all's bytes leave through each host's NICs
            out += (hosts,)
        torus = self.torus_axis(axis)
        return out if torus is None else out + (torus.segments,)

    def _steps(self, axis: Axis) -> tuple[int, int, float, float]:
        """(devices per domain in a group g, domains k, latency inside a domain, latency between) along ``axis``."""
        n, k = self.axis_size(axis), self.axis_domains(axis)
        return n // k, k, self.cluster.intra_host.latency, self.cluster.inter_host.latency

    def _tree_latency(self, axis: Axis) -> float:
        """One pass (up or down) of a hierarchical tree: log2 levels inside a domain over NVLink-class links, then
        log2 levels between domains. (NCCL's own tree is a chain inside a node, n/nodes - 1 steps; the presets'
        intra-host latency was fitted to NCCL's small-message all-reduce time counted as log2 levels, 10-15 us over
        2 x 3 levels on 8 GPUs, so the step count and that figure change together or not at all.)"""
        g, k, a_in, a_out = self._steps(axis)
        return math.ceil(math.log2(g)) * a_in + math.ceil(math.log2(k)) * a_out

    def _ring_latency(self, axis: Axis) -> float:
        """The n-1 steps of one pass round a ring of n = g x k devices: k-1 of them cross between domains (the
        scale-out latency), the other n-k stay inside one (NCCL's tuning model: ``(nsteps - nInterSteps) x intraLat
        + nInterSteps x interLat``, nInterSteps = nNodes - 1 for an all-gather)."""
        g, k, a_in, a_out = self._steps(axis)
        return (g * k - k) * a_in + (k - 1) * a_out

    def _ring_step_latency(self, axis: Axis) -> float:
        """One ring step taken alone (ring attention's send/recv): it waits for its slowest hop, the scale-out one
        when the ring leaves a domain."""
        g, k, a_in, a_out = self._steps(axis)
        return a_out if k > 1 else a_in

    def _bandwidth_s(self, nbytes: float, axis: Axis, factor: float) -> float:
        return factor * nbytes / self.axis_link(axis).bandwidth

    def ring_step(self, nbytes: float, axis: Axis) -> float:
        """One step of a ring along ``axis``: every device sends ``nbytes`` to its neighbour at once, waiting for the
        slowest hop's latency (:meth:`all_gather` of B is n-1 such steps of B / n). 0 on an axis of one device."""
        if self.axis_size(axis) == 1 or nbytes <= 0:
            return 0.0
        torus = self.torus_axis(axis)
        if torus is not None:
            return torus.ring_step(nbytes)
        return self._ring_step_latency(axis) + self._bandwidth_s(nbytes, axis, 1.0)

    def all_gather(self, nbytes: float, axis: Axis) -> float:
        """B = bytes of the gathered (full) buffer: a ring (NCCL's algorithm for it), n-1 steps moving (n-1)/n B at
        the axis' bus bandwidth; on a TPU slice, :meth:`TorusAxis.all_gather`."""
        n = self.axis_size(axis)
        if n == 1:
            return 0.0  # nothing to communicate: exactly zero, not the latency
        torus = self.torus_axis(axis)
        if torus is not None:
            return torus.all_gather(nbytes)
        return self._ring_latency(axis) + self._bandwidth_s(nbytes, axis, (n - 1) / n)

    def reduce_scatter(self, nbytes: float, axis: Axis) -> float:
        """B = bytes of the full (unscattered) buffer: as :meth:`all_gather` (a ring)."""
        return self.all_gather(nbytes, axis)

    def all_reduce(self, nbytes: float, axis: Axis) -> float:
        """2 (n-1)/n B at the bus bandwidth, with the latency of NCCL's faster algorithm: a ring's two passes
        (:meth:`_ring_latency` each) or a hierarchical tree's pass up and down (:meth:`_tree_latency`). Small buffers
        take the tree, so one all-reduce beats a reduce-scatter and an all-gather. On a TPU slice,
        :meth:`TorusAxis.all_reduce`."""
        n = self.axis_size(axis)
        if n == 1:
            return 0.0
        torus = self.torus_axis(axis)
        if torus is not None:
            return torus.all_reduce(nbytes)
        latency = 2 * min(self._ring_latency(axis), self._tree_latency(axis))
        return latency + self._bandwidth_s(nbytes, axis, 2 * (n - 1) / n)

    def all_to_all(self, nbytes: float, axis: Axis) -> float:
        """B = bytes of the full buffer along the axis: each of the n devices holds B/n, keeps 1/n of it and sends
        a piece of B/n^2 straight to each other device. NCCL has no all-to-all algorithm: it is n-1 grouped sends
        and receives, one message per peer, each paying its link's latency: g-1 inside the device's scale-up domain
        (g = n/k devices of the group in each of its k domains), n-g to peers beyond it.

        The bytes take two paths at once:

        * inside the domain, (g-1) B/n^2 per device over its own NVLink (``intra_host``);
        * beyond it, (n-g) B/n^2 per device through its host's NICs, which the group's h = n/hosts devices on that
          host share (h = g where each host is its own domain, as on a DGX), and with them every other group
          crossing from that host at once (:meth:`axis_link`'s bandwidth, the host's NICs over those groups):
          h (n-g) B/n^2 at that bandwidth. The host's NICs, not each GPU, are the limit: charging each device's
          (n-g) B/n^2 at the whole host's bandwidth would price 8 GPUs' traffic as one's.

        NCCL runs the two concurrently (the grouped sends go to every peer at once, NVLink and the NICs are separate
        engines), so the time is the slower path, not their sum:

            max((g-1) B/n^2 / W_nvlink, h (n-g) B/n^2 / W_nic) + (g-1) alpha_in + (n-g) alpha_out

        On one domain (k = 1) this is (n-1)/n^2 B at the domain's link. On a TPU slice,
        :meth:`TorusAxis.all_to_all` (pieces travel several hops); an axis across slices takes its in-slice part
        at one ICI link (``intra_host``), an approximation.
        """
        n = self.axis_size(axis)
        if n == 1:
            return 0.0
        torus = self.torus_axis(axis)
        if torus is not None:
            return torus.all_to_all(nbytes)
        return self._all_to_all(nbytes, axis, 1.0)

    def routed_all_to_all(self, nbytes: float, axis: Axis) -> float:
        """An MoE layer's token exchange (dispatch or combine; B = the dispatched tokens, ``top_k`` copies of each)
        under the cluster's :attr:`~autopar_lab.cluster.Cluster.moe_routing` (a
        :class:`~autopar_lab.cluster.values.NodeLimit`): as :meth:`all_to_all`, with the bytes beyond the domain
        scaled by ``copies(k) / top_k`` for a group over k domains. :meth:`all_to_all` sends each of a token's
        ``top_k`` copies to its expert wherever it is, so ``top_k (n-g)/n`` copies of a token cross domains; with
        node-limited routing and a dispatcher that sends one copy per domain and forwards it over NVLink (DeepEP),
        a token reaches at most ``copies(k)`` domains and ``copies(k) (n-g)/n`` copies cross (the same share of them
        beyond the sender's own domain as before, for balanced routing):

            max((g-1) B/n^2 / W_nvlink, h (n-g) B/n^2 copies(k) / top_k / W_nic) + (g-1) alpha_in + (n-g) alpha_out

        DeepSeek-V3 (top-8 in 4 of 8 groups) on 8 nodes: 4 x 7/8 copies a token cross instead of 8 x 7/8, half the
        bytes. The NVLink leg and the latency terms are kept as :meth:`all_to_all` prices them (the forwarding inside
        a node is NVLink traffic, much faster than the NICs). Without ``moe_routing``, or inside one domain: exactly
        :meth:`all_to_all`."""
        limit = self.cluster.moe_routing
        if limit is None or self.axis_size(axis) == 1 or self.torus_axis(axis) is not None:
            return self.all_to_all(nbytes, axis)
        return self._all_to_all(nbytes, axis, limit.copies(self.axis_domains(axis)) / limit.top_k)

    def _all_to_all(self, nbytes: float, axis: Axis, beyond_share: float) -> float:
        g, k, a_in, a_out = self._steps(axis)
        n = g * k
        latency = (g - 1) * a_in + (n - g) * a_out
        if k == 1:
            return latency + self._bandwidth_s(nbytes, axis, (n - 1) / (n * n))
        h = n // self.axis_hosts(axis)
        inside = (g - 1) * nbytes / (n * n) / self.cluster.scale_up_link(g).bandwidth
        beyond = self._bandwidth_s(nbytes, axis, h * (n - g) / (n * n) * beyond_share)
        return latency + max(inside, beyond)

    def to_jax_mesh(self, devices: Sequence[Any] | None = None):
        """A ``jax.sharding.Mesh`` with axes ("x", "y") over real jax devices.

        ``devices`` is either exactly this mesh's devices (taken in order) or the whole cluster's device list
        (indexed by :attr:`devices`); by default ``jax.devices()``.
        """
        import jax  # lazy: the cost model must not need jax

        devs = list(jax.devices() if devices is None else devices)
        if len(devs) == self.num_devices:
            arr = np.empty(self.num_devices, dtype=object)
            arr[:] = devs
            arr = arr.reshape(self.shape)
        elif len(devs) > int(self.devices.max()):
            arr = np.empty(self.shape, dtype=object)
            for idx, d in np.ndenumerate(self.devices):
                arr[idx] = devs[int(d)]
        else:
            raise ValueError(
                f"got {len(devs)} jax devices for a {self.shape} mesh of devices "
                f"{self.devices.min()}..{self.devices.max()}; pass exactly {self.num_devices} devices or the cluster's "
                "full list (set JAX_NUM_CPU_DEVICES to get more)."
            )
        axis_type = getattr(jax.sharding, "AxisType", None)
        if axis_type is not None:
            return jax.sharding.Mesh(arr, ("x", "y"), axis_types=(axis_type.Auto, axis_type.Auto))
        return jax.sharding.Mesh(arr, ("x", "y"))
