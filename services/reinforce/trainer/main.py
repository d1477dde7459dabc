"""The trainer: feeds prompts, consumes rollout groups, applies the algorithm (REINFORCE or PPO), publishes weights.

    python -m reinforce.trainer --spec RUN_DIR/spec.yaml --redis-url redis://... [--metrics-port N] [--host ADDRESS]
        [--critic-url http://...]   (algorithm.name ppo: the critic service)

Strictly on-policy (max_policy_lag 0): the prompts of step s are sampled with weight version s, and the
trainer publishes version s + 1 before it enqueues the prompts of step s + 1.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import signal
import threading
import time
from pathlib import Path

import torch
from prometheus_client import start_http_server
from transformers import AutoConfig

from reinforce.core.data import read_prompt_file
from reinforce.core.durable import write_text_atomically
from reinforce.core.environment_api import prompt_data
from reinforce.core.hardware import bfloat16_is_native
from reinforce.core.launch import TRAINER
from reinforce.core.launch_flags import TrainerFlags
from reinforce.core.lora import LORA_FORMAT
from reinforce.core.metrics import TrainerMetrics, read_metrics, shown
from reinforce.core.names import WEIGHTS_TOKEN_ENV
from reinforce.core.policy import load_tokenizer, materialize_policy
from reinforce.core.queue import RolloutQueue, connect
from reinforce.core.run_dir import RunPaths, ensure_run_id
from reinforce.core.samples import discard_samples_after
from reinforce.core.spec import RunSpec, load_spec
from reinforce.core.threads import configure_threads
from reinforce.core.trackers import Trackers
from reinforce.core.weights import publish
from reinforce.trainer.algorithms import build_algorithm
from reinforce.trainer.allocator import use_allocator
from reinforce.trainer.backends import build_backend
from reinforce.trainer.batch import StepBatch, prompt_index
from reinforce.trainer.checkpoint import TrainerState, load_checkpoint, newest_intact_checkpoint, save_checkpoint
from reinforce.trainer.collect import GroupCollector
from reinforce.trainer.cursors import DataCursor, PromptCursor
from reinforce.trainer.distributed import Ranks
from reinforce.trainer.dynamic_sampling import GroupFilter
from reinforce.trainer.feed import PromptFeeder
from reinforce.trainer.group_check import GroupLimits, max_group_bytes
from reinforce.trainer.plot import plot_metrics
from reinforce.trainer.samples import log_samples
from reinforce.trainer.validation import Validator
from reinforce.trainer.weight_server import WeightServer

log = logging.getLogger("reinforce.trainer")
# How each step metric combines across data-parallel ranks (the rest are averaged).
SUMMED_METRICS = {
    "train_optim/loss",
    "train_rollouts/dropped_nonfinite_rewards",
    "train_rollouts/dropped_stale_groups",
    "train_rollouts/filtered_groups",
    "train_rollouts/invalid_groups",
    "train_rollouts/refused_mismatched_groups",
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
    "train_memory/peak_rss_gib",
    "train_optim/skipped_nonfinite_steps",  # the same on every rank: the gradient norm is a global one
    "train_optim/skipped_empty_steps",
}


class Trainer:
    """Rank 0 (the main rank) also feeds prompts, publishes weights, checkpoints and writes the metrics.

    With model parallelism (training.tensor_parallel) the processes of one data-parallel rank hold one replica
    between them: each takes part in every forward, update, gather and checkpoint, but only the rank's reader
    (Ranks.is_reader) touches its rollout groups in the stream.
    """

    def __init__(
        self, spec: RunSpec, redis_url: str, ranks: Ranks | None = None, critic_url: str | None = None
    ) -> None:
        self.spec = spec
        self.ranks = ranks or Ranks()
        self.consumer = f"trainer-{self.ranks.rank}"
        self.paths = RunPaths(spec.resolved_run_dir())
        self.run_id = ensure_run_id(self.paths) if self.ranks.is_main else ""  # named by checkpoint manifests
        # A pod has no supervisor to prepare it (locally this finds the supervisor's folder and returns);
        # before seeding, so that building it leaves the trainer's random state as it would be otherwise. The main
        # process alone writes it, the others wait: once a process group exists, transformers' save_pretrained
        # writes a model's weights from rank 0 only, so another rank's build lacks them, and trainer pods that
        # share the data volume could rename that folder into place.
        if self.ranks.is_main:
            materialize_policy(spec.policy, self.paths.initial_policy, spec.seed)
        self.ranks.barrier()
        torch.manual_seed(spec.seed)
        self.tokenizer = load_tokenizer(self.paths.initial_policy)
        self.backend = build_backend(spec.training, self.paths.initial_policy, self.ranks)
        self.algorithm = build_algorithm(spec, self.ranks, critic_url)
        self.stopping = threading.Event()  # set by SIGTERM: stop after the current step
        queue = connect(redis_url, max_outage_s=spec.queue.max_outage_s, stopping=self.stopping)
        limits = GroupLimits.of(spec, AutoConfig.from_pretrained(self.paths.initial_policy).vocab_size)
        self.queue = RolloutQueue(queue, spec.name, max_record_bytes=max_group_bytes(limits))
        self.queue.ensure_groups()
        self.feeder = PromptFeeder(spec, open_prompt_cursor(spec), self.tokenizer, self.queue)
        self.group_filter = None  # DAPO's dynamic sampling (one data-parallel rank: its reader is the main process)
        if spec.algorithm.dynamic_sampling:
            self.group_filter = GroupFilter(spec, self.queue, self.feeder.enqueue_replacement)
        self.collector = GroupCollector(
            spec, self.queue, self.consumer, self.ranks, self.feeder.prompt_of, self.feeder.enqueued, limits,
            self.stopping, self.group_filter,
        )  # fmt: skip
        self.metrics = TrainerMetrics(self.paths.metrics if self.ranks.is_main else None)
        self.validator: Validator | None = None
        if spec.data.validation_prompts and self.ranks.rank == 0:  # the main process and its replica's peers
            self.validator = Validator(
                spec, self.tokenizer, self.queue, self.backend, self.paths, self.consumer, self.stopping, self.ranks,
                limits,
            )  # fmt: skip
        self.trackers: Trackers | None = None  # opened by resume_if_possible, once the step is known
        self.step = 0
        self.weights_base_url: str | None = None  # set by serve_weights (weights.transport http)

    # ---- run ---------------------------------------------------------------------------------------
    def resume_if_possible(self) -> None:
        checkpoint = newest_intact_checkpoint(self.paths.checkpoints, self.run_id, self.ranks)
        if checkpoint is not None:
            state = load_checkpoint(checkpoint, self.backend)
            self.feeder.cursor = self.feeder.cursor.restored(state.cursor)
            self.step = state.step
            log.info("resumed from %s at step %d", checkpoint, self.step)
        self.algorithm.restore(self.step)
        # Steps after the checkpoint (all of them when a first life died before its first checkpoint) are
        # redone, so their rows from the earlier life go.
        if self.ranks.is_main:
            _truncate_jsonl(self.paths.trained_groups, keep_through_step=self.step)
            _truncate_jsonl(self.paths.metrics, keep_through_step=self.step)
            discard_samples_after(self.paths, self.step)
            self.metrics.reopen()  # it appended to the file that the rewrite replaced
            if self.spec.logging.trackers:
                self.trackers = Trackers(
                    self.spec.logging.trackers,
                    self.paths.root,
                    self.spec.model_dump(mode="json"),
                    self.spec.name,
                    self.spec.logging.project,
                    resume_step=self.step,
                    earlier_rows=read_metrics(self.paths.metrics),
                )

    def discard_unfinished_rollouts(self) -> None:
        """Groups delivered to an earlier life of this trainer but not trained: the steps they belong to are
        redone from the checkpoint, with the same prompts and seeds, so they are simply dropped."""
        if not self.ranks.is_reader:
            return
        stale = self.queue.read_rollouts(self.consumer, count=100_000, block_ms=0, pending=True)
        if stale:
            self.queue.ack_rollouts([entry_id for entry_id, _ in stale])
            log.info("dropped %d rollout groups of an interrupted step", len(stale))
        if self.validator is not None and self.ranks.is_main:
            self.validator.discard_pending()

    def run(self) -> None:
        self.publish_weights()
        # The start's evaluation (step 0's row); a resumed run evaluated its checkpoint's version already. The
        # replica's processes share one pod, so they read the same file, and row 0 is written only after all of
        # them have joined finish(0).
        if self.validator is not None and self.step == 0 and not _has_row(self.paths.metrics, 0):
            if self.ranks.is_main:
                self.feeder.fill_pipeline(0)  # the first step's generation overlaps the evaluation
            self.validator.start(0)
            values = self.validator.finish(0)
            if self.ranks.is_main:
                self.record(0, values)
        while self.step < self.spec.training.steps and not self.stopping.is_set():
            self.train_step()
            last = self.step == self.spec.training.steps
            if self.step % self.spec.training.checkpoint_every == 0 or last:
                self.checkpoint()
                if self.trackers is not None:
                    self.trackers.durable(self.step)  # rows a resume will never redo
        if self.step == self.spec.training.steps:
            self.finish()
        if self.trackers is not None:
            self.trackers.close()

    def record(self, step: int, values: dict[str, float]) -> None:
        """One metrics.jsonl row, also to every tracker."""
        self.metrics.record(step, values)
        if self.trackers is not None:
            self.trackers.log(step, values)

    def serve_weights(self, host: str, port: int, advertise_host: str, token: str | None) -> None:
        """weights.transport http: generators stream each version from this trainer's weight endpoint."""
        self.weight_server = WeightServer(self.paths.weights, host=host, port=port, token=token)
        self.weight_server.start()
        self.weights_base_url = self.weight_server.base_url(advertise_host)
        log.info("serving weights at %s", self.weights_base_url)

    def publish_weights(self) -> float:
        """Every process of the first data-parallel rank calls it (a sharded policy is gathered); the main one
        writes the version."""
        start = time.perf_counter()
        if self.ranks.rank != 0:
            return 0.0
        tensors, metadata = self.backend.weights_to_publish()
        if not self.ranks.is_main:
            return 0.0
        _check_finite(tensors, self.step)
        # whole weights travel in the generators' precision; LoRA adapters (a few MB) as they were trained
        engine_dtype = getattr(torch, self.spec.generation.resolved_dtype(bfloat16_is_native()))
        dtype = None if metadata.get("format") == LORA_FORMAT else engine_dtype
        weights = publish(
            tensors,
            self.paths.weights,
            self.step,
            self.spec.weights.keep_versions,
            self.weights_base_url,
            metadata,
            dtype,
        )
        self.queue.publish_weights(weights)
        return time.perf_counter() - start

    def checkpoint(self) -> None:
        """Every process calls it: a sharded backend writes a part from each."""
        # the cursor as it was before the next untrained step drew its prompts: a resume redraws them
        cursor = self.feeder.cursor_state_before(self.step)
        state = TrainerState(step=self.step, cursor=cursor, weight_version=self.step)
        if self.ranks.is_main:
            self.algorithm.save(self.step)  # first: a trainer checkpoint always has the algorithm's beside it
        keep = self.spec.training.keep_checkpoints
        path = save_checkpoint(self.paths.checkpoints, state, self.backend, keep, self.run_id, self.ranks)
        log.info("checkpoint %s", path)

    def finish(self) -> None:
        if self.ranks.rank == 0:
            self.backend.save_final(self.paths.final_model)  # the first data-parallel rank's processes gather
        if not self.ranks.is_main:
            return
        self.tokenizer.save_pretrained(self.paths.final_model)
        plot_metrics(self.paths.metrics, self.paths.plot)
        log.info("final model in %s", self.paths.final_model)

    # ---- one step ----------------------------------------------------------------------------------
    def train_step(self) -> None:
        step_start = time.perf_counter()
        if self.ranks.is_main:
            self.feeder.fill_pipeline(self.step)
        entry_ids, groups = self.collector.collect_groups(self.step)
        rollout_time = time.perf_counter() - step_start
        batch = StepBatch.from_groups(groups)
        values = self.update(batch)
        if self.ranks.is_main:  # what the model wrote, for people to read (a skipped step has no advantage or KL)
            sample_values = None if values["train_optim/skipped_empty_steps"] else self.algorithm.sample_values
            log_samples(self.spec, self.paths, self.trackers, self.step + 1, batch, sample_values)
        trained = self.step
        self.step += 1
        values["timers/weight_publish"] = self.publish_weights()
        evaluate = self.validator is not None and self.validator.due(self.step)
        if evaluate:
            # the next step's prompts first: generators sample them while this rank waits for the evaluation
            if self.step < self.spec.training.steps and self.ranks.is_main:
                self.feeder.fill_pipeline(self.step)
            self.validator.start(self.step)
        self.ranks.barrier()
        # Acknowledge only once the step's effect (the new weights) is written; the reader holds the entry ids.
        if self.ranks.is_reader:
            self.queue.ack_rollouts(entry_ids)
        indices = self.ranks.gather_ints([prompt_index(g) for g in groups], len(groups))
        dropped = self.ranks.gather_ints([int((~keep).sum()) for keep in batch.keep], len(groups))
        values.update(self.rollout_stats(batch, rollout_time, trained))
        values.update(self.feeder.trained(trained))
        filtered = self.group_filter.take(trained) if self.group_filter is not None else []
        values["train_rollouts/filtered_groups"] = float(len(filtered))
        values["timers/step_time"] = time.perf_counter() - step_start
        values = self.ranks.reduce_metrics(values, SUMMED_METRICS, MAXED_METRICS)
        if evaluate:
            values.update(self.validator.finish(self.step))  # the main rank's replica: all of its processes
        if not self.ranks.is_main:
            return
        trained_ids = [f"{trained}-{i}" for i in indices]
        audit = {"step": self.step, "prompt_ids": trained_ids}
        if self.group_filter is not None:
            audit["filtered_prompt_ids"] = filtered  # acknowledged, never trained (dynamic sampling)
        if lost := {f"{trained}-{i}": n for i, n in zip(indices, dropped, strict=True) if n}:
            audit["nonfinite_reward_samples"] = lost  # prompt id: its samples left out for a NaN or infinite reward
        _append_jsonl(self.paths.trained_groups, audit)
        self.record(self.step, values)
        log.info(
            "step %d reward %s kl %s grad norm %s",
            self.step,
            shown(values.get("train_rollouts/rewards"), ".4f"),
            shown(values.get("train_rollouts/init_policy_kl"), ".4f"),
            shown(values.get("train_optim/grad_norm"), ".4f"),
        )

    def update(self, batch: StepBatch) -> dict[str, float]:
        """The algorithm's update, or a skipped step when no sample of any rank kept its reward (a reward
        function that failed for the whole step): nothing to learn from, and an optimizer step on no data
        would still move the weights (AdamW's momentum and decay)."""
        skipped_before = self.backend.skipped_nonfinite_steps
        reset_peak_rss()
        lag = self.spec.algorithm.max_policy_lag
        if lag > 0:  # the weights of this step's version, which later groups may claim (up to lag steps on)
            self.backend.keep_version(self.step, oldest=self.step - lag)
        if self.ranks.sum(batch.num_samples) == 0:
            log.warning("step %d: every sample was dropped; the step is skipped", self.step)
            values = {"train_optim/lr": self.backend.skip_step(), "train_optim/skipped_empty_steps": 1.0}
        else:
            values = self.algorithm.update(batch, self.backend, version=self.step)
            values["train_optim/skipped_empty_steps"] = 0.0
        skipped = self.backend.skipped_nonfinite_steps - skipped_before
        if skipped:
            log.warning("step %d: %d optimizer step(s) skipped for a non-finite gradient norm", self.step, skipped)
        values["train_optim/skipped_nonfinite_steps"] = float(skipped)
        values["train_memory/peak_rss_gib"] = peak_rss_bytes() / 2**30
        return values

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
            **self.collector.take_counts(),
            "timers/rollout_time": rollout_time,
            "timers/generate": generate,
            "timers/reward": sum(g.reward_seconds for g in batch.groups),
            "throughput/generated_tokens_per_second": sum(response_lengths) / generate if generate else 0.0,
            "weights/published_version": float(self.step),
            "queue/prompts_pending": float(depths["prompts"]),
            "queue/rollouts_waiting": float(depths["rollouts_unread"]),
            "queue/dead_letters": float(depths["deadletter"]),
        }


