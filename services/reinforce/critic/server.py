"""The PPO critic as a service: values for the trainer's GAE, and the critic's own updates, in one process.

    python -m reinforce.critic --spec RUN_DIR/spec.yaml [--port N] [--host H] [--device D] [--metrics-port N]
        (the critic's bearer token comes from $REINFORCE_CRITIC_TOKEN, which only the trainer also holds)

The run spec's `critic` section says how the value model starts (from the initial policy or a reward model) and
trains (AdamW, value clipping, micro-batches); its checkpoints go to RUN_DIR/critic_checkpoints.

NeMo-Aligner's serve_ppo_critic.py (CriticServerTrainer) as a FastAPI service. NeMo-Aligner binds infer, train and
save as three PyTriton "models". FastAPI rather than Triton here: training and checkpointing are not inference.
They are ordered, stateful commands on one model and one optimizer that must never be batched together or run
beside a forward pass; a Triton Python-backend model serves stateless infer requests well but has no clean place
for an optimizer, its state, a lock ordering train against infer, or an atomic checkpoint and resume. Every other
control plane of this pipeline is FastAPI too (a bearer token, probes and Prometheus endpoint).

Endpoints (JSON bodies, see api.py; /v1/* need `Authorization: Bearer <token>`, checked before the body is read;
bodies are capped at critic.max_request_mb, and values and train requests at the rows and tokens per row the run's
trainer sends (413, naming the cap)):
    POST /v1/values      prompt and response token ids -> V(s_t) for every response token, the state before it is
                         emitted (the positions of response_logprobs)
    POST /v1/train       minibatches of token ids, returns and old values -> one AdamW step per minibatch (value-
                         clipped loss of ppo.critic_loss, gradient clipping), the losses
    POST /v1/checkpoint  {step}: model, optimizer and RNG into critic_checkpoints/step-NNNNNN/, atomically
    POST /v1/restore     {step}: load that checkpoint and move newer ones into critic_checkpoints/set-aside/ (a
                         trainer resuming from an earlier step than the critic's latest); step 0 without a
                         checkpoint: the fresh critic; 409 behind the trainer's newest checkpoint (where visible)
    GET  /healthz, /readyz, /metrics (Prometheus: reinforce_critic_*)
On start the service loads the latest checkpoint in its folder, so a restarted critic continues exactly.
One lock serialises everything that touches the model: a values request never sees half an optimizer step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from prometheus_client import start_http_server
from pydantic import BaseModel
from safetensors.torch import load_model, save_model
from starlette.concurrency import run_in_threadpool

from reinforce.core.checkpoints import (
    checkpoint_folder,
    checkpoint_step,
    commit_checkpoint,
    list_checkpoints,
    start_checkpoint,
)
from reinforce.core.critic_api import (
    CHECKPOINT_PATH,
    RESTORE_PATH,
    TRAIN_PATH,
    VALUES_PATH,
    CheckpointRequest,
    CheckpointResponse,
    Minibatch,
    MinibatchResult,
    ReadyResponse,
    TrainRequest,
    TrainResponse,
    ValuesRequest,
    ValuesResponse,
)
from reinforce.core.http_kit import add_probes, bearer_dependency, count_requests, read_body
from reinforce.core.launch import CRITIC
from reinforce.core.launch_flags import CriticFlags
from reinforce.core.metrics import CriticMetrics
from reinforce.core.names import CRITIC_PORT, CRITIC_TOKEN_ENV, LOCAL_HOST
from reinforce.core.optim import adamw
from reinforce.core.policy import materialize_policy
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import CriticSpec, RunSpec, load_spec
from reinforce.core.threads import configure_threads
from reinforce.critic.value_model import critic_loss, load_value_model, response_values

log = logging.getLogger("reinforce.critic")
# What each request cap is made of (CriticConfig.from_spec), named when a request is refused
ROWS_CAP = "training.prompts_per_step x algorithm.num_rollouts_per_prompt x algorithm.ppo_epochs"
ROW_TOKENS_CAP = "data.max_prompt_tokens + generation.max_new_tokens"


class RequestTooLarge(ValueError):
    """A request past the critic's caps (rows, tokens per row): answered 413."""


