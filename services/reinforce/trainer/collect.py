"""Collecting rollout groups: one group per prompt of the step being trained, in prompt order.

Each data-parallel rank's reader reads its share from the stream; with model parallelism it hands the groups
(serialised protobuf records) to the other processes of its replica, which never read the stream themselves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from reinforce.core.queue import RolloutQueue
from reinforce.core.records_pb2 import Prompt, RolloutGroup
from reinforce.core.spec import RunSpec
from reinforce.trainer.distributed import Ranks
from reinforce.trainer.dynamic_sampling import GroupFilter
from reinforce.trainer.group_check import GroupLimits, group_problem, identity_problem

log = logging.getLogger("reinforce.trainer")
# Per-step counts of the groups the collector dropped (step metrics, summed over data-parallel ranks).
COLLECT_COUNTS = ("train_rollouts/dropped_stale_groups", "train_rollouts/invalid_groups")


def share_groups(ranks: Ranks, groups: list[RolloutGroup]) -> list[RolloutGroup]:
    """The reader's `groups` on every process of its model-parallel group, sent as serialised protobuf records."""
    if ranks.model_world == 1:
        return groups
    shared = ranks.share_with_model_peers([g.SerializeToString() for g in groups])
    return [RolloutGroup.FromString(payload) for payload in shared]


class GroupCollector:
    """Reads this rank's share of each step's groups; keeps early ones, drops stale ones and too-old ones."""

    def __init__(
        self,
        spec: RunSpec,
        queue: RolloutQueue,
        consumer: str,
        ranks: Ranks,
        prompt_of: Callable[[RolloutGroup], Prompt],
        enqueued: Callable[[str], Prompt | None],
        limits: GroupLimits,
        stopping: threading.Event,
        group_filter: GroupFilter | None = None,
    ) -> None:
        """prompt_of: a group's prompt, rebuilt to enqueue it again; enqueued: the prompt the trainer enqueued
        under an id (None where this process does not know it); limits: what a well-formed group looks like;
        group_filter: dynamic sampling's (algorithm.dynamic_sampling)."""
        self.spec = spec
        self.queue = queue
        self.consumer = consumer
        self.ranks = ranks
        self.prompt_of = prompt_of
        self.enqueued = enqueued
        self.limits = limits
        self.stopping = stopping
        self.group_filter = group_filter
        self.early: dict[str, tuple[str, RolloutGroup]] = {}  # groups of later steps that arrived early
        self.counts = dict.fromkeys(COLLECT_COUNTS, 0)  # since the last take_counts()

    def take_counts(self) -> dict[str, float]:
        """The step metrics of the groups dropped since the last call (per step, this rank's)."""
        counts = {name: float(n) for name, n in self.counts.items()}
        self.counts = dict.fromkeys(COLLECT_COUNTS, 0)
        return counts

    def collect_groups(self, step: int) -> tuple[list[str], list[RolloutGroup]]:
        """This data-parallel rank's groups of `step`, in prompt order, on every process of its replica (the entry
        ids, for acknowledging, only on its reader)."""
        entry_ids, groups = self.read_groups(step) if self.ranks.is_reader else ([], [])
        return entry_ids, share_groups(self.ranks, groups)

    def read_groups(self, step: int) -> tuple[list[str], list[RolloutGroup]]:
        """Wait for one group per prompt of `step`, in prompt order.

        Groups of later in-flight steps are kept for their turn (asynchronous mode); groups of trained steps
        or duplicates are stale and acknowledged away; a group sampled by weights more than max_policy_lag
        versions old is dropped, counted, and its prompt enqueued again.
        """
        # Prompt ids are "<step>-<index>"; each rank trains an equal share of the step's groups.
        enqueued = self.spec.training.prompts_per_step
        if self.group_filter is not None:
            enqueued = self.group_filter.prompts_per_step(enqueued)
        order = {f"{step}-{i}": i for i in range(enqueued)}
        share = self.spec.training.prompts_per_step // self.ranks.world
        groups: dict[str, tuple[str, RolloutGroup]] = {pid: self.early.pop(pid) for pid in order if pid in self.early}
        while len(groups) < share:
            if self.stopping.is_set():
                raise SystemExit(0)
            wanted = share - len(groups)
            self.queue.restore_published_weights()  # garbage in the weights key would hold every generator
            arrived = self.queue.read_rollouts(self.consumer, count=wanted, block_ms=1000)
            for entry_id, group in arrived or self.lost_deliveries(groups):
                self.sort_group(step, order, groups, entry_id, group)
        ordered = sorted(groups.values(), key=lambda e: order[e[1].prompt_id])
        return [entry_id for entry_id, _ in ordered], [group for _, group in ordered]

    def lost_deliveries(self, groups: dict) -> list[tuple[str, RolloutGroup]]:
        """Groups delivered to this trainer that it holds nowhere. A blocking read whose reply was lost (Redis
        killed and restarted while it waited: the retried read found the groups already delivered) leaves them
        pending to this consumer, and reading new entries never returns them again: the step would wait forever."""
        held = {entry_id for entry_id, _ in (*groups.values(), *self.early.values())}
        pending = self.queue.read_rollouts(self.consumer, count=100_000, block_ms=0, pending=True)
        return [(entry_id, group) for entry_id, group in pending if entry_id not in held]

    def sort_group(self, step: int, order: dict[str, int], groups: dict, entry_id: str, group: RolloutGroup) -> None:
        lag_limit = self.spec.algorithm.max_policy_lag
        current = group.prompt_id in order and group.prompt_id not in groups
        early = step < group.step <= step + lag_limit and group.prompt_id not in self.early
        if (current or early) and self.refused(step, entry_id, group):
            return
        if current:
            if step - group.policy_version <= lag_limit:
                if self.group_filter is None or not self.group_filter.filters(step, entry_id, group):
                    groups[group.prompt_id] = (entry_id, group)
                return
            log.warning("group %s is %d versions old: dropped, prompt re-enqueued", group.prompt_id,
                        step - group.policy_version)  # fmt: skip
            self.counts["train_rollouts/dropped_stale_groups"] += 1
            self.queue.put_prompts([self.prompt_of(group)])
        elif early:
            self.early[group.prompt_id] = (entry_id, group)
            return
        else:
            log.warning("dropping stale or duplicate rollout group %s", group.prompt_id)
        self.queue.ack_rollouts([entry_id])

    def refused(self, step: int, entry_id: str, group: RolloutGroup) -> bool:
        """Dead-letter a group that cannot be trained on (trainer/group_check.py), with its reason. If it names a
        prompt of this run, that prompt is enqueued again (as enqueued, where this process knows it) so that its
        step still gets a group."""
        enqueued = self.enqueued(group.prompt_id)
        problem = group_problem(group, self.limits, published=step, enqueued=enqueued)
        if not problem:
            return False
        log.warning("rollout group %s from %s refused: %s", group.prompt_id, group.generator_id or "?", problem)
        self.counts["train_rollouts/invalid_groups"] += 1
        self.queue.dead_letter_group(entry_id, group, problem)
        if not identity_problem(group, self.limits):
            self.queue.put_prompts([enqueued or self.prompt_of(group)])
        return True
