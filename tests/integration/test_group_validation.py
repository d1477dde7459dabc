"""Rollout groups are checked when the trainer reads them, against a real Redis (issue 30: R3-3, R3-4, R3-5, R3-18).

A group that does not fit the run goes to the dead-letter stream with its reason, its prompt is enqueued again,
and the step is trained on the well-formed groups: no crash, no restart, no forward pass spent on it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import redis

from reinforce.core.queue import DATA_FIELD, RolloutQueue
from reinforce.core.records_pb2 import Prompt, RolloutGroup, Sample
from reinforce.core.spec import RunSpec
from reinforce.trainer.collect import GroupCollector
from reinforce.trainer.distributed import Ranks
from reinforce.trainer.group_check import GroupLimits, max_group_bytes

SPEC = RunSpec.model_validate(
    {
        "name": "checked",
        "policy": {"random_init": {"hidden_size": 16, "intermediate_size": 16, "num_layers": 1}},
        "data": {"prompts": "unused.txt", "max_prompt_tokens": 8, "chat_template": False},
        "algorithm": {"num_rollouts_per_prompt": 2, "max_policy_lag": 1},
        "generation": {"max_new_tokens": 4},
        "training": {"prompts_per_step": 2},
    }
)
LIMITS = GroupLimits.of(SPEC, vocab_size=35)


def group(prompt_id: str, step: int = 0, version: int = 0, logprob: float = -1.0) -> RolloutGroup:
    samples = [Sample(token_ids=[5, 6], logprobs=[logprob, -0.5], reward=1.0, is_end=True) for _ in range(2)]
    return RolloutGroup(prompt_id=prompt_id, step=step, policy_version=version, prompt_token_ids=[1, 2],
                        prompt_text="p", samples=samples)  # fmt: skip


def collector(queue: RolloutQueue) -> GroupCollector:
    def prompt_of(g: RolloutGroup) -> Prompt:
        return Prompt(id=g.prompt_id, step=g.step, token_ids=g.prompt_token_ids, text=g.prompt_text)

    return GroupCollector(SPEC, queue, "trainer-0", Ranks(), prompt_of, lambda _: None, LIMITS, threading.Event())


def within_seconds(seconds: float, call: Callable[[], object]) -> list:
    """[call()] if it returns within `seconds`, else [] (a daemon thread: a call that waits forever fails the test
    without holding it)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    return result


def test_malformed_groups_are_dead_lettered_with_their_reason_and_their_prompts_enqueued_again(redis_url):
    client = redis.Redis.from_url(redis_url)
    queue = RolloutQueue(client, "checked", max_record_bytes=max_group_bytes(LIMITS))
    queue.ensure_groups()
    queue.put_rollout(group("0-0", logprob=math.nan))  # R3-4
    queue.put_rollout(group("0-1", version=999_999))  # R3-3: a version the trainer never published
    client.xadd(queue.rollouts_key, {DATA_FIELD: b"\x0a" + b"x" * (max_group_bytes(LIMITS) + 10)})  # R3-5: oversized
    queue.put_rollout(group("0-0"))
    queue.put_rollout(group("1-0", step=1, logprob=math.nan))  # an early group of the next step is checked too
    queue.put_rollout(group("0-1"))

    reader = collector(queue)
    _, groups = reader.read_groups(0)

    assert [g.prompt_id for g in groups] == ["0-0", "0-1"]
    assert all(math.isfinite(x) and g.policy_version == 0 for g in groups for s in g.samples for x in s.logprobs)
    reasons = [fields[b"reason"].decode() for _, fields in client.xrange(queue.deadletter_key)]
    assert len(reasons) == 4
    assert "sample 0: a log-prob that is NaN" in reasons[0]
    assert "policy_version 999999 was never published (newest: 0)" in reasons[1]
    assert "more than this run's" in reasons[2]
    # R3-18: per-step counts, not running totals (the oversized one never decoded: queue/dead_letters counts it)
    assert reader.take_counts() == {"train_rollouts/dropped_stale_groups": 0.0, "train_rollouts/invalid_groups": 3.0}
    assert reader.take_counts()["train_rollouts/invalid_groups"] == 0.0
    enqueued_again = [p.id for _, p in queue.read_prompts("g", count=10, block_ms=0)]
    assert sorted(enqueued_again) == ["0-0", "0-1", "1-0"]


