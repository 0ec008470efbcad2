"""Moved to :mod:`autopar_lab.solve.ilp.highs_direct` (the ILP's backends live together); kept so that
``from autopar_lab.solve import highs_direct`` still works."""

from .ilp.highs_direct import ArrayModel, build, solve

__all__ = ["ArrayModel", "build", "solve"]
