"""The trainer-backend seam: what the algorithm needs from whatever holds the policy and its optimizer.

Implementations, chosen by `training.backend`: `torch` (torch_backend.py: a Hugging Face model, AdamW) and
`megatron` (megatron/backend.py: Megatron-core GPTModel shards, tensor parallelism). A backend
computes log-probs of given tokens (the policy's, differentiable, and the frozen reference's), takes one
optimisation step from the gradients the algorithm's loss left, gives the model to publish in Hugging Face form,
and saves and loads its checkpoint state.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import torch

from reinforce.core.spec import TrainingSpec


def lr_factor(training: TrainingSpec, step: int) -> float:
    """Linear warm-up to 1, then constant or cosine down to min_lr_ratio at the last step."""
    if step < training.warmup_steps:
        return (step + 1) / training.warmup_steps
    if training.lr_schedule == "constant":
        return 1.0
    progress = (step - training.warmup_steps) / max(1, training.steps - training.warmup_steps)
    return training.min_lr_ratio + (1 - training.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class TrainerBackend(ABC):
    name: ClassVar[str]
    # True: the state is split over the processes, each saves and loads its part (save_state is called on every
    # process); False: the main process saves the whole state.
    sharded: ClassVar[bool] = False
    # True: a log-prob pass runs each run of equal prompts (a group's k samples) through the model once, then the
    # responses after its keys and values (core/response_states.py); False: every row's prompt + response, padded.
    # The token budget (training.micro_batch_tokens) counts what the forward computes.
    shares_prompts: ClassVar[bool] = True
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    skipped_nonfinite_steps = 0  # optimizer steps skipped for a non-finite gradient norm, in this process's life

    def __init__(self) -> None:
        self._versions: dict[int, dict[str, torch.Tensor]] = {}  # earlier versions' weights (`keep_version`)

    @abstractmethod
    def policy_logprobs(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi of each response token [B, T], differentiable; mask [B, T]), as logprobs.response_logprobs."""

    @abstractmethod
    def policy_logprobs_and_entropy(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log pi [B, T], the entropy H_t of each token's distribution [B, T], both differentiable; mask [B, T])."""

    @abstractmethod
    def reference_logprobs(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float
    ) -> torch.Tensor:
        """log pi_ref of each response token [B, T] under the frozen initial policy (no gradient)."""

    @abstractmethod
    def logprob_module(self) -> torch.nn.Module:
        """The module `policy_logprobs` runs (this process's part of it, when sharded)."""

    # ---- earlier versions (max_policy_lag > 0) ----------------------------------------------------------------
    def keep_version(self, version: int, oldest: int) -> None:
        """Remember the weights as they are now as `version`, and forget those of versions before `oldest`: a group
        sampled by an earlier version is checked against that version's own log-probs (`version_logprobs`). Only
        what trains is kept (LoRA: the adapters), one copy per version, in this process's memory."""
        for old in [v for v in self._versions if v < oldest]:
            del self._versions[old]
        module = self.logprob_module()
        self._versions[version] = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def version_logprobs(
        self, version: int, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(log pi [B, T] under the kept weights of `version`, mask [B, T]), or None if this process never kept them
        (it started since). The kept tensors are swapped into the parameters for the pass and swapped back."""
        kept = self._versions.get(version)
        if kept is None:
            return None
        parameters = dict(self.logprob_module().named_parameters())

        def swap() -> None:
            for name, tensor in kept.items():
                parameters[name].data, kept[name] = tensor, parameters[name].data

        swap()
        try:
            return self.policy_logprobs(prompt_ids, response_ids, temperature)
        finally:
            swap()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @abstractmethod
    def optimizer_step(self) -> tuple[float, float]:
        """Sum gradients over data-parallel ranks, clip, step the optimizer and the schedule (`step_if_finite`):
        (grad norm, lr)."""

    def step_if_finite(self, grad_norm: torch.Tensor) -> tuple[float, float]:
        """Step the optimizer, unless the gradient norm is NaN or infinite; always step the schedule.

        One NaN log-prob or a bf16 overflow makes the whole gradient non-finite, and one such step would make
        every weight NaN, be published to the generators and be checkpointed. Its gradients are thrown away
        instead and the step counted (`train_optim/skipped_nonfinite_steps`); the norm is the same on every
        process (gradients are summed and the norm reduced first), so all of them skip together. The schedule
        still advances: the learning rate stays a function of the step number, as a resume computes it.
        """
        lr = self.scheduler.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.zero_grad()
            self.skipped_nonfinite_steps += 1
        self._advance_schedule()
        return grad_norm.item(), lr

    def skip_step(self) -> float:
        """A step with nothing to learn from (every sample dropped): no optimizer step, the schedule advances
        as in `step_if_finite`. The step's learning rate."""
        lr = self.scheduler.get_last_lr()[0]
        self.zero_grad()
        self._advance_schedule()
        return lr

    def _advance_schedule(self) -> None:
        # A schedule stepped with no optimizer step before it makes torch warn that a learning rate may be skipped:
        # LambdaLR computes each step's rate from the step count alone, so none is, and skipping is the point here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler")
            self.scheduler.step()

    @abstractmethod
    def publishable_model(self) -> torch.nn.Module | None:
        """The policy as the Hugging Face model whose safetensors the generators load (None on a process that
        does not publish: a sharded backend gathers it to the main process)."""

    def weights_to_publish(self) -> tuple[torch.nn.Module | dict[str, torch.Tensor], dict[str, str]]:
        """(what a weight version holds, safetensors metadata): the whole policy by default; LoRA: the adapters."""
        return self.publishable_model(), {}

    def save_final(self, folder: Path) -> None:
        """The trained policy in Hugging Face form (the run's final_model/)."""
        self.publishable_model().save_pretrained(folder)

    @abstractmethod
    def save_state(self, folder: Path) -> None:
        """Model, optimizer and schedule into `folder` (safetensors; torch files read back with weights_only)."""

    @abstractmethod
    def load_state(self, folder: Path) -> None: ...
