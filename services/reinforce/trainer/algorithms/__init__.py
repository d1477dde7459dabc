"""Algorithms behind one interface (base.py), chosen by `algorithm.name`."""

from __future__ import annotations

from reinforce.core.spec import RunSpec
from reinforce.trainer.algorithms.base import Algorithm
from reinforce.trainer.distributed import Ranks


def build_algorithm(spec: RunSpec, ranks: Ranks) -> Algorithm:
    if spec.algorithm.name == "reinforce":
        from reinforce.trainer.algorithms.reinforce import Reinforce

        return Reinforce(spec, ranks)
    raise ValueError(f"algorithm.name {spec.algorithm.name!r} is not available")
