"""The trainer: feeds prompts, consumes rollout groups, applies REINFORCE (RLOO + KL), publishes weights.

    python -m reinforce.trainer --spec RUN_DIR/spec.yaml --redis-url redis://... [--metrics-port N]

Strictly on-policy (max_policy_lag 0): the prompts of step s are sampled with weight version s, and the
trainer publishes version s + 1 before it enqueues the prompts of step s + 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client import start_http_server

from reinforce.core.data import PromptCursor, read_prompt_file
from reinforce.core.metrics import TrainerMetrics, read_metrics
from reinforce.core.models import (
    encode_prompt_checked,
    load_policy,
    load_tokenizer,
    materialize_policy,
    response_logprobs,
)
from reinforce.core.names import CONTROL_TOKEN_ENV
from reinforce.core.queue import RolloutQueue, add_redis_url_argument, connect
from reinforce.core.records_pb2 import Prompt, RolloutGroup
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import RunSpec, TrainingSpec, load_spec
from reinforce.core.weights import WeightServer, publish
from reinforce.trainer.algorithms.reinforce import (
    policy_gradient_loss,
    rloo_advantages,
    sequence_kl,
    truncated_importance_weights,
)
from reinforce.trainer.checkpoint import TrainerState, list_checkpoints, load_checkpoint, save_checkpoint
from reinforce.trainer.distributed import Ranks
from reinforce.trainer.plot import plot_metrics

log = logging.getLogger("reinforce.trainer")
# How each step metric combines across data-parallel ranks (the rest are averaged).
SUMMED_METRICS = {
    "train_optim/loss",
    "train_rollouts/dropped_nonfinite_rewards",
    "train_rollouts/dropped_stale_groups",
    "timers/generate",
    "timers/reward",
    "data/truncated_prompts",
    "data/skipped_long_prompts",
}
MAXED_METRICS = {
    "train_rollouts/policy_lag_max",
    "train_rollouts/importance_weight_max",
    "timers/rollout_time",
    "timers/init_logprobs",
    "timers/train_time",
    "timers/weight_publish",
    "timers/step_time",
}
DATA_STATS = ("data/truncated_prompts", "data/skipped_long_prompts")


def lr_factor(training: TrainingSpec, step: int) -> float:
    """Linear warm-up to 1, then constant or cosine down to min_lr_ratio at the last step."""
    if step < training.warmup_steps:
        return (step + 1) / training.warmup_steps
    if training.lr_schedule == "constant":
        return 1.0
    progress = (step - training.warmup_steps) / max(1, training.steps - training.warmup_steps)
    return training.min_lr_ratio + (1 - training.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def prompt_seed(run_seed: int, prompt_id: str) -> int:
    """A sampling seed that depends only on the run and the prompt, so a re-sampled prompt repeats itself."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}:{prompt_id}".encode()).digest()[:7], "big")


@dataclass
class StepBatch:
    """One step's rollout groups as tensors, groups in prompt order."""

    groups: list[RolloutGroup]
    rewards: torch.Tensor  # [G, k]
    is_end: torch.Tensor  # [G, k] bool; False also for samples dropped for a non-finite reward
    keep: torch.Tensor  # [G, k] bool; samples that contribute to the loss
    num_tokens: int  # response tokens of kept samples: the loss normaliser

    @classmethod
    def from_groups(cls, groups: list[RolloutGroup]) -> StepBatch:
        rewards = torch.tensor([[s.reward for s in g.samples] for g in groups], dtype=torch.float32)
        keep = torch.isfinite(rewards)
        is_end = torch.tensor([[s.is_end for s in g.samples] for g in groups]) & keep
        lengths = torch.tensor([[len(s.token_ids) for s in g.samples] for g in groups])
        return cls(groups, torch.where(keep, rewards, 0.0), is_end, keep, int(lengths[keep].sum()))


