"""Every metric name, defined once.

Step metrics use NeMo-Aligner's names (`train_rollouts/rewards`, ...) in metrics.jsonl; Prometheus gets the same
name with the prefix `reinforce_` and `/` turned into `_` (`reinforce_train_rollouts_rewards`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import IO

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from reinforce.core.names import PROMETHEUS_COMPONENT_LABEL, PROMETHEUS_INSTANCE_LABEL, PROMETHEUS_RUN_LABEL

PREFIX = "reinforce_"
log = logging.getLogger(__name__)

# name -> meaning. The trainer sets each of these once per step.
STEP_METRICS: dict[str, str] = {
    "train_rollouts/rewards": "Mean reward of the step's samples.",
    "train_rollouts/init_policy_kl": "Mean per-sample KL to the reference policy (the configured estimator).",
    "train_rollouts/rewards_with_kl": "Mean of reward - beta * KL.",
    "train_rollouts/fraction_of_samples_properly_ended": "Fraction of samples that emitted EOS or a stop string.",
    "train_rollouts/response_lengths": "Mean response length in tokens.",
    "train_rollouts/prompt_lengths": "Mean prompt length in tokens.",
    "train_rollouts/generation_length": "Mean prompt + response length in tokens.",
    "train_rollouts/advantages_abs": "reinforce: mean absolute advantage over the response tokens of kept samples.",
    "train_rollouts/advantages": "ppo: mean GAE advantage A_t over response tokens (before whitening).",
    "train_rollouts/returns": "ppo: mean return R_t = A_t + V(s_t) over response tokens (the critic's target).",
    "train_rollouts/values": "ppo: mean critic value V(s_t) over response tokens, as the rollout was valued.",
    "train_rollouts/dropped_nonfinite_rewards": "Samples left out of the step because their reward was NaN or inf.",
    "train_rollouts/logprob_mismatch": "Mean |generator log-prob - trainer log-prob| of the same tokens and weights.",
    "train_rollouts/refused_mismatched_groups": "Groups refused because their log-probs were far from the trainer's "
    "for the same weights (training.max_logprob_mismatch): not sampled by the published weights.",
    "train_rollouts/policy_lag": "Mean of (trained weight version - version that sampled the group).",
    "train_rollouts/policy_lag_max": "Largest policy lag of the step's groups (never above max_policy_lag).",
    "train_rollouts/dropped_stale_groups": "Groups dropped during the step for being more than max_policy_lag "
    "versions old (their prompts enqueued again).",
    "train_rollouts/invalid_groups": "Groups dead-lettered during the step because they did not fit the run (sample "
    "count, token ids, lengths, log-probs, weight version; the reason is in the dead-letter stream).",
    "train_rollouts/importance_weight_mean": "Mean truncated importance weight min(pi/mu, cap) (asynchronous mode); "
    "with policy_loss clip or gspo the mean ratio before clipping.",
    "train_rollouts/importance_weight_max": "Largest truncated importance weight of the step (asynchronous mode).",
    "train_rollouts/importance_weight_capped_fraction": "Fraction of tokens whose importance weight hit the cap.",
    "train_optim/loss": "reinforce: the REINFORCE loss (masked token mean).",
    "train_optim/actor_loss": "ppo: clipped surrogate loss minus the entropy bonus, mean over the minibatch steps.",
    "train_optim/critic_loss": "ppo: the critic's clipped value loss, mean over its minibatch steps.",
    "train_optim/critic_grad_norm": "ppo: the critic's gradient norm before clipping, mean over its minibatch steps.",
    "train_optim/ppo_ratio": "ppo: mean ratio pi / pi_old over response tokens, ended or not (as NeMo-Aligner's "
    "actor; the loss counts the tokens of ppo_loss_mask).",
    "train_optim/ppo_ratio_clamped": "ppo: mean of the ratio clamped to [1 - eps_low, 1 + eps_high], over the same "
    "tokens as ppo_ratio.",
    "train_optim/ppo_clip_fraction": "ppo, and reinforce with policy_loss clip or gspo: fraction of tokens whose "
    "clipped term won (no gradient from them).",
    "train_rollouts/overlong_penalty": "reinforce: mean overlong reward shaping of the kept samples "
    "(algorithm.overlong_buffer; 0 without).",
    "train_rollouts/filtered_groups": "Groups filtered by dynamic sampling (all rewards equal): acknowledged, "
    "recorded in trained_groups.jsonl, not trained; a new prompt replaced each.",
    "train_optim/entropy": "ppo: mean entropy of the policy's token distributions.",
    "train_optim/grad_norm": "Global gradient norm before clipping.",
    "train_optim/lr": "Learning rate used by the step.",
    "train_optim/skipped_nonfinite_steps": "Optimizer steps of the step skipped because the gradient norm was NaN "
    "or infinite (the weights stay as they were; the learning-rate schedule advances).",
    "train_optim/skipped_empty_steps": "1 when the step was skipped because every sample was dropped (no finite "
    "reward), else 0.",
    "train_batch/padding_fraction": "Fraction of the tokens the forward computes that were padding, in the step's "
    "micro-batches (reinforce: its training pass; ppo: its reference and old log-prob pass).",
    "train_batch/tokens_per_micro_batch": "Mean tokens the forward computes per micro-batch of that pass "
    "(as training.micro_batch_tokens counts them).",
    "train_batch/micro_batches": "Micro-batches of that pass (training.micro_batch_tokens, micro_batch_prompts).",
    "train_memory/peak_rss_gib": "Peak resident memory of the trainer process during the step's update, GiB "
    "(Linux: VmHWM, reset before each step; elsewhere the process's peak so far).",
    "timers/rollout_time": "Seconds from enqueueing the step's prompts to receiving its last rollout group.",
    "timers/generate": "Generator seconds spent sampling the step's groups (summed over generators).",
    "timers/reward": "Generator seconds spent waiting for the reward server for the step's groups.",
    "timers/init_logprobs": "Seconds computing the reference policy's log-probs.",
    "timers/logprobs": "ppo: seconds computing the sampling policy's log-probs before the update.",
    "timers/critic_wait": "ppo: seconds the trainer waited for the critic (values, then its update).",
    "timers/train_time": "Seconds of forward, backward and optimizer step (current log-probs come from this pass).",
    "timers/weight_publish": "Seconds writing and announcing the new weight version.",
    "timers/step_time": "Wall seconds of the whole step.",
    "throughput/generated_tokens_per_second": "Response tokens of the step / generate seconds.",
    "weights/published_version": "Latest published weight version.",
    "queue/prompts_pending": "Prompts enqueued but not yet acknowledged by a generator.",
    "queue/rollouts_waiting": "Rollout groups not yet consumed by the trainer.",
    "queue/dead_letters": "Records moved to the run's dead-letter stream because they did not decode.",
    "data/truncated_prompts": "Prompts of the step truncated from the left to max_prompt_tokens.",
    "data/skipped_long_prompts": "Prompts skipped this step for being longer than max_prompt_tokens.",
    "val/rewards": "Validation: mean reward on the validation prompts (rows of evaluation steps only).",
    "val/response_lengths": "Validation: mean response length in tokens.",
    "val/init_policy_kl": "Validation: mean per-response KL to the reference policy (the configured estimator).",
    "val/fraction_of_samples_properly_ended": "Validation: fraction of responses that ended properly.",
    "timers/validation": "Validation: seconds the trainer waited for and scored the evaluation.",
}
# Recorded only in the rows of evaluation steps (data.validation_prompts): at the start, every
# training.val_every steps and at the end. The start's row (step 0) holds only these.
VALIDATION_METRICS = (*(name for name in STEP_METRICS if name.startswith("val/")), "timers/validation")

STEP = "step"  # the jsonl key of the step number; Prometheus: TRAINER_STEP
TRAINER_STEP = PREFIX + "trainer_step"  # Prometheus name of the last completed step
TIME = "time"  # the jsonl key of the unix time the step finished
GENERATOR_WEIGHT_VERSION = PREFIX + "generator_weight_version"  # a generator's loaded weight version


def prometheus_name(name: str) -> str:
    return PREFIX + name.replace("/", "_")


class RequestMetrics:
    """A control plane's HTTP requests (reinforce_<component>_requests, _request_seconds), by route template and
    status code: written by core/http_kit.py's count_requests for the generator, the critic and the environment."""

    def __init__(self, component: str, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            f"{PREFIX}{component}_requests", "HTTP requests by endpoint and status code.", ["endpoint", "code"],
            registry=registry,
        )  # fmt: skip
        self.seconds = Histogram(
            f"{PREFIX}{component}_request_seconds",
            "Seconds to answer a request, by endpoint.",
            ["endpoint"],
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300),
            registry=registry,
        )


