"""The layouts frameworks run, priced by the library: Megatron-LM's (:func:`megatron_plan`), torchtitan's FSDP
(:func:`fsdp_plan`) and MaxText's (:func:`maxtext_plan`), on any transformer the traced graph holds.

- :mod:`~autopar_lab.layouts.config`: the values they are made of (parallel degrees, the roles of a stage mesh's axes,
  ZeRO stages) and how 3-4 framework axes sit on the 2-D logical mesh;
- :mod:`~autopar_lab.layouts.roles`: what each matmul of a transformer does (column, row, attention, experts, ...);
- :mod:`~autopar_lab.layouts.shardpins`: the operator pins that make a mesh's intra-op plan a framework's;
- :mod:`~autopar_lab.layouts.engine`: from a layout to a priced plan (memory-lean stages where one overflows);
- :mod:`~autopar_lab.layouts.fit`: which part of a stage overflows by how much, in words;
- :mod:`~autopar_lab.layouts.storage`: ZeRO on a plan whose sharding is the ILP's (``auto_plan(zero=...)``), and
  what the planner sharded to fit, said in explain();
- :mod:`~autopar_lab.layouts.megatron`, :mod:`~autopar_lab.layouts.fsdp`, :mod:`~autopar_lab.layouts.maxtext`: the
  three frameworks.
"""

from .config import ZERO_STAGES, MeshRoles, Parallelism, check_zero
from .engine import Layout, price_layout
from .fsdp import fsdp_plan
from .maxtext import maxtext_plan
from .megatron import megatron_plan
from .roles import Roles, find_roles
from .storage import explain_fit, with_zero

__all__ = ["Layout", "MeshRoles", "Parallelism", "Roles", "ZERO_STAGES", "check_zero", "explain_fit", "find_roles",
           "fsdp_plan", "maxtext_plan", "megatron_plan", "price_layout", "with_zero"]
