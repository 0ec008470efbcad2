"""Sharding specs: how one tensor is laid out over a 2D logical mesh (Alpa's "S0R", JAX's ``PartitionSpec``).

A :class:`ShardingSpec` gives, per tensor dimension, the tuple of mesh axes that split it:

- ``()``      replicated                      -> ``"R"``
- ``(0,)``    split over mesh axis 0          -> ``"S0"``
- ``(1,)``    split over mesh axis 1          -> ``"S1"``
- ``(0, 1)``  split over both axes, flattened -> ``"S01"`` (axis 0 major, like ``PartitionSpec(("x", "y"))``)

Example:
    >>> s = ShardingSpec.parse("S0RS1")
    >>> s.dims, str(s)
    (((0,), (), (1,)), 'S0RS1')
    >>> s.to_partition_spec()
    P('x', None, 'y')
    >>> s.shard_shape((8, 3, 16), (2, 4))
    (4, 3, 4)

A rank-0 tensor (a scalar) has the empty spec, written ``""``; :meth:`ShardingSpec.parse` also accepts ``"R"`` for it
when told ``rank=0`` (``"R"`` alone otherwise means a replicated rank-1 tensor).
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from jax.sharding import PartitionSpec

from ..graph.opgraph import dtype_size

MESH_AXES = (0, 1)
DEFAULT_AXIS_NAMES = ("x", "y")  # what LogicalMesh.to_jax_mesh names its axes
_TOKEN = re.compile(r"R|S([01]{1,2})")

Axes = tuple[int, ...]


#: ``str(spec)`` per spec (a few thousand distinct ones in a plan).
_TEXT: dict = {}


@dataclass(frozen=True, init=False)
class ShardingSpec:
    """Per tensor dimension, the mesh axes that split it (see the module docstring).

    >>> ShardingSpec(((0, 1), ())).__str__()
    'S01R'
    >>> ShardingSpec.replicated(3)
    ShardingSpec('RRR')
    >>> ShardingSpec.parse("S0R") is ShardingSpec(((0,), ()))  # one object per layout
    True
    """

    dims: tuple[Axes, ...]

    def __new__(cls, dims=None):
        # Specs are built by the hundred thousand while the planner enumerates strategies, and looked up in dicts
        # keyed by tuples of them: one object per layout makes those lookups identity checks (no __eq__ call) and
        # skips the checks for a layout seen before. (No dims: unpickling an old pickle, which sets the state.)
        if cls is ShardingSpec and dims is not None:
            try:
                return _INTERNED[dims]
            except (KeyError, TypeError):  # new, or given as lists
                pass
        return object.__new__(cls)

    def __init__(self, dims) -> None:
        if "_hash" in self.__dict__:
            return  # the interned spec of these dims, set up when first made
        try:
            dims = _CANONICAL[dims]
        except (KeyError, TypeError):  # new, or given as lists
            dims = _canonical_dims(dims)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "_hash", hash(dims))
        if type(self) is ShardingSpec and len(_INTERNED) < 1 << 16:
            _INTERNED.setdefault(dims, self)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if other.__class__ is not ShardingSpec:
            return NotImplemented
        return self._hash == other._hash and self.dims == other.dims

    def __reduce__(self):
        return (ShardingSpec, (self.dims,))  # unpickled specs are the interned ones too

    def __getstate__(self):
        return {"dims": self.dims}

    def __setstate__(self, state) -> None:
        object.__setattr__(self, "dims", state["dims"])
        object.__setattr__(self, "_hash", hash(state["dims"]))

    # --- construction -------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, rank: int | None = None) -> "ShardingSpec":
        """Alpa's string form: ``"S0R"``, ``"RS01"``, ``""`` for a scalar (or ``"R"`` with ``rank=0``).

        >>> ShardingSpec.parse("RS01").dims
        ((), (0, 1))
        >>> ShardingSpec.parse("R", rank=0).rank
        0
        """
        text = str(text).strip().replace(" ", "")
        if rank == 0 and text in ("", "R"):
            return cls(())
        dims, pos = [], 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                raise ValueError(
                    f"cannot read sharding spec {text!r} at position {pos}: write one token per dimension, "
                    "R (replicated), S0, S1 or S01 (split over mesh axis 0, 1 or both), e.g. 'S0R'"
                )
            dims.append(tuple(int(c) for c in m.group(1)) if m.group(1) else ())
            pos = m.end()
        if rank is not None and len(dims) != rank:
            raise ValueError(f"sharding spec {text!r} has {len(dims)} dimensions, the tensor has {rank}")
        return cls(tuple(dims))

    @classmethod
    def replicated(cls, rank: int) -> "ShardingSpec":
        """All dimensions replicated: ``replicated(2)`` is ``RR``."""
        return cls(((),) * int(rank))

    @classmethod
    def from_partition_spec(
        cls, pspec: PartitionSpec, rank: int | None = None, axis_names: Sequence[str] = DEFAULT_AXIS_NAMES
    ) -> "ShardingSpec":
        """The inverse of :meth:`to_partition_spec`; ``rank`` pads missing trailing entries with ``None``.

        >>> str(ShardingSpec.from_partition_spec(PartitionSpec(("x", "y"), None)))
        'S01R'
        """
        index = {name: i for i, name in enumerate(axis_names)}
        entries = list(pspec)
        if rank is not None:
            if len(entries) > rank:
                raise ValueError(f"PartitionSpec {pspec} has {len(entries)} entries, the tensor has rank {rank}")
            entries += [None] * (rank - len(entries))
        dims = []
        for e in entries:
            names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
            try:
                dims.append(tuple(index[n] for n in names))
            except KeyError as k:
                raise ValueError(f"PartitionSpec {pspec} names mesh axis {k.args[0]!r}; known axes: {tuple(axis_names)}") from None
        return cls(tuple(dims))

    # --- views --------------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def axes(self) -> frozenset[int]:
        """The mesh axes this spec splits over (anywhere)."""
        axes = self.__dict__.get("_axes")
        if axes is None:  # remembered: pricing asks for every strategy's specs on every mesh
            axes = frozenset(a for d in self.dims for a in d)
            object.__setattr__(self, "_axes", axes)
        return axes

    def dim_of(self, axis: int) -> int | None:
        """The tensor dimension split over mesh ``axis``, or None when the tensor is replicated along it."""
        for i, d in enumerate(self.dims):
            if axis in d:
                return i
        return None

    def without_axes(self, axes: Iterable[int]) -> "ShardingSpec":
        """This spec with ``axes`` removed (replicated along them): the layout after an all-gather over them."""
        key = (self, tuple(axes))
        out = _WITHOUT.get(key)
        if out is None:  # remembered: the sequential solve projects every strategy's specs on every mesh
            drop = set(key[1])
            out = ShardingSpec(tuple(tuple(a for a in d if a not in drop) for d in self.dims))
            if len(_WITHOUT) > 1 << 16:
                _WITHOUT.clear()
            _WITHOUT[key] = out
        return out

    def __str__(self) -> str:
        text = _TEXT.get(self)
        if text is None:  # remembered per spec: every strategy's name spells its specs (~10^5 per plan)
            text = _TEXT[self] = "".join("S" + "".join(map(str, d)) if d else "R" for d in self.dims)
        return text

    def __repr__(self) -> str:
        return f"ShardingSpec({str(self)!r})"

    def to_partition_spec(self, axis_names: Sequence[str] = DEFAULT_AXIS_NAMES) -> PartitionSpec:
        """The ``jax.sharding.PartitionSpec`` over a mesh whose axes are named ``axis_names`` (axis 0 first).

        >>> ShardingSpec.parse("RS01").to_partition_spec()
        P(None, ('x', 'y'))
        """
        entries = []
        for d in self.dims:
            names = tuple(axis_names[a] for a in d)
            entries.append(None if not names else names[0] if len(names) == 1 else names)
        return PartitionSpec(*entries)

    # --- shapes and bytes ---------------------------------------------------------------------------------
    def num_shards(self, dim: int, mesh_shape: Sequence[int]) -> int:
        """How many pieces dimension ``dim`` is cut into on a mesh of ``mesh_shape``."""
        return math.prod(int(mesh_shape[a]) for a in self.dims[dim])

    def is_valid(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
        """Rank matches and every split dimension divides evenly (no padding); axes of size 1 are allowed.

        >>> ShardingSpec.parse("S0R").is_valid((6, 4), (4, 2)), ShardingSpec.parse("S0R").is_valid((8, 4), (4, 2))
        (False, True)
        """
        return self._shard_shape(shape, mesh_shape) is not None

    def shard_shape(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape each device holds. Raises if the spec does not divide ``shape``."""
        out = self._shard_shape(shape, mesh_shape)
        if out is None:
            raise ValueError(f"spec {self} does not evenly shard shape {tuple(shape)} on a {tuple(mesh_shape)} mesh")
        return out

    def bytes_per_device(self, shape: Sequence[int], dtype: str, mesh_shape: Sequence[int]) -> int:
        """Bytes of one device's shard: ``bytes_per_device((8, 4), "float32", (2, 4))`` of ``S0R`` is 64."""
        key = (self, shape, dtype, mesh_shape)
        try:  # pricing asks for every spec of every strategy: one lookup for what recurs
            return _BYTES[key]
        except (KeyError, TypeError):  # new, or a list among the arguments
            pass
        out = math.prod(self.shard_shape(shape, mesh_shape)) * dtype_size(str(dtype))
        if type(shape) is tuple and type(mesh_shape) is tuple:
            if len(_BYTES) > 1 << 18:
                _BYTES.clear()
            _BYTES[key] = out
        return out

    def _shard_shape(self, shape, mesh_shape) -> tuple[int, ...] | None:
        """The shard shape, or None when the spec does not fit (memoised: the same few shapes recur)."""
        try:
            return _SHARD_SHAPES[(self, shape, mesh_shape)]
        except KeyError:
            out = self._compute_shard_shape(shape, mesh_shape)
            if len(_SHARD_SHAPES) > 1 << 18:
                _SHARD_SHAPES.clear()
            _SHARD_SHAPES[(self, shape, mesh_shape)] = out
            return out
        except TypeError:  # shape or mesh_shape given as lists
            return self._compute_shard_shape(shape, mesh_shape)

    def _compute_shard_shape(self, shape, mesh_shape) -> tuple[int, ...] | None:
        if len(shape) != self.rank:
            return None
        out = []
        for i in range(self.rank):
            n = self.num_shards(i, mesh_shape)
            if int(shape[i]) % n:
                return None
            out.append(int(shape[i]) // n)
        return tuple(out)


_CANONICAL: dict[tuple, tuple[Axes, ...]] = {}
_INTERNED: dict[tuple, ShardingSpec] = {}
_SHARD_SHAPES: dict[tuple, tuple[int, ...] | None] = {}
_BYTES: dict[tuple, int] = {}
_WITHOUT: dict[tuple, "ShardingSpec"] = {}


def _canonical_dims(dims) -> tuple[Axes, ...]:
    """``dims`` as a tuple of tuples of ints, checked (each axis exists and is used once)."""
    out = tuple(tuple(int(a) for a in d) for d in dims)
    used = [a for d in out for a in d]
    bad = [a for a in used if a not in MESH_AXES]
    if bad:
        raise ValueError(f"mesh axis {bad[0]} does not exist: a logical mesh has axes 0 and 1")
    if len(used) != len(set(used)):
        raise ValueError(f"spec {out} uses a mesh axis twice; each axis may split at most one dimension once")
    if len(_CANONICAL) < 1 << 16:
        _CANONICAL[out] = out
        try:
            _CANONICAL[dims] = out
        except TypeError:
            pass
    return out


def useful_axes(mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Mesh axes with more than one device.

    Splitting over a size-1 axis changes nothing about the layout, so strategies only use these axes: otherwise
    ``S0R`` on a (1, 8) mesh would duplicate ``RR``.
    """
    return tuple(a for a in MESH_AXES if int(mesh_shape[a]) > 1)


def axis_choices(mesh_shape: Sequence[int]) -> tuple[Axes, ...]:
    """The ways to split one dimension: each useful axis alone, and both flattened when both are useful."""
    ax = useful_axes(mesh_shape)
    return tuple((a,) for a in ax) + ((tuple(ax),) if len(ax) == 2 else ())


def assignments(num_dims: int, mesh_shape: Sequence[int], dims: Iterable[int] | None = None) -> Iterator[dict[int, Axes]]:
    """Every way to give the useful mesh axes to dimensions (each axis used at most once), as ``{dim: axes}``.

    On a 2D mesh this yields: nothing split; one dim over axis 0, 1 or both; two dims over axis 0 and 1. That is
    1 + 3r + r(r-1) choices for r candidate dimensions (r + 1 on a mesh with one useful axis), so a spec never
    splits more than two dimensions.

    >>> len(list(assignments(2, (2, 4))))
    9
    """
    cand = list(range(num_dims)) if dims is None else sorted(set(dims))
    yield {}
    for d in cand:
        for axes in axis_choices(mesh_shape):
            yield {d: axes}
    ax = useful_axes(mesh_shape)
    if len(ax) == 2:
        for d0, d1 in itertools.permutations(cand, 2):
            yield {d0: (ax[0],), d1: (ax[1],)}


def candidate_specs(shape: Sequence[int], mesh_shape: Sequence[int], dims: Iterable[int] | None = None) -> list[ShardingSpec]:
    """Valid specs of ``shape`` that split at most two of ``dims`` (all dims by default) over useful axes.

    >>> [str(s) for s in candidate_specs((8, 3), (1, 4))]
    ['RR', 'S1R']
    """
    out = []
    for a in assignments(len(shape), mesh_shape, dims):
        spec = ShardingSpec(tuple(a.get(i, ()) for i in range(len(shape))))
        if spec.is_valid(shape, mesh_shape):
            out.append(spec)
    return out


__all__ = [
    "Axes",
    "DEFAULT_AXIS_NAMES",
    "MESH_AXES",
    "ShardingSpec",
    "assignments",
    "axis_choices",
    "candidate_specs",
    "useful_axes",
]
