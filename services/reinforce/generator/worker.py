"""The generator: a pull-based worker that samples k responses per prompt, scores them and pushes the group.

    python -m reinforce.generator --spec RUN_DIR/spec.yaml --redis-url URL --reward-url URL --port N --id NAME
        [--host ADDRESS] [--weights-url TRAINER_WEIGHT_ENDPOINT] [--metrics-port N] [--environment-url URL]

With environment.enabled each sample is a multi-turn episode of the environment service at --environment-url
(its token from $REINFORCE_ENVIRONMENT_TOKEN): episodes.py. Should the service fail mid-batch (restarted, gone), the
batch's prompts stay unacknowledged and the whole batch is sampled again: no group is pushed twice or half.

Control plane (FastAPI, on --host:--port): GET /healthz, GET /readyz, GET /metrics (Prometheus; also alone on
--metrics-port when given, the port a pod opens to Prometheus),
GET /v1/weights (loaded and desired version), POST /v1/weights (a WeightVersion as JSON: load it between batches;
with "relaySources", the ancestors' relays of weights.distribution relay, it is fetched at once by generator/relay.py,
which serves it on to this generator's successors as it arrives). A posted version is accepted only if it is the
run's published one, exactly as the trainer announced it in Redis (version, uri and sha256): the control token lets
the reconciler say "load the latest now", never "load this file". A prompt names the oldest weight version allowed
to sample it (strictly on-policy: its step's own version); it waits, unacknowledged, until such a version is loaded,
and a stale prompt (its step already trained, or enqueued by a trainer that restarted from an earlier checkpoint) is
acknowledged without work. Every sample of a group comes from one version, which the group records.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from google.protobuf.json_format import ParseError
from prometheus_client import start_http_server
from transformers import AutoConfig

from reinforce.core import generator_api as api
from reinforce.core.environment_client import EnvironmentServiceError
from reinforce.core.http_kit import add_probes, bearer_dependency, count_requests, read_capped
from reinforce.core.launch import GENERATOR
from reinforce.core.launch_flags import GeneratorFlags
from reinforce.core.metrics import GeneratorMetrics
from reinforce.core.names import CONTROL_TOKEN_ENV, ENVIRONMENT_TOKEN_ENV, LOCAL_HOST, WEIGHTS_TOKEN_ENV
from reinforce.core.policy import load_tokenizer, materialize_policy
from reinforce.core.queue import RolloutQueue, UnreadableRecord, connect
from reinforce.core.records_pb2 import Prompt, PromptKind, RolloutGroup, Sample, WeightVersion
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import RunSpec, load_spec
from reinforce.core.threads import configure_threads
from reinforce.core.weights import WeightError, WeightSources, load_verified
from reinforce.generator.engines import build_engine
from reinforce.generator.engines.base import SampledSequence
from reinforce.generator.engines.common import eos_token_ids
from reinforce.generator.episodes import Episode, EpisodeRunner, ObservationFormat
from reinforce.generator.relay import Relay
from reinforce.generator.reward_client import RewardClient, RewardFunctionError

log = logging.getLogger("reinforce.generator")
ENVIRONMENT_RETRY_S = 1.0  # after the environment service failed a batch, before it is sampled again
# Reclaim passes come at least this often: prompts a stopping generator handed back are taken within a second.
RECLAIM_EVERY_S = 1.0


class NotPublished(ValueError):
    """A posted weight version that is not the run's published record."""


@dataclass
class WeightState:
    """What the control plane and the worker loop share, under one lock."""

    loaded: int = 0
    loaded_sha256: str = ""  # with `loaded`, what identifies the loaded weights ("": the initial policy)
    loads: int = 0  # versions loaded since the process started
    desired: WeightVersion | None = None
    last_error: str = ""
    unreadable: bool = False  # the last read of the published version from Redis did not decode
    lock: threading.Lock = field(default_factory=threading.Lock)


