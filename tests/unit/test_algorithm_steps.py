"""Whole optimisation steps of the algorithms on a tiny policy: REINFORCE with each advantage estimator (micro-batching
changes nothing), and PPO (ppo_trainer.py) with a critic that answers from memory: what it sends the critic, what it
reports, and that it stops when the critic lost steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reinforce.core.critic_api import CheckpointResponse, Minibatch, ReadyResponse, TrainResponse
from reinforce.core.metrics import STEP_METRICS
from reinforce.core.policy import materialize_policy
from reinforce.core.records_pb2 import RolloutGroup, Sample
from reinforce.core.spec import PolicySpec, RandomInit, RunSpec, parse_spec
from reinforce.trainer.algorithms.ppo_trainer import PPO
from reinforce.trainer.algorithms.reinforce import Reinforce
from reinforce.trainer.backends.torch_backend import TorchBackend
from reinforce.trainer.batch import StepBatch
from reinforce.trainer.critic_client import CriticError
from reinforce.trainer.distributed import Ranks

K, PROMPTS = 2, 4


class MemoryCritic:
    """CriticClient's methods: values 0.5 everywhere, and a record of what it was asked to train."""

    def __init__(self, lose_steps: bool = False) -> None:
        self.trained: list[Minibatch] = []
        self.lose_steps = lose_steps

    def values(self, prompt_token_ids: list[list[int]], response_token_ids: list[list[int]]) -> list[list[float]]:
        return [[0.5] * len(r) for r in response_token_ids]

    def train(self, minibatches: list[Minibatch]) -> TrainResponse:
        self.trained += minibatches
        steps = len(self.trained) - (1 if self.lose_steps else 0)
        return TrainResponse(critic_loss=0.25, grad_norm=1.0, minibatches=[], train_steps=steps)

    def restore(self, step: int) -> CheckpointResponse:
        return CheckpointResponse(step=step, path="", train_steps=0)

    def wait_ready(self) -> ReadyResponse:
        return ReadyResponse(ready=True, train_steps=0, checkpoint_step=None)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    init = RandomInit(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2)
    return materialize_policy(PolicySpec(random_init=init), tmp_path_factory.mktemp("ppo") / "policy", seed=0)


def spec_with(algorithm: dict, micro_batch_prompts: int | None = 1, micro_batch_tokens: int | None = None) -> RunSpec:
    return parse_spec(
        {
            "name": "t",
            "policy": {"random_init": {}},
            "data": {"prompts": "p.txt"},
            "algorithm": {"num_rollouts_per_prompt": K, **algorithm},
            # the samples' recorded log-probs are made up, not the policy's: no group may be refused for them
            "training": {
                "prompts_per_step": PROMPTS,
                "micro_batch_prompts": micro_batch_prompts,
                "micro_batch_tokens": micro_batch_tokens,
                "lr": 1e-2,
                "max_logprob_mismatch": 1e6,
                "precision": "fp32",  # the steps are compared to float32 noise
            },
        }
    )


def ppo_spec() -> RunSpec:
    return spec_with({"name": "ppo", "ppo_epochs": 2, "num_minibatches": 2})


def sgd_gradients(backend: TorchBackend) -> list[list[torch.Tensor]]:
    """Put plain SGD in the backend's place of AdamW and record the gradients each of its steps is given. The claims
    below are about those gradients: AdamW's first step moves each weight by about +-lr whatever its gradient's size,
    so a gradient element near 0 whose float noise (another BLAS, another summation order) flips its sign ends 2 lr
    apart, and comparing AdamW's weights tests the BLAS. Under SGD the later steps' gradients stay comparable too."""
    parameters = backend.trainable_parameters()
    backend.optimizer = torch.optim.SGD(parameters, lr=backend.training.lr)
    backend.scheduler = torch.optim.lr_scheduler.LambdaLR(backend.optimizer, lambda step: 1.0)
    steps: list[list[torch.Tensor]] = []
    backend.optimizer.register_step_pre_hook(lambda *_: steps.append([p.grad.clone() for p in parameters]))
    return steps