class PolicyUpdate:
    """The policy, its frozen reference, AdamW and the LR schedule: one optimisation step per rollout batch."""

    def __init__(self, spec: RunSpec, policy_dir: Path, ranks: Ranks) -> None:
        self.spec = spec
        self.ranks = ranks
        self.policy = load_policy(policy_dir).train()
        # The reference is always the initial policy, also after a resume.
        self.reference = load_policy(policy_dir).requires_grad_(False)
        t = spec.training
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(t, s))

    def apply(self, batch: StepBatch, version: int) -> dict[str, float]:
        """One optimisation pass over this rank's groups of the step (trained weights: `version`),
        micro-batched by whole groups (RLOO needs them); gradients are summed over ranks."""
        alg, t = self.spec.algorithm, self.spec.training
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = self.ranks.sum(batch.num_tokens)  # the loss is the token mean over every rank's batch
        kl_all, rwk_all, adv_all = [], [], []
        loss_total, ref_seconds = 0.0, 0.0
        mismatch, weights = TokenStats(), TokenStats()
        train_start = time.perf_counter()
        for start in range(0, len(batch.groups), t.micro_batch_prompts):
            rows = slice(start, start + t.micro_batch_prompts)
            groups = batch.groups[rows]
            prompt_ids = [list(g.prompt_token_ids) for g in groups for _ in g.samples]
            response_ids = [list(s.token_ids) for g in groups for s in g.samples]
            ref_start = time.perf_counter()
            with torch.no_grad():
                ref_logprobs, _ = response_logprobs(
                    self.reference, prompt_ids, response_ids, self.spec.generation.temperature
                )
            ref_seconds += time.perf_counter() - ref_start
            logprobs, mask = response_logprobs(self.policy, prompt_ids, response_ids, self.spec.generation.temperature)
            shape = batch.rewards[rows].shape
            kl = sequence_kl(logprobs.detach(), ref_logprobs, mask, alg.kl_estimator, alg.use_absolute_kl)
            adv = rloo_advantages(
                batch.rewards[rows], kl.view(shape), batch.is_end[rows], alg.initial_policy_kl_penalty
            )
            loss_mask = mask * batch.keep[rows].reshape(-1, 1)
            behaviour = generator_logprobs(groups, like=logprobs)
            rho = None
            if alg.max_policy_lag > 0:
                rho = truncated_importance_weights(logprobs, behaviour, alg.importance_weight_cap)
                weights.add(rho, loss_mask)
            loss = policy_gradient_loss(logprobs, adv.advantages.reshape(-1), loss_mask, num_tokens, rho)
            loss.backward()
            loss_total += loss.item()
            # train/inference mismatch: only where the generator had the very weights being trained
            same_version = torch.tensor([g.policy_version == version for g in groups for _ in g.samples])
            mismatch.add((behaviour - logprobs.detach()).abs(), mask * same_version.unsqueeze(-1))
            kl_all.append(adv.kl)
            rwk_all.append(adv.rewards_with_kl)
            adv_all.append(adv.advantages)
        self.ranks.sum_gradients(self.policy.parameters())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), t.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        keep = batch.keep
        return {
            "train_rollouts/init_policy_kl": torch.cat(kl_all)[keep].mean().item(),
            "train_rollouts/rewards_with_kl": torch.cat(rwk_all)[keep].mean().item(),
            "train_rollouts/advantages_abs": torch.cat(adv_all)[keep].abs().mean().item(),
            "train_rollouts/logprob_mismatch": mismatch.mean(),
            "train_rollouts/importance_weight_mean": weights.mean(),
            "train_rollouts/importance_weight_max": weights.max,
            "train_rollouts/importance_weight_capped_fraction": weights.fraction_at_least(alg.importance_weight_cap),
            "train_optim/loss": loss_total,
            "train_optim/grad_norm": grad_norm.item(),
            "train_optim/lr": lr,
            "timers/init_logprobs": ref_seconds,
            "timers/train_time": time.perf_counter() - train_start - ref_seconds,
        }