class TrainerMetrics:
    """The trainer's gauges and its metrics.jsonl, written together so the two never disagree."""

    def __init__(self, jsonl_path: Path | None, registry: CollectorRegistry | None = None) -> None:
        """jsonl_path None: Prometheus only (data-parallel ranks other than the main one)."""
        self.registry = registry or CollectorRegistry()
        self._gauges = {
            name: Gauge(prometheus_name(name), doc, registry=self.registry) for name, doc in STEP_METRICS.items()
        }
        self._step = Gauge(TRAINER_STEP, "Last completed trainer step.", registry=self.registry)
        self.policy_lag = Histogram(
            PREFIX + "trainer_group_policy_lag",
            "Per rollout group: trained version - version that sampled it.",
            buckets=(0, 1, 2, 3, 4, 8),
            registry=self.registry,
        )
        self._jsonl_path = jsonl_path
        self._jsonl: IO[str] | None = None
        self.reopen()

    def reopen(self) -> None:
        """(Re)open metrics.jsonl for appending: after it was replaced by a rewrite (a resume drops rows)."""
        self.close()
        if self._jsonl_path is not None:
            self._jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = self._jsonl_path.open("a", buffering=1)

    def record(self, step: int, values: dict[str, float]) -> None:
        """One metrics.jsonl row (and the gauges, and every configured tracker)."""
        unknown = set(values) - set(STEP_METRICS)
        if unknown:
            raise KeyError(f"undeclared metric names {sorted(unknown)}: add them to STEP_METRICS")
        for name, value in values.items():
            self._gauges[name].set(value)
        self._step.set(step)
        if self._jsonl is not None:
            row = {STEP: step, TIME: time.time(), **{k: (v if math.isfinite(v) else None) for k, v in values.items()}}
            self._jsonl.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


