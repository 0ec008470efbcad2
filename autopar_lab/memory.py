"""Each stage's peak memory per device, split into what holds it (the workbench's memory view reads this).

The breakdown is the pricing layer's own (:mod:`autopar_lab.pricing.memory`): the same sums the stage-cost formula
makes, so the parts (:data:`PARTS`: parameters, gradients, fp32 master weights, optimizer state, parameter
copies, buffers, the recomputation working set, activations) add up to the plan's reported peak. This module
keeps the name the views import.
"""

from .pricing.memory import PARTS, memory_breakdown

__all__ = ["PARTS", "memory_breakdown"]