def assert_same_gradients(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    """The same number of optimizer steps, each given the same gradients to float32 noise."""
    assert len(a) == len(b) > 0
    for step_a, step_b in zip(a, b, strict=True):
        assert any(g.abs().max() > 1e-3 for g in step_a), "no gradient to compare"
        for ga, gb in zip(step_a, step_b, strict=True):
            torch.testing.assert_close(ga, gb, rtol=0, atol=1e-6)


def step_batch() -> StepBatch:
    """Responses of different lengths (one empty), rewards in [0, 1], one non-finite reward, one unended sample."""
    groups = []
    for g in range(PROMPTS):
        samples = [
            Sample(
                token_ids=[5 + g, 6, 7][: (g + i) % 4],
                logprobs=[0.0] * ((g + i) % 4),
                reward=0.25 * (g + i),
                is_end=(g, i) != (3, 1),
            )
            for i in range(K)
        ]
        groups.append(RolloutGroup(prompt_id=f"0-{g}", prompt_token_ids=[1, 8 + g], samples=samples))
    groups[1].samples[0].reward = float("nan")
    return StepBatch.from_groups(groups)


@pytest.mark.parametrize(
    ("estimator", "policy_loss"),
    [
        ("rloo", "reinforce"),
        ("grpo", "reinforce"),
        ("dr_grpo", "reinforce"),
        ("reinforce_plus_plus", "reinforce"),
        ("grpo", "clip"),
        ("grpo", "gspo"),
    ],
)
def test_reinforce_step_is_the_same_whatever_the_micro_batch(
    policy_dir: Path, estimator: str, policy_loss: str
) -> None:
    """reinforce_plus_plus whitens over the whole batch (a pass without gradient first); the group estimators need
    whole groups: either way one micro-batch per prompt trains like one for the whole step."""
    gradients, metrics = [], []
    for micro in (1, PROMPTS):
        spec = spec_with({"advantage_estimator": estimator, "policy_loss": policy_loss}, micro_batch_prompts=micro)
        backend = TorchBackend(spec.training, policy_dir, Ranks())
        gradients.append(sgd_gradients(backend))
        metrics.append(Reinforce(spec, Ranks()).update(step_batch(), backend, version=0))
    assert set(metrics[0]) <= set(STEP_METRICS)
    assert metrics[0]["train_rollouts/advantages_abs"] > 0
    assert metrics[0]["train_optim/loss"] == pytest.approx(metrics[1]["train_optim/loss"], abs=1e-6)
    assert_same_gradients(*gradients)  # different padding widths sum in another order: float noise only


ONE_BIG_BATCH = {"micro_batch_prompts": None, "micro_batch_tokens": None}
# the test's sequences are 2 to 5 tokens long: 4 puts every group (and all but the shortest sequences) alone, 12
# packs two or three sequences, or one or two groups, per micro-batch
TOKEN_BUDGETS = (
    {"micro_batch_prompts": None, "micro_batch_tokens": 4},
    {"micro_batch_prompts": None, "micro_batch_tokens": 12},
)


@pytest.mark.parametrize("budget", TOKEN_BUDGETS)
@pytest.mark.parametrize(
    ("estimator", "policy_loss"),
    [("rloo", "reinforce"), ("grpo", "reinforce"), ("dr_grpo", "reinforce"), ("reinforce_plus_plus", "reinforce"),
     ("grpo", "gspo")],
)  # fmt: skip
def test_reinforce_step_by_token_budget_is_the_step_of_one_big_batch(
    policy_dir: Path, estimator: str, policy_loss: str, budget: dict
) -> None:
    """Micro-batches packed by token budget, longest first (out of prompt order), train like the whole step at once,
    and every sample's KL and advantage is reported in its own place."""
    gradients, metrics, values = [], [], []
    for micro in (budget, ONE_BIG_BATCH):
        spec = spec_with({"advantage_estimator": estimator, "policy_loss": policy_loss}, **micro)
        backend = TorchBackend(spec.training, policy_dir, Ranks())
        gradients.append(sgd_gradients(backend))
        algorithm = Reinforce(spec, Ranks())
        metrics.append(algorithm.update(step_batch(), backend, version=0))
        values.append(algorithm.sample_values)
    assert set(metrics[0]) <= set(STEP_METRICS)
    assert metrics[0]["train_batch/micro_batches"] > 1 and metrics[1]["train_batch/micro_batches"] == 1
    assert metrics[0]["train_optim/loss"] == pytest.approx(metrics[1]["train_optim/loss"], abs=1e-6)
    assert torch.allclose(values[0].kl, values[1].kl, atol=1e-6)
    assert torch.allclose(values[0].advantage, values[1].advantage, atol=1e-6)
    assert_same_gradients(*gradients)


@pytest.mark.parametrize("budget", TOKEN_BUDGETS)
def test_ppo_step_by_token_budget_is_the_step_of_one_big_batch(policy_dir: Path, budget: dict) -> None:
    """PPO's passes (reference and old log-probs, each minibatch's actor micro-batches) split by sequence, out of
    order, give the whole batch's rollout, critic minibatches and weights."""
    gradients, metrics, critics = [], [], []
    for micro in (budget, ONE_BIG_BATCH):
        spec = spec_with({"name": "ppo", "ppo_epochs": 2, "num_minibatches": 2}, **micro)
        critics.append(MemoryCritic())
        ppo = PPO(spec, Ranks(), critics[-1])  # type: ignore[arg-type]
        backend = TorchBackend(spec.training, policy_dir, Ranks())
        gradients.append(sgd_gradients(backend))
        ppo.restore(0)
        metrics.append(ppo.update(step_batch(), backend, version=0))
    assert set(metrics[0]) <= set(STEP_METRICS)
    assert metrics[0]["train_batch/micro_batches"] > 1
    assert metrics[0]["train_optim/actor_loss"] == pytest.approx(metrics[1]["train_optim/actor_loss"], abs=1e-6)
    returns = [[value for m in critic.trained for row in m.returns for value in row] for critic in critics]
    assert returns[0] == pytest.approx(returns[1], abs=1e-6)
    assert len(gradients[0]) == 4  # 2 epochs x 2 minibatches
    assert_same_gradients(*gradients)


def test_a_step_trains_actor_and_critic_on_the_same_minibatches(policy_dir: Path) -> None:
    spec = ppo_spec()
    critic = MemoryCritic()
    ppo = PPO(spec, Ranks(), critic)  # type: ignore[arg-type]  # the client's interface, from memory
    backend = TorchBackend(spec.training, policy_dir, Ranks())
    before = {k: v.clone() for k, v in backend.policy.state_dict().items()}
    ppo.restore(0)
    metrics = ppo.update(step_batch(), backend, version=0)

    assert set(metrics) <= set(STEP_METRICS)
    assert {"train_rollouts/values", "train_optim/critic_loss", "train_optim/ppo_ratio"} <= set(metrics)
    assert metrics["train_rollouts/values"] == pytest.approx(0.5)
    assert metrics["train_optim/critic_loss"] == 0.25
    # 2 epochs x 2 minibatches of 4 samples; the sample with a nan reward is left out of the critic's
    assert len(critic.trained) == 4 and ppo.critic_steps == 4
    assert sum(len(m.response_token_ids) for m in critic.trained) == 2 * (PROMPTS * K - 1)
    for m in critic.trained:
        assert [len(r) for r in m.returns] == [len(r) for r in m.response_token_ids]
        assert all(v == 0.5 for row in m.old_values for v in row)
    assert any(not torch.equal(before[k], v) for k, v in backend.policy.state_dict().items())


def test_a_critic_that_lost_steps_stops_the_trainer(policy_dir: Path) -> None:
    spec = ppo_spec()
    ppo = PPO(spec, Ranks(), MemoryCritic(lose_steps=True))  # type: ignore[arg-type]
    ppo.restore(0)
    with pytest.raises(CriticError, match="restarted from an older checkpoint"):
        ppo.update(step_batch(), TorchBackend(spec.training, policy_dir, Ranks()), version=0)


def test_baseline_over_all_samples_gives_signal_to_groups_that_did_not_end(policy_dir: Path) -> None:
    """No sample ends (every response cut by max_new_tokens): NeMo-Aligner's baseline over the ended samples gives
    no signal; TRL's over all samples (baseline_samples: all) does, and it averages the other k - 1."""
    batch = step_batch()
    batch.is_end[:] = False
    advantages = {}
    for members in ("ended", "all"):
        spec = spec_with({"baseline_samples": members})
        backend = TorchBackend(spec.training, policy_dir, Ranks())
        advantages[members] = Reinforce(spec, Ranks()).update(batch, backend, version=0)[
            "train_rollouts/advantages_abs"
        ]
    assert advantages["ended"] == 0.0
    assert advantages["all"] > 0.0
    all_members = Reinforce(spec_with({"baseline_samples": "all"}), Ranks()).baseline_members(batch)
    assert torch.equal(all_members, batch.keep)  # every scored sample; the non-finite reward stays out


def test_ppo_actor_averages_over_properly_ended_responses_by_default(policy_dir: Path) -> None:
    """ppo_loss_mask ended (NeMo-Aligner's actor: masked_mean(..., mask * is_end)): a response cut by max_new_tokens
    adds no gradient; the advantages' whitening and the critic still see every kept response."""
    batch = step_batch()
    batch.is_end[2, 1] = False  # a 3-token response cut by the limit
    # kept tokens (lengths (g + i) % 4, sample (1, 0) dropped): 0 + 1 + 2 + 2 + 3 + 3 + 0 = 11; without (2, 1): 8
    for loss_mask, actor_tokens in (("ended", 8), ("all", 11)):
        spec = spec_with({"name": "ppo", "ppo_loss_mask": loss_mask})
        ppo = PPO(spec, Ranks(), MemoryCritic())  # type: ignore[arg-type]
        rollout = ppo.rollout(batch, TorchBackend(spec.training, policy_dir, Ranks()), version=0)[0]
        assert int(rollout.mask.sum()) == 11
        assert int(rollout.actor_mask.sum()) == actor_tokens
        assert rollout.actor_mask[5].sum() == (0 if loss_mask == "ended" else 3)  # row 2 * K + 1


def test_ppo_actor_gets_no_gradient_when_no_response_ended(policy_dir: Path) -> None:
    """With an entropy bonus: the entropy averages over the same mask as L_clip (NeMo-Aligner's actor)."""
    batch = step_batch()
    batch.is_end[:] = False
    grad_norms = {}
    for loss_mask in ("ended", "all"):
        spec = spec_with({"name": "ppo", "ppo_loss_mask": loss_mask, "entropy_bonus": 0.01})
        ppo = PPO(spec, Ranks(), MemoryCritic())  # type: ignore[arg-type]
        ppo.restore(0)
        grad_norms[loss_mask] = ppo.update(batch, TorchBackend(spec.training, policy_dir, Ranks()), version=0)[
            "train_optim/grad_norm"
        ]
    assert grad_norms["ended"] == 0.0
    assert grad_norms["all"] > 0.0