def test_stale_groups_are_counted_per_step(redis_url):
    """R3-18: dropped_stale_groups was a running total reported as a step's value."""
    queue = RolloutQueue(redis.Redis.from_url(redis_url), "checked")
    queue.ensure_groups()
    reader = collector(queue)
    queue.put_rollout(group("3-0", step=3, version=1))  # 2 versions old with max_policy_lag 1
    queue.put_rollout(group("3-0", step=3, version=3))
    queue.put_rollout(group("3-1", step=3, version=3))
    reader.read_groups(3)
    assert reader.take_counts()["train_rollouts/dropped_stale_groups"] == 1.0
    queue.put_rollout(group("4-0", step=4, version=4))
    queue.put_rollout(group("4-1", step=4, version=4))
    reader.read_groups(4)
    assert reader.take_counts()["train_rollouts/dropped_stale_groups"] == 0.0


def test_a_malformed_validation_group_is_dead_lettered_and_its_prompt_enqueued_again(redis_url, tmp_path):
    from reinforce.core.policy import load_tokenizer, materialize_policy
    from reinforce.core.run_dir import RunPaths
    from reinforce.trainer.backends import build_backend
    from reinforce.trainer.validation import Validator

    (tmp_path / "val.txt").write_text("abc\n")
    spec = SPEC.model_copy(
        update={"data": SPEC.data.model_copy(update={"validation_prompts": str(tmp_path / "val.txt")})}
    )
    materialize_policy(spec.policy, tmp_path / "policy", seed=0)
    client = redis.Redis.from_url(redis_url)
    queue = RolloutQueue(client, "checked")
    queue.ensure_groups()
    backend = build_backend(spec.training, tmp_path / "policy", Ranks())
    validator = Validator(spec, load_tokenizer(tmp_path / "policy"), queue, backend, RunPaths(tmp_path / "run"),
                          "trainer-0", threading.Event(), Ranks(), LIMITS)  # fmt: skip
    validator.start(0)
    [(_, prompt)] = queue.read_prompts("g", count=10, block_ms=0)

    def answer(token: int, version: int = 0) -> RolloutGroup:
        sample = Sample(token_ids=[token], logprobs=[-1.0], reward=1.0, is_end=True)
        return RolloutGroup(prompt_id=prompt.id, step=version, policy_version=version, prompt_text=prompt.text,
                            prompt_token_ids=prompt.token_ids, samples=[sample], kind=prompt.kind)  # fmt: skip

    client.xadd(queue.validation_key, {DATA_FIELD: answer(1_000_000).SerializeToString()})
    client.xadd(queue.validation_key, {DATA_FIELD: answer(5).SerializeToString()})
    groups, _ = validator.wait_for_groups(0)
    assert [list(g.samples[0].token_ids) for g in groups] == [[5]]
    [(_, letter)] = client.xrange(queue.deadletter_key)
    assert b"outside the vocabulary" in letter[b"reason"] and letter[b"stream"] == queue.validation_key.encode()
    assert [p.id for _, p in queue.read_prompts("g", count=10, block_ms=0)] == [prompt.id]

    # The next evaluation's group is delivered to the validator's consumer and the reply lost (Redis restarted
    # during the blocking read): it is read back from the pending entries, not waited for forever.
    queue.ack_validation([entry_id for entry_id, _ in client.xrange(queue.validation_key)])
    validator.start(1)
    [(_, prompt)] = queue.read_prompts("g", count=10, block_ms=0)
    client.xadd(queue.validation_key, {DATA_FIELD: answer(6, version=1).SerializeToString()})
    client.xreadgroup("trainer", "trainer-0", {queue.validation_key: ">"}, count=1)
    collected = within_seconds(30, lambda: validator.wait_for_groups(1))
    assert collected, "the evaluation waited for a group that was delivered and lost"
    groups, entry_ids = collected[0]
    assert [list(g.samples[0].token_ids) for g in groups] == [[6]] and len(entry_ids) == 1


def test_groups_whose_delivery_was_lost_are_read_back(redis_url):
    """A read delivered a group to the trainer's consumer but its reply never arrived (CI: Redis killed and
    restarted during a blocking read): it stays pending to that consumer, and the step collects it all the same,
    without taking a group it already holds (an early one) for a duplicate."""
    client = redis.Redis.from_url(redis_url)
    queue = RolloutQueue(client, "checked")
    queue.ensure_groups()
    reader = collector(queue)
    queue.put_rollout(group("5-0", step=5, version=5))
    client.xreadgroup("trainer", "trainer-0", {queue.rollouts_key: ">"}, count=1)  # "5-0", its reply lost
    queue.put_rollout(group("6-0", step=6, version=5))  # early: held for step 6
    queue.put_rollout(group("5-1", step=5, version=5))

    collected = within_seconds(30, lambda: reader.read_groups(5))
    assert collected, "the step waited for a group that was delivered and lost"
    _, groups = collected[0]
    assert [g.prompt_id for g in groups] == ["5-0", "5-1"]
    assert list(reader.early) == ["6-0"]
    assert client.xpending(queue.rollouts_key, "trainer")["pending"] == 3, "a held group was acknowledged away"
