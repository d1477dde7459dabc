"""The generator: a pull-based worker that samples k responses per prompt, scores them and pushes the group.

    python -m reinforce.generator --spec RUN_DIR/spec.yaml --redis-url URL --reward-url URL --port N --id NAME

Control plane (FastAPI, on --port): GET /healthz, GET /readyz, GET /metrics (Prometheus),
GET /v1/weights (loaded and desired version), POST /v1/weights (a WeightVersion as JSON: load it between
batches). A prompt that asks for a newer weight version than the loaded one waits, unacknowledged, until
that version is loaded; so every sample of a group comes from one version, which the group records.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, field

import torch
import uvicorn
from fastapi import FastAPI, Response
from google.protobuf.json_format import ParseDict, ParseError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from reinforce.core.metrics import GeneratorMetrics
from reinforce.core.models import load_policy, load_tokenizer
from reinforce.core.queue import RolloutQueue, connect
from reinforce.core.records_pb2 import Prompt, RolloutGroup, Sample, WeightVersion
from reinforce.core.reward_client import RewardClient
from reinforce.core.run_dir import RunPaths
from reinforce.core.sampling import sample
from reinforce.core.spec import RunSpec, load_spec
from reinforce.core.weights import WeightError, load_verified

log = logging.getLogger("reinforce.generator")


@dataclass
class WeightState:
    """What the control plane and the worker loop share, under one lock."""

    loaded: int = 0
    desired: WeightVersion | None = None
    last_error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)


class Generator:
    def __init__(self, spec: RunSpec, redis_url: str, reward_url: str, name: str) -> None:
        self.spec = spec
        self.name = name
        paths = RunPaths(spec.resolved_run_dir())
        self.tokenizer = load_tokenizer(paths.initial_policy)
        self.model = load_policy(paths.initial_policy)  # weight version 0
        self.queue = RolloutQueue(connect(redis_url), spec.name)
        self.queue.ensure_groups()
        self.reward = RewardClient.from_spec(reward_url, spec.reward)
        self.weights = WeightState()
        self.metrics = GeneratorMetrics()
        self.held: list[tuple[str, Prompt]] = []  # prompts waiting for a newer weight version
        self.stopping = threading.Event()

    # ---- weights -----------------------------------------------------------------------------------
    def request_weights(self, weights: WeightVersion) -> None:
        with self.weights.lock:
            if self.weights.desired is None or weights.version > self.weights.desired.version:
                self.weights.desired = weights

    def apply_desired_weights(self) -> None:
        """Between batches: load the desired version if it is newer; a bad file leaves the old one serving."""
        with self.weights.lock:
            desired = self.weights.desired
            if desired is None or desired.version <= self.weights.loaded:
                return
        start = time.perf_counter()
        try:
            load_verified(self.model, desired)
        except WeightError as err:
            log.error("refusing weights: %s", err)
            with self.weights.lock:
                self.weights.last_error = str(err)
                self.weights.desired = None  # wait for a new request rather than re-reading a bad file
            return
        self.metrics.weight_load_seconds.set(time.perf_counter() - start)
        self.metrics.weight_version.set(desired.version)
        with self.weights.lock:
            self.weights.loaded = desired.version
            self.weights.last_error = ""
        log.info("loaded weight version %d in %.2fs", desired.version, time.perf_counter() - start)

    # ---- work loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        self.reward.wait_ready(deadline_s=300)
        while not self.stopping.is_set():
            self.apply_desired_weights()
            # short blocks while prompts wait for weights, so a new version is picked up promptly
            block_ms = 20 if self.held else 200
            fresh = self.queue.read_prompts(self.name, count=self.spec.generation.batch_prompts, block_ms=block_ms)
            ready, self.held = self.split_by_version(self.held + fresh)
            if ready:
                self.process(ready)

    def split_by_version(self, entries: list[tuple[str, Prompt]]) -> tuple[list, list]:
        loaded = self.weights.loaded
        ready = [e for e in entries if e[1].policy_version <= loaded]
        waiting = [e for e in entries if e[1].policy_version > loaded]
        return ready, waiting

    def process(self, entries: list[tuple[str, Prompt]]) -> None:
        prompts = [p for _, p in entries]
        version = self.weights.loaded
        start = time.perf_counter()
        sampled = sample(
            self.model,
            self.tokenizer,
            [list(p.token_ids) for p in prompts],
            self.spec.algorithm.num_rollouts_per_prompt,
            self.spec.generation,
            [p.seed for p in prompts],
        )
        generate_seconds = time.perf_counter() - start
        start = time.perf_counter()
        texts = [s.text for seqs in sampled for s in seqs]
        rewards = self.reward.score([p.text for p, seqs in zip(prompts, sampled, strict=True) for _ in seqs], texts)
        reward_seconds = time.perf_counter() - start
        rewards_iter = iter(rewards)
        for (entry_id, prompt), seqs in zip(entries, sampled, strict=True):
            group = RolloutGroup(
                prompt_id=prompt.id,
                step=prompt.step,
                policy_version=version,
                prompt_text=prompt.text,
                prompt_token_ids=prompt.token_ids,
                generator_id=self.name,
                # each group's share of the batch's time, so a step's sum is the generators' busy time
                generate_seconds=generate_seconds / len(entries),
                reward_seconds=reward_seconds / len(entries),
                samples=[
                    Sample(
                        token_ids=s.token_ids,
                        logprobs=s.logprobs,
                        reward=next(rewards_iter),
                        is_end=s.is_end,
                        text=s.text,
                    )
                    for s in seqs
                ],
            )
            self.queue.put_rollout(group)
            self.queue.ack_prompts([entry_id])  # the group is on the stream: the prompt's work is durable
        self.count(sampled, rewards, generate_seconds, reward_seconds)

    def count(self, sampled: list, rewards: list[float], generate_s: float, reward_s: float) -> None:
        sequences = [s for seqs in sampled for s in seqs]
        self.metrics.prompts.inc(len(sampled))
        self.metrics.samples.inc(len(sequences))
        self.metrics.tokens.inc(sum(len(s.token_ids) for s in sequences))
        self.metrics.generate_seconds.inc(generate_s)
        self.metrics.reward_seconds.inc(reward_s)
        self.metrics.batch_size.observe(len(sequences))
        self.metrics.nonfinite_rewards.inc(sum(not math.isfinite(r) for r in rewards))


def control_plane(gen: Generator) -> FastAPI:
    app = FastAPI(title=f"reinforce generator {gen.name}")

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/readyz")
    def readyz(response: Response) -> dict:
        ready = not gen.stopping.is_set()
        response.status_code = 200 if ready else 503
        return {"ready": ready, "weight_version": gen.weights.loaded}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(gen.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/weights")
    def get_weights() -> dict:
        with gen.weights.lock:
            desired = gen.weights.desired.version if gen.weights.desired else None
            return {
                "loaded_version": gen.weights.loaded,
                "desired_version": desired,
                "last_error": gen.weights.last_error,
            }

    @app.post("/v1/weights", status_code=202)
    def post_weights(body: dict, response: Response) -> dict:
        try:
            weights = ParseDict(body, WeightVersion())
        except ParseError as err:
            response.status_code = 422
            return {"error": f"not a WeightVersion: {err}"}
        gen.request_weights(weights)
        return {"accepted_version": weights.version}

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m reinforce.generator", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="resolved run spec (RUN_DIR/spec.yaml)")
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--reward-url", required=True, help="Triton HTTP address of the reward server")
    parser.add_argument("--port", type=int, required=True, help="control plane port")
    parser.add_argument("--id", required=True, help="consumer name in the prompts stream's group")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.id} %(levelname)s %(message)s")
    torch.set_grad_enabled(False)
    gen = Generator(load_spec(args.spec), args.redis_url, args.reward_url, args.id)
    server = uvicorn.Server(uvicorn.Config(control_plane(gen), host="0.0.0.0", port=args.port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: gen.stopping.set())
    try:
        gen.run()
    finally:
        server.should_exit = True
