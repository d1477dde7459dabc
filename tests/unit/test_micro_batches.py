"""Micro-batches by token budget (training.micro_batch_tokens): how sequences are packed, and the per-step peak
memory the trainer reports. That training on them equals one big batch is tests/unit/test_algorithm_steps.py's."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from reinforce.core.packing import MicroBatch, packing_metrics
from reinforce.core.response_states import response_states
from reinforce.core.spec import TrainingSpec
from reinforce.trainer.batch import micro_batches
from reinforce.trainer.main import peak_rss_bytes, reset_peak_rss


def sequences(lengths: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """One prompt token and a response of length - 1 each."""
    return [[1] for _ in lengths], [[2] * (n - 1) for n in lengths]


def padded(lengths: list[int], training: TrainingSpec, k: int, whole_groups: bool) -> list[MicroBatch]:
    """Micro-batches for a backend that runs every row's whole sequence (megatron)."""
    return micro_batches(*sequences(lengths), training, k, whole_groups=whole_groups, shares_prompts=False)


def test_sequences_are_packed_longest_first_within_the_budget() -> None:
    parts = padded([10, 2, 9, 3], TrainingSpec(micro_batch_tokens=20), k=1, whole_groups=False)
    assert [part.rows.tolist() for part in parts] == [[0, 2], [1, 3]]
    assert [part.forward_tokens for part in parts] == [20, 6]
    metrics = packing_metrics(parts)
    assert metrics["train_batch/padding_fraction"] == 1 - 24 / 26
    assert metrics["train_batch/tokens_per_micro_batch"] == 13
    assert metrics["train_batch/micro_batches"] == 2


def test_groups_stay_whole_and_a_unit_over_the_budget_goes_alone() -> None:
    # groups of k = 2: (3, 30) over the budget, (4, 5) and (6, 2) share one micro-batch of width 6
    parts = padded([4, 5, 3, 30, 6, 2], TrainingSpec(micro_batch_tokens=24), k=2, whole_groups=True)
    assert [part.rows.tolist() for part in parts] == [[2, 3], [0, 1, 4, 5]]
    assert [part.groups(2).tolist() for part in parts] == [[1], [0, 2]]


def test_micro_batch_prompts_caps_the_sequences_on_top_of_the_budget() -> None:
    training = TrainingSpec(micro_batch_tokens=1000, micro_batch_prompts=1)
    parts = padded([4, 5, 3, 3, 6, 2], training, k=2, whole_groups=False)
    assert [len(part.rows) for part in parts] == [2, 2, 2]
    unlimited = padded([4, 5], TrainingSpec(micro_batch_tokens=None), k=2, whole_groups=True)
    assert len(unlimited) == 1


def test_a_shared_prompt_counts_once_in_the_budget() -> None:
    """Two prompts of 10 tokens, k = 4 samples each of 3 response tokens: a forward that shares prompts computes
    10 + 4 x 2 tokens per group (the responses but their last token), one that does not 4 x 13."""
    prompts = [[1] * 10] * 4 + [[2] * 10] * 4
    responses = [[3, 4, 5]] * 8
    budget = TrainingSpec(micro_batch_tokens=40, micro_batch_prompts=None)
    shared = micro_batches(prompts, responses, budget, k=4, whole_groups=False, shares_prompts=True)
    # packed one sequence at a time, yet each micro-batch holds a prompt's samples side by side: 2 x 10 + 8 x 2
    assert [part.rows.tolist() for part in shared] == [list(range(8))]
    assert [part.forward_tokens for part in shared] == [36]
    whole = micro_batches(prompts, responses, budget, k=4, whole_groups=False, shares_prompts=False)
    assert [part.forward_tokens for part in whole] == [39, 39, 26]


def test_forward_tokens_are_what_response_states_computes() -> None:
    """MicroBatch.forward_tokens counts the positions response_states runs through the transformer body."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    body = LlamaForCausalLM(config).model
    prompts = [[1, 5, 9]] * 3 + [[1, 7, 8, 9, 10, 11]] * 2 + [[1, 2]]
    responses = [[20, 21], [30, 31, 32, 33], [40], [41, 42, 43], [44], [45, 46, 47, 48, 49]]
    computed = []
    body.register_forward_hook(
        lambda _m, _args, kwargs, _out: computed.append(kwargs["inputs_embeds"].shape[:2].numel()), with_kwargs=True
    )
    response_states(body, prompts, responses, pad=0)
    (part,) = micro_batches(
        prompts, responses, TrainingSpec(micro_batch_tokens=None), 1, whole_groups=False, shares_prompts=True
    )
    assert part.forward_tokens == sum(computed) == 3 * 6 + 6 * 4
    # 3 + 6 + 2 prompt tokens, 1 + 3 + 0 + 2 + 0 + 4 response tokens that predict one
    assert part.real_tokens == 21
    assert packing_metrics([part])["train_batch/padding_fraction"] == 1 - 21 / 42


def test_peak_memory_is_measured_per_step() -> None:
    """The step's peak, not the process's: an earlier step's larger allocation no longer counts once reset."""
    block = torch.ones(64 * 2**20)  # 256 MiB, touched
    with_block = peak_rss_bytes()
    del block
    reset_peak_rss()
    assert peak_rss_bytes() < with_block - 128 * 2**20
