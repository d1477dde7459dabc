"""Validation: the trainer's main rank evaluates weight versions on data.validation_prompts.

An evaluation of version v enqueues the validation prompts (kind VALIDATION, ids "val-<v>-<i>", one response
each at validation.temperature, 0 greedy) into the same prompts stream, so the same generators sample them with
version v and the same reward server scores them. Generators push their groups onto the run's validation
stream, which only this class reads: a validation group can never be trained on, and never enters
trained_groups.jsonl. The trainer enqueues the next step's training prompts first and then waits only for the
evaluation, so a step is held up by at most the evaluation's time, while the generators also sample the next
step. The metrics (`val/...`) go into the row of step v; a few responses go to validation/step-NNNNNN.jsonl.

With tensor parallelism the main rank's replica is several processes: each of them runs a Validator, and the
main one hands the evaluation's groups to the others (`collect.share_groups`) so that all of them take
part in the scoring's forward passes. Only the main one touches the queue and writes.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import torch
from transformers import PreTrainedTokenizerBase

from reinforce.core.data import prompt_answer, read_prompt_file
from reinforce.core.environment_api import prompt_data
from reinforce.core.prompt_encoding import encode_prompt_checked
from reinforce.core.queue import RolloutQueue
from reinforce.core.records_pb2 import Prompt, PromptKind, RolloutGroup
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import RunSpec
from reinforce.trainer.algorithms.tensors import sequence_kl
from reinforce.trainer.backends.base import TrainerBackend
from reinforce.trainer.batch import response_row
from reinforce.trainer.collect import share_groups
from reinforce.trainer.distributed import Ranks
from reinforce.trainer.feed import prompt_seed
from reinforce.trainer.group_check import GroupLimits, content_problem

log = logging.getLogger("reinforce.trainer")


def validation_prompt_id(version: int, index: int) -> str:
    return f"val-{version}-{index}"


class Validator:
    def __init__(
        self,
        spec: RunSpec,
        tokenizer: PreTrainedTokenizerBase,
        queue: RolloutQueue,
        backend: TrainerBackend,
        paths: RunPaths,
        consumer: str,
        stopping: threading.Event,
        ranks: Ranks,
        limits: GroupLimits,
    ) -> None:
        """limits: what a well-formed group of the run looks like (a malformed validation group is dead-lettered)."""
        assert spec.data.validation_prompts is not None
        assert ranks.rank == 0, "the validator runs on the main rank's replica"
        self.spec = spec
        self.ranks = ranks
        self.queue = queue
        self.backend = backend
        self.paths = paths
        self.consumer = consumer
        self.stopping = stopping
        texts = read_prompt_file(spec.data.validation_prompts, spec.data.on_bad_line, spec.data.prompt_field).prompts
        self.prompts: list[tuple[str, list[int]]] = []
        self.answers: list[str] = []  # each prompt's reference answer ("": none)
        data = prompt_data(spec)  # encoded as the training prompts are
        for text in texts:
            if len(self.prompts) == spec.validation.num_prompts:
                break
            ids, _ = encode_prompt_checked(tokenizer, text, data)
            if ids is not None:  # on_long_prompt skip: the next one instead
                self.prompts.append((str(text), ids))
                self.answers.append(prompt_answer(text))
        self.limits = limits
        self.started: dict[int, float] = {}
        self.enqueued: dict[str, Prompt] = {}  # the validation prompts of evaluations in flight, by id

    def due(self, step: int) -> bool:
        """At the start, every training.val_every steps, and at the end."""
        every = self.spec.training.val_every
        return step == 0 or step == self.spec.training.steps or (every > 0 and step % every == 0)

    def start(self, version: int) -> None:
        """Enqueue the validation prompts for weight version `version` (already published); the main rank's."""
        if not self.ranks.is_main:
            return
        v = self.spec.validation
        prompts = [
            Prompt(
                id=validation_prompt_id(version, i),
                step=version,
                policy_version=version,
                text=text,
                token_ids=ids,
                num_samples=1,
                # the same seed at every evaluation: sampled validation compares versions on equal terms
                seed=prompt_seed(self.spec.seed, f"val-{i}"),
                kind=PromptKind.VALIDATION,
                temperature=v.temperature,
                answer=self.answers[i],
            )
            for i, (text, ids) in enumerate(self.prompts)
        ]
        self.queue.put_prompts(prompts)
        self.enqueued.update((p.id, p) for p in prompts)
        self.started[version] = time.perf_counter()

    def finish(self, version: int) -> dict[str, float]:
        """Wait for the evaluation of `version`; its metrics. Writes the response table. Every process of the main
        rank's replica calls it; the others take part in the scoring and get {}."""
        groups, entry_ids = self.wait_for_groups(version) if self.ranks.is_main else ([], [])
        groups = share_groups(self.ranks, groups)
        values = self.score(groups)
        if not self.ranks.is_main:
            return {}
        self.write_table(version, groups)
        self.queue.ack_validation(entry_ids)
        values["timers/validation"] = time.perf_counter() - self.started.pop(version)
        log.info("validation of version %d: reward %.4f kl %.4f", version, values["val/rewards"],
                 values["val/init_policy_kl"])  # fmt: skip
        return values

    def wait_for_groups(self, version: int) -> tuple[list[RolloutGroup], list[str]]:
        """The evaluation's groups in prompt order, and the stream entries read (to acknowledge)."""
        wanted = {validation_prompt_id(version, i): i for i in range(len(self.prompts))}
        groups: dict[str, RolloutGroup] = {}
        entry_ids: list[str] = []
        while len(groups) < len(wanted):
            if self.stopping.is_set():
                raise SystemExit(0)
            arrived = self.queue.read_validation(self.consumer, count=len(wanted), block_ms=1000)
            for entry_id, group in arrived or self.lost_deliveries(entry_ids):
                if group.prompt_id in wanted and group.policy_version == version and self.refused(entry_id, group):
                    continue
                entry_ids.append(entry_id)
                if group.prompt_id in wanted and group.policy_version == version:
                    groups.setdefault(group.prompt_id, group)
                else:
                    log.warning("dropping stale or duplicate validation group %s", group.prompt_id)
        for prompt_id in wanted:
            self.enqueued.pop(prompt_id, None)
        return sorted(groups.values(), key=lambda g: wanted[g.prompt_id]), entry_ids

    def lost_deliveries(self, read: list[str]) -> list[tuple[str, RolloutGroup]]:
        """Validation groups delivered to this consumer whose reply never arrived (Redis restarted during the
        blocking read): reading new entries never returns them again (as trainer/collect.py's lost_deliveries)."""
        pending = self.queue.read_validation(self.consumer, count=100_000, block_ms=0, pending=True)
        return [(entry_id, group) for entry_id, group in pending if entry_id not in read]

    def refused(self, entry_id: str, group: RolloutGroup) -> bool:
        """Dead-letter a validation group that cannot be scored (trainer/group_check.py) and enqueue its prompt
        again."""
        prompt = self.enqueued[group.prompt_id]
        problem = content_problem(group, self.limits, num_samples=1, enqueued=prompt)
        if not problem:
            return False
        log.warning("validation group %s from %s refused: %s", group.prompt_id, group.generator_id or "?", problem)
        self.queue.dead_letter_group(entry_id, group, problem, validation=True)
        self.queue.put_prompts([prompt])
        return True

    @torch.no_grad()
    def score(self, groups: list[RolloutGroup]) -> dict[str, float]:
        samples = [(g, s) for g in groups for s in g.samples]
        rewards = torch.tensor([s.reward for _, s in samples], dtype=torch.float64)
        finite = torch.isfinite(rewards)
        with_tokens = [(g, s) for g, s in samples if len(s.token_ids)]
        kl = 0.0
        if with_tokens:
            prompts = [list(g.prompt_token_ids) for g, _ in with_tokens]
            responses = [response_row(s) for _, s in with_tokens]  # the tools' tokens have no KL
            temperature = self.spec.generation.temperature
            logprobs, mask = self.backend.policy_logprobs(prompts, responses, temperature)
            ref = self.backend.reference_logprobs(prompts, responses, temperature)
            a = self.spec.algorithm
            per_sample = sequence_kl(logprobs.detach(), ref, mask, a.kl_estimator, a.use_absolute_kl, a.kl_clamp)
            kl = per_sample.sum().item() / len(samples)  # an empty response's KL is 0
        return {
            "val/rewards": rewards[finite].mean().item() if finite.any() else float("nan"),
            "val/response_lengths": sum(len(s.token_ids) for _, s in samples) / len(samples),
            "val/init_policy_kl": kl,
            "val/fraction_of_samples_properly_ended": sum(s.is_end for _, s in samples) / len(samples),
        }

    def write_table(self, version: int, groups: list[RolloutGroup]) -> None:
        n = self.spec.validation.num_logged_responses
        if n == 0:
            return
        self.paths.validation.mkdir(parents=True, exist_ok=True)
        rows = [
            {
                "step": version,
                "prompt_id": g.prompt_id,
                "prompt": g.prompt_text,
                "response": s.text,
                "reward": s.reward,
                "response_tokens": len(s.token_ids),
                "is_end": s.is_end,
            }
            for g in groups
            for s in g.samples
        ][:n]
        path = self.paths.validation / f"step-{version:06d}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def discard_pending(self) -> None:
        """Validation groups delivered to an earlier life of this trainer: that evaluation is redone."""
        stale = self.queue.read_validation(self.consumer, count=100_000, block_ms=0, pending=True)
        if stale:
            self.queue.ack_validation([entry_id for entry_id, _ in stale])
