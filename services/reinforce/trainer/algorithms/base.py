"""The algorithm seam: advantages from a step's groups, the loss of its micro-batches, its metrics.

Implementations, chosen by `algorithm.name`: `reinforce` (reinforce.py: a group baseline and a KL penalty) and `ppo`
(ppo_trainer.py, the math in ppo.py: GAE with the critic service, the clipped objective). An algorithm owns the
passes of one optimisation step over its rank's groups, using the backend for log-probs and the optimizer step,
and returns the step's metrics. State of its own outside the backend (PPO's critic) is saved and restored with the
trainer's checkpoints.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from reinforce.core.spec import RunSpec
from reinforce.trainer.backends.base import TrainerBackend
from reinforce.trainer.batch import StepBatch
from reinforce.trainer.distributed import Ranks


@dataclass(frozen=True)
class SampleValues:
    """Per-sample results of the last update, [B] each over the rank's batch (prompt-major): the samples table's."""

    kl: torch.Tensor  # KL_i, the mean over the response tokens of the configured estimate
    advantage: torch.Tensor  # A_i (an estimator with one per token: their mean over the response)


class Algorithm(ABC):
    name: ClassVar[str]

    def __init__(self, spec: RunSpec, ranks: Ranks) -> None:
        self.spec = spec
        self.ranks = ranks
        self.sample_values: SampleValues | None = None  # set by each update

    @abstractmethod
    def update(self, batch: StepBatch, backend: TrainerBackend, version: int) -> dict[str, float]:
        """One optimisation step on this rank's groups of the step (trained weights: `version`): its metrics."""

    def restore(self, step: int) -> None:
        """Go back to the state of the trainer's checkpoint at `step` (0: the start), before the trainer trains.

        Nothing by default: the backend's state is all the trainer's checkpoint holds."""
        return None

    def save(self, step: int) -> None:
        """Save the state of the trainer's checkpoint at `step`; called before the trainer writes its own."""
        return None

    def close(self) -> None:
        """Release connections and threads."""
        return None


class TokenStats:
    """Mean, max and counts of a per-token quantity over masked tokens, accumulated across micro-batches."""

    def __init__(self) -> None:
        self.total, self.count, self.max, self._values = 0.0, 0, 0.0, []

    def add(self, values: torch.Tensor, mask: torch.Tensor) -> None:
        picked = values.detach()[mask.bool()]
        if picked.numel():
            self.total += picked.sum().item()
            self.count += picked.numel()
            self.max = max(self.max, picked.max().item())
            self._values.append(picked)

    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def fraction_at_least(self, bound: float) -> float:
        return (torch.cat(self._values) >= bound).float().mean().item() if self._values else 0.0
