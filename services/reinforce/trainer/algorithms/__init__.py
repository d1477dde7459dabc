"""Algorithms behind one interface (base.py), chosen by `algorithm.name` (core/registry.py's names)."""

from __future__ import annotations

import os
from collections.abc import Callable

from reinforce.core.names import CRITIC_TOKEN_ENV
from reinforce.core.registry import AlgorithmName
from reinforce.core.spec import RunSpec
from reinforce.trainer.algorithms.base import Algorithm
from reinforce.trainer.distributed import Ranks

AlgorithmFactory = Callable[[RunSpec, Ranks, "str | None"], Algorithm]


def _reinforce(spec: RunSpec, ranks: Ranks, critic_url: str | None) -> Algorithm:
    from reinforce.trainer.algorithms.reinforce import Reinforce

    return Reinforce(spec, ranks)


def _ppo(spec: RunSpec, ranks: Ranks, critic_url: str | None) -> Algorithm:
    from reinforce.trainer.algorithms.ppo_trainer import PPO
    from reinforce.trainer.critic_client import CriticClient

    if critic_url is None:
        raise ValueError("algorithm.name ppo needs the critic service's URL (--critic-url)")
    # one critic client: the main process (it sends the whole step, every rank's samples, and hands out the values)
    client = CriticClient(critic_url, os.environ.get(CRITIC_TOKEN_ENV, "")) if ranks.is_main else None
    return PPO(spec, ranks, client)


ALGORITHMS: dict[AlgorithmName, AlgorithmFactory] = {"reinforce": _reinforce, "ppo": _ppo}


def build_algorithm(spec: RunSpec, ranks: Ranks, critic_url: str | None = None) -> Algorithm:
    """The algorithm the spec names; ppo talks to the critic service at `critic_url`."""
    return ALGORITHMS[spec.algorithm.name](spec, ranks, critic_url)
