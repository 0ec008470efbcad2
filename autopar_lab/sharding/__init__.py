"""Alpa's intra-operator space: sharding specs, per-primitive strategies, resharding costs.

>>> from autopar_lab.sharding import ShardingSpec
>>> ShardingSpec.parse("S0R").to_partition_spec()
P('x', None)
"""

from .reshard import plan_reshard, reshard_cost
from .spec import ShardingSpec, candidate_specs, useful_axes
from .strategies import (
    Strategy,
    contraction_strategies,
    follow_strategies,
    register_rule,
    registered_primitives,
    strategies_for,
    unregister_rule,
    unsupported_ops,
)
from . import rules  # noqa: F401 - registers the built-in rules (strategies_for reads the registry)

__all__ = [
    "ShardingSpec",
    "Strategy",
    "candidate_specs",
    "contraction_strategies",
    "follow_strategies",
    "plan_reshard",
    "register_rule",
    "registered_primitives",
    "reshard_cost",
    "strategies_for",
    "unregister_rule",
    "unsupported_ops",
    "useful_axes",
]