class RestoreRefused(ValueError):
    """A restore that would take the critic behind the trainer's newest checkpoint: answered 409."""


Body = TypeVar("Body", bound=BaseModel)


@dataclass(frozen=True)
class CriticConfig:
    """How the critic service runs: the run spec's `critic` section, and the folders, address and device."""

    model: Path  # Hugging Face folder: the policy (init policy) or a num_labels == 1 reward model (init reward_model)
    checkpoints: Path  # where /v1/checkpoint writes and where start-up resumes from
    critic: CriticSpec = field(default_factory=CriticSpec)
    keep_checkpoints: int = 2  # newest checkpoints kept (the trainer's training.keep_checkpoints)
    host: str = LOCAL_HOST  # loopback unless asked: the bearer token is the only authentication
    port: int = CRITIC_PORT
    seed: int = 0  # torch's RNG at start (dropout, if the model has any); a resume restores the saved state
    device: str = "cpu"
    # Request caps (None: none), refused with 413 before the model lock is taken: the run's trainer never sends more.
    max_rows: int | None = None  # sequences in one request (a train request's minibatches together)
    max_row_tokens: int | None = None  # prompt + response tokens of one sequence
    # The trainer's checkpoints (the run folder's): /v1/restore refuses to go behind the newest. None, or a folder
    # without checkpoints (the critic's pod on Kubernetes, whose volume is not the trainer's): not checked.
    trainer_checkpoints: Path | None = None

    @classmethod
    def from_spec(
        cls, spec: RunSpec, port: int = CRITIC_PORT, host: str = LOCAL_HOST, device: str = "cpu"
    ) -> CriticConfig:
        paths = RunPaths(spec.resolved_run_dir())
        c, alg = spec.critic, spec.algorithm
        model = paths.initial_policy if c.init == "policy" else Path(str(c.reward_model_path))
        return cls(
            model, paths.critic_checkpoints, c, spec.training.keep_checkpoints, host, port, spec.seed, device,
            max_rows=spec.training.prompts_per_step * alg.num_rollouts_per_prompt * alg.ppo_epochs,
            max_row_tokens=spec.data.max_prompt_tokens + spec.generation.max_new_tokens,
            trainer_checkpoints=paths.checkpoints,
        )  # fmt: skip


# ---- checkpoints -----------------------------------------------------------------------------------------------
# checkpoints/step-000010/
#     model.safetensors   value model (body and head)
#     optimizer.pt        AdamW state: tensors and numbers only, read back with torch.load(weights_only=True)
#     rng.pt              torch RNG state(s)
#     critic_state.json   {"step": ..., "train_steps": ...}
SET_ASIDE = "set-aside"  # checkpoints a restore went back past, kept for the user to inspect or delete


def save_checkpoint(
    root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_steps: int, keep: int
) -> Path:
    """Written and rotated as the trainer's are (core/checkpoints.py): a crash leaves the old checkpoints and no
    half-written one."""
    staging = start_checkpoint(root, step)
    save_model(model, str(staging / "model.safetensors"))
    torch.save(optimizer.state_dict(), staging / "optimizer.pt")
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, staging / "rng.pt")
    (staging / "critic_state.json").write_text(json.dumps({"step": step, "train_steps": train_steps}))
    return commit_checkpoint(staging, keep)


