"""DAPO's dynamic sampling in the trainer's collection: a step trains on prompts_per_step informative groups.

A group whose rewards are all equal (algorithms/dapo.py uninformative) is filtered as the collector reads it: it is
acknowledged, its prompt id kept for the step's row of trained_groups.jsonl (under "filtered_prompt_ids", beside the
trained "prompt_ids"), and the feeder enqueues the cursor's next prompt in its place ("<step>-<prompts_per_step + n>").
So every prompt id a step enqueued ends up trained or filtered, once. After `max_filtered_groups` filtered groups the
step trains on the groups that arrive, uninformative ones included, so that a task the policy has mastered (or not
begun to) cannot stall the run.

One data-parallel rank and on-policy only (the spec says so): the main rank alone draws from the data cursor, and on
policy the cursor's order, and so a resumed run's, depends on nothing but the step's own groups.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from reinforce.core.queue import RolloutQueue
from reinforce.core.records_pb2 import RolloutGroup
from reinforce.core.spec import RunSpec
from reinforce.trainer.algorithms.dapo import uninformative

log = logging.getLogger("reinforce.trainer")


class GroupFilter:
    """Filters a step's uninformative groups while it collects; `replace(step)` enqueues one more prompt."""

    def __init__(self, spec: RunSpec, queue: RolloutQueue, replace: Callable[[int], None]) -> None:
        self.queue = queue
        self.replace = replace
        self.limit = spec.algorithm.max_filtered_groups
        self.filtered: dict[int, list[str]] = {}  # step -> prompt ids filtered, in the order they arrived

    def prompts_per_step(self, prompts_per_step: int) -> int:
        """How many prompt ids a step may enqueue: its own and the replacements."""
        return prompts_per_step + self.limit

    def filters(self, step: int, entry_id: str, group: RolloutGroup) -> bool:
        """Whether the group of `step` is filtered (then it is acknowledged and its replacement enqueued)."""
        filtered = self.filtered.setdefault(step, [])
        if len(filtered) >= self.limit or not uninformative(group):
            return False
        filtered.append(group.prompt_id)
        self.queue.ack_rollouts([entry_id])
        self.replace(step)
        log.info("group %s has equal rewards: filtered, a new prompt enqueued", group.prompt_id)
        return True

    def take(self, step: int) -> list[str]:
        """The prompt ids filtered from `step` (once: the step's audit row)."""
        return self.filtered.pop(step, [])
