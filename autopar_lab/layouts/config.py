"""The values every framework's layout is made of: its parallel degrees, where they sit on a stage's 2-D logical mesh,
and the ZeRO stage of its optimizer.

The logical mesh of a stage is 2-D, ``(n0, n1)`` (Alpa's, and every other part of the library's). A framework has
three or four axes (data, tensor, context, expert, FSDP); :class:`MeshRoles` says which mesh axis carries which:

* Megatron-LM (``dp x tp``, optionally ``cp``, ``ep``): axis 0 the data-parallel group, axis 1 the tensor-parallel
  group inside a scale-up domain. Context parallelism without tensor parallelism takes axis 1 (``(dp, cp)``: the
  sequence split over it, attention a ring over it, :mod:`autopar_lab.sharding.ring`); with tensor parallelism it is
  *folded* into axis 0 (``(dp x cp, tp)``): each device then holds the same tokens as under Megatron-LM's
  ``dp x cp`` split and the gradient reduction and ZeRO run over the same ``dp x cp`` group, but attention is priced
  as if each device attended to its own tokens only (the ring's key/value exchange, which overlaps attention's
  compute, is not charged). Expert parallelism splits the experts over the mesh axes whose sizes multiply to ``ep``
  (``dp`` or ``dp x cp`` on axis 0, the whole stage on both axes); any other ``ep`` is not expressible here.
* torchtitan (FSDP x TP x PP x CP): the same, FSDP sharding over axis 0 (HSDP's replicate x shard, without tensor
  parallelism: ``(replicate, shard)``, state sharded over axis 1 only).
* MaxText (``ici_*`` / ``dcn_*`` axes): data, FSDP, sequence and expert axes on axis 0 and ``tensor`` on axis 1; with
  no tensor axis, data on axis 0 and FSDP on axis 1 (state sharded over FSDP only); with both, data and FSDP share axis
  0 and the state is sharded over data too (an approximation, said in the plan's notes).

ZeRO (Rajbhandari et al., SC20): stage 1 shards the optimizer state (with the fp32 master weights) over the
data-parallel group, 2 also the gradients, 3 also the parameters; 0 none. ``None``: the storage is left to the
planner (the intra-op ILP's choice, the memory-lean solution where a stage overflows).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .. import checks

__all__ = ["ZERO_STAGES", "MeshRoles", "Parallelism", "check_zero"]

#: The ZeRO stages a layout may name (None: the storage left open).
ZERO_STAGES = (0, 1, 2, 3)


def check_zero(zero: Any) -> int | None:
    """``zero`` checked: None or a ZeRO stage of :data:`ZERO_STAGES`.

    >>> check_zero(1), check_zero(None)
    (1, None)
    """
    if zero is None:
        return None
    return checks.whole(zero, "zero (the ZeRO stage: 0 none, 1 optimizer state, 2 and gradients, 3 and parameters)",
                        0, 3)


@dataclass(frozen=True)
class Parallelism:
    """A framework's parallel degrees: data ``dp``, tensor ``tp``, pipeline ``pp``, context ``cp``, expert ``ep``
    (carved out of ``dp x cp``, Megatron-LM's convention). ``devices`` is ``dp x tp x pp x cp``.

    >>> Parallelism(dp=32, tp=4).devices, Parallelism(dp=32, tp=4).with_(pp=2).devices
    (128, 256)
    """

    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "cp", "ep"):
            checks.whole(getattr(self, name), name)

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def stage_devices(self) -> int:
        """Devices of one pipeline stage."""
        return self.dp * self.tp * self.cp

    def with_(self, **changes) -> Parallelism:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class MeshRoles:
    """Which axes of a stage's logical mesh ``shape`` carry what: ``batch`` (the axes the batch is split over),
    ``tensor`` (the tensor-parallel axis, None without), ``context`` (the axis the sequence is split over, ring
    attention on it), ``experts`` (the axes the experts are split over; ``()``: whole on every device; None: the
    ILP's choice), ``zero`` (the data-parallel group ZeRO shards state over) and ``notes`` (what the 2-D mesh
    approximates).

    >>> m = MeshRoles((32, 4), batch=(0,), tensor=1, zero=(0,))
    >>> m.size(m.batch), m.tensor_size
    (32, 4)
    """

    shape: tuple[int, int]
    batch: tuple[int, ...] = (0,)
    tensor: int | None = None
    context: int | None = None
    experts: tuple[int, ...] | None = None
    zero: tuple[int, ...] = (0,)
    notes: tuple[str, ...] = ()

    def size(self, axes) -> int:
        return math.prod(self.shape[a] for a in axes)

    def useful(self, axes) -> tuple[int, ...]:
        """``axes`` of more than one device."""
        return tuple(a for a in axes if self.shape[a] > 1)

    @property
    def tensor_size(self) -> int:
        return self.shape[self.tensor] if self.tensor is not None else 1

    def with_(self, **changes) -> MeshRoles:
        return dataclasses.replace(self, **changes)

    def key(self) -> tuple:
        """What the pins of a mesh depend on (the notes aside)."""
        return (self.shape, self.batch, self.tensor, self.context, self.experts, self.zero)
