"""How the critic service runs (CriticConfig): the run spec's `critic` section, its folders, address, device and the
request caps derived from the run's trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from reinforce.core.names import CRITIC_PORT, LOCAL_HOST
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import CriticSpec, RunSpec


@dataclass(frozen=True)
class CriticConfig:
    """How the critic service runs: the run spec's `critic` section, and the folders, address and device."""

    model: Path  # Hugging Face folder: the policy (init policy) or a num_labels == 1 reward model (init reward_model)
    checkpoints: Path  # where /v1/checkpoint writes and where start-up resumes from
    critic: CriticSpec = field(default_factory=CriticSpec)
    keep_checkpoints: int = 2  # newest checkpoints kept (the trainer's training.keep_checkpoints)
    host: str = LOCAL_HOST  # loopback unless asked: the bearer token is the only authentication
    port: int = CRITIC_PORT
    seed: int = 0  # torch's RNG at start (dropout, if the model has any); a resume restores the saved state
    device: str = "cpu"
    # Request caps (None: none), refused with 413 before the model lock is taken: the run's trainer never sends more.
    max_rows: int | None = None  # sequences in one request (a train request's minibatches together)
    max_row_tokens: int | None = None  # prompt + response tokens of one sequence
    # The trainer's checkpoints (the run folder's): /v1/restore refuses to go behind the newest. None, or a folder
    # without checkpoints (the critic's pod on Kubernetes, whose volume is not the trainer's): not checked.
    trainer_checkpoints: Path | None = None

    @classmethod
    def from_spec(
        cls, spec: RunSpec, port: int = CRITIC_PORT, host: str = LOCAL_HOST, device: str = "cpu"
    ) -> CriticConfig:
        paths = RunPaths(spec.resolved_run_dir())
        c, alg = spec.critic, spec.algorithm
        model = paths.initial_policy if c.init == "policy" else Path(str(c.reward_model_path))
        return cls(
            model, paths.critic_checkpoints, c, spec.training.keep_checkpoints, host, port, spec.seed, device,
            max_rows=spec.training.prompts_per_step * alg.num_rollouts_per_prompt * alg.ppo_epochs,
            max_row_tokens=spec.data.max_prompt_tokens + spec.generation.max_new_tokens,
            trainer_checkpoints=paths.checkpoints,
        )  # fmt: skip
