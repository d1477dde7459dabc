"""The REINFORCE-path advantage estimators against values computed by hand (the arithmetic is in the comments)."""

import pytest
import torch

from reinforce.core.records_pb2 import RolloutGroup, Sample
from reinforce.trainer.algorithms.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
)
from reinforce.trainer.algorithms.reinforce import KLPenalty, rloo_advantages, token_advantages
from reinforce.trainer.batch import StepBatch

INF = float("inf")


def test_grpo_normalises_by_group_mean_and_unbiased_std():
    a = grpo_advantages(torch.tensor([[1.0, 2.0, 3.0, 6.0]]), torch.ones(1, 4))
    # mean 3; deviations -2, -1, 0, 3; squares sum to 14; unbiased var 14 / 3 = 4.6666667; std 2.1602469
    # A = deviation / (2.1602469 + 1e-4) = deviation / 2.1603469
    assert a.tolist()[0] == pytest.approx([-0.9257772, -0.4628886, 0.0, 1.3886659], abs=1e-6)


def test_grpo_groups_are_independent():
    a = grpo_advantages(torch.tensor([[0.0, 2.0], [10.0, 10.0]]), torch.ones(2, 2))
    # group 0: mean 1, deviations -1, 1, unbiased std sqrt(2 / 1) = 1.4142136: -+1 / 1.4143136
    assert a[0].tolist() == pytest.approx([-0.7070568, 0.7070568], abs=1e-6)
    assert a[1].tolist() == [0.0, 0.0]


def test_grpo_identical_rewards_give_zero_advantages_not_nan():
    a = grpo_advantages(torch.tensor([[0.5, 0.5, 0.5]]), torch.ones(1, 3))
    assert torch.equal(a, torch.zeros(1, 3))


def test_grpo_single_sample_group_gives_zero_not_nan():
    assert torch.equal(grpo_advantages(torch.tensor([[3.0], [-1.0]]), torch.ones(2, 1)), torch.zeros(2, 1))


def test_reinforce_plus_plus_returns_and_batch_whitening():
    rewards = torch.tensor([1.0, 0.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 1.0, INF]])  # the padded KL holds garbage
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    a = reinforce_plus_plus_advantages(rewards, kl, mask, kl_penalty=0.1)
    # per-token rewards: row 0 [-0.01, -0.02, -0.03 + 1] = [-0.01, -0.02, 0.97]; row 1 [-0.05, -0.1]
    # returns (reverse cumulative sums, gamma 1): row 0 from the end 0.97, 0.97 - 0.02 = 0.95, 0.95 - 0.01 = 0.94,
    #   so [0.94, 0.95, 0.97]; row 1: [-0.15, -0.1]
    # over the 5 real tokens: mean 2.61 / 5 = 0.522; deviations 0.418, 0.428, 0.448, -0.672, -0.622;
    # squares 0.174724 + 0.183184 + 0.200704 + 0.451584 + 0.386884 = 1.39708; var 1.39708 / 5 = 0.279416;
    # std 0.5285981; A = deviation / std
    expected = torch.tensor([[0.7907708, 0.8096888, 0.8475247], [-1.2712871, -1.1766973, 0.0]])
    assert torch.allclose(a, expected, atol=1e-5)


def test_reinforce_plus_plus_all_equal_returns_give_zeros():
    a = reinforce_plus_plus_advantages(torch.tensor([1.0, 1.0]), torch.zeros(2, 2), torch.ones(2, 2), 0.1)
    assert a.tolist() == [[0.0, 0.0], [0.0, 0.0]]  # returns all [1, 1]: deviation 0 everywhere


