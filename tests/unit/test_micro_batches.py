"""Micro-batches by token budget (training.micro_batch_tokens): how sequences are packed, and the per-step peak
memory the trainer reports. That training on them equals one big batch is tests/unit/test_algorithm_steps.py's."""

from __future__ import annotations

import torch

from reinforce.core.spec import TrainingSpec
from reinforce.trainer.batch import micro_batches, packing_metrics
from reinforce.trainer.main import peak_rss_bytes, reset_peak_rss


def sequences(lengths: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """One prompt token and a response of length - 1 each."""
    return [[1] for _ in lengths], [[2] * (n - 1) for n in lengths]


def test_sequences_are_packed_longest_first_within_the_budget() -> None:
    parts = micro_batches(*sequences([10, 2, 9, 3]), TrainingSpec(micro_batch_tokens=20), k=1, whole_groups=False)
    assert [part.rows.tolist() for part in parts] == [[0, 2], [3, 1]]
    assert [part.padded_tokens for part in parts] == [20, 6]
    metrics = packing_metrics(parts)
    assert metrics["train_batch/padding_fraction"] == 1 - 24 / 26
    assert metrics["train_batch/tokens_per_micro_batch"] == 13
    assert metrics["train_batch/micro_batches"] == 2


def test_groups_stay_whole_and_a_unit_over_the_budget_goes_alone() -> None:
    # groups of k = 2: (3, 30) over the budget, (4, 5) and (6, 2) share one micro-batch of width 6
    parts = micro_batches(*sequences([4, 5, 3, 30, 6, 2]), TrainingSpec(micro_batch_tokens=24), k=2, whole_groups=True)
    assert [part.rows.tolist() for part in parts] == [[2, 3], [4, 5, 0, 1]]
    assert [part.groups(2).tolist() for part in parts] == [[1], [2, 0]]


def test_micro_batch_prompts_caps_the_sequences_on_top_of_the_budget() -> None:
    training = TrainingSpec(micro_batch_tokens=1000, micro_batch_prompts=1)
    parts = micro_batches(*sequences([4, 5, 3, 3, 6, 2]), training, k=2, whole_groups=False)
    assert [len(part.rows) for part in parts] == [2, 2, 2]
    unlimited = micro_batches(*sequences([4, 5]), TrainingSpec(micro_batch_tokens=None), k=2, whole_groups=True)
    assert len(unlimited) == 1


def test_peak_memory_is_measured_per_step() -> None:
    """The step's peak, not the process's: an earlier step's larger allocation no longer counts once reset."""
    block = torch.ones(64 * 2**20)  # 256 MiB, touched
    with_block = peak_rss_bytes()
    del block
    reset_peak_rss()
    assert peak_rss_bytes() < with_block - 128 * 2**20
