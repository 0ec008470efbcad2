"""Graph capture: a JAX training step as an operator graph."""

from .capture import TraceError, UnknownPrimitiveWarning, trace
from .opgraph import OpGraph, OpNode, TensorInfo

__all__ = ["OpGraph", "OpNode", "TensorInfo", "TraceError", "UnknownPrimitiveWarning", "trace"]