class Generator:
    def __init__(
        self,
        spec: RunSpec,
        redis_url: str,
        reward_url: str,
        name: str,
        weights_token: str = "",
        weights_url: str | None = None,
        environment: tuple[str, str] | None = None,
        relay_host: str = LOCAL_HOST,
    ) -> None:
        """`environment`: the environment service's (url, token), needed with environment.enabled. With a
        `weights_url` the generator also relays versions to others (generator/relay.py), on `relay_host`, any free
        port."""
        self.spec = spec
        self.name = name
        self.weights_token = weights_token  # the trainer's weight endpoint's (weights.transport http)
        paths = RunPaths(spec.resolved_run_dir())
        # Weights come from the run's folder or its trainer's endpoint, nowhere else (the token goes only there).
        self.sources = WeightSources(paths.weights, weights_url)
        # A pod has no supervisor to prepare it (locally this finds the supervisor's folder and returns)
        materialize_policy(spec.policy, paths.initial_policy, spec.seed)
        self.engine = build_engine(
            spec.generation, paths.initial_policy, spec.algorithm.num_rollouts_per_prompt, spec.training.lora
        )
        log.info("generation engine: %s", self.engine.name)
        self.weight_cache = Path(tempfile.mkdtemp(prefix=f"reinforce-{name}-weights-"))  # http downloads
        self.relay = self._relay(weights_url, relay_host)
        self.stopping = threading.Event()
        queue = connect(redis_url, max_outage_s=spec.queue.max_outage_s, stopping=self.stopping)
        self.queue = RolloutQueue(queue, spec.name)
        self.queue.ensure_groups()
        self.reward = RewardClient.from_spec(reward_url, spec.reward)
        self.weights = WeightState()
        self.metrics = GeneratorMetrics()
        self.held: list[tuple[str, Prompt]] = []  # prompts waiting for a newer weight version
        self.episodes = self._episode_runner(paths, environment) if spec.environment.enabled else None

    def _relay(self, weights_url: str | None, host: str) -> Relay | None:
        if weights_url is None:  # weights.transport file: every generator reads the shared folder
            return None
        w = self.spec.weights
        relay = Relay(self.weight_cache / "relay", self.weights_token, host, w.relay_stall_s, w.relay_deadline_s)
        relay.start()
        return relay

    def _episode_runner(self, paths: RunPaths, environment: tuple[str, str] | None) -> EpisodeRunner:
        if environment is None:
            raise ValueError("environment.enabled: the generator needs --environment-url and its token")
        tokenizer = load_tokenizer(paths.initial_policy)
        config = AutoConfig.from_pretrained(paths.initial_policy, local_files_only=True)
        eos = eos_token_ids(paths.initial_policy, config, tokenizer)
        observations = ObservationFormat(tokenizer, self.spec.data.chat_template, eos)
        return EpisodeRunner(self.engine, observations, *environment, caller=self.name)

    # ---- weights -----------------------------------------------------------------------------------
    def request_weights(self, weights: WeightVersion, relay_sources: list[str] | None = None) -> None:
        """Accept `weights` if it is the run's published version, exactly; raise NotPublished otherwise.
        With `relay_sources` (the ancestors' relays, nearest first) it is fetched by the relay at once.

        The latest request wins, older or newer: a trainer resumed from a checkpoint rolls the version back.
        The reconciler posts what it read from Redis; should the trainer publish again in between, this
        refusal is answered by the reconciler's next pass with the newer version.
        """
        try:
            published = self.published_weights()
        except UnreadableRecord as err:
            raise NotPublished(f"weight version {weights.version}: {err}") from err
        if published is None or not _same_record(weights, published):
            raise NotPublished(
                f"weight version {weights.version} ({weights.uri}) is not the run's published weight version "
                f"({'none yet' if published is None else published.version})"
            )
        if relay_sources is not None and self.relay is not None:
            self.relay.request(published, self._planned(published, relay_sources))
        with self.weights.lock:
            self.weights.desired = weights

    def _planned(self, published: WeightVersion, relay_sources: list[str]) -> list[str]:
        """`relay_sources` if the weight reconciler planned every one for `published` (its RelayPlan in Redis), else
        NotPublished: a load request needs only the control token, and the weights token goes to each source."""
        plan = self.queue.relay_plan()
        if plan is None or (plan.version, plan.sha256) != (published.version, published.sha256):
            raise NotPublished(f"weight version {published.version}: no relay plan for it, relay sources refused")
        unplanned = [url for url in relay_sources if url not in plan.sources]
        if unplanned:
            raise NotPublished(f"weight version {published.version}: relay sources {unplanned} were not planned")
        return relay_sources

    def published_weights(self) -> WeightVersion | None:
        """The run's published version from Redis. An undecodable record raises UnreadableRecord, counted, and logged
        once per spell of them: callers wait as for a Redis outage, until the trainer's next publish replaces it."""
        try:
            latest = self.queue.latest_weights()
        except UnreadableRecord as err:
            self.metrics.unreadable_weight_records.inc()
            if not self.weights.unreadable:
                log.error("%s; waiting for the trainer to publish again", err)
            self.weights.unreadable = True
            raise
        self.weights.unreadable = False
        return latest

    def apply_desired_weights(self) -> None:
        """Between batches: load the desired version if it differs; a bad file leaves the old one serving."""
        with self.weights.lock:
            desired = self.weights.desired
            if desired is None or self._is_loaded(desired):
                return
        start = time.perf_counter()
        try:
            if self.relay is not None and self.relay.requested(desired):
                stats = self.relay.load(self.engine.load_weights, desired, self.sources)
            else:
                stats = load_verified(
                    self.engine.load_weights, desired, self.sources, cache_dir=self.weight_cache,
                    token=self.weights_token,
                )  # fmt: skip
        except WeightError as err:
            log.error("refusing weights: %s", err)
            with self.weights.lock:
                self.weights.last_error = str(err)
                self.weights.desired = None  # wait for a new request rather than re-reading a bad file
            return
        self.metrics.weight_load_seconds.set(time.perf_counter() - start)
        self.metrics.weight_fetch_seconds.set(stats.fetch_seconds)
        self.metrics.weight_bytes.inc(stats.num_bytes)
        self.metrics.weight_version.set(desired.version)
        with self.weights.lock:
            self.weights.loaded = desired.version
            self.weights.loaded_sha256 = desired.sha256
            self.weights.loads += 1
            self.weights.last_error = ""
        log.info("loaded weight version %d in %.2fs", desired.version, time.perf_counter() - start)

    def _is_loaded(self, weights: WeightVersion) -> bool:
        """By version and digest, not by version alone: another file claiming the loaded number is not it."""
        if not self.weights.loaded_sha256:  # the initial policy, version 0 by definition
            return weights.version == 0
        return (weights.version, weights.sha256) == (self.weights.loaded, self.weights.loaded_sha256)

    # ---- work loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        self.reward.wait_ready(deadline_s=300)
        # A restarted generator (same name) first takes back the prompts its previous life had not finished.
        self.held = self.queue.read_prompts(self.name, count=10_000, block_ms=0, pending=True)
        next_reclaim = time.monotonic()
        while not self.stopping.is_set():
            self.apply_desired_weights()
            if time.monotonic() >= next_reclaim:
                self.held += self.reclaim_from_dead_generators()
                next_reclaim = time.monotonic() + min(self.spec.generation.reclaim_idle_s / 4, RECLAIM_EVERY_S)
            # short blocks while prompts wait for weights, so a new version is picked up promptly
            block_ms = 20 if self.held else 200
            fresh = self.queue.read_prompts(self.name, count=self.spec.generation.batch_prompts, block_ms=block_ms)
            ready, self.held = self.split_by_version(self.held + fresh)
            # Validation prompts sample in their own batch: their own sample count and temperature.
            for batch in _split_by_sampling(ready):
                self.process(batch)
        # Told to stop (SIGTERM: scale-in, a rolling update): what it claimed and did not finish goes to the others
        # now, not after reclaim_idle_s.
        log.info("stopping: handed back %d prompts", self.queue.hand_back_prompts(self.name))

    def reclaim_from_dead_generators(self) -> list[tuple[str, Prompt]]:
        idle_ms = int(self.spec.generation.reclaim_idle_s * 1000)
        claimed = self.queue.reclaim_prompts(self.name, min_idle_ms=idle_ms, count=self.spec.generation.batch_prompts)
        held = {entry_id for entry_id, _ in self.held}
        claimed = [e for e in claimed if e[0] not in held]  # our own held prompts are idle too
        if claimed:
            log.info("reclaimed %d prompts from a generator that stopped answering", len(claimed))
        return claimed

    def split_by_version(self, entries: list[tuple[str, Prompt]]) -> tuple[list, list]:
        """(ready to sample, waiting for weights); stale prompts are acknowledged and dropped.

        With P the published version, a prompt of step s naming oldest version m is stale when s < P (its
        step is trained) or m > P (enqueued by a trainer that then restarted from an earlier checkpoint). It is
        ready when m <= loaded <= P; on-policy m = s = P, so only the published version itself samples it.
        """
        if not entries:
            return [], []
        # The trainer publishes a version before it enqueues prompts that need it.
        try:
            latest = self.published_weights()
        except UnreadableRecord:  # like an outage: nothing is sampled or dropped until a publish heals it
            return [], entries
        published = latest.version if latest is not None else 0
        stale = [entry_id for entry_id, p in entries if p.step < published or p.policy_version > published]
        if stale:
            log.info("dropping %d stale prompts (published version is %d)", len(stale), published)
            self.queue.ack_prompts(stale)
        live = [e for e in entries if e[0] not in set(stale)]
        loaded = self.weights.loaded
        ready = [e for e in live if e[1].policy_version <= loaded <= published]
        return ready, [e for e in live if e not in ready]

    def process(self, entries: list[tuple[str, Prompt]]) -> None:
        prompts = [p for _, p in entries]
        version = self.weights.loaded
        start = time.perf_counter()
        first = prompts[0]
        if first.kind == PromptKind.VALIDATION:
            temperature = first.temperature if first.HasField("temperature") else None
            options = {"num_samples": first.num_samples, "temperature": temperature}
        else:
            options = {}
        try:
            sampled = self.sample(prompts, options)
        except EnvironmentServiceError as err:
            # Nothing of the batch was pushed or acknowledged: its prompts wait and are sampled again whole.
            log.warning("environment service failed (%s); sampling the batch's %d prompts again", err, len(entries))
            self.metrics.environment_failures.inc()
            self.held += entries
            self.stopping.wait(ENVIRONMENT_RETRY_S)
            return
        generate_seconds = time.perf_counter() - start
        start = time.perf_counter()
        texts = [s.text for seqs in sampled for s in seqs]
        rows = [p for p, seqs in zip(prompts, sampled, strict=True) for _ in seqs]
        rewards = self.score([p.text for p in rows], texts, [p.answer for p in rows])
        reward_seconds = time.perf_counter() - start
        rewards_iter = iter(rewards)
        for seqs in sampled:
            for sample in seqs:
                sample.reward = next(rewards_iter)
        for (entry_id, prompt), seqs in zip(entries, sampled, strict=True):
            group = RolloutGroup(
                prompt_id=prompt.id,
                step=prompt.step,
                policy_version=version,
                prompt_text=prompt.text,
                prompt_token_ids=prompt.token_ids,
                generator_id=self.name,
                kind=prompt.kind,
                answer=prompt.answer,
                # each group's share of the batch's time, so a step's sum is the generators' busy time
                generate_seconds=generate_seconds / len(entries),
                reward_seconds=reward_seconds / len(entries),
                samples=seqs,
            )
            self.queue.put_rollout(group)
            self.queue.ack_prompts([entry_id])  # the group is on the stream: the prompt's work is durable
        self.count(sampled, rewards, generate_seconds, reward_seconds)

    def sample(self, prompts: list[Prompt], options: dict) -> list[list[Sample]]:
        """Each prompt's samples (no reward yet): single responses, or episodes with environment.enabled."""
        if self.episodes is None:
            sampled = self.engine.sample([list(p.token_ids) for p in prompts], [p.seed for p in prompts], **options)
            return [[_single_turn(s) for s in seqs] for seqs in sampled]
        k = options.get("num_samples") or self.spec.algorithm.num_rollouts_per_prompt
        batch = [(list(p.token_ids), p.text, p.seed) for p in prompts]
        episodes = self.episodes.run(batch, k, options.get("temperature"))
        return [[self._episode_sample(e) for e in group] for group in episodes]

    def _episode_sample(self, episode: Episode) -> Sample:
        self.metrics.episode_turns.observe(episode.turns)
        self.metrics.tool_calls.inc(episode.tool_calls)
        return Sample(
            token_ids=episode.token_ids,
            logprobs=episode.logprobs,
            is_end=episode.is_end,
            # the whole trajectory, tools' output included: what the reward server scores
            text=self.episodes.observations.tokenizer.decode(episode.token_ids, skip_special_tokens=True),
            loss_mask=episode.loss_mask,
            turns=episode.turns,
            tool_calls=episode.tool_calls,
        )

    def score(self, prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
        """The rewards; NaN for every row of a batch the reward function failed on.

        A failing reward function (it raised, or returned the wrong count or type) is a bug in user code that
        retrying cannot fix; NaN makes the trainer drop those samples (counted) and the run go on, while the
        error is logged here and counted. An unreachable server still raises: this generator restarts.
        """
        try:
            return self.reward.score(prompts, responses, answers)
        except RewardFunctionError as err:
            log.error("reward function failed on %d responses; they get no reward (NaN): %s", len(responses), err)
            self.metrics.reward_failures.inc(len(responses))
            return [math.nan] * len(responses)

    def count(self, sampled: list, rewards: list[float], generate_s: float, reward_s: float) -> None:
        sequences = [s for seqs in sampled for s in seqs]
        self.metrics.prompts.inc(len(sampled))
        self.metrics.samples.inc(len(sequences))
        self.metrics.tokens.inc(sum(len(s.token_ids) for s in sequences))
        self.metrics.generate_seconds.inc(generate_s)
        self.metrics.reward_seconds.inc(reward_s)
        self.metrics.batch_size.observe(len(sequences))
        self.metrics.nonfinite_rewards.inc(sum(not math.isfinite(r) for r in rewards))


def _single_turn(s: SampledSequence) -> Sample:
    return Sample(token_ids=s.token_ids, logprobs=s.logprobs, is_end=s.is_end, text=s.text)


def _split_by_sampling(entries: list[tuple[str, Prompt]]) -> list[list[tuple[str, Prompt]]]:
    """Ready prompts as batches that sample alike: training prompts together, validation prompts by their
    (sample count, temperature)."""
    batches: dict[tuple, list[tuple[str, Prompt]]] = {}
    for entry in entries:
        p = entry[1]
        key = (p.kind, p.num_samples, p.temperature if p.HasField("temperature") else None)
        key = key if p.kind == PromptKind.VALIDATION else (PromptKind.TRAIN,)
        batches.setdefault(key, []).append(entry)
    return list(batches.values())


def control_plane(gen: Generator, token: str) -> FastAPI:
    """Probes and metrics are open; the weight endpoints demand `Authorization: Bearer <token>`. Paths and bodies:
    core/generator_api.py."""
    app = FastAPI(title=f"reinforce generator {gen.name}")
    authorized = bearer_dependency(token, "control token")
    count_requests(app, gen.metrics.http)

    def readiness() -> api.Readiness:
        return api.Readiness(ready=not gen.stopping.is_set(), weight_version=gen.weights.loaded)

    add_probes(app, gen.metrics.registry, readiness, api.Readiness)

    # the relay fields only from a generator that relays: a caller of an earlier release expects none
    @app.get(api.WEIGHTS_PATH, dependencies=[Depends(authorized)], response_model_exclude_unset=True)
    def get_weights() -> api.WeightsStatus:
        with gen.weights.lock:
            desired = gen.weights.desired.version if gen.weights.desired else None
            status = {"loaded_version": gen.weights.loaded, "loads": gen.weights.loads, "desired_version": desired}
            status["last_error"] = gen.weights.last_error
        if gen.relay is not None:  # where other generators fetch from this one (at its control address's host)
            status.update(relay_port=gen.relay.port, relay_version=gen.relay.held_version())
        return api.WeightsStatus(**status)

    # The body is read by hand, after `authorized` ran (FastAPI would parse a declared body parameter first),
    # and at most MAX_CONTROL_BODY_BYTES of it: no unauthenticated or oversized body is ever held in memory.
    @app.post(api.WEIGHTS_PATH, status_code=202, dependencies=[Depends(authorized)])
    async def post_weights(request: Request) -> api.LoadAccepted:
        body = await read_capped(request, api.MAX_CONTROL_BODY_BYTES)
        if body is None:
            raise HTTPException(413, f"a WeightVersion body is at most {api.MAX_CONTROL_BODY_BYTES} bytes")
        try:
            weights, relay_sources = api.parse_load_request(json.loads(body))
        except (ParseError, ValueError, TypeError, AttributeError) as err:  # ParseDict raises these for non-objects
            raise HTTPException(422, f"not a WeightVersion: {err}") from None
        try:
            await run_in_threadpool(gen.request_weights, weights, relay_sources)  # reads Redis: off the event loop
        except (NotPublished, WeightError) as err:
            raise HTTPException(409, str(err)) from None
        return api.LoadAccepted(accepted_version=weights.version)

    return app


def _same_record(a: WeightVersion, b: WeightVersion) -> bool:
    return (a.version, a.uri, a.sha256) == (b.version, b.uri, b.sha256)


def main(argv: list[str] | None = None) -> None:
    parser = GENERATOR.parser(__doc__.splitlines()[0])
    spec_file, args = GeneratorFlags.parse(parser, argv)
    token = os.environ.get(CONTROL_TOKEN_ENV)
    if not token:
        parser.error(f"${CONTROL_TOKEN_ENV} must hold the control plane's token")
    weights_token = os.environ.get(WEIGHTS_TOKEN_ENV, "")  # sent to --weights-url only
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.id} %(levelname)s %(message)s")
    torch.set_grad_enabled(False)
    configure_threads()
    environment = (args.environment_url, os.environ.get(ENVIRONMENT_TOKEN_ENV, "")) if args.environment_url else None
    gen = Generator(
        load_spec(spec_file), args.redis_url, args.reward_url, args.id, weights_token, args.weights_url, environment,
        relay_host=args.host,
    )  # fmt: skip
    config = uvicorn.Config(control_plane(gen, token), host=args.host, port=args.port, log_level="warning")
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    if args.metrics_port:  # in a pod: what Prometheus may reach, apart from the control plane
        start_http_server(args.metrics_port, addr=args.host, registry=gen.metrics.registry)
    signal.signal(signal.SIGTERM, lambda *_: gen.stopping.set())
    try:
        gen.run()
    finally:
        server.should_exit = True
        if gen.relay is not None:
            gen.relay.stop()
        shutil.rmtree(gen.weight_cache, ignore_errors=True)
