"""The planning space: the submesh shapes and logical meshes the stage DP searches, and which of them are the same
problem for the intra-op pass (:func:`mesh_signature`). The cost table (:mod:`autopar_lab.pricing.table`) solves one
ILP per mesh this module lists."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from ..cluster import Cluster, LogicalMesh

__all__ = ["SPACES", "FULL_SPACE_MAX_HOSTS", "SCALE_SPACE_MIN_HOSTS", "mesh_signature", "distinct_mesh_shapes",
           "planning_submeshes", "scale_space", "lean_everywhere"]

#: Planning spaces: "full" (every Alpa submesh shape), "divisors" (see :func:`planning_submeshes`), "scale" (see
#: :func:`scale_space`), "auto" (full up to ``FULL_SPACE_MAX_HOSTS`` hosts, divisors above, scale from
#: ``SCALE_SPACE_MIN_HOSTS`` hosts on where the host count is a power of two).
SPACES = ("auto", "full", "divisors", "scale")
FULL_SPACE_MAX_HOSTS = 4
#: From this many hosts on, a power-of-two cluster is planned in the "scale" space by default (issue 36: Llama 3
#: 405B on 2,048 DGX H100 hosts, DeepSeek-V3 on 256 H800 hosts); below, no plan changes (the golden plans, the
#: 1T on 384 and 530B on 315 hosts of bench/RESULTS.md are unaffected).
SCALE_SPACE_MIN_HOSTS = 256


def scale_space(cluster: Cluster, space: str) -> bool:
    """Whether ``space`` plans ``cluster`` in the "scale" space: named, or "auto" on a power-of-two cluster of at
    least ``SCALE_SPACE_MIN_HOSTS`` hosts.

    The scale space is the divisors space cut three times, an approximation whose gap ``bench/RESULTS.md`` records
    ("Planning at 16,384 GPUs"): submeshes of whole hosts only (a stage of 1, 2 or 4 GPUs among thousands makes
    the stage DP count free devices one by one, 8 times the columns of counting hosts); of a power-of-two host
    count only (they tile a power-of-two cluster, and every Megatron-LM layout of such a cluster is one); and a
    logical mesh with both axes split keeps its fast axis (axis 1, the tensor axis of a Megatron layout) inside one
    scale-up domain, as Megatron-LM and Llama 3 keep tensor parallelism inside the NVLink domain. The one-axis view
    of every submesh, which may span hosts, stays.

    >>> from autopar_lab.cluster import Cluster
    >>> [scale_space(Cluster.preset("dgx-h100", hosts=n), "auto") for n in (128, 256, 384)]
    [False, True, False]
    """
    n = cluster.hosts
    return space == "scale" or (space == "auto" and n >= SCALE_SPACE_MIN_HOSTS and n & (n - 1) == 0)


def lean_everywhere(cluster: Cluster, space: str, lean: str) -> bool:
    """Whether a cost table with ``lean`` ("auto", "all" or "off": ``table.LEAN_MODES``) in ``space`` wants every
    planned mesh's lean solution whatever the fast ones cost: "all", or "auto" in the scale space (see
    ``CostTable.lean_wanted``). Its ILPs then solve a mesh's lean solution right after its fast one, on one
    StrategyCache (``table_pool.mesh_tasks``).

    >>> from autopar_lab.cluster import Cluster
    >>> [lean_everywhere(Cluster.preset("h800", hosts=256), "auto", m) for m in ("auto", "all", "off")]
    [True, True, False]
    """
    return lean == "all" or (lean == "auto" and scale_space(cluster, space))


def mesh_signature(mesh: LogicalMesh) -> tuple:
    """What the intra-op pass sees of a logical mesh: each axis' collective profile (size, hosts spanned, link;
    :meth:`~autopar_lab.cluster.LogicalMesh.axis_profile`), the cluster's device.

    A mesh with one split axis is the same problem whichever axis it is: (1, 8) and (8, 1) on one host run the same
    collectives over the same devices, and the ILP finds the same plan with the axis renamed. With both axes split
    the order matters (the sequential solve decides axis 0 first), so it is kept.

    >>> from autopar_lab.cluster import Cluster
    >>> c = Cluster.preset("p3.16xlarge")
    >>> mesh_signature(c.logical_mesh((1, 8), (1, 8))) == mesh_signature(c.logical_mesh((1, 8), (8, 1)))
    True
    >>> mesh_signature(c.logical_mesh((1, 8), (2, 4))) == mesh_signature(c.logical_mesh((1, 8), (4, 2)))
    False
    """
    axes = [mesh.axis_profile(a) for a in (0, 1) if mesh.axis_size(a) > 1]
    return (mesh.cluster.device, tuple(axes))


def distinct_mesh_shapes(cluster: Cluster, submesh: Sequence[int], space: str = "full") -> list[tuple[int, int]]:
    """The submesh's logical mesh shapes, keeping the first of each group with the same :func:`mesh_signature`
    (their layer costs are the same, so the stage DP needs only one and the intra-op pass solves only one). In the
    "scale" space (:func:`scale_space`: ``space`` names it, or is "auto" on a cluster that large) a view with both
    axes split keeps axis 1 inside one scale-up domain.

    >>> from autopar_lab.cluster import Cluster
    >>> distinct_mesh_shapes(Cluster.preset("p3.16xlarge"), (1, 8))
    [(1, 8), (2, 4), (4, 2)]
    """
    out, seen = [], set()
    shapes = cluster.logical_mesh_shapes(submesh)
    if scale_space(cluster, space):
        shapes = [(a, b) for a, b in shapes if a == 1 or b == 1 or b <= cluster.devices_per_domain]
    for shape in shapes:
        sig = mesh_signature(cluster.logical_mesh(submesh, shape))
        if sig not in seen:
            seen.add(sig)
            out.append((int(shape[0]), int(shape[1])))
    return out


def planning_submeshes(cluster: Cluster, batch_size: int, space: str = "auto") -> list[tuple[int, int]]:
    """The submesh shapes the stage DP searches, in Alpa's order.

    ``"full"``: every shape of :meth:`Cluster.submesh_shapes` ((1, 1) ... (1, M), (2, M) ... (N, M)). ``"divisors"``:
    every (1, m), and the (n, M) whose device count divides the batch (data parallelism splits the batch evenly) or
    whose host count divides the cluster's (a pipeline of equal stages tiles it, Megatron's layouts). The others
    cannot split the batch over all their devices, and the cost model prices them accordingly (GPT-39B on 512 A100s:
    their best layer costs 5 to 50 times the device-seconds of the others); at 64 hosts they are 52 of 67 shapes
    and 326 of 412 logical meshes, and leaving them out gives the same plan; GPT-39B on 8 p3 hosts (Alpa's case)
    too, with 22 of 40 meshes (``bench/RESULTS.md``). An approximation all the same: ``"full"`` searches Alpa's
    whole space. ``"scale"``: see :func:`scale_space`. ``"auto"``: full up to ``FULL_SPACE_MAX_HOSTS`` hosts,
    divisors above, scale on a power-of-two cluster of ``SCALE_SPACE_MIN_HOSTS`` hosts or more.

    >>> from autopar_lab.cluster import Cluster
    >>> c = Cluster.preset("dgx-a100", hosts=24)
    >>> [n for n, m in planning_submeshes(c, 96, "divisors") if m == 8]
    [1, 2, 3, 4, 6, 8, 12, 24]
    """
    if space not in SPACES:
        raise ValueError(f"space must be one of {SPACES}, got {space!r}")
    shapes = [(int(n), int(m)) for n, m in cluster.submesh_shapes()]
    if space == "full" or (space == "auto" and cluster.hosts <= FULL_SPACE_MAX_HOSTS):
        return shapes
    M, N = cluster.devices_per_host, cluster.hosts
    if scale_space(cluster, space):  # whole hosts, power-of-two host counts (and the whole cluster)
        return [(n, m) for n, m in shapes if m == M and (n & (n - 1) == 0 or n == N)]
    return [(n, m) for n, m in shapes if n == 1 or batch_size % (n * M) == 0 or N % n == 0]
