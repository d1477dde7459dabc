"""The fault campaign in CI (tests/campaign.py; `benchmarks/fault_campaign.py` throws a hundred): twenty faults of
every kind that applies to examples/tiny.yaml, thrown at one run from a seeded schedule, the first a kill of the
trainer before its first checkpoint (the restarted trainer starts over and must forget the steps it redoes). The
run ends with the weights of the session's undisturbed run of the same spec (`tiny_run`) bit for bit, every step
trained once on its own prompts, and each kill answered by a restart of its component. As root the checkpoints folder
is a small tmpfs and the schedule fills it (a trainer whose checkpoint fails restarts); the reward faults, which
leave samples out, are thrown by the benchmark and tests/integration/test_bad_rollouts.py."""

from collections import Counter

import pytest
import yaml
from campaign import DATA_FAULTS, TRAINER_FAILED, Campaign, kinds_for, run_campaign, schedule
from campaign import campaign_overrides as overrides
from runs import EXAMPLES, FinishedRun, assert_each_step_trained_once, max_weight_difference, write_spec

from reinforce.core.metrics import read_metrics
from reinforce.core.run_dir import RunPaths

pytestmark = pytest.mark.slow
FAULTS = 20
SEED = 20261202
CHECKPOINT_EVERY = 5
KILLED = {  # the component whose restart answers each kill
    "kill -9 trainer": "trainer",
    "kill -9 a generator": "generator-0",
    "kill -9 reward server": "reward",
    "kill -9 redis-server": "redis",
}


def test_twenty_faults_on_one_run_lose_nothing(tmp_path, tiny_run: FinishedRun):
    tiny = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())
    steps, generators = tiny["training"]["steps"], tiny["generation"]["num_generators"]
    # checkpoints twice as often as tiny_run's (they change no weight): a killed trainer redoes fewer steps
    spec = write_spec(tmp_path, **overrides(steps, generators, training={"checkpoint_every": CHECKPOINT_EVERY}))
    # the first alone on step 1, the schedule's on steps 2.. (a process fault has a step of its own)
    plan = [(1, "kill -9 trainer"), *((s + 1, k) for s, k in schedule(SEED, FAULTS - 1, steps - 1, kinds_for(tiny)))]
    assert set(kind for _, kind in plan) == set(kinds_for(tiny)), "every kind that applies is thrown"

    campaign, struck = run_campaign(spec, tmp_path, plan, SEED)
    print("\n".join(f"{s.after_step:>3} {s.recovered_s:6.1f} s  {s.kind}" for s in struck))

    assert len(struck) == FAULTS
    assert max_weight_difference(tiny_run.run_dir, campaign.run_dir) == 0.0  # bit for bit
    assert_each_step_trained_once(campaign.run_dir, steps)
    # the metrics of the steps a restarted trainer redid are written once, as the undisturbed run wrote them
    [steps_logged, rewards], [undisturbed_steps, undisturbed_rewards] = map(rewards_by_step, (campaign, tiny_run))
    assert steps_logged == undisturbed_steps and rewards == pytest.approx(undisturbed_rewards)
    stderr, kinds = campaign.stderr(), Counter(kind for _, kind in plan)
    for kind, name in KILLED.items():
        restarts = stderr.count(f"component {name} exited with code -9; restart")
        assert restarts >= kinds[kind], f"{kind}: {kinds[kind]} thrown, {restarts} restarts of {name}\n{stderr}"
    failed_checkpoints = stderr.count(TRAINER_FAILED)  # each full disk: the trainer's checkpoint raised, it restarted
    assert failed_checkpoints >= kinds["disk full during a checkpoint"], stderr
    assert campaign.resumes == kinds["kill -9 supervisor and all, then --resume"]
    assert all(s.recovered_s == 0.0 for s in struck if s.kind in DATA_FAULTS)


def rewards_by_step(run: Campaign | FinishedRun) -> tuple[list[float], list[float]]:
    rows = read_metrics(RunPaths(run.run_dir).metrics)
    return [row["step"] for row in rows], [row["train_rollouts/rewards"] for row in rows]
