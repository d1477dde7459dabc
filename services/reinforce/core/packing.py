"""Micro-batches by token budget: sequences packed so that each forward (and backward) computes at most a budget of
token positions, whatever the lengths. The trainer's passes (trainer/batch.py: training.micro_batch_tokens) and the
critic's (critic.micro_batch_tokens) plan with it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reinforce.core.response_states import distinct_runs


@dataclass(frozen=True)
class MicroBatch:
    """Sequences that go through one forward (and backward) together."""

    rows: torch.Tensor  # [b] their positions among the sequences planned, ascending: a whole group's k adjacent
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    shares_prompts: bool  # the forward runs each run of equal prompts once (core/response_states.py)

    @property
    def forward_tokens(self) -> int:
        """The token positions the forward computes: every row's prompt + response right-padded to the longest or,
        where the forward shares prompts (core/response_states.py), each run of equal prompts once, right-padded to
        the longest prompt, plus every row's response but its last token (which predicts nothing), right-padded to
        the longest."""
        if not self.shares_prompts:
            return len(self.rows) * max(len(p) + len(r) for p, r in self._sequences())
        prompts, _ = distinct_runs(self.prompt_ids)
        longest_continuation = max(len(r) for r in self.response_ids) - 1
        return len(prompts) * max(map(len, prompts)) + len(self.rows) * max(longest_continuation, 0)

    @property
    def real_tokens(self) -> int:
        """The forward tokens that are not padding."""
        if not self.shares_prompts:
            return sum(len(p) + len(r) for p, r in self._sequences())
        prompts, _ = distinct_runs(self.prompt_ids)
        return sum(map(len, prompts)) + sum(max(len(r) - 1, 0) for r in self.response_ids)

    def _sequences(self) -> zip:
        return zip(self.prompt_ids, self.response_ids, strict=True)

    def groups(self, k: int) -> torch.Tensor:
        """[b / k] indices of its groups, for micro-batches planned with whole groups."""
        return self.rows[::k] // k


def pack(
    prompt_ids: Sequence[list[int]],
    response_ids: Sequence[list[int]],
    max_tokens: int | None,
    max_rows: int | None = None,
    unit_size: int = 1,
    shares_prompts: bool = True,
) -> list[MicroBatch]:
    """The sequences split into micro-batches of at most `max_tokens` forward tokens (MicroBatch.forward_tokens) and
    `max_rows` sequences (None: no limit), in units of `unit_size` adjacent sequences that stay together (a group of
    k samples where the algorithm needs it whole). Units are packed longest first, so that sequences of similar
    lengths share a micro-batch and little is padding; a unit over the budget goes alone. A micro-batch holds its
    sequences in the order given, so that a prompt's samples sit next to each other and a forward that shares
    prompts runs the prompt once. Every sequence is in exactly one micro-batch, so a step's gradient is the same
    whatever the packing."""
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    units = [range(start, start + unit_size) for start in range(0, len(lengths), unit_size)]
    units.sort(key=lambda unit: -max(lengths[i] for i in unit))  # stable: ties keep the given order

    def planned(rows: list[int]) -> MicroBatch:
        rows = sorted(rows)
        prompts, responses = [prompt_ids[i] for i in rows], [response_ids[i] for i in rows]
        return MicroBatch(torch.tensor(rows), prompts, responses, shares_prompts)

    parts: list[MicroBatch] = []
    for unit in units:
        grown = planned([*parts[-1].rows.tolist(), *unit]) if parts else None
        fits = (
            grown is not None
            and (max_tokens is None or grown.forward_tokens <= max_tokens)
            and (max_rows is None or len(grown.rows) <= max_rows)
        )
        if fits:
            parts[-1] = grown
        else:
            parts.append(planned(list(unit)))
    return parts


def packing_metrics(parts: list[MicroBatch]) -> dict[str, float]:
    """How well a pass's micro-batches were packed."""
    computed = sum(part.forward_tokens for part in parts)
    return {
        "train_batch/padding_fraction": 1 - sum(part.real_tokens for part in parts) / max(computed, 1),
        "train_batch/tokens_per_micro_batch": computed / max(len(parts), 1),
        "train_batch/micro_batches": float(len(parts)),
    }
