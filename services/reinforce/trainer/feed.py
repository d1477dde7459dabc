"""Feeding prompts: the trainer's main rank keeps the prompts of the next steps enqueued for the generators."""

from __future__ import annotations

import hashlib

from transformers import PreTrainedTokenizerBase

from reinforce.core.data import prompt_answer
from reinforce.core.environment_api import prompt_data
from reinforce.core.prompt_encoding import encode_prompt_checked
from reinforce.core.queue import RolloutQueue
from reinforce.core.records_pb2 import Prompt, RolloutGroup
from reinforce.core.spec import RunSpec
from reinforce.trainer.cursors import DataCursor

DATA_STATS = ("data/truncated_prompts", "data/skipped_long_prompts")


def prompt_seed(run_seed: int, prompt_id: str) -> int:
    """A sampling seed that depends only on the run and the prompt, so a re-sampled prompt repeats itself."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}:{prompt_id}".encode()).digest()[:7], "big")


class PromptFeeder:
    """The data cursor and the steps whose prompts are enqueued but not yet trained (up to max_policy_lag + 1)."""

    def __init__(self, spec: RunSpec, cursor: DataCursor, tokenizer: PreTrainedTokenizerBase, queue: RolloutQueue):
        self.spec = spec
        self.cursor = cursor
        self.tokenizer = tokenizer
        self.data = prompt_data(spec)  # data.system_prompt with the tools' instructions, when they go in prompts
        self.queue = queue
        self.in_flight: dict[int, list[Prompt]] = {}
        self.cursor_before: dict[int, dict] = {}  # data cursor before each in-flight step drew its prompts
        self.data_stats: dict[int, dict[str, float]] = {}

    def cursor_state_before(self, step: int) -> dict:
        """The cursor as it was before `step` drew its prompts (a resume at `step` redraws them)."""
        return self.cursor_before.get(step, self.cursor.state())

    def trained(self, step: int) -> dict[str, float]:
        """Forget a trained step; its data metrics."""
        self.in_flight.pop(step, None)
        self.cursor_before.pop(step, None)
        return self.data_stats.pop(step, dict.fromkeys(DATA_STATS, 0.0))

    def fill_pipeline(self, current: int) -> None:
        """Keep the prompts of steps step .. step + max_policy_lag enqueued (just this step when on-policy)."""
        last = min(current + self.spec.algorithm.max_policy_lag, self.spec.training.steps - 1)
        for step in range(current, last + 1):
            if step not in self.in_flight:
                self.cursor_before[step] = self.cursor.state()
                self.in_flight[step] = self.enqueue_prompts(step)

    def prompt_of(self, group: RolloutGroup) -> Prompt:
        """The prompt a group answered, rebuilt from the group (any rank can re-enqueue it)."""
        return Prompt(
            id=group.prompt_id,
            step=group.step,
            policy_version=max(0, group.step - self.spec.algorithm.max_policy_lag),
            text=group.prompt_text,
            token_ids=group.prompt_token_ids,
            num_samples=self.spec.algorithm.num_rollouts_per_prompt,
            seed=prompt_seed(self.spec.seed, group.prompt_id),
            answer=group.answer,
        )

    def enqueued(self, prompt_id: str) -> Prompt | None:
        """The prompt enqueued under `prompt_id` if its step is in flight here (only the main rank enqueues)."""
        step, _, _ = prompt_id.partition("-")
        prompts = self.in_flight.get(int(step)) if step.isdigit() else None
        return next((p for p in prompts or () if p.id == prompt_id), None)

    def enqueue_prompts(self, step: int) -> list[Prompt]:
        """Enqueue a step's prompts_per_step prompts.

        Each names the oldest weight version allowed to sample it, step - max_policy_lag (the step's own
        version when on-policy); generators hold it until they have at least that version.

        An over-long prompt is truncated, or with on_long_prompt "skip" replaced by the cursor's next one,
        so every step still has prompts_per_step prompts. The counts go to `self.data_stats` (step metrics).
        """
        self.data_stats[step] = dict.fromkeys(DATA_STATS, 0.0)
        prompts = self.draw(step, self.spec.training.prompts_per_step, first_index=0)
        self.queue.put_prompts(prompts)
        return prompts

    def enqueue_replacement(self, step: int) -> None:
        """Enqueue one more prompt for the in-flight `step` (dynamic sampling filtered one of its groups), with the
        next index: "<step>-<prompts_per_step + n>" for the n-th replacement."""
        prompts = self.draw(step, 1, first_index=len(self.in_flight[step]))
        self.in_flight[step] += prompts
        self.queue.put_prompts(prompts)

    def draw(self, step: int, count: int, first_index: int) -> list[Prompt]:
        """The cursor's next `count` prompts as the step's prompts first_index, first_index + 1, ...; the data
        metrics are added to the step's."""
        k = self.spec.algorithm.num_rollouts_per_prompt
        batch = self.cursor.take_encoded(count, lambda text: encode_prompt_checked(self.tokenizer, text, self.data))
        prompts = []
        oldest_version = max(0, step - self.spec.algorithm.max_policy_lag)
        for i, (text, token_ids) in enumerate(batch.prompts, start=first_index):
            prompt_id = f"{step}-{i}"
            prompts.append(
                Prompt(
                    id=prompt_id,
                    step=step,
                    policy_version=oldest_version,
                    text=text,
                    num_samples=k,
                    token_ids=token_ids,
                    seed=prompt_seed(self.spec.seed, prompt_id),
                    answer=prompt_answer(text),
                )
            )
        stats = self.data_stats[step]
        stats["data/truncated_prompts"] += batch.truncated
        stats["data/skipped_long_prompts"] += batch.skipped
        return prompts
