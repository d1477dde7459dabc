"""Building a step's tensors from its rollout groups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reinforce.core.packing import MicroBatch, pack
from reinforce.core.records_pb2 import RolloutGroup, Sample
from reinforce.core.response_states import ResponseIds
from reinforce.core.spec import TrainingSpec


@dataclass
class StepBatch:
    """One step's rollout groups (this rank's share) as tensors, groups in prompt order."""

    groups: list[RolloutGroup]
    rewards: torch.Tensor  # [G, k]
    is_end: torch.Tensor  # [G, k] bool; False also for samples dropped for a non-finite reward
    keep: torch.Tensor  # [G, k] bool; samples that contribute to the loss
    num_tokens: int  # trained response tokens of kept samples (tools' output is not): the token_mean loss normaliser
    lengths: torch.Tensor  # [G, k] response lengths in tokens

    @property
    def num_samples(self) -> int:
        """Kept samples: the sequence_mean and constant loss normaliser."""
        return int(self.keep.sum())

    @classmethod
    def from_groups(cls, groups: list[RolloutGroup]) -> StepBatch:
        rewards = torch.tensor([[s.reward for s in g.samples] for g in groups], dtype=torch.float32)
        keep = torch.isfinite(rewards)
        is_end = torch.tensor([[s.is_end for s in g.samples] for g in groups]) & keep
        lengths = torch.tensor([[len(s.token_ids) for s in g.samples] for g in groups])
        trained = torch.tensor([[trained_tokens(s) for s in g.samples] for g in groups])
        return cls(groups, torch.where(keep, rewards, 0.0), is_end, keep, int(trained[keep].sum()), lengths)


def prompt_index(group: RolloutGroup) -> int:
    """The index of a group's prompt within its step (prompt ids are "<step>-<index>")."""
    return int(group.prompt_id.rsplit("-", 1)[1])


def token_lists(groups: list[RolloutGroup]) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, response ids) of every sample of `groups`, one row per sample.

    A multi-turn sample's row is a ResponseIds carrying its loss mask: this is where the tools' tokens are folded
    out of the per-token mask that every backend's log-prob pass returns (response_states.response_positions), so every
    algorithm, the KL and the metrics see them as padding.
    """
    prompts = [list(g.prompt_token_ids) for g in groups for _ in g.samples]
    responses = [response_row(s) for g in groups for s in g.samples]
    return prompts, responses


def response_row(sample: Sample) -> list[int]:
    """A sample's response ids as log-prob passes take them (a ResponseIds with its loss mask, if it has one)."""
    if not sample.loss_mask:  # single-turn: every token is the model's
        return list(sample.token_ids)
    return ResponseIds(list(sample.token_ids), list(sample.loss_mask))


def trained_tokens(sample: Sample) -> int:
    """The sample's tokens the policy sampled (all but a multi-turn episode's tool output)."""
    return sum(sample.loss_mask) if sample.loss_mask else len(sample.token_ids)


def generator_logprobs(groups: list[RolloutGroup], like: torch.Tensor) -> torch.Tensor:
    """The generators' recorded log-probs of the groups' samples, padded like the trainer's [B, T]."""
    out = torch.zeros_like(like, requires_grad=False)
    for row, sample in enumerate(s for g in groups for s in g.samples):
        out[row, : len(sample.logprobs)] = torch.tensor(list(sample.logprobs))
    return out


def micro_batches(
    prompt_ids: Sequence[list[int]],
    response_ids: Sequence[list[int]],
    training: TrainingSpec,
    k: int,
    whole_groups: bool,
    shares_prompts: bool,
) -> list[MicroBatch]:
    """The sequences (prompt-major, k per prompt) packed (core/packing.py) into micro-batches of at most
    training.micro_batch_tokens forward tokens and, if set, micro_batch_prompts * k sequences; whole groups of k when
    `whole_groups` (the group estimators need a group's samples together). `shares_prompts`: the backend's
    (TrainerBackend.shares_prompts)."""
    max_rows = None if training.micro_batch_prompts is None else training.micro_batch_prompts * k
    size = k if whole_groups else 1
    return pack(prompt_ids, response_ids, training.micro_batch_tokens, max_rows, size, shares_prompts)


def in_order(tensors: list[torch.Tensor], parts: list[MicroBatch]) -> torch.Tensor:
    """The micro-batches' [b_i, T_i] results as one [B, max T_i] tensor in the planned sequences' order."""
    return pad_cat(tensors)[torch.argsort(torch.cat([part.rows for part in parts]))]


def pad_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Right-padded [b_i, T_i] tensors (micro-batches) -> one [sum b_i, max T_i] tensor, 0 on the new padding."""
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors])
