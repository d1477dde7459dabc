"""DAPO's dynamic sampling against a real Redis: groups whose rewards are all equal are filtered, acknowledged and
replaced by new prompts until the step has prompts_per_step informative groups; none is lost."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from reinforce.core.policy import load_tokenizer, materialize_policy
from reinforce.core.queue import RolloutQueue
from reinforce.core.records_pb2 import RolloutGroup, Sample
from reinforce.core.spec import RunSpec
from reinforce.trainer.collect import GroupCollector
from reinforce.trainer.cursors import PromptCursor
from reinforce.trainer.distributed import Ranks
from reinforce.trainer.dynamic_sampling import GroupFilter
from reinforce.trainer.feed import PromptFeeder
from reinforce.trainer.group_check import GroupLimits

PROMPTS = ["abc", "bcd", "cde", "def", "efg", "fgh"]
# the rewards a "generator" gives each prompt id's two samples: 0-0 and 0-2 all equal
REWARDS = {"0-0": [1.0, 1.0], "0-1": [0.0, 1.0], "0-2": [0.5, 0.5], "0-3": [1.0, 0.0], "0-4": [0.2, 0.3]}


def spec(max_filtered_groups: int) -> RunSpec:
    return RunSpec.model_validate(
        {
            "name": "dapo",
            "policy": {"random_init": {"hidden_size": 16, "intermediate_size": 16, "num_layers": 1}},
            "data": {"prompts": "unused.txt", "max_prompt_tokens": 8, "chat_template": False},
            "algorithm": {
                "num_rollouts_per_prompt": 2,
                "dynamic_sampling": True,
                "max_filtered_groups": max_filtered_groups,
            },
            "generation": {"max_new_tokens": 4},
            "training": {"prompts_per_step": 2},
        }
    )


def answer_prompts(queue: RolloutQueue, stop: threading.Event) -> None:
    """A generator: one group per prompt, with the prompt's REWARDS."""
    while not stop.is_set():
        for entry_id, prompt in queue.read_prompts("generator-0", count=10, block_ms=100):
            samples = [
                Sample(token_ids=[5, 6], logprobs=[-1.0, -0.5], reward=r, is_end=True) for r in REWARDS[prompt.id]
            ]
            queue.put_rollout(
                RolloutGroup(prompt_id=prompt.id, step=prompt.step, policy_version=0, samples=samples,
                             prompt_token_ids=prompt.token_ids, prompt_text=prompt.text)
            )  # fmt: skip
            queue.ack_prompts([entry_id])


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    return materialize_policy(spec(1).policy, tmp_path / "policy", seed=0)


@pytest.fixture
def queue(redis_url: str) -> Iterator[RolloutQueue]:
    queue = RolloutQueue(redis.Redis.from_url(redis_url), "dapo")
    queue.ensure_groups()
    stop = threading.Event()
    generator = threading.Thread(target=answer_prompts, args=(queue, stop), daemon=True)
    generator.start()
    yield queue
    stop.set()
    generator.join()


def collect_step_0(run: RunSpec, policy: Path, queue: RolloutQueue) -> tuple[list[RolloutGroup], list[str]]:
    feeder = PromptFeeder(run, PromptCursor(PROMPTS, seed=0, shuffle=False), load_tokenizer(policy), queue)
    group_filter = GroupFilter(run, queue, feeder.enqueue_replacement)
    limits = GroupLimits.of(run, vocab_size=64)
    collector = GroupCollector(
        run, queue, "trainer-0", Ranks(), feeder.prompt_of, feeder.enqueued, limits, threading.Event(), group_filter
    )
    feeder.fill_pipeline(0)
    entry_ids, groups = collector.read_groups(0)
    queue.ack_rollouts(entry_ids)
    assert [p.text for p in feeder.in_flight[0]] == PROMPTS[: len(feeder.in_flight[0])]  # the cursor's order
    return groups, group_filter.take(0)


def test_equal_reward_groups_are_filtered_and_replaced_until_the_step_is_full(policy, queue):
    groups, filtered = collect_step_0(spec(max_filtered_groups=4), policy, queue)
    # 0-0 filtered: replaced by 0-2, filtered too, replaced by 0-3; the step trains 0-1 and 0-3
    assert [g.prompt_id for g in groups] == ["0-1", "0-3"]
    assert sorted(filtered) == ["0-0", "0-2"]
    # every enqueued prompt ends trained or filtered, once; nothing is left unacknowledged
    assert queue.read_rollouts("trainer-0", count=10, block_ms=0, pending=True) == []


def test_past_the_cap_the_step_trains_on_what_arrives(policy, queue):
    groups, filtered = collect_step_0(spec(max_filtered_groups=1), policy, queue)
    # 0-0 is filtered, the cap is reached: 0-2 (equal rewards) is trained beside 0-1
    assert filtered == ["0-0"]
    assert [g.prompt_id for g in groups] == ["0-1", "0-2"]
