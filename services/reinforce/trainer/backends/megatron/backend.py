"""The Megatron backend (`training.backend: megatron`): the policy and its frozen reference as Megatron-core
GPTModels split over `training.tensor_parallel` processes, loaded from the Hugging Face initial policy.

Optimizer: torch's AdamW over this rank's shards, with tensor-parallel-aware clipping (model.clip_grad_norm_);
Megatron's own optimizers allocate on CUDA. Gradients are summed over data-parallel ranks (Ranks.sum_gradients;
the data-parallel group is Megatron's). Weights are published, and the final model written, in Hugging Face form:
the shards are gathered to the first process, which loads them into an HF model and saves it exactly as the torch
backend saves its own.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from reinforce.core.optim import adamw
from reinforce.core.policy import load_policy
from reinforce.core.spec import TrainingSpec
from reinforce.trainer.backends.base import TrainerBackend, lr_factor
from reinforce.trainer.backends.megatron.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from reinforce.trainer.backends.megatron.convert import (
    FULL_RECOMPUTE,
    build_gpt_model,
    layout_from_hf,
    transformer_config_from_hf,
)
from reinforce.trainer.backends.megatron.model import (
    clip_grad_norm_,
    gather_hf_state_dict,
    initialize_parallel,
    load_hf_state_dict,
    read_hf_folder,
    response_logprobs,
    response_logprobs_and_entropy,
)
from reinforce.trainer.distributed import Ranks


class MegatronBackend(TrainerBackend):
    name = "megatron"
    sharded = True
    shares_prompts = False  # model._response_states runs every row's whole sequence

    def __init__(self, training: TrainingSpec, policy_dir: Path, ranks: Ranks) -> None:
        super().__init__()
        self.training = training
        self.ranks = ranks
        # The trainer seeded torch with the run's seed just before; Megatron's per-rank RNG tracker follows it.
        initialize_parallel(training.tensor_parallel, training.pipeline_parallel, seed=torch.initial_seed())
        _check_same_layout(ranks)
        config, hf_state = read_hf_folder(policy_dir)
        try:
            self.layout = layout_from_hf(config, training.tensor_parallel)
        except ValueError as err:
            tp = training.tensor_parallel
            raise ValueError(f"training.tensor_parallel {tp} does not fit the policy: {err}") from None
        transformer_config = transformer_config_from_hf(config, tensor_parallel_size=training.tensor_parallel)
        recompute = FULL_RECOMPUTE if training.gradient_checkpointing else {}
        policy_config = transformer_config_from_hf(config, tensor_parallel_size=training.tensor_parallel, **recompute)
        self.policy = build_gpt_model(config, policy_config, layout=self.layout)
        load_hf_state_dict(self.policy, hf_state, self.layout)
        self.policy.train()
        # The reference is always the initial policy, also after a resume.
        self.reference = build_gpt_model(config, transformer_config, layout=self.layout)
        load_hf_state_dict(self.reference, hf_state, self.layout)
        self.reference.requires_grad_(False).eval()
        # The HF model the gathered weights are written through, on the one process that publishes.
        self.hf_model: PreTrainedModel | None = load_policy(policy_dir) if ranks.is_main else None
        t = training
        self.optimizer = adamw(self.policy.parameters(), t.lr, t.adam_betas, t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(t, s))

    def logprob_module(self) -> torch.nn.Module:
        return self.policy

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

    def optimizer_step(self) -> tuple[float, float]:
        parameters = list(self.policy.parameters())
        self.ranks.sum_gradients(parameters)
        grad_norm = clip_grad_norm_(parameters, self.training.max_grad_norm)
        return self.step_if_finite(grad_norm)

    def publishable_model(self) -> torch.nn.Module | None:
        """The gathered policy as the HF model on the main process; None on the others. Every process of the
        first data-parallel rank must call it (the gather is a collective of its tensor-parallel group)."""
        hf_state = gather_hf_state_dict(self.policy, self.layout)
        if self.hf_model is None:
            return None
        # strict=False: with tied embeddings the gathered dict has no lm_head.weight; it is the embedding's.
        missing, unexpected = self.hf_model.load_state_dict(hf_state, strict=False)
        tied = {"lm_head.weight"} if self.layout.tied_embeddings else set()
        if unexpected or set(missing) != tied:
            raise RuntimeError(f"gathered weights do not fit the HF policy: missing {missing}, unexpected {unexpected}")
        return self.hf_model

    def save_final(self, folder: Path) -> None:
        model = self.publishable_model()
        if model is not None:
            model.save_pretrained(folder)

    def save_state(self, folder: Path) -> None:
        save_sharded_checkpoint(folder, self.policy, self.optimizer, self.layout, self.scheduler)

    def load_state(self, folder: Path) -> None:
        load_sharded_checkpoint(folder, self.policy, self.optimizer, self.layout, self.scheduler)


def _check_same_layout(ranks: Ranks) -> None:
    """The trainer's data-parallel ranks (who reads which groups) must be Megatron's (who sums which gradients)."""
    from megatron.core import parallel_state as ps

    megatron = (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_tensor_model_parallel_rank())
    if megatron != (ranks.rank, ranks.world, ranks.model_rank):
        raise RuntimeError(f"Megatron's rank layout {megatron} differs from the trainer's {ranks}")