def set_aside(checkpoint: Path) -> Path:
    """Move a checkpoint folder into `set-aside/` beside it, under a name no other move can take; the new path."""
    target = checkpoint.parent / SET_ASIDE / f"{checkpoint.name}-{time.time_ns()}"
    target.parent.mkdir(exist_ok=True)
    os.replace(checkpoint, target)
    return target


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Restore model, optimizer and RNG exactly; returns critic_state.json."""
    load_model(model, str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    rng = torch.load(path / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return json.loads((path / "critic_state.json").read_text())


# ---- the critic ------------------------------------------------------------------------------------------------
def _chunks(n: int, size: int) -> list[slice]:
    return [slice(start, start + size) for start in range(0, n, size)]


def _padded(rows: list[list[float]], like: torch.Tensor) -> torch.Tensor:
    """Right-pad per-token floats to `like`'s [B, T]."""
    out = torch.zeros_like(like)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=like.dtype)
    return out


class Critic:
    """The value model, its AdamW, the step counters and the lock that serialises every use of them."""

    def __init__(self, config: CriticConfig, metrics: CriticMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or CriticMetrics()
        self.lock = threading.Lock()
        self._initialise()
        self.vocab_size = int(self.model.config.vocab_size)
        checkpoints = list_checkpoints(config.checkpoints)
        if checkpoints:
            self._load(checkpoint_step(checkpoints[-1]), checkpoints[-1])
            log.info("resumed from %s (%d optimizer steps)", checkpoints[-1], self.train_steps)

    def _initialise(self) -> None:
        """The value model, AdamW and counters as a fresh critic has them (the same bytes every time)."""
        c, optim = self.config, self.config.critic
        torch.manual_seed(c.seed)
        self.model = load_value_model(c.model, optim.init).to(c.device)
        self.optimizer = adamw(self.model.parameters(), optim.lr, optim.adam_betas, optim.weight_decay)
        self.train_steps = 0
        self.checkpoint_step: int | None = None
        self.metrics.train_steps.set(0)

    def _check_caps(self, requests: list[ValuesRequest]) -> None:
        """Refuse (RequestTooLarge) what the run's trainer never sends, before the lock: one request of 1.5M one-token
        rows held it for minutes."""
        c = self.config
        rows = sum(len(r.prompt_token_ids) for r in requests)
        if c.max_rows is not None and rows > c.max_rows:
            raise RequestTooLarge(f"{rows} rows, more than the cap of {c.max_rows} per request ({ROWS_CAP})")
        if c.max_row_tokens is None:
            return
        for request in requests:
            for i, (prompt, response) in enumerate(
                zip(request.prompt_token_ids, request.response_token_ids, strict=True)
            ):
                if len(prompt) + len(response) > c.max_row_tokens:
                    raise RequestTooLarge(
                        f"row {i} has {len(prompt) + len(response)} tokens, more than the cap of {c.max_row_tokens} "
                        f"per row ({ROW_TOKENS_CAP})"
                    )

    def _check_ids(self, request: ValuesRequest) -> None:
        # an id past the embedding table would fail deep inside the forward pass (a 500); say which row instead
        for name in ("prompt_token_ids", "response_token_ids"):
            for i, row in enumerate(getattr(request, name)):
                if row and max(row) >= self.vocab_size:
                    raise ValueError(f"{name}[{i}] holds id {max(row)}, past the vocabulary ({self.vocab_size})")

    def values(self, request: ValuesRequest) -> ValuesResponse:
        self._check_caps([request])
        self._check_ids(request)
        prompts, responses = request.prompt_token_ids, request.response_token_ids
        out: list[list[float]] = []
        with self.lock, torch.no_grad():
            for rows in _chunks(len(prompts), self.config.critic.micro_batch_size):
                values, _ = response_values(self.model, prompts[rows], responses[rows])
                out += [v[: len(r)].tolist() for v, r in zip(values.cpu(), responses[rows], strict=True)]
        return ValuesResponse(values=out)

    def train(self, request: TrainRequest) -> TrainResponse:
        self._check_caps(list(request.minibatches))
        for minibatch in request.minibatches:
            self._check_ids(minibatch)
        results: list[MinibatchResult] = []
        with self.lock:
            self.model.train()
            try:
                for minibatch in request.minibatches:
                    results.append(self._step(minibatch))
            except RuntimeError as err:
                raise RuntimeError(f"minibatch {len(results)}: {err} (the minibatches before it were applied)") from err
            finally:
                self.model.eval()
        return TrainResponse(
            critic_loss=sum(r.critic_loss for r in results) / len(results),
            grad_norm=sum(r.grad_norm for r in results) / len(results),
            minibatches=results,
            train_steps=self.train_steps,
        )

    def _step(self, minibatch: Minibatch) -> MinibatchResult:
        """One AdamW step on a minibatch, micro-batched; the loss is the minibatch's token mean."""
        c = self.config.critic
        prompts, responses = minibatch.prompt_token_ids, minibatch.response_token_ids
        num_tokens = sum(len(r) for r in responses)
        self.optimizer.zero_grad(set_to_none=True)
        loss, clipped_tokens = 0.0, 0.0
        for rows in _chunks(len(prompts), c.micro_batch_size):
            values, mask = response_values(self.model, prompts[rows], responses[rows])
            returns = _padded(minibatch.returns[rows], values)
            old_values = _padded(minibatch.old_values[rows], values)
            out = critic_loss(values, old_values, returns, mask, c.value_clip, num_tokens)
            out.loss.backward()
            loss += out.loss.item()
            clipped_tokens += out.clip_fraction.item() * float(mask.sum())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.max_grad_norm))
        if not math.isfinite(grad_norm):
            # stepping would write nan into every weight the optimizer touches, and into its moments
            self.optimizer.zero_grad(set_to_none=True)
            raise RuntimeError(f"non-finite critic gradient (norm {grad_norm}); its step was not applied")
        self.optimizer.step()
        self.train_steps += 1
        result = MinibatchResult(
            critic_loss=loss, grad_norm=grad_norm, value_clip_fraction=clipped_tokens / num_tokens, tokens=num_tokens
        )
        self.metrics.train_steps.set(self.train_steps)
        self.metrics.train_tokens.inc(num_tokens)
        self.metrics.loss.set(result.critic_loss)
        self.metrics.grad_norm.set(grad_norm)
        self.metrics.value_clip_fraction.set(result.value_clip_fraction)
        return result

    def save(self, step: int) -> CheckpointResponse:
        start = time.perf_counter()
        with self.lock:
            c = self.config
            path = save_checkpoint(
                c.checkpoints, step, self.model, self.optimizer, self.train_steps, c.keep_checkpoints
            )
            self.checkpoint_step = step
        self.metrics.checkpoint_step.set(step)
        self.metrics.checkpoint_seconds.set(time.perf_counter() - start)
        log.info("checkpoint %s", path)
        return CheckpointResponse(step=step, path=str(path), train_steps=self.train_steps)

    def restore(self, step: int) -> CheckpointResponse:
        """Load checkpoint `step` and move newer ones aside (never deleted): they belong to a history the trainer
        has abandoned, and a later restart must not resume from them. Step 0 without a checkpoint is the fresh critic
        (a trainer that starts over before its first checkpoint). Refused (RestoreRefused) when `step` is behind the
        trainer's newest checkpoint, which is where the trainer resumes from."""
        self._check_not_behind_trainer(step)
        root = self.config.checkpoints
        with self.lock:
            path = checkpoint_folder(root, step)
            if path.is_dir():
                self._load(step, path)
            elif step == 0:
                self._initialise()
            else:
                raise FileNotFoundError(f"no critic checkpoint for step {step} in {root}")
            for newer in list_checkpoints(root):
                if checkpoint_step(newer) > step:
                    log.warning("restored step %d: checkpoint %s moved aside to %s", step, newer, set_aside(newer))
        log.info("restored step %d", step)
        return CheckpointResponse(step=step, path=str(path), train_steps=self.train_steps)

    def _check_not_behind_trainer(self, step: int) -> None:
        folder = self.config.trainer_checkpoints
        trainer = list_checkpoints(folder) if folder is not None else []
        if trainer and step < checkpoint_step(trainer[-1]):
            raise RestoreRefused(
                f"step {step} is behind the trainer's newest checkpoint ({trainer[-1]}), where a resumed trainer "
                "starts: the critic stays where it is"
            )

    def _load(self, step: int, path: Path) -> None:
        state = load_checkpoint(path, self.model, self.optimizer)
        self.train_steps = int(state["train_steps"])
        self.checkpoint_step = step
        self.metrics.train_steps.set(self.train_steps)
        self.metrics.checkpoint_step.set(step)

    def ready(self) -> ReadyResponse:
        return ReadyResponse(ready=True, train_steps=self.train_steps, checkpoint_step=self.checkpoint_step)


