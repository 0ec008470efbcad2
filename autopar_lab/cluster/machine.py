"""The cluster: N hosts x M devices of one kind, a fast link inside a scale-up domain and a network between domains;
Alpa's submeshes, their placement, and the logical meshes over them (:mod:`~autopar_lab.cluster.mesh`).

A scale-up domain is the hosts that share one NVLink / NVSwitch fabric: one host on a DGX (``domain_hosts`` 1), the
18 trays of a GB200 NVL72 rack. On the TPU presets a host is one ICI slice, its chips on a torus (``torus``).

>>> c = Cluster.preset("gb200-nvl72", 18)           # 18 trays of 4 GPUs, one NVLink domain
>>> c.num_devices, c.devices_per_domain, c.p2p_link([0], [71]) == c.intra_host
(72, 72, True)
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from .cpuprofile import CPU_PROFILE_KIND, cpu_fields, profile_fields
from .mesh import LogicalMesh
from .presets import GPU_PRESETS, PRESETS, SPEC_HELP, TPU_PRESETS, count_word, preset_fields
from .torus import Torus
from .values import (Device, Efficiency, Link, NodeLimit, check_link, check_positive, is_power_of_two, is_whole,
                     send_recv, shares_cores_of)

__all__ = ["Cluster", "MAX_HOSTS", "MAX_DEVICES_PER_HOST"]

#: Bounds on a cluster's size, checked where a Cluster is made: past them the planner's tables (a submesh shape per
#: host count, a mesh view per divisor) would take longer than anyone waits. Alpa's largest runs used 8 hosts x 8;
#: a host of 4,096 devices is the largest TPU v5p slice the presets model (16x16x16); 2,048 hosts of 8 GPUs are the
#: 16,384 H100s Llama 3 405B trained on (issue 36), planned with the space pruned above that size.
MAX_HOSTS = 4096
MAX_DEVICES_PER_HOST = 4096


#: The form of cluster file :meth:`Cluster.to_dict` writes and :meth:`Cluster.from_json` reads.
CLUSTER_FILE_VERSION = 1


@dataclass(frozen=True)
class Cluster:
    """N hosts x M devices, one device type, a scale-up link inside a domain and a scale-out link between domains.

    ``intra_host``: the scale-up link, per device (NVLink through NVSwitch; on a TPU slice one ICI link, one way,
    its latency per hop). ``inter_host``: the whole host's network bandwidth (all its NICs; a TPU slice's
    data-center network), shared by its devices; see :meth:`LogicalMesh.axis_link`. Devices are numbered host-major:
    device d sits in host ``d // M``.

    ``domain_hosts``: the consecutive hosts that share one scale-up fabric (1: each host is its own, as on a DGX;
    18 on a GB200 NVL72 rack of 18 trays). A collective whose groups stay inside one domain uses ``intra_host``, one
    that crosses domains ``inter_host``; so does a stage-to-stage transfer. ``torus``: the ICI torus of one host
    when the hosts are TPU slices (:class:`~autopar_lab.cluster.torus.Torus`; None for switched fabrics).

    ``mesh_peers``: 0 where the scale-up links go through a switch (NVSwitch: every group of a host's devices talks
    at the full ``intra_host`` bandwidth); else the devices of a board are joined pairwise by links of their own, a
    full mesh in which each device's ``intra_host`` bandwidth is split evenly over its ``mesh_peers`` peers (an HGX
    H100 / H200 4-GPU board: 3, six of a GPU's 18 NVLink4 links to each other GPU, no NVSwitch). A collective among
    k devices of the board then uses only the links between them, ``(k - 1) / mesh_peers`` of a device's bandwidth
    (NCCL's rings over a full mesh), and a transfer to one device ``1 / mesh_peers`` (:meth:`scale_up_link`). A
    cluster may hold only part of such a board (``devices_per_host`` up to ``mesh_peers + 1``).

    ``moe_routing``: the node limit of the model's expert routing, where the model declares one and the dispatcher
    sends one copy per node (:class:`~autopar_lab.cluster.values.NodeLimit`; DeepSeek-V3 with DeepEP): its token
    exchanges are priced by :meth:`LogicalMesh.routed_all_to_all`. A property of the model run on the cluster, so
    :meth:`CostTable.build <autopar_lab.pricing.CostTable.build>` sets it from the model's config; not part of the
    cluster's JSON form.

    >>> c = Cluster(hosts=2, devices_per_host=4, device=Device("toy", {"float32": 1e12}, 2**30, 1e11),
    ...             intra_host=Link(1e11, 1e-6), inter_host=Link(1e10, 1e-5))
    >>> c.num_devices, c.host_of(5)
    (8, 1)
    """

    hosts: int
    devices_per_host: int
    device: Device
    intra_host: Link
    inter_host: Link
    name: str = "custom"
    domain_hosts: int = 1
    torus: Torus | None = None
    moe_routing: NodeLimit | None = None
    mesh_peers: int = 0

    def __post_init__(self) -> None:
        for field, value, most in (("hosts", self.hosts, MAX_HOSTS),
                                   ("devices_per_host", self.devices_per_host, MAX_DEVICES_PER_HOST)):
            if not is_whole(value) or value <= 0:
                raise ValueError(f"{field} must be a positive whole number, got {value!r}; set it to 1 or more.")
            if value > most:  # the planner's tables grow with both: a typo must not eat the machine's memory
                raise ValueError(f"{field} is {value}, more than the {most} autopar-lab plans for; set it to at "
                                 f"most {most}.")
        if not is_power_of_two(self.devices_per_host):
            lower = 1 << (self.devices_per_host.bit_length() - 1)
            raise ValueError(
                f"devices_per_host must be a power of two (1, 2, 4, 8, ...), got {self.devices_per_host}, because "
                f"Alpa's submesh shapes (1,1), (1,2), (1,4) ... (1,M) can only tile a host of M devices when M is a "
                f"power of two; use {lower} (or {lower * 2}) devices per host."
            )
        if not isinstance(self.device, Device):
            raise ValueError(f"device must be a Device, got {type(self.device).__name__}; build one with Device(...).")
        for field in ("intra_host", "inter_host"):
            if not isinstance(getattr(self, field), Link):
                raise ValueError(f"{field} must be a Link, got {type(getattr(self, field)).__name__}; use "
                                 "Link(bandwidth, latency).")
        if not is_whole(self.domain_hosts) or not 1 <= self.domain_hosts <= MAX_HOSTS:
            raise ValueError(f"domain_hosts must be a whole number of hosts from 1 to {MAX_HOSTS} (the hosts that "
                             f"share one scale-up fabric), got {self.domain_hosts!r}; use 1 where each host is its "
                             "own.")
        if self.moe_routing is not None and not isinstance(self.moe_routing, NodeLimit):
            raise ValueError(f"moe_routing must be a NodeLimit or None, got {type(self.moe_routing).__name__}; "
                             "build one with NodeLimit(num_experts, top_k, n_group, topk_group).")
        if not is_whole(self.mesh_peers) or self.mesh_peers < 0 or \
                (self.mesh_peers and (self.mesh_peers < self.devices_per_host - 1 or self.domain_hosts != 1
                                      or self.torus is not None)):
            raise ValueError(f"mesh_peers must be 0 (a switched scale-up fabric) or the peers each device of a "
                             f"fully connected board links to, at least devices_per_host - 1 = "
                             f"{self.devices_per_host - 1} and with domain_hosts=1 and no torus; got "
                             f"{self.mesh_peers!r}.")
        if self.torus is not None:
            torus = Torus.from_dict(self.torus)
            object.__setattr__(self, "torus", torus)
            if torus.size != self.devices_per_host or self.domain_hosts != 1:
                raise ValueError(f"a torus of {torus.describe()} holds {torus.size} chips, so it needs "
                                 f"devices_per_host={torus.size} and domain_hosts=1 (a host is one slice), not "
                                 f"{self.devices_per_host} and {self.domain_hosts}; give a matching torus or "
                                 "torus=None.")

    # -- basic facts ------------------------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    def host_of(self, device: int) -> int:
        """The host index of a (host-major) device index."""
        return int(device) // self.devices_per_host

    @property
    def devices_per_domain(self) -> int:
        """The devices of one whole scale-up domain (``domain_hosts`` x ``devices_per_host``; more than the cluster
        has when it holds only part of a domain)."""
        return self.devices_per_host * self.domain_hosts

    def domain_of(self, device: int) -> int:
        """The scale-up domain of a (host-major) device index.

        >>> c = Cluster.preset("gb200-nvl72", 36)          # two racks
        >>> c.domain_of(71), c.domain_of(72)
        (0, 1)
        """
        return int(device) // self.devices_per_domain

    @property
    def host_boundary_link(self) -> Link:
        """The link the stage DP prices a pipeline cut at a host boundary with: the scale-up link when one domain of
        several hosts holds them all (one GB200 NVL72 rack), else the scale-out link. Where domains span several
        hosts but not all, a cut between two hosts of one domain is priced by the DP at the scale-out link
        (pessimistic); the plan's own pricing (:func:`~autopar_lab.pricing.price.price_stages`) gives it the scale-up
        link."""
        return self.intra_host if 1 < self.domain_hosts and self.hosts <= self.domain_hosts else self.inter_host

    # -- construction ---------------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, hosts: int | None = None) -> "Cluster":
        """A named cluster (:data:`~autopar_lab.cluster.PRESETS`), from its data file in ``autopar_lab/presets/``.

        ``hosts``: for the GPU presets the hosts (8 GPUs each; ``gb200-nvl72`` trays of 4, 18 to a rack and one
        NVLink domain), default 1 (``gb200-nvl72``: 18); for the TPU presets the chips, a count with a standard
        slice shape (``tpu-v5p``: 4 ... 4096, 4x4x8 for 128) or a multiple of the largest slice (slices joined by
        the data-center network), default one host's chips.

        >>> Cluster.preset("dgx-a100", hosts=4).num_devices
        32
        >>> Cluster.preset("tpu-v5p", 128).torus.describe()
        '4x4x8, wraparound on every dimension'
        """
        key = str(name).strip().lower()
        if key != "cpu" and key not in GPU_PRESETS + TPU_PRESETS:
            raise ValueError(f"unknown cluster preset {name!r}; {SPEC_HELP}.")
        word = count_word(key)
        if hosts is not None and (not is_whole(hosts) or hosts <= 0):
            raise ValueError(f"{word} must be a positive whole number, got {hosts!r}; set it to 1 or more.")
        if word == "hosts" and hosts is not None and hosts > MAX_HOSTS:
            raise ValueError(f"hosts is {hosts}, more than the {MAX_HOSTS} autopar-lab plans for; set it to at most "
                             f"{MAX_HOSTS}.")
        if key == "cpu":
            return cls(**cpu_fields(1 if hosts is None else hosts))
        return cls(**preset_fields(key, hosts))

    @classmethod
    def from_profile(cls, path: str | os.PathLike, hosts: int = 1) -> "Cluster":
        """The ``cpu`` preset with the figures of the profile at ``path`` (one ``python -m autopar_lab.calibrate
        --out PATH`` wrote) in place of the shipped one: this machine as it measures now (its speed moves with its
        load), for a prediction to set beside a run made at the same time.

        >>> from autopar_lab.cluster import CPU_PROFILE_PATH
        >>> Cluster.from_profile(CPU_PROFILE_PATH).name
        'cpu'
        """
        if not is_whole(hosts) or hosts <= 0 or hosts > MAX_HOSTS:
            raise ValueError(f"hosts must be a whole number from 1 to {MAX_HOSTS}, got {hosts!r}.")
        return cls(**cpu_fields(hosts, path))

    @classmethod
    def parse(cls, spec: str) -> "Cluster":
        """``'PRESET:HOSTS'`` (``'tpu-v5p:128'``: chips for a TPU preset), ``'PRESET'`` (its default count: one
        host, a GB200 NVL72 rack, one TPU host's chips) or a path to a JSON cluster file.

        >>> Cluster.parse("p3.16xlarge:2").hosts
        2
        >>> Cluster.parse("tpu-v5e:512").hosts          # two 16x16 pods over the data-center network
        2
        """
        if isinstance(spec, Cluster):
            return spec
        if not isinstance(spec, (str, os.PathLike)):
            raise ValueError(f"bad cluster spec {spec!r}; {SPEC_HELP}.")
        text = os.fspath(spec).strip()
        if text.lower().endswith(".json") or os.path.exists(text):
            return cls.from_json(text)
        name, sep, hosts_text = text.partition(":")
        if not sep:
            return cls.preset(name)
        try:
            hosts = int(hosts_text)
        except ValueError:
            hosts = 0
        if hosts <= 0 or name.strip().lower() not in PRESETS:
            raise ValueError(f"bad cluster spec {text!r}; {SPEC_HELP}.")
        return cls.preset(name, hosts)

    def to_dict(self) -> dict:
        """The JSON form (see :meth:`from_json`)."""
        return {
            "version": CLUSTER_FILE_VERSION,
            "name": self.name,
            "hosts": self.hosts,
            "devices_per_host": self.devices_per_host,
            "device": self.device.to_dict(),
            "intra_host": self.intra_host.to_dict(),
            "inter_host": self.inter_host.to_dict(),
            # Only where set: the files of every cluster without a domain or a torus stay as they were.
            **({"domain_hosts": self.domain_hosts} if self.domain_hosts != 1 else {}),
            **({"torus": self.torus.to_dict()} if self.torus is not None else {}),
            **({"mesh_peers": self.mesh_peers} if self.mesh_peers else {}),
        }

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The cluster as JSON text; also written to ``path`` when given.

        >>> Cluster.from_json(Cluster.preset("dgx-h100").to_json()) == Cluster.preset("dgx-h100")
        True
        """
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, source: str | os.PathLike | Mapping) -> "Cluster":
        """A cluster from a dict, JSON text or a JSON file path. The form (units: bytes, bytes/s, s, FLOP/s)::

            {"version": 1, "name": "my-cluster", "hosts": 2, "devices_per_host": 8,
             "device": {"name": "V100", "peak_flops": {"float32": 15.7e12, "float16": 125e12},
                        "memory_bytes": 17179869184, "memory_bandwidth": 9e11},
             "intra_host": {"bandwidth": 1.5e11, "latency": 5e-6},
             "inter_host": {"bandwidth": 3.125e9, "latency": 5e-5}}

        ``inter_host.bandwidth`` is the whole host's network bandwidth. ``name`` and ``version`` are optional, and
        so are ``domain_hosts`` (default 1: each host its own scale-up domain), ``torus`` (``{"dims": [4, 4, 8],
        "wrap": [true, true, true]}``: the hosts are TPU slices on that ICI torus) and ``mesh_peers`` (default 0:
        a switched scale-up fabric; see :class:`Cluster`).
        """
        from ..safeio import loads_json, read_text_file

        where = "cluster dict"
        if isinstance(source, Mapping):
            data = source
        elif not isinstance(source, (str, os.PathLike)):
            raise ValueError(f"a cluster must be a dict, JSON text or a JSON file path, got {type(source).__name__}; "
                             "use the form shown in Cluster.from_json.")
        else:
            text = os.fspath(source)
            if text.lstrip().startswith("{"):
                where = "cluster JSON text"
            else:
                where = f"cluster file {text!r}"
                # Untrusted like a plan file: a regular file, bounded in size (safeio says why).
                text = read_text_file(text, "cluster file", limit=1 << 20)
            try:
                data = loads_json(text, where)
            except ValueError as e:
                hint = "" if ";" in str(e) else "; fix it to the form shown in Cluster.from_json"
                raise ValueError(f"{str(e).rstrip('.')}{hint}.") from None
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must hold a JSON object, got {type(data).__name__}; use the form shown in "
                             "Cluster.from_json.")
        if "version" in data and (isinstance(data["version"], bool) or data["version"] != CLUSTER_FILE_VERSION):
            raise ValueError(f"{where} has version {data['version']!r:.20}, but this autopar-lab reads version "
                             f"{CLUSTER_FILE_VERSION}; write the file in that form (see Cluster.from_json) or leave "
                             "version out.")
        if data.get("kind") == CPU_PROFILE_KIND:  # a calibration of this machine: the cpu preset with its figures
            return cls(**profile_fields(data, 1, where))

        def get(obj: Any, key: str, label: str) -> Any:
            if not isinstance(obj, Mapping) or key not in obj:
                raise ValueError(f"{where} is missing {label!r}; add it (see Cluster.from_json for the form).")
            return obj[key]

        dev = get(data, "device", "device")
        device = Device(
            name=str(dev.get("name", "device")) if isinstance(dev, Mapping) else "device",
            peak_flops=get(dev, "peak_flops", "device.peak_flops"),
            memory_bytes=get(dev, "memory_bytes", "device.memory_bytes"),
            memory_bandwidth=get(dev, "memory_bandwidth", "device.memory_bandwidth"),
            task_overhead_s=dev.get("task_overhead_s", 0.0) if isinstance(dev, Mapping) else 0.0,
            shares_cores=shares_cores_of(dev) if isinstance(dev, Mapping) else False,
            vector_flops=dev.get("vector_flops") if isinstance(dev, Mapping) else None,
            efficiency=Efficiency.from_dict(dev.get("efficiency") if isinstance(dev, Mapping) else None),
        )
        links = {}
        for field in ("intra_host", "inter_host"):
            raw = get(data, field, field)
            # Checked here with the field's name, so the message says which link is wrong.
            bw, lat = check_link(get(raw, "bandwidth", f"{field}.bandwidth"), get(raw, "latency", f"{field}.latency"),
                                 field)
            links[field] = Link(bw, lat)
        return cls(
            hosts=get(data, "hosts", "hosts"),
            devices_per_host=get(data, "devices_per_host", "devices_per_host"),
            device=device,
            name=str(data.get("name", "custom")),
            domain_hosts=data.get("domain_hosts", 1),
            torus=data.get("torus"),
            mesh_peers=data.get("mesh_peers", 0),
            intra_host=links["intra_host"],
            inter_host=links["inter_host"],
        )

    # Shortcuts accepted by with_() besides the dataclass fields, so a what-if slider can move one number.
    _SHORTCUTS = {
        "intra_host_bandwidth": ("intra_host", "bandwidth"),
        "intra_host_latency": ("intra_host", "latency"),
        "inter_host_bandwidth": ("inter_host", "bandwidth"),
        "inter_host_latency": ("inter_host", "latency"),
        "memory_bytes": ("device", "memory_bytes"),
        "memory_bandwidth": ("device", "memory_bandwidth"),
        "peak_flops": ("device", "peak_flops"),
        "efficiency": ("device", "efficiency"),
    }
    # Fields of the device's Efficiency a what-if may set directly (``cluster.with_(flash_attention=False)``).
    _EFFICIENCY_SHORTCUTS = frozenset(f.name for f in dataclasses.fields(Efficiency))

    def with_(self, **changes: Any) -> "Cluster":
        """A modified copy: any field (``hosts=4``) or shortcut (``inter_host_bandwidth=1e9``, ``memory_bytes=...``),
        or a field of the device's :class:`Efficiency` (``flash_attention=False``: attention priced as matmuls and a
        softmax through memory, a per-plan choice).

        >>> Cluster.preset("p3.16xlarge").with_(hosts=4, memory_bytes=32 * 2**30).device.memory_bytes == 32 * 2**30
        True
        >>> Cluster.preset("dgx-a100").with_(flash_attention=False).device.efficiency.flash_attention
        False
        """
        fields = {f.name for f in dataclasses.fields(self)}
        eff = {k: changes.pop(k) for k in list(changes) if k in self._EFFICIENCY_SHORTCUTS and k not in fields}
        if eff:
            base_dev = changes.get("device", self.device)
            changes["device"] = dataclasses.replace(base_dev,
                                                    efficiency=dataclasses.replace(base_dev.efficiency, **eff))
        direct = {k: v for k, v in changes.items() if k in fields}
        nested: dict[str, dict] = {}
        for key, value in changes.items():
            if key in fields:
                continue
            if key not in self._SHORTCUTS:
                valid = ", ".join(sorted(fields | set(self._SHORTCUTS) | self._EFFICIENCY_SHORTCUTS))
                raise ValueError(f"Cluster.with_ got an unknown change {key!r}; use one of: {valid}.")
            part, attr = self._SHORTCUTS[key]
            nested.setdefault(part, {})[attr] = value
        for part, attrs in nested.items():
            base = direct.get(part, getattr(self, part))
            direct[part] = dataclasses.replace(base, **attrs)
        return dataclasses.replace(self, **direct)

    def scaled_inter_host(self, factor: float) -> "Cluster":
        """The same cluster with inter-host bandwidth ``factor`` times lower (latency unchanged).

        >>> c = Cluster.preset("p3.16xlarge")
        >>> c.scaled_inter_host(4).inter_host.bandwidth == c.inter_host.bandwidth / 4
        True
        """
        f = check_positive(factor, "scaled_inter_host factor", "times")
        return self.with_(inter_host_bandwidth=self.inter_host.bandwidth / f)

    # -- submeshes ------------------------------------------------------------------------------------

    def submesh_shapes(self) -> list[tuple[int, int]]:
        """Alpa's submesh shapes: (1,1), (1,2), (1,4) ... (1,M), then (2,M), (3,M) ... (N,M).

        >>> Cluster.preset("p3.16xlarge", hosts=2).submesh_shapes()
        [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]
        """
        m = self.devices_per_host
        shapes = [(1, 1 << i) for i in range(m.bit_length())]  # powers of two up to M (M is one)
        shapes += [(n, m) for n in range(2, self.hosts + 1)]
        return shapes

    def checked_submesh(self, submesh: Sequence[int]) -> tuple[int, int]:
        """``submesh`` as an (n, m) tuple of ints, or one sentence listing this cluster's submesh shapes."""
        try:
            shape = (int(submesh[0]), int(submesh[1]))
            ok = len(submesh) == 2
        except (TypeError, ValueError, IndexError):
            ok = False
        if not ok or shape not in self.submesh_shapes():
            raise ValueError(
                f"submesh {tuple(submesh) if isinstance(submesh, (list, tuple)) else submesh!r} is not one of this "
                f"cluster's submesh shapes; use one of {self.submesh_shapes()}."
            )
        return shape

    def logical_mesh_shapes(self, submesh: Sequence[int]) -> list[tuple[int, int]]:
        """The 2D logical views (n0, n1) of an (n, m) submesh, n0 ascending.

        Returned: every (n0, n1) with n0 * n1 = n * m where n1 divides M or is a whole number of hosts (k * M,
        k dividing n). Devices fill the logical mesh row-major in host-major order, so axis 1 is the fast axis:
        this rule guarantees every axis-1 group lies inside one host or is made of whole hosts, so each axis
        runs over one kind of link. For n == 1 this is (1, m), (2, m/2) ... (m, 1); for n > 1 it includes the
        physical (n, M), (n*M, 1) and (1, n*M). Alpa's "all" space also tries n1 values that split a host
        unevenly (e.g. (8, 3) on a (3, 8) submesh); those are left out because their groups straddle hosts.

        >>> Cluster.preset("p3.16xlarge", hosts=2).logical_mesh_shapes((2, 8))
        [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)]
        """
        n, m = self.checked_submesh(submesh)
        size, host = n * m, self.devices_per_host
        out = []
        for n0 in range(1, size + 1):
            if size % n0:
                continue
            n1 = size // n0
            if host % n1 == 0 or (n1 % host == 0 and n % (n1 // host) == 0):
                out.append((n0, n1))
        return out

    def logical_mesh(self, submesh: Sequence[int], shape: Sequence[int] | None = None,
                     first_device: int = 0) -> LogicalMesh:
        """A validated :class:`LogicalMesh` (``shape`` defaults to the submesh's physical shape).

        >>> Cluster.preset("dgx-a100", hosts=2).logical_mesh((1, 8), (2, 4)).axis_size((0, 1))
        8
        """
        sub = self.checked_submesh(submesh)
        return LogicalMesh(self, sub, tuple(shape) if shape is not None else sub, first_device)

    def place(self, submeshes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """Device indices for each submesh (in the given order), tiling the cluster as Alpa does.

        Whole-host shapes (n, M) take whole hosts first; the (1, 2^k) shapes then go in decreasing size,
        each right after the previous one. Why this always fits: while placing size s, every earlier piece
        in that host was a multiple of s, so the offset is a multiple of s, and M is too, so no piece
        straddles a host; with sizes summing to at most N*M, nothing runs past the last device.

        >>> Cluster.preset("p3.16xlarge").place([(1, 2), (1, 4), (1, 1)])
        [(4, 5), (0, 1, 2, 3), (6,)]
        """
        shapes = [self.checked_submesh(s) for s in submeshes]
        total = sum(n * m for n, m in shapes)
        if total > self.num_devices:
            raise ValueError(
                f"submeshes {shapes} need {total} devices but the cluster has {self.num_devices}; "
                "drop or shrink some submeshes."
            )
        # Stable sort: whole-host shapes (larger first) then sub-host shapes by decreasing size.
        order = sorted(range(len(shapes)), key=lambda i: -(shapes[i][0] * shapes[i][1]))
        out: list[tuple[int, ...]] = [()] * len(shapes)
        nxt = 0
        for i in order:
            size = shapes[i][0] * shapes[i][1]
            out[i] = tuple(range(nxt, nxt + size))
            nxt += size
        return out

    # -- links ------------------------------------------------------------------------------------------

    def p2p_link(self, src_devices: Sequence[int], dst_devices: Sequence[int]) -> Link:
        """The link a stage-to-stage transfer uses: intra_host if both device sets lie in one scale-up domain (one
        host, or the hosts sharing an NVLink fabric; a TPU slice), else inter_host.

        >>> c = Cluster.preset("p3.16xlarge", hosts=2)
        >>> c.p2p_link([0, 1], [2, 3]) == c.intra_host, c.p2p_link([0], [8]) == c.inter_host
        (True, True)
        """
        devs = [int(d) for d in list(src_devices) + list(dst_devices)]
        bad = [d for d in devs if not 0 <= d < self.num_devices]
        if bad:
            raise ValueError(f"device indices {bad} are outside this cluster's 0..{self.num_devices - 1}; use indices "
                             "in that range.")
        return self.scale_up_link(2) if len({self.domain_of(d) for d in devs}) <= 1 else self.inter_host

    def scale_up_link(self, devices: int) -> Link:
        """The link of a collective among ``devices`` devices of one scale-up domain (2: a transfer between two):
        ``intra_host``, or on a fully connected board (``mesh_peers``) the links to the group's other devices only,
        ``(devices - 1) / mesh_peers`` of its bandwidth.

        >>> c = Cluster.preset("dgx-h200").with_(devices_per_host=4, mesh_peers=3)
        >>> [round(c.scale_up_link(k).bandwidth / c.intra_host.bandwidth, 3) for k in (2, 3, 4)]
        [0.333, 0.667, 1.0]
        """
        share = min(max(int(devices) - 1, 1) / self.mesh_peers, 1.0) if self.mesh_peers else 1.0
        return self.intra_host if share >= 1.0 else Link(self.intra_host.bandwidth * share, self.intra_host.latency)

    def send_recv(self, nbytes: float, src_devices: Sequence[int], dst_devices: Sequence[int]) -> float:
        """Time to move ``nbytes`` between two device sets over :meth:`p2p_link`."""
        return send_recv(nbytes, self.p2p_link(src_devices, dst_devices))