# One prompt, k = 2, T = 3: d = log pi - log pi_ref = [0.5, -0.5] for sample 0 and [1.0] for sample 1 (n = 1);
# k1 |d|: KL_0 = 0.5, KL_1 = 1.0. Rewards 1 and 0; beta 0.1 -> rewards_with_kl = [0.95, -0.1].
LOGPROBS = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, 0.0, 0.0]])
REF = torch.tensor([[-1.5, -1.5, 7.0], [-2.0, 5.0, 5.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
REWARDS = torch.tensor([[1.0, 0.0]])
ENDED = torch.tensor([[True, True]])


def _token_advantages(estimator: str) -> torch.Tensor:
    out = token_advantages(estimator, REWARDS, LOGPROBS, REF, MASK, ENDED, ENDED, KLPenalty(0.1))
    assert out.kl.tolist() == pytest.approx([0.5, 1.0])
    return out.advantages


def test_rloo_estimator_is_reinforce_py_broadcast_to_tokens():
    # baseline of each = the other's rewards_with_kl: A = [0.95 - (-0.1), -0.1 - 0.95] = [1.05, -1.05]
    a = _token_advantages("rloo")
    assert torch.allclose(a, torch.tensor([[1.05, 1.05, 0.0], [-1.05, 0.0, 0.0]]))
    same = rloo_advantages(REWARDS, torch.tensor([[0.5, 1.0]]), ENDED, 0.1).advantages
    assert torch.allclose(a[:, 0], same.reshape(-1))


def test_grpo_estimator_normalises_rewards_with_kl():
    # mean 0.425, deviations 0.525, -0.525, unbiased std 0.7424621; A = -+0.525 / 0.7425621 = -+0.7070116
    a = _token_advantages("grpo")
    assert torch.allclose(a, torch.tensor([[0.7070116, 0.7070116, 0.0], [-0.7070116, 0.0, 0.0]]), atol=1e-6)


def test_reinforce_plus_plus_estimator_uses_per_token_kl():
    # per-token rewards: sample 0 [-0.05, -0.05 + 1] = [-0.05, 0.95], sample 1 [-0.1 + 0] = [-0.1]
    # returns [0.9, 0.95] and [-0.1]; mean 1.75 / 3 = 0.5833333; deviations 0.3166667, 0.3666667, -0.6833333;
    # var (0.1002778 + 0.1344444 + 0.4669444) / 3 = 0.2338889; std 0.4836206
    a = _token_advantages("reinforce_plus_plus")
    expected = torch.tensor([[0.6547832, 0.7581701, 0.0], [-1.4129533, 0.0, 0.0]])
    assert torch.allclose(a, expected, atol=1e-5)


def test_unknown_estimator_is_an_error():
    with pytest.raises(ValueError, match="advantage_estimator"):
        _token_advantages("ppo")


# ---- dropped samples (a reward that is not finite): in no group or batch statistic --------------------------------


def batch_of(rewards: list[list[float]], length: int = 1) -> StepBatch:
    """A step's batch of `length`-token responses with these rewards, every sample ended."""
    groups = [
        RolloutGroup(
            prompt_id=f"0-{g}",
            prompt_token_ids=[1],
            samples=[Sample(token_ids=[2] * length, logprobs=[0.0] * length, reward=r, is_end=True) for r in row],
        )
        for g, row in enumerate(rewards)
    ]
    return StepBatch.from_groups(groups)


def advantages_of(estimator: str, batch: StepBatch) -> torch.Tensor:
    """token_advantages with beta 0 and pi = pi_ref: the first token's advantage of each sample, [G, k]."""
    logprobs = torch.zeros(batch.rewards.numel(), int(batch.lengths.max()))
    mask = torch.ones_like(logprobs)
    out = token_advantages(estimator, batch.rewards, logprobs, logprobs, mask, batch.is_end, batch.keep, KLPenalty(0.0))
    return out.advantages[:, 0].view(batch.rewards.shape)


NAN = float("nan")


def test_grpo_counts_only_kept_samples_in_the_group_statistics():
    # the case: k = 3, [1, NaN, 1]: the kept two are equal, so 0 (TRL's nanmean / nanstd); counting the
    # dropped sample as 0 gave mean 2/3, std 0.5773503 and 0.577 each
    assert advantages_of("grpo", batch_of([[1.0, NAN, 1.0]])).tolist() == [[0.0, 0.0, 0.0]]
    # half a group dropped: kept [1, 3], mean 2, deviations -1, 1, unbiased std sqrt(2) = 1.4142136: -+1 / 1.4143136
    half = advantages_of("grpo", batch_of([[1.0, NAN, 3.0, NAN]]))
    assert half.tolist()[0] == pytest.approx([-0.7070568, 0.0, 0.7070568, 0.0], abs=1e-6)
    # a whole group dropped: 0, and the other group is as if alone; a single kept sample: 0
    whole = advantages_of("grpo", batch_of([[NAN, NAN], [0.0, 2.0], [5.0, NAN]]))
    assert whole.tolist()[0] == [0.0, 0.0] and whole.tolist()[2] == [0.0, 0.0]
    assert whole.tolist()[1] == pytest.approx([-0.7070568, 0.7070568], abs=1e-6)


def test_dr_grpo_is_the_kept_samples_deviation_from_their_mean():
    # kept [1, 3, 0]: mean 4/3; deviations -1/3, 5/3, -4/3, no std division; the dropped sample 0
    a = advantages_of("dr_grpo", batch_of([[1.0, NAN, 3.0, 0.0]]))
    assert a.tolist()[0] == pytest.approx([-1 / 3, 0.0, 5 / 3, -4 / 3], abs=1e-6)
    assert advantages_of("dr_grpo", batch_of([[NAN, NAN], [7.0, NAN]])).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert torch.equal(dr_grpo_advantages(torch.tensor([[2.0, 4.0]]), torch.ones(1, 2)), torch.tensor([[-1.0, 1.0]]))


def test_reinforce_plus_plus_whitens_over_the_kept_samples_tokens_only():
    # the case: k = 2, [1, NaN], two tokens each: the kept returns are [1, 1], all equal: 0 (with the
    # dropped sample's two tokens of return 0: mean 0.5, std 0.5, and 1.0)
    single = token_advantages(
        "reinforce_plus_plus", torch.tensor([[1.0, 0.0]]), torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2, 2),
        torch.tensor([[True, False]]), torch.tensor([[True, False]]), KLPenalty(0.0),
    ).advantages  # fmt: skip
    assert single.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    # a whole group dropped beside a group [1, 0] of one-token responses: returns 1 and 0, mean 0.5, var 0.25:
    # (1, -1) / sqrt(0.25 + 1e-8) (counting the failed group's tokens: mean 0.25, var 0.1875, and 1.73, -0.58)
    whole = advantages_of("reinforce_plus_plus", batch_of([[1.0, 0.0], [NAN, NAN]]))
    assert whole.tolist() == [pytest.approx([1.0, -1.0], abs=1e-6), [0.0, 0.0]]
    # half a group: kept [2, 0] of k = 4: (1, -1) again
    half = advantages_of("reinforce_plus_plus", batch_of([[2.0, NAN, 0.0, NAN]]))
    assert half.tolist()[0] == pytest.approx([1.0, 0.0, -1.0, 0.0], abs=1e-6)
