"""PPO at full width through real processes (`reinforce run` on examples/tiny-ppo.yaml, the critic its own process):
over two data-parallel ranks, and asynchronously."""

import pytest
from runs import (
    BASELINE_TRAINING,
    assert_each_step_trained_once,
    assert_reward_rose,
    max_weight_difference,
    reinforce,
    write_spec,
)

from reinforce.core.metrics import read_metrics
from reinforce.core.run_dir import RunPaths


@pytest.mark.slow
def test_ppo_over_two_data_parallel_ranks_trains_like_one(tmp_path, tiny_ppo_baseline):
    """torchrun, 2 gloo ranks, each reading its own half of every step's groups; the main rank gathers the others'
    samples for the critic: the actor's weights and both losses are one rank's after 12 steps (2 epochs x 2
    minibatches: four AdamW steps per step)."""
    spec = write_spec(tmp_path, "tiny-ppo", training={**BASELINE_TRAINING, "num_ranks": 2})
    result = reinforce("run", str(spec))
    assert result.returncode == 0, result.stderr[-3000:]
    assert max_weight_difference(tiny_ppo_baseline, tmp_path / "run") < 1e-4
    assert_each_step_trained_once(tmp_path / "run", BASELINE_TRAINING["steps"])
    ours, one_rank = (read_metrics(RunPaths(run).metrics) for run in (tmp_path / "run", tiny_ppo_baseline))
    for name in ("train_optim/critic_loss", "train_optim/actor_loss"):  # per-token means average per rank
        assert [r[name] for r in ours] == pytest.approx([r[name] for r in one_rank], rel=1e-3, abs=1e-5), name


@pytest.mark.slow
def test_asynchronous_ppo_learns_with_truncated_importance_weights(tmp_path):
    """max_policy_lag 2: generators sample up to two versions ahead; each clipped term is weighted by
    min(pi_old / mu, cap). The reward rises and every step trains its own prompts once."""
    result = reinforce("run", str(write_spec(tmp_path, "tiny-ppo", algorithm={"max_policy_lag": 2})))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(RunPaths(tmp_path / "run").metrics)
    assert max(r["train_rollouts/policy_lag_max"] for r in rows) == 2
    assert sum(r["train_rollouts/policy_lag"] for r in rows) > 0
    assert all(0.5 < r["train_rollouts/importance_weight_mean"] < 1.5 for r in rows)
    assert any(r["train_rollouts/importance_weight_mean"] != 1.0 for r in rows)  # off-policy samples were weighted
    assert_reward_rose(rows)
    assert_each_step_trained_once(tmp_path / "run", len(rows))