class GeneratorMetrics:
    """A generator's counters; Prometheus only (the trainer's step metrics summarise them per step)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.prompts = Counter(PREFIX + "generator_prompts", "Prompts sampled and pushed.", registry=r)
        self.samples = Counter(PREFIX + "generator_samples", "Responses sampled.", registry=r)
        self.tokens = Counter(PREFIX + "generator_tokens", "Response tokens sampled.", registry=r)
        self.generate_seconds = Counter(PREFIX + "generator_generate_seconds", "Seconds spent sampling.", registry=r)
        self.reward_seconds = Counter(
            PREFIX + "generator_reward_seconds", "Seconds waiting for the reward server.", registry=r
        )
        self.batch_size = Histogram(
            PREFIX + "generator_batch_sequences",
            "Sequences sampled together in one batch.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.weight_version = Gauge(GENERATOR_WEIGHT_VERSION, "Loaded weight version.", registry=r)
        self.weight_load_seconds = Gauge(
            PREFIX + "generator_weight_load_seconds", "Seconds the last weight load took.", registry=r
        )
        self.weight_fetch_seconds = Gauge(
            PREFIX + "generator_weight_fetch_seconds",
            "Seconds the last weight version took to transfer and check (sha256).",
            registry=r,
        )
        self.weight_bytes = Counter(PREFIX + "generator_weight_bytes", "Weight bytes fetched.", registry=r)
        self.reward_failures = Counter(
            PREFIX + "generator_reward_failures",
            "Responses left without a reward (NaN) because the reward function failed on their batch.",
            registry=r,
        )
        self.nonfinite_rewards = Counter(
            PREFIX + "generator_nonfinite_rewards", "Rewards that came back NaN or infinite.", registry=r
        )
        self.unreadable_weight_records = Counter(
            PREFIX + "generator_unreadable_weight_records",
            "Reads of the run's published weight version that did not decode; prompts wait as in a Redis outage.",
            registry=r,
        )
        # multi-turn rollouts (environment.enabled)
        self.episode_turns = Histogram(
            PREFIX + "generator_episode_turns",
            "Assistant turns per episode.",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=r,
        )
        self.tool_calls = Counter(
            PREFIX + "generator_tool_calls", "Tool observations appended to episodes.", registry=r
        )
        self.environment_failures = Counter(
            PREFIX + "generator_environment_failures",
            "Batches redone because the environment service failed (restarted, unreachable, refused).",
            registry=r,
        )
        self.http = RequestMetrics("generator", r)


class CriticMetrics:
    """The critic's Prometheus series (reinforce_critic_*)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.http = RequestMetrics("critic", r)
        self.train_steps = Gauge(
            PREFIX + "critic_train_steps", "Optimizer steps since the critic was created, resumes included.", registry=r
        )
        self.train_tokens = Counter(PREFIX + "critic_train_tokens", "Response tokens trained on.", registry=r)
        self.loss = Gauge(PREFIX + "critic_loss", "Critic loss of the last minibatch.", registry=r)
        self.grad_norm = Gauge(PREFIX + "critic_grad_norm", "Gradient norm (before clipping), last step.", registry=r)
        self.value_clip_fraction = Gauge(
            PREFIX + "critic_value_clip_fraction", "Tokens whose clipped value error won, last step.", registry=r
        )
        self.checkpoint_step = Gauge(
            PREFIX + "critic_checkpoint_step", "Step of the checkpoint last written or loaded.", registry=r
        )
        self.checkpoint_seconds = Gauge(
            PREFIX + "critic_checkpoint_seconds", "Seconds the last checkpoint took to write.", registry=r
        )