def reset_peak_rss() -> None:
    """Start measuring this process's peak resident memory anew (Linux >= 4.0: writing 5 to clear_refs resets
    VmHWM; elsewhere the peak stays the process's)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    """This process's peak resident memory since reset_peak_rss (Linux's VmHWM), else since it started."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    # ru_maxrss is in kB on Linux, bytes on macOS; only macOS (no /proc) gets here
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def open_prompt_cursor(spec: RunSpec) -> DataCursor:
    """The data cursor of data.loader: over the prompt file (default), or over pre-tokenized shards (dali)."""
    if spec.data.loader == "dali":
        from reinforce.trainer.dali_cursor import DaliPromptCursor

        # the shards were tokenized with the tools' instructions in the system prompt, if the run puts them there
        return DaliPromptCursor(spec.data.prompts, spec.seed, spec.data.shuffle, prompt_data(spec))
    # read_prompt_file logs how many malformed lines it skipped (on_bad_line: skip), once, here at start.
    prompts = read_prompt_file(spec.data.prompts, spec.data.on_bad_line, spec.data.prompt_field).prompts
    return PromptCursor(prompts, spec.seed, spec.data.shuffle)


def _check_finite(weights: torch.nn.Module | dict[str, torch.Tensor], version: int) -> None:
    """Refuse to publish (and so to checkpoint) non-finite weights. Backends never step on a non-finite gradient,
    so this is the last line, not the first: one fused norm per tensor is a single cheap pass."""
    named = dict(weights.named_parameters() if isinstance(weights, torch.nn.Module) else weights.items())
    norms = torch._foreach_norm([t.detach() for t in named.values()])
    bad = [name for name, norm in zip(named, norms, strict=True) if not torch.isfinite(norm)]
    if bad:
        raise RuntimeError(f"weight version {version}: {len(bad)} tensors are not finite (first: {bad[0]}); "
                           "not published. The run resumes from its last checkpoint.")  # fmt: skip