# ---- HTTP ------------------------------------------------------------------------------------------------------
async def _call(fn: Callable[[Body], BaseModel], body: Body) -> dict:
    """Run a model-touching call off the event loop (probes stay answerable during a long train request)."""
    try:
        return (await run_in_threadpool(fn, body)).model_dump()
    except RequestTooLarge as err:
        raise HTTPException(status_code=413, detail=str(err)) from None
    except RestoreRefused as err:
        raise HTTPException(status_code=409, detail=str(err)) from None
    except ValueError as err:
        raise HTTPException(status_code=422, detail=str(err)) from None
    except FileNotFoundError as err:
        raise HTTPException(status_code=404, detail=str(err)) from None
    except RuntimeError as err:  # a refused step: say why rather than a bare 500
        raise HTTPException(status_code=500, detail=str(err)) from None


def create_app(critic: Critic, token: str) -> FastAPI:
    """Probes and metrics are open; /v1/* demand `Authorization: Bearer <token>`."""
    app = FastAPI(title="reinforce critic")
    max_bytes = int(critic.config.critic.max_request_mb * 2**20)
    authorized = bearer_dependency(token)

    count_requests(app, critic.metrics.http)
    # The service starts listening only after the model is loaded and resumed: answering means ready.
    add_probes(app, critic.metrics.registry, critic.ready, ReadyResponse)

    @app.post(VALUES_PATH, dependencies=[Depends(authorized)])
    async def values(request: Request) -> dict:
        return await _call(critic.values, await read_body(request, ValuesRequest, max_bytes))

    @app.post(TRAIN_PATH, dependencies=[Depends(authorized)])
    async def train(request: Request) -> dict:
        return await _call(critic.train, await read_body(request, TrainRequest, max_bytes))

    @app.post(CHECKPOINT_PATH, dependencies=[Depends(authorized)])
    async def checkpoint(request: Request) -> dict:
        body = await read_body(request, CheckpointRequest, max_bytes)
        return await _call(lambda b: critic.save(b.step), body)

    @app.post(RESTORE_PATH, dependencies=[Depends(authorized)])
    async def restore(request: Request) -> dict:
        body = await read_body(request, CheckpointRequest, max_bytes)
        return await _call(lambda b: critic.restore(b.step), body)

    return app


# ---- command line ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    spec_file, args = CriticFlags.parse(CRITIC.parser(__doc__.splitlines()[0]), argv)
    token = os.environ.get(CRITIC_TOKEN_ENV)
    if not token:
        raise SystemExit(f"${CRITIC_TOKEN_ENV} must hold the critic's bearer token")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s critic %(levelname)s %(message)s")
    configure_threads()
    spec = load_spec(spec_file)
    config = CriticConfig.from_spec(spec, args.port, args.host, args.device)
    if spec.critic.init == "policy":
        # A pod has no supervisor to prepare it (locally this finds the supervisor's folder and returns).
        materialize_policy(spec.policy, config.model, spec.seed)
    critic = Critic(config)  # loads the model and resumes before the port opens: answering /readyz means ready
    if args.metrics_port:  # in a pod: what Prometheus may reach, apart from the API
        start_http_server(args.metrics_port, addr=config.host, registry=critic.metrics.registry)
    uvicorn.run(create_app(critic, token), host=config.host, port=config.port, log_level="warning")
