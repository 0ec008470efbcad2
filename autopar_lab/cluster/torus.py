"""A TPU slice's ICI torus, and the collectives of a logical mesh axis laid along it.

A slice's chips sit on a 2D (TPU v5e, v6e) or 3D (v4, v5p) torus of nearest-neighbour links (ICI). Chips are numbered
with the first torus dimension fastest, so the aligned block of ``2^k`` consecutive chips that Alpa's submesh
tiling hands a stage is a box (a sub-torus), and a logical mesh axis covers a run of the chip number's bits: the
axis of ``n1`` consecutive chips covers the lowest ``log2 n1`` bits, the other axis the next ones. Each bit belongs to
one torus dimension, so an axis runs along one or more dimensions (:class:`Segment`): ``length`` chips of that
dimension, ``stride`` apart (an axis that starts at a dimension's higher bits skips chips), with a wraparound
when the dimension has one and the axis reaches its far end.

The collective formulas follow "How to Scale Your Model" (Austin et al., 2025), part 3, "Sharded Matrices and How
to Multiply Them", section "A Deeper Dive into TPU Communication Primitives" and its summary table, with part 2's
("How to Think About TPUs", section "TPU Networking") rule for wraparound links (on v5e and v6e a dimension of 16,
the full pod's; on v5p a slice of whole 4x4x4 cubes, whose dimensions are multiples of 4):

- an AllGather or ReduceScatter of ``B`` bytes (the full buffer) passes the shards around a ring, in both
  directions at once where the ring closes (the wraparound): ``(n - 1) / n * B / W`` with ``W`` one link's one-way
  bandwidth times 2 on a closed ring, 1 on a line; gathering over several torus dimensions at once adds their
  bandwidths ("this increases the available bandwidth by a factor of n_axes");
- an AllReduce is a ReduceScatter then an AllGather: twice that;
- an AllToAll moves each piece only part of the way round: ``B / (4 W)`` on a bidirectional ring ("AllGather / 4");
  over several dimensions, the bisection of each dimension bounds it (the data that must cross the cut through the
  middle of a dimension, ``B / 4`` each way, over the links that cut crosses), which on one dimension is the
  book's formula;
- the latency is the longest path's hops (``n / 2`` round a closed ring, ``n - 1`` along a line) times a hop's
  latency (the book: "typically around 1us"), added to the bandwidth term as the GPU formulas do (the book takes the
  larger of the two; the sum differs from it by at most the latency).

An axis whose chips are ``stride`` apart shares each link with the ``stride`` interleaved groups beside it (the
other axis' positions), which run the same collective at once: it gets ``1 / stride`` of the link, and each of its
hops crosses ``stride`` links.

>>> t = Torus((16, 16), (True, True))                      # a full TPU v5e pod
>>> [(s.dim, s.length, s.stride, s.wraps) for s in t.segments(0, 4)]
[(0, 16, 1, True)]
>>> [(s.dim, s.length, s.stride, s.wraps) for s in t.segments(2, 6)]   # the top of x, the bottom of y
[(0, 4, 4, True), (1, 4, 1, False)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .values import Link, is_power_of_two, is_whole

__all__ = ["Torus", "Segment", "TorusAxis", "axis_bits"]


@dataclass(frozen=True)
class Segment:
    """Where a mesh axis runs along one torus dimension: ``length`` chips ``stride`` apart, closed into a ring by
    the dimension's wraparound (``wraps``) or a line."""

    dim: int
    length: int
    stride: int
    wraps: bool

    @property
    def lanes(self) -> float:
        """One-way links' worth of bandwidth a group gets along this dimension: both directions of a closed ring,
        one of a line, shared by the ``stride`` interleaved groups."""
        return (2.0 if self.wraps else 1.0) / self.stride

    @property
    def hops(self) -> int:
        """Links on the longest path between two of its chips: half round a ring, end to end along a line."""
        return self.stride * (self.length // 2 if self.wraps else self.length - 1)


@dataclass(frozen=True)
class Torus:
    """One slice's ICI torus: chips along each dimension (the first fastest in the chip numbering; powers of two)
    and whether each dimension has its wraparound link.

    >>> Torus((4, 4, 8), (True, True, True)).describe()
    '4x4x8, wraparound on every dimension'
    """

    dims: tuple
    wrap: tuple

    def __post_init__(self) -> None:
        dims = tuple(self.dims) if isinstance(self.dims, (list, tuple)) else ()
        wrap = tuple(self.wrap) if isinstance(self.wrap, (list, tuple)) else ()
        if not 1 <= len(dims) <= 3 or not all(is_whole(d) and is_power_of_two(d) for d in dims):
            raise ValueError(f"torus dims must be 1 to 3 powers of two (chips along each dimension, e.g. [4, 4, 8]), "
                             f"got {self.dims!r}.")
        if len(wrap) != len(dims) or not all(isinstance(w, bool) for w in wrap):
            raise ValueError(f"torus wrap must give true or false for each of the {len(dims)} dimensions {list(dims)}, "
                             f"got {self.wrap!r}.")
        short = [d for d, w in zip(dims, wrap) if w and d < 4]
        if short:
            raise ValueError(f"a wraparound needs a ring of at least 4 chips, but dimension(s) of {short} have one; "
                             "set their wrap to false.")
        object.__setattr__(self, "dims", tuple(int(d) for d in dims))
        object.__setattr__(self, "wrap", wrap)

    @property
    def size(self) -> int:
        """Chips in the slice."""
        return math.prod(self.dims)

    def describe(self) -> str:
        shape = "x".join(str(d) for d in self.dims)
        if all(self.wrap):
            return f"{shape}, wraparound on every dimension"
        if not any(self.wrap):
            return f"{shape}, no wraparound"
        which = ", ".join(str(d) for d, w in zip(self.dims, self.wrap) if w)
        return f"{shape}, wraparound on the dimension(s) of {which}"

    def segments(self, lo: int, hi: int) -> tuple[Segment, ...]:
        """The dimensions an axis over bits ``lo .. hi - 1`` of the chip number runs along."""
        out, base = [], 0
        for k, (d, w) in enumerate(zip(self.dims, self.wrap)):
            bits = d.bit_length() - 1
            a, b = max(lo, base), min(hi, base + bits)
            if b > a:
                # the dimension's chips a group visits: 2^(b-a) of them, 2^(a-base) apart; the ring closes when they
                # reach the dimension's last chip and it wraps round to the first
                out.append(Segment(k, 1 << (b - a), 1 << (a - base), w and b == base + bits))
            base += bits
        return tuple(out)

    def to_dict(self) -> dict:
        return {"dims": list(self.dims), "wrap": list(self.wrap)}

    @classmethod
    def from_dict(cls, data: Any) -> "Torus":
        if isinstance(data, Torus):
            return data
        if not isinstance(data, Mapping) or set(data) != {"dims", "wrap"}:
            raise ValueError(f"a torus must be an object with 'dims' and 'wrap' lists (e.g. {{\"dims\": [4, 4, 8], "
                             f"\"wrap\": [true, true, true]}}), got {data!r}.")
        return cls(tuple(data["dims"]), tuple(data["wrap"]))


@dataclass(frozen=True)
class TorusAxis:
    """A logical mesh axis inside one slice: its :class:`Segment` s and the ICI link (one way; latency per hop).

    A full 16-chip ring of a v5e pod (45 GB/s a link each way, 1 us a hop), and a 4-chip line of a smaller slice:

    >>> ici = Link(45e9, 1e-6)
    >>> ring = TorusAxis((Segment(0, 16, 1, True),), ici)
    >>> ring.all_gather(1e9) == 8 * 1e-6 + (15 / 16) * 1e9 / (2 * 45e9)
    True
    >>> line = TorusAxis((Segment(0, 4, 1, False),), ici)
    >>> line.all_to_all(1e9) == 3 * 1e-6 + 1e9 / (4 * 45e9)
    True
    """

    segments: tuple
    link: Link

    @property
    def size(self) -> int:
        return math.prod(s.length for s in self.segments)

    @property
    def bandwidth(self) -> float:
        """Bytes/s a ring collective moves per chip: the links of every dimension the axis runs along."""
        return self.link.bandwidth * sum(s.lanes for s in self.segments)

    @property
    def hops(self) -> int:
        """Links on the longest path between two of the axis' chips."""
        return sum(s.hops for s in self.segments)

    def all_gather(self, nbytes: float) -> float:
        """B = bytes of the gathered buffer: ``hops`` hop latencies + ``(n - 1) / n B`` over :attr:`bandwidth`."""
        n = self.size
        if n == 1:
            return 0.0
        return self.hops * self.link.latency + (n - 1) / n * nbytes / self.bandwidth

    def reduce_scatter(self, nbytes: float) -> float:
        """B = bytes of the full buffer: as :meth:`all_gather`."""
        return self.all_gather(nbytes)

    def all_reduce(self, nbytes: float) -> float:
        """A ReduceScatter then an AllGather: twice :meth:`all_gather`."""
        return 2 * self.all_gather(nbytes)

    def all_to_all(self, nbytes: float) -> float:
        """B = bytes of the whole buffer: the slowest dimension's bisection, ``B / 4`` each way across the
        ``n / length`` lines of that dimension, each with its ``lanes``."""
        n = self.size
        if n == 1:
            return 0.0
        cross = max(s.length / (n * s.lanes) for s in self.segments)
        return self.hops * self.link.latency + nbytes / 4 * cross / self.link.bandwidth

    def ring_step(self, nbytes: float) -> float:
        """One step of a ring through the axis' chips (every chip sends ``nbytes`` to the next at once): on one
        dimension the closing step of a line crosses its whole length back (each link carries one message each
        way); over several dimensions a grid with an even side has a cycle of neighbour hops."""
        if self.size == 1 or nbytes <= 0:
            return 0.0
        stride = max(s.stride for s in self.segments)
        if len(self.segments) == 1 and not self.segments[0].wraps:
            hops = self.segments[0].hops
        else:
            hops = stride
        return hops * self.link.latency + nbytes * stride / self.link.bandwidth


def axis_bits(shape: Sequence[int], axis: Any) -> tuple[int, int]:
    """The bits of the chip number (within a submesh block) that ``axis`` of a logical ``shape`` (n0, n1) covers:
    axis 1 the lowest ``log2 n1``, axis 0 the next ``log2 n0``, (0, 1) both.

    >>> axis_bits((8, 16), 1), axis_bits((8, 16), 0), axis_bits((8, 16), (0, 1))
    ((0, 4), (4, 7), (0, 7))
    """
    n0, n1 = (int(s) for s in shape)
    low = n1.bit_length() - 1
    if axis == 1:
        return 0, low
    if axis == 0:
        return low, low + n0.bit_length() - 1
    return 0, low + n0.bit_length() - 1
