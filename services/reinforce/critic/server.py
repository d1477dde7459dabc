"""The critic's HTTP API: NeMo-Aligner's serve_ppo_critic.py (CriticServerTrainer) as a FastAPI app.

NeMo-Aligner binds infer, train and save as three PyTriton "models". FastAPI rather than Triton here: training and
checkpointing are not inference. They are ordered, stateful commands on one model and one optimizer that must never be
batched together or run beside a forward pass; a Triton Python-backend model serves stateless infer requests well but
has no clean place for an optimizer, its state, a lock ordering train against infer, or an atomic checkpoint and
resume. Every other control plane of this pipeline is FastAPI too (core/http_kit.py: a bearer token, probes and
Prometheus endpoint).

Endpoints (JSON bodies, see core/critic_api.py; /v1/* need `Authorization: Bearer <token>`, checked before the body is
read; bodies are capped at critic.max_request_mb, and values and train requests at the rows and tokens per row the
run's trainer sends (413, naming the cap; checks.py)):
    POST /v1/values      prompt and response token ids -> V(s_t) for every response token, the state before it is
                         emitted (the positions of response_logprobs)
    POST /v1/train       minibatches of token ids, returns and old values -> one AdamW step per minibatch (value-
                         clipped loss of ppo.critic_loss, gradient clipping), the losses
    POST /v1/checkpoint  {step}: model, optimizer and RNG into critic_checkpoints/step-NNNNNN/, atomically
    POST /v1/restore     {step}: load that checkpoint and move newer ones into critic_checkpoints/set-aside/ (a
                         trainer resuming from an earlier step than the critic's latest); step 0 without a
                         checkpoint: the fresh critic; 409 behind the trainer's newest checkpoint (where visible)
    GET  /healthz, /readyz, /metrics (Prometheus: reinforce_critic_*)
One lock (critic.py's Critic) serialises everything that touches the model: a values request never sees half an
optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from reinforce.core.critic_api import (
    CHECKPOINT_PATH,
    RESTORE_PATH,
    TRAIN_PATH,
    VALUES_PATH,
    CheckpointRequest,
    ReadyResponse,
    TrainRequest,
    ValuesRequest,
)
from reinforce.core.http_kit import add_probes, bearer_dependency, count_requests, read_body
from reinforce.critic.checks import RequestTooLarge
from reinforce.critic.critic import Critic, RestoreRefused

Body = TypeVar("Body", bound=BaseModel)

# The status each refusal of the critic is answered with; the first match in this order wins (RequestTooLarge and
# RestoreRefused are ValueErrors too).
_STATUS: tuple[tuple[type[Exception], int], ...] = (
    (RequestTooLarge, 413),
    (RestoreRefused, 409),
    (ValueError, 422),
    (FileNotFoundError, 404),
    (RuntimeError, 500),  # a refused step: say why rather than a bare 500
)


async def _call(fn: Callable[[Body], BaseModel], body: Body) -> dict:
    """Run a model-touching call off the event loop (probes stay answerable during a long train request)."""
    try:
        return (await run_in_threadpool(fn, body)).model_dump()
    except tuple(error for error, _ in _STATUS) as err:
        status = next(code for error, code in _STATUS if isinstance(err, error))
        raise HTTPException(status_code=status, detail=str(err)) from None


def create_app(critic: Critic, token: str) -> FastAPI:
    """Probes and metrics are open; /v1/* demand `Authorization: Bearer <token>`."""
    app = FastAPI(title="reinforce critic")
    max_bytes = int(critic.config.critic.max_request_mb * 2**20)
    authorized = [Depends(bearer_dependency(token))]

    count_requests(app, critic.metrics.http)
    # The service starts listening only after the model is loaded and resumed: answering means ready.
    add_probes(app, critic.metrics.registry, critic.ready, ReadyResponse)

    @app.post(VALUES_PATH, dependencies=authorized)
    async def values(request: Request) -> dict:
        return await _call(critic.values, await read_body(request, ValuesRequest, max_bytes))

    @app.post(TRAIN_PATH, dependencies=authorized)
    async def train(request: Request) -> dict:
        return await _call(critic.train, await read_body(request, TrainRequest, max_bytes))

    @app.post(CHECKPOINT_PATH, dependencies=authorized)
    async def checkpoint(request: Request) -> dict:
        body = await read_body(request, CheckpointRequest, max_bytes)
        return await _call(lambda b: critic.save(b.step), body)

    @app.post(RESTORE_PATH, dependencies=authorized)
    async def restore(request: Request) -> dict:
        body = await read_body(request, CheckpointRequest, max_bytes)
        return await _call(lambda b: critic.restore(b.step), body)

    return app