def _append_jsonl(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _truncate_jsonl(path: Path, keep_through_step: int) -> None:
    """Drop the rows of steps after the checkpoint: those steps are redone after a resume."""
    if path.exists():
        rows = [r for r in read_metrics(path) if r["step"] <= keep_through_step]
        # By rename, so that a crash mid-rewrite cannot lose the rows kept (the metrics writer then reopens it).
        write_text_atomically(path, "".join(json.dumps(r) + "\n" for r in rows))


def _has_row(path: Path, step: int) -> bool:
    return any(r["step"] == step for r in read_metrics(path))


def _mean(values: list[float] | list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def main(argv: list[str] | None = None) -> None:
    spec_file, args = TrainerFlags.parse(TRAINER.parser(__doc__.splitlines()[0]), argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per critic request
    spec = load_spec(spec_file)
    use_allocator(spec.training.allocator)  # may start this process again, with jemalloc preloaded
    configure_threads()
    ranks = Ranks.from_environment(spec.training.tensor_parallel * spec.training.pipeline_parallel)
    trainer = Trainer(spec, args.redis_url, ranks, args.critic_url)
    if spec.weights.transport == "http" and ranks.is_main:
        trainer.serve_weights(args.host, args.weights_port, args.advertise_host, os.environ.get(WEIGHTS_TOKEN_ENV))
    if args.metrics_port and ranks.is_main:
        start_http_server(args.metrics_port, addr=args.host, registry=trainer.metrics.registry)

    terminated = threading.Event()

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping after the current step", signum)
        trainer.stopping.set()
        terminated.set()

    signal.signal(signal.SIGTERM, stop)
    trainer.resume_if_possible()
    trainer.discard_unfinished_rollouts()
    trainer.run()
    trainer.metrics.close()
    trainer.algorithm.close()
    if args.stay_up and not trainer.stopping.is_set():
        log.info("all %d steps trained: serving metrics and weights until SIGTERM", spec.training.steps)
        terminated.wait()