class EnvironmentMetrics:
    """The environment service's Prometheus series (reinforce_environment_*)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.episodes = Counter(PREFIX + "environment_episodes", "Episodes started.", registry=r)
        self.open_episodes = Gauge(PREFIX + "environment_open_episodes", "Episodes started and not ended.", registry=r)
        self.episodes_ended = Counter(
            PREFIX + "environment_episodes_ended",
            "Episodes ended, by reason: no_tool_call, max_turns, deleted, expired (idle past episode_idle_s).",
            ["reason"],
            registry=r,
        )
        self.turns = Histogram(
            PREFIX + "environment_turns_per_episode",
            "Assistant turns an episode took, observed when it ends.",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=r,
        )
        self.tool_calls = Counter(PREFIX + "environment_tool_calls", "Tool calls run, by tool.", ["tool"], registry=r)
        self.tool_errors = Counter(
            PREFIX + "environment_tool_errors",
            "Tool calls that failed (a nonzero exit, an exception, a malformed call; timeouts are counted apart), by "
            "tool (`invalid` for a call that named no known tool or did not parse).",
            ["tool"],
            registry=r,
        )
        self.timeouts = Counter(
            PREFIX + "environment_tool_timeouts",
            "Tool calls stopped at environment.time_limit_s, by tool.",
            ["tool"],
            registry=r,
        )
        self.sandbox_kills = Counter(
            PREFIX + "environment_sandbox_kills",
            "Sandboxed processes that ended by a signal (the time limit's SIGKILL, SIGXCPU at the CPU limit, ...), "
            "by signal name.",
            ["signal"],
            registry=r,
        )
        self.seconds = Histogram(
            PREFIX + "environment_tool_call_seconds",
            "Seconds of a tool call, from its request to its observation (waiting for a free slot included), by tool.",
            ["tool"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.http = RequestMetrics("environment", r)


def read_metrics(jsonl_path: Path) -> list[dict[str, float | None]]:
    """The rows of a metrics.jsonl (the supervisor's progress bar, plots and tests read it).

    A value is None where the step's was NaN or infinite (every reward of the step failed, an overflowing
    mean): readers show it as missing. A line that is not a JSON object with a step (a disk that filled
    mid-write) is skipped with a warning: a display never stops a run.
    """
    if not jsonl_path.exists():
        return []
    if not jsonl_path.is_file():  # a FIFO or a device would block the read, or never end it
        log.warning("%s is not a regular file: no metrics read", jsonl_path)
        return []
    # A last line without its newline is still being written by the trainer: it is read next time.
    complete = jsonl_path.read_text(errors="replace").rpartition("\n")[0]
    rows = []
    for number, line in enumerate(complete.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get(STEP), int):
            rows.append(row)
        else:
            log.warning("%s line %d is not a metrics row: skipped", jsonl_path, number)
    return rows


def scrape(url: str, timeout_s: float) -> dict[str, float] | None:
    """The samples of a Prometheus endpoint by name (labels ignored: the first sample of each name), None when it
    does not answer."""
    try:
        text = httpx.get(url, timeout=timeout_s).raise_for_status().text
    except httpx.HTTPError:
        return None
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, sample.value)
    return found


def shown(value: float | None, spec: str) -> str:
    """A metric for people: formatted, or "-" where the step had none (null in metrics.jsonl, NaN, inf)."""
    if value is None or not math.isfinite(value):
        return "-"
    return format(value, spec)


def file_sd_target(run: str, component: str, instance: str, address: str) -> dict:
    """One entry of a Prometheus file-service-discovery file, labelled as the dashboards and alerts select."""
    labels = {PROMETHEUS_RUN_LABEL: run, PROMETHEUS_COMPONENT_LABEL: component, PROMETHEUS_INSTANCE_LABEL: instance}
    return {"targets": [address], "labels": labels}
