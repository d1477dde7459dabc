"""Multi-turn samples carry a loss mask: the tools' tokens in a trajectory get exactly zero gradient, whatever the
algorithm, through a real backend (the torch one on a tiny policy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reinforce.core.policy import materialize_policy
from reinforce.core.records_pb2 import RolloutGroup, Sample
from reinforce.core.spec import PolicySpec, RandomInit, RunSpec, parse_spec
from reinforce.trainer.algorithms.ppo import token_rewards
from reinforce.trainer.algorithms.ppo_trainer import PPO
from reinforce.trainer.algorithms.reinforce import Reinforce
from reinforce.trainer.backends.torch_backend import TorchBackend
from reinforce.trainer.batch import StepBatch
from reinforce.trainer.distributed import Ranks
from reinforce.trainer.validation import Validator
from tests.unit.test_algorithm_steps import MemoryCritic

K, PROMPTS = 2, 2
# model turn, tool observation, model turn
MASK = [True] * 3 + [False] * 4 + [True] * 2


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    init = RandomInit(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2)
    return materialize_policy(PolicySpec(random_init=init), tmp_path_factory.mktemp("mask") / "policy", seed=0)


def spec_with(algorithm: dict) -> RunSpec:
    return parse_spec(
        {
            "name": "t",
            "policy": {"random_init": {}},
            "data": {"prompts": "p.txt"},
            "algorithm": {"num_rollouts_per_prompt": K, **algorithm},
            "training": {"prompts_per_step": PROMPTS, "lr": 1e-2, "max_logprob_mismatch": 1e6},
        }
    )


def multi_turn_batch() -> StepBatch:
    groups = []
    for g in range(PROMPTS):
        samples = [
            Sample(
                token_ids=[5 + (g + i + t) % 20 for t in range(len(MASK))],
                logprobs=[-1.0 if trained else 0.0 for trained in MASK],
                loss_mask=MASK,
                reward=float(i),
                is_end=True,
            )
            for i in range(K)
        ]
        groups.append(RolloutGroup(prompt_id=f"0-{g}", prompt_token_ids=[1, 8 + g], samples=samples))
    return StepBatch.from_groups(groups)


class LogprobSpy:
    """The backend's log-prob passes, unchanged, keeping each differentiable result's gradient for inspection."""

    def __init__(self, backend: TorchBackend) -> None:
        self.results: list[torch.Tensor] = []
        for name in ("policy_logprobs", "policy_logprobs_and_entropy"):
            setattr(backend, name, self.wrap(getattr(backend, name)))

    def wrap(self, method):
        def spied(*args, **kwargs):
            result = method(*args, **kwargs)
            if result[0].requires_grad:
                result[0].retain_grad()
                self.results.append(result[0])
            return result

        return spied


@pytest.mark.parametrize(
    "algorithm",
    [
        {"advantage_estimator": "rloo"},
        {"advantage_estimator": "grpo"},
        {"advantage_estimator": "reinforce_plus_plus"},
        {"advantage_estimator": "grpo", "policy_loss": "clip"},
        {"name": "ppo", "ppo_loss_mask": "all"},
    ],
)
def test_tool_tokens_get_exactly_zero_gradient(policy_dir: Path, algorithm: dict) -> None:
    spec = spec_with(algorithm)
    backend = TorchBackend(spec.training, policy_dir, Ranks())
    spy = LogprobSpy(backend)
    batch = multi_turn_batch()
    assert batch.num_tokens == PROMPTS * K * sum(MASK)  # the token_mean normaliser counts the model's tokens
    if algorithm.get("name") == "ppo":
        ppo = PPO(spec, Ranks(), MemoryCritic())  # type: ignore[arg-type]  # the client's interface, from memory
        ppo.restore(0)
        ppo.update(batch, backend, version=0)
    else:
        Reinforce(spec, Ranks()).update(batch, backend, version=0)
    assert spy.results
    tools = ~torch.tensor(MASK)
    for logprobs in spy.results:
        assert logprobs.grad is not None
        assert torch.equal(logprobs.grad[:, tools], torch.zeros_like(logprobs.grad[:, tools]))
        assert torch.equal(logprobs.detach()[:, tools], torch.zeros_like(logprobs.detach()[:, tools]))
        assert logprobs.grad[:, ~tools].abs().sum() > 0  # the model's own tokens do learn


def test_the_score_lands_on_the_last_model_token_past_a_tools_output() -> None:
    """PPO and REINFORCE++ put a response's score on its last token; the tools' tokens before it do not move it."""
    mask = torch.tensor([MASK, [True] * 2 + [False] * 7])
    rewards = token_rewards(torch.tensor([1.0, 2.0]), torch.zeros(2, len(MASK)), mask.float(), kl_penalty=0.1)
    assert rewards[0].tolist() == [0.0] * 8 + [1.0]
    assert rewards[1].tolist() == [0.0, 2.0] + [0.0] * 7


def test_validation_kl_leaves_the_tools_tokens_out(policy_dir: Path) -> None:
    """The evaluation's val/init_policy_kl: two trajectories that differ only in a trailing (cut) tool observation
    have the same KL; the same tokens as the model's would change it."""
    spec = spec_with({})
    backend = TorchBackend(spec.training, policy_dir, Ranks())
    Reinforce(spec, Ranks()).update(multi_turn_batch(), backend, version=0)  # the policy moves off the reference
    validator = object.__new__(Validator)  # score() needs only the spec and the backend
    validator.spec, validator.backend = spec, backend

    def kl(tail: list[int], trained: bool) -> float:
        sample = Sample(token_ids=[5, 6, 7, *tail], logprobs=[0.0] * (3 + len(tail)), reward=1.0, is_end=False)
        sample.loss_mask[:] = [True] * 3 + [trained] * len(tail)
        return validator.score([RolloutGroup(prompt_id="0-0", prompt_token_ids=[1, 8], samples=[sample])])[
            "val/init_policy_kl"
        ]

    assert kl([9, 10], trained=False) == kl([11, 12, 13], trained=False)
    assert kl([9, 10], trained=True) != kl([11, 12, 13], trained=True)
