"""The layout of a run folder, shared by every process of a run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def spec(self) -> Path:
        """The resolved spec every service reads (absolute paths)."""
        return self.root / "spec.yaml"

    @property
    def initial_policy(self) -> Path:
        """Hugging Face folder of the initial policy: weight version 0 and the reference."""
        return self.root / "initial_policy"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def critic_checkpoints(self) -> Path:
        """The PPO critic's checkpoints, one per trainer checkpoint (the same step)."""
        return self.root / "critic_checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def trained_groups(self) -> Path:
        """One line per step: the prompt ids of the groups it trained on (an exactly-once audit trail)."""
        return self.root / "trained_groups.jsonl"

    @property
    def plot(self) -> Path:
        return self.root / "reward_kl.png"

    @property
    def final_model(self) -> Path:
        """The trained policy in Hugging Face format."""
        return self.root / "final_model"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def redis(self) -> Path:
        return self.root / "redis"

    @property
    def lock(self) -> Path:
        """Held (flock) by the live supervisor of this folder, and holding its PID."""
        return self.root / "supervisor.lock"

    @property
    def validation(self) -> Path:
        """validation/step-NNNNNN.jsonl: a few validation responses of each evaluation."""
        return self.root / "validation"

    @property
    def trackers(self) -> Path:
        """Experiment trackers' folders: tensorboard/, wandb/, mlruns/ (logging.trackers)."""
        return self.root