class Trainer:
    """Rank 0 (the main rank) also feeds prompts, publishes weights, checkpoints and writes the metrics."""

    def __init__(self, spec: RunSpec, redis_url: str, ranks: Ranks | None = None) -> None:
        self.spec = spec
        self.ranks = ranks or Ranks()
        self.consumer = f"trainer-{self.ranks.rank}"
        self.paths = RunPaths(spec.resolved_run_dir())
        # A pod has no supervisor to prepare it (locally this finds the supervisor's folder and returns);
        # before seeding, so that building it leaves the trainer's random state as it would be otherwise.
        materialize_policy(spec.policy, self.paths.initial_policy, spec.seed)
        torch.manual_seed(spec.seed)
        self.tokenizer = load_tokenizer(self.paths.initial_policy)
        self.update = PolicyUpdate(spec, self.paths.initial_policy, self.ranks)
        self.policy = self.update.policy
        # read_prompt_file logs how many malformed lines it skipped (on_bad_line: skip), once, here at start.
        self.cursor = PromptCursor(
            read_prompt_file(spec.data.prompts, spec.data.on_bad_line).prompts, spec.seed, spec.data.shuffle
        )
        self.queue = RolloutQueue(connect(redis_url), spec.name)
        self.queue.ensure_groups()
        self.metrics = TrainerMetrics(self.paths.metrics if self.ranks.is_main else None)
        self.step = 0
        self.stopping = False
        # Steps whose prompts are enqueued but not yet trained: up to max_policy_lag + 1 of them.
        self.in_flight: dict[int, list[Prompt]] = {}
        self.cursor_before: dict[int, dict] = {}  # data cursor before each in-flight step drew its prompts
        self.data_stats: dict[int, dict[str, float]] = {}
        self.early: dict[str, tuple[str, RolloutGroup]] = {}  # groups of later steps that arrived early
        self.dropped_groups = 0
        self.weights_base_url: str | None = None  # set by serve_weights (weights.transport http)

    # ---- run ---------------------------------------------------------------------------------------
    def resume_if_possible(self) -> None:
        checkpoints = list_checkpoints(self.paths.checkpoints)
        if checkpoints:
            state = load_checkpoint(checkpoints[-1], self.policy, self.update.optimizer, self.update.scheduler)
            self.cursor = PromptCursor.from_state(
                self.cursor.prompts, self.spec.seed, self.spec.data.shuffle, state.cursor
            )
            self.step = state.step
            log.info("resumed from %s at step %d", checkpoints[-1], self.step)
        # Steps after the checkpoint (all of them when a first life died before its first checkpoint) are
        # redone, so their rows from the earlier life go.
        if self.ranks.is_main:
            _truncate_jsonl(self.paths.trained_groups, keep_through_step=self.step)
            _truncate_jsonl(self.paths.metrics, keep_through_step=self.step)

    def discard_unfinished_rollouts(self) -> None:
        """Groups delivered to an earlier life of this trainer but not trained: the steps they belong to are
        redone from the checkpoint, with the same prompts and seeds, so they are simply dropped."""
        stale = self.queue.read_rollouts(self.consumer, count=100_000, block_ms=0, pending=True)
        if stale:
            self.queue.ack_rollouts([entry_id for entry_id, _ in stale])
            log.info("dropped %d rollout groups of an interrupted step", len(stale))

    def run(self) -> None:
        if self.ranks.is_main:
            self.publish_weights()
        while self.step < self.spec.training.steps and not self.stopping:
            self.train_step()
            last = self.step == self.spec.training.steps
            if self.ranks.is_main and (self.step % self.spec.training.checkpoint_every == 0 or last):
                self.checkpoint()
        if self.step == self.spec.training.steps and self.ranks.is_main:
            self.finish()

    def serve_weights(self, port: int, advertise_host: str, token: str | None) -> None:
        """weights.transport http: generators stream each version from this trainer's weight endpoint."""
        self.weight_server = WeightServer(self.paths.weights, port=port, token=token)
        self.weight_server.start()
        self.weights_base_url = self.weight_server.base_url(advertise_host)
        log.info("serving weights at %s", self.weights_base_url)

    def publish_weights(self) -> float:
        start = time.perf_counter()
        weights = publish(
            self.policy, self.paths.weights, self.step, self.spec.weights.keep_versions, self.weights_base_url
        )
        self.queue.publish_weights(weights)
        return time.perf_counter() - start

    def checkpoint(self) -> None:
        # the cursor as it was before the next untrained step drew its prompts: a resume redraws them
        cursor = self.cursor_before.get(self.step, self.cursor.state())
        state = TrainerState(step=self.step, cursor=cursor, weight_version=self.step)
        path = save_checkpoint(
            self.paths.checkpoints,
            state,
            self.policy,
            self.update.optimizer,
            self.update.scheduler,
            self.spec.training.keep_checkpoints,
        )
        log.info("checkpoint %s", path)

    def finish(self) -> None:
        self.policy.save_pretrained(self.paths.final_model)
        self.tokenizer.save_pretrained(self.paths.final_model)
        plot_metrics(self.paths.metrics, self.paths.plot)
        log.info("final model in %s", self.paths.final_model)

    # ---- one step ----------------------------------------------------------------------------------
    def train_step(self) -> None:
        step_start = time.perf_counter()
        if self.ranks.is_main:
            self.fill_pipeline()
        entry_ids, groups = self.collect_groups(self.step)
        rollout_time = time.perf_counter() - step_start
        batch = StepBatch.from_groups(groups)
        values = self.update.apply(batch, version=self.step)
        trained = self.step
        self.step += 1
        values["timers/weight_publish"] = self.publish_weights() if self.ranks.is_main else 0.0
        self.ranks.barrier()
        # Acknowledge only once the step's effect (the new weights) is written.
        self.queue.ack_rollouts(entry_ids)
        indices = self.ranks.gather_ints([_prompt_index(g) for g in groups], len(groups))
        values.update(self.rollout_stats(batch, rollout_time, trained))
        values.update(self.data_stats.pop(trained, dict.fromkeys(DATA_STATS, 0.0)))
        values["timers/step_time"] = time.perf_counter() - step_start
        values = self.ranks.reduce_metrics(values, SUMMED_METRICS, MAXED_METRICS)
        if not self.ranks.is_main:
            return
        del self.in_flight[trained]
        self.cursor_before.pop(trained, None)
        trained_ids = [f"{trained}-{i}" for i in indices]
        _append_jsonl(self.paths.trained_groups, {"step": self.step, "prompt_ids": trained_ids})
        self.metrics.record(self.step, values)
        log.info(
            "step %d reward %.4f kl %.4f loss %.4f",
            self.step,
            values["train_rollouts/rewards"],
            values["train_rollouts/init_policy_kl"],
            values["train_optim/loss"],
        )

    def fill_pipeline(self) -> None:
        """Keep the prompts of steps step .. step + max_policy_lag enqueued (just this step when on-policy)."""
        last = min(self.step + self.spec.algorithm.max_policy_lag, self.spec.training.steps - 1)
        for step in range(self.step, last + 1):
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
        )

    def enqueue_prompts(self, step: int) -> list[Prompt]:
        """Enqueue a step's prompts_per_step prompts.

        Each names the oldest weight version allowed to sample it, step - max_policy_lag (the step's own
        version when on-policy); generators hold it until they have at least that version.

        An over-long prompt is truncated, or with on_long_prompt "skip" replaced by the cursor's next one,
        so every step still has prompts_per_step prompts. The counts go to `self.data_stats` (step metrics).
        """
        k = self.spec.algorithm.num_rollouts_per_prompt
        batch = self.cursor.take_encoded(
            self.spec.training.prompts_per_step,
            lambda text: encode_prompt_checked(self.tokenizer, text, self.spec.data),
        )
        prompts = []
        oldest_version = max(0, step - self.spec.algorithm.max_policy_lag)
        for i, (text, token_ids) in enumerate(batch.prompts):
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
                )
            )
        self.data_stats[step] = {
            "data/truncated_prompts": float(batch.truncated),
            "data/skipped_long_prompts": float(batch.skipped),
        }
        self.queue.put_prompts(prompts)
        return prompts

    def collect_groups(self, step: int) -> tuple[list[str], list[RolloutGroup]]:
        """Wait for one group per prompt of `step`, in prompt order.

        Groups of later in-flight steps are kept for their turn (asynchronous mode); groups of trained steps
        or duplicates are stale and acknowledged away; a group sampled by weights more than max_policy_lag
        versions old is dropped, counted, and its prompt enqueued again.
        """
        # Prompt ids are "<step>-<index>"; each rank trains an equal share of the step's groups.
        order = {f"{step}-{i}": i for i in range(self.spec.training.prompts_per_step)}
        share = self.spec.training.prompts_per_step // self.ranks.world
        groups: dict[str, tuple[str, RolloutGroup]] = {pid: self.early.pop(pid) for pid in order if pid in self.early}
        while len(groups) < share:
            if self.stopping:
                raise SystemExit(0)
            wanted = share - len(groups)
            for entry_id, group in self.queue.read_rollouts(self.consumer, count=wanted, block_ms=1000):
                self.sort_group(step, order, groups, entry_id, group)
        ordered = sorted(groups.values(), key=lambda e: order[e[1].prompt_id])
        return [entry_id for entry_id, _ in ordered], [group for _, group in ordered]

    def sort_group(self, step: int, order: dict[str, int], groups: dict, entry_id: str, group: RolloutGroup) -> None:
        lag_limit = self.spec.algorithm.max_policy_lag
        if group.prompt_id in order and group.prompt_id not in groups:
            if step - group.policy_version <= lag_limit:
                groups[group.prompt_id] = (entry_id, group)
                return
            log.warning("group %s is %d versions old: dropped, prompt re-enqueued", group.prompt_id,
                        step - group.policy_version)  # fmt: skip
            self.dropped_groups += 1
            self.queue.put_prompts([self.prompt_of(group)])
        elif step < group.step <= step + lag_limit and group.prompt_id not in self.early:
            self.early[group.prompt_id] = (entry_id, group)
            return
        else:
            log.warning("dropping stale or duplicate rollout group %s", group.prompt_id)
        self.queue.ack_rollouts([entry_id])

    def rollout_stats(self, batch: StepBatch, rollout_time: float, trained_step: int) -> dict[str, float]:
        samples = [s for g in batch.groups for s in g.samples]
        response_lengths = [len(s.token_ids) for s in samples]
        prompt_lengths = [len(g.prompt_token_ids) for g in batch.groups for _ in g.samples]
        generate = sum(g.generate_seconds for g in batch.groups)
        depths = self.queue.depths()
        lags = [trained_step - g.policy_version for g in batch.groups]
        for lag in lags:
            self.metrics.policy_lag.observe(lag)
        return {
            "train_rollouts/rewards": batch.rewards[batch.keep].mean().item(),
            "train_rollouts/fraction_of_samples_properly_ended": sum(s.is_end for s in samples) / len(samples),
            "train_rollouts/response_lengths": _mean(response_lengths),
            "train_rollouts/prompt_lengths": _mean(prompt_lengths),
            "train_rollouts/generation_length": _mean(
                [a + b for a, b in zip(prompt_lengths, response_lengths, strict=True)]
            ),
            "train_rollouts/dropped_nonfinite_rewards": float((~batch.keep).sum()),
            "train_rollouts/policy_lag": _mean(lags),
            "train_rollouts/policy_lag_max": float(max(lags)),
            "train_rollouts/dropped_stale_groups": float(self.dropped_groups),
            "timers/rollout_time": rollout_time,
            "timers/generate": generate,
            "timers/reward": sum(g.reward_seconds for g in batch.groups),
            "throughput/generated_tokens_per_second": sum(response_lengths) / generate if generate else 0.0,
            "weights/published_version": float(self.step),
            "queue/prompts_pending": float(depths["prompts"]),
            "queue/rollouts_waiting": float(depths["rollouts_unread"]),
            "queue/dead_letters": float(depths["deadletter"]),
        }


