"""The torch backend: the policy and its frozen reference as Hugging Face models, AdamW, data parallelism by
summing gradients over torchrun ranks (trainer/distributed.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from reinforce.core.models import load_policy, response_logprobs, response_logprobs_and_entropy
from reinforce.core.spec import TrainingSpec
from reinforce.trainer.backends.base import TrainerBackend, lr_factor
from reinforce.trainer.distributed import Ranks


class TorchBackend(TrainerBackend):
    name = "torch"

    def __init__(self, training: TrainingSpec, policy_dir: Path, ranks: Ranks) -> None:
        self.training = training
        self.ranks = ranks
        self.policy = load_policy(policy_dir).train()
        # The reference is always the initial policy, also after a resume.
        self.reference = load_policy(policy_dir).requires_grad_(False)
        t = training
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(t, s))

    def policy_logprobs(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return response_logprobs(self.policy, prompt_ids, response_ids, temperature)

    def policy_logprobs_and_entropy(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return response_logprobs_and_entropy(self.policy, prompt_ids, response_ids, temperature)

    @torch.no_grad()
    def reference_logprobs(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float
    ) -> torch.Tensor:
        return response_logprobs(self.reference, prompt_ids, response_ids, temperature)[0]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> tuple[float, float]:
        self.ranks.sum_gradients(self.policy.parameters())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.training.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        return grad_norm.item(), lr

    def publishable_model(self) -> torch.nn.Module:
        return self.policy

    def save_state(self, folder: Path) -> None:
        save_model(self.policy, str(folder / "model.safetensors"))
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        torch.save(state, folder / "optimizer.pt")

    def load_state(self, folder: Path) -> None:
        load_model(self.policy, str(folder / "model.safetensors"))
        state = torch.load(folder / "optimizer.pt", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