def _prompt_index(group: RolloutGroup) -> int:
    return int(group.prompt_id.rsplit("-", 1)[1])


def _append_jsonl(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _truncate_jsonl(path: Path, keep_through_step: int) -> None:
    """Drop the rows of steps after the checkpoint: those steps are redone after a resume."""
    if path.exists():
        rows = [r for r in read_metrics(path) if r["step"] <= keep_through_step]
        # In place, not by rename: the metrics writer already holds the file open for appending.
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _mean(values: list[float] | list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def generator_logprobs(groups: list[RolloutGroup], like: torch.Tensor) -> torch.Tensor:
    """The generators' recorded log-probs of the groups' samples, padded like the trainer's [B, T]."""
    out = torch.zeros_like(like, requires_grad=False)
    for row, sample in enumerate(s for g in groups for s in g.samples):
        out[row, : len(sample.logprobs)] = torch.tensor(list(sample.logprobs))
    return out


class TokenStats:
    """Mean, max and counts of a per-token quantity over masked tokens, accumulated across micro-batches."""

    def __init__(self) -> None:
        self.total, self.count, self.max, self._values = 0.0, 0, 0.0, []

    def add(self, values: torch.Tensor, mask: torch.Tensor) -> None:
        picked = values.detach()[mask.bool()]
        if picked.numel():
            self.total += picked.sum().item()
            self.count += picked.numel()
            self.max = max(self.max, picked.max().item())
            self._values.append(picked)

    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def fraction_at_least(self, bound: float) -> float:
        return (torch.cat(self._values) >= bound).float().mean().item() if self._values else 0.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m reinforce.trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="resolved run spec (RUN_DIR/spec.yaml)")
    add_redis_url_argument(parser)
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: none)")
    parser.add_argument("--weights-port", type=int, default=0, help="weights.transport http: port (0: any free)")
    parser.add_argument(
        "--advertise-host", default="127.0.0.1", help="host generators use to reach the weight endpoint"
    )
    parser.add_argument(
        "--stay-up",
        action="store_true",
        help="after the last step keep serving metrics and weights until SIGTERM (on Kubernetes, where a container "
        "that exits is restarted, and generators still fetch the final weights from this one)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    ranks = Ranks.from_environment()
    spec = load_spec(args.spec)
    trainer = Trainer(spec, args.redis_url, ranks)
    if spec.weights.transport == "http" and ranks.is_main:
        trainer.serve_weights(args.weights_port, args.advertise_host, os.environ.get(CONTROL_TOKEN_ENV))
    if args.metrics_port and ranks.is_main:
        start_http_server(args.metrics_port, registry=trainer.metrics.registry)

    terminated = threading.Event()

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping after the current step", signum)
        trainer.stopping = True
        terminated.set()

    signal.signal(signal.SIGTERM, stop)
    trainer.resume_if_possible()
    trainer.discard_unfinished_rollouts()
    trainer.run()
    trainer.metrics.close()
    if args.stay_up and not trainer.stopping:
        log.info("all %d steps trained: serving metrics and weights until SIGTERM", spec.training.steps)
        terminated.wait()
