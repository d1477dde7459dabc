"""The Tinker HTTP API as the `tinker` SDK (0.38.0) calls it: every route under /api/v1/, JSON bodies in the SDK's
own pydantic types (tinker/types), forward_backward as its protobuf (wire.py).

    GET  /api/v1/healthz                   {"status": "ok"} (open, as /healthz, /readyz and /metrics are)
    POST /api/v1/client/config             the SDK's flags: no JWT exchange (the API key is the credential)
    POST /api/v1/client/dynamic_config     404, which the SDK takes as "no dynamic flags"
    POST /api/v1/create_session            a session id; /api/v1/session_heartbeat keeps it (404 unknown, 410 finished)
    POST /api/v1/sessions/ID/finish        the session ends (ServiceClient.close)
    GET  /api/v1/get_server_capabilities   the one base model, trainable and sampleable
    POST /api/v1/create_model              a future: a LoRA model `SESSION:train:N` (tenants.py)
    POST /api/v1/get_info                  the base model's name and its tokenizer's folder (get_tokenizer loads it)
    POST /api/v1/forward_backward          a future (protobuf body; forward_only for `forward`)
    POST /api/v1/optim_step                a future: AdamW (AdamParams only)
    POST /api/v1/save_weights, load_weights  futures: tinker:// checkpoints (checkpoint.py)
    POST /api/v1/retrieve_future           a long poll: the result, {"type": "try_again", ...} while pending, or
                                           {"error": ..., "category": ...} for a failed request
    POST /api/v1/telemetry                 {"status": "accepted"} (not kept)
    ...  the routes of each extension main.py passes: sampling.py's (save_weights_for_sampler, sampling sessions,
         asample)

Every other route is refused at once with 400, a body naming the SDK method that calls it and saying this version
does not support it, and `x-should-retry: false`: the SDK retries 408, 409, 429 and 5xx (and a 400 without a
body) for minutes, so a refusal must be none of those. Requests that change a model are accepted once per
(model, seq_id) in Redis (store.py); a different payload under a used seq_id is refused with 409 naming both. The
worker applies each model's requests in seq_id order (worker.py), so a request refused here once its model and
seq_id are known is recorded as a gap it must not wait for. A request on a model of an expired session (no
heartbeat for --session-timeout-s) is refused with 410 naming the session.
Every /api/v1 route but healthz needs the API key in `X-API-Key`.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ValidationError
from tinker import types
from tinker.types.get_server_capabilities_response import SupportedModel
from tinker.types.try_again_response import TryAgainResponse  # not exported by tinker.types

from reinforce.core.http_kit import add_probes, count_requests, read_capped, unauthorized_detail
from reinforce.core.metrics import RequestMetrics
from reinforce.training_api.store import FutureStore, SeqRefused, Stored, session_of
from reinforce.training_api.tenants import Tenants, target_modules
from reinforce.training_api.wire import PROTOBUF, batch_of, parse_forward_backward, to_request

Body = TypeVar("Body", bound=BaseModel)

API = "/api/v1"
LONG_POLL_S = 30.0  # under the SDK's 45 s timeout of a retrieve_future call
MAX_BODY_BYTES = 64 * 2**20

# The SDK methods behind each route this version refuses, for the refusal's message.
UNSUPPORTED = {
    "retrieve_futures": "SamplingClient's session poller (client/config leaves it off)",
    "join_sampling_session": "SamplingClient (unpickled clone)",
    "save_weights_external": "TrainingClient.save_weights_external",
    "create_custom_loss": "ServiceClient.create_custom_loss",
    "copy_weights": "ServiceClient.copy_weights",
    "cancel_future": "SamplingClient (cancelling a sample)",
    "unload_model": "unload_model",
    "auth": "the SDK's JWT and API-key commands (client/config turns JWT off)",
    "weights_info": "RestClient.get_weights_info_by_tinker_path",
    "training_runs": "RestClient training-run and checkpoint methods",
    "checkpoints": "RestClient.list_user_checkpoints",
    "sessions": "RestClient session methods",
    "audit": "RestClient audit methods",
    "billing": "RestClient billing and storage-usage methods",
}


class ReadyResponse(BaseModel):
    ready: bool = True
    base_model: str


def unsupported(route: str) -> JSONResponse:
    first = route.split("/", 1)[0]
    method = UNSUPPORTED.get(first, f"the method that calls {API}/{route}")
    detail = f"{method} ({API}/{route}) is not supported in this version of the reinforce training API"
    return JSONResponse({"detail": detail}, status_code=400, headers={"x-should-retry": "false"})


def refuse(status: int, detail: str) -> HTTPException:
    """An error the SDK must not retry (it retries 408, 409, 429 and 5xx on its own)."""
    return HTTPException(status_code=status, detail=detail, headers={"x-should-retry": "false"})


async def read_body(request: Request) -> bytes:
    body = await read_capped(request, MAX_BODY_BYTES)
    if body is None:
        raise refuse(413, f"request body over {MAX_BODY_BYTES} bytes")
    return body


def parse(body: bytes, model: type[Body]) -> Body:
    """A JSON body as the SDK's type of it; 422 naming the fields that do not validate."""
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        raise refuse(422, f"{model.__name__}: {err.errors(include_url=False, include_input=False)}") from None


async def read_json(request: Request, model: type[Body]) -> Body:
    return parse(await read_body(request), model)


def stored_payload(held: Stored, kind: type[BaseModel] | type[Message]) -> BaseModel | Message:
    """A stored request's payload parsed as this one's; protobuf bytes are not canonical (map order), so payloads
    compare parsed, never as bytes."""
    if issubclass(kind, Message):
        return parse_forward_backward(held.body, held.encoding or None)
    return parse(held.body, kind)


def future(request_id: str, model_id: str) -> dict:
    return types.UntypedAPIFuture(request_id=request_id, model_id=model_id).model_dump(exclude_none=True)


Accept = Callable[[str, int | None, str, bytes, str, BaseModel | Message], Awaitable[dict]]
# Routes built on this module's helpers and the server's `accept` (which they cannot import: they import this).
Extension = Callable[[Tenants, FutureStore, Accept], APIRouter]


def create_app(tenants: Tenants, store: FutureStore, api_key: str, extensions: Sequence[Extension] = ()) -> FastAPI:
    app = FastAPI(title="reinforce training API (Tinker)")
    registry = CollectorRegistry()
    count_requests(app, RequestMetrics("training_api", registry))
    add_probes(app, registry, lambda: ReadyResponse(base_model=tenants.base_model), ReadyResponse)

    def authorized(x_api_key: str | None = Header(default=None)) -> None:
        if x_api_key is None or not hmac.compare_digest(x_api_key.encode(), api_key.encode()):
            raise refuse(401, unauthorized_detail("X-API-Key"))

    keyed = [Depends(authorized)]

    async def open_session(session_id: str) -> None:
        found = await store.session(session_id)
        if not found:
            raise refuse(404, f"session_id {session_id!r}: no such session")
        if b"expiry" in found:
            raise refuse(410, found[b"expiry"].decode())
        if b"finished" in found:
            raise refuse(410, f"session {session_id} has finished")

    async def gap(model_id: str, seq_id: int | None, status: int, detail: str) -> HTTPException:
        """The refusal of a request that names (model_id, seq_id), recorded so that the worker, which applies a
        model's requests in seq_id order, does not wait for it (seq 0, a model's creation, is never a gap)."""
        if seq_id:
            await store.refused(model_id, seq_id)
        return refuse(status, detail)

    async def accept(
        model_id: str, seq_id: int | None, kind: str, body: bytes, encoding: str, payload: BaseModel | Message
    ) -> dict:
        """The future of a request that changes `model_id`: a new one, or the one (model_id, seq_id) was accepted
        as where that one's payload, parsed, equals this one's `payload` (409 where it does not)."""
        if seq_id is None:
            raise refuse(400, f"{kind}: seq_id is required (every SDK request carries one)")
        try:
            request_id, held = await store.accept(model_id, seq_id, kind, body, encoding)
        except SeqRefused as err:
            raise refuse(409, f"{kind}: {err}") from None
        if held is None:
            return future(request_id, model_id)
        if held.kind != kind or stored_payload(held, type(payload)) != payload:
            raise refuse(
                409,
                f"model {model_id} seq_id {seq_id} was already accepted as {held.kind} request {held.request_id}, "
                f"and this {kind} request carries another payload: a seq_id is used once",
            )
        return future(held.request_id, model_id)

    async def existing(model_id: str) -> None:
        if not await store.created(model_id):
            raise refuse(404, f"model_id {model_id!r}: no such model")
        expiry = (await store.session(session_of(model_id))).get(b"expiry")
        if expiry is not None:  # its models were unloaded, their state saved
            raise refuse(410, expiry.decode())

    @app.get(f"{API}/healthz")
    async def healthz() -> dict:
        return types.HealthResponse(status="ok").model_dump()

    @app.post(f"{API}/client/config", dependencies=keyed)
    async def client_config(request: Request) -> dict:
        await read_json(request, types.ClientConfigRequest)
        # The server does not decompress zstd bodies by middleware, but wire.py reads them: either setting works.
        return types.ClientConfigResponse(pjwt_auth_enabled=False, proto_compress_fwdbwd=False).model_dump()

    @app.post(f"{API}/client/dynamic_config", dependencies=keyed)
    async def dynamic_config() -> Response:
        raise refuse(404, "no dynamic client config in this version")

    @app.post(f"{API}/create_session", dependencies=keyed)
    async def create_session(request: Request) -> dict:
        await read_json(request, types.CreateSessionRequest)
        return types.CreateSessionResponse(session_id=await store.open_session()).model_dump(exclude_none=True)

    @app.post(f"{API}/session_heartbeat", dependencies=keyed)
    async def session_heartbeat(request: Request) -> dict:
        beat = await read_json(request, types.SessionHeartbeatRequest)
        await open_session(beat.session_id)
        await store.touch_session(beat.session_id, "heartbeat")
        return types.SessionHeartbeatResponse().model_dump()

    @app.post(f"{API}/sessions/{{session_id}}/finish", dependencies=keyed)
    async def finish_session(session_id: str) -> dict:
        if not await store.session(session_id):
            raise refuse(404, f"session_id {session_id!r}: no such session")
        await store.touch_session(session_id, "finished")
        return {}

    @app.get(f"{API}/get_server_capabilities", dependencies=keyed)
    async def get_server_capabilities() -> dict:
        model = SupportedModel(
            model_name=tenants.base_model, max_context_length=tenants.max_context_length, trainable=True,
            sampleable=True,
        )  # fmt: skip
        return types.GetServerCapabilitiesResponse(supported_models=[model]).model_dump()

    def check_creation(base_model: str | None, optimizer: types.OptimizerConfig | None) -> None:
        if base_model is not None and base_model != tenants.base_model:
            raise refuse(400, f"base_model {base_model!r}: this server trains {tenants.base_model!r}")
        if optimizer is not None and optimizer.type != "adamw":
            raise refuse(400, f"optimizer_config {optimizer.type!r} is not supported in this version (adamw only)")

    @app.post(f"{API}/create_model", dependencies=keyed)
    async def create_model(request: Request) -> dict:
        body = await read_body(request)
        create = parse(body, types.CreateModelRequest)
        await open_session(create.session_id)
        check_creation(create.base_model, create.optimizer_config)
        if create.lora_config is None:
            raise refuse(400, "lora_config: full fine-tuning is not supported in this version; pass a LoRA rank")
        try:
            target_modules(create.lora_config)
        except ValueError as err:
            raise refuse(400, str(err)) from None
        model_id = f"{create.session_id}:train:{create.model_seq_id}"
        return await accept(model_id, 0, "create_model", body, "", create)

    @app.post(f"{API}/get_info", dependencies=keyed)
    async def get_info(request: Request) -> dict:
        ask = await read_json(request, types.GetInfoRequest)
        try:
            return tenants.info(ask.model_id).model_dump(exclude_none=True)
        except KeyError:
            raise refuse(404, f"model_id {ask.model_id!r}: no such model on this server") from None

    @app.post(f"{API}/forward_backward", dependencies=keyed)
    async def forward_backward(request: Request) -> dict:
        if PROTOBUF not in request.headers.get("content-type", ""):
            raise refuse(415, f"forward_backward takes a protobuf body ({PROTOBUF}), as the SDK sends since 0.25")
        body = await read_body(request)
        encoding = request.headers.get("content-encoding", "")
        try:
            message = parse_forward_backward(body, encoding or None)
        except ValueError as err:
            raise refuse(400, f"forward_backward: {err}") from None
        try:
            batch_of(to_request(message), message.forward_only, tenants.vocab_size)  # refused now, not in the queue
        except ValueError as err:
            raise await gap(message.model_id, message.seq_id, 400, f"forward_backward: {err}") from None
        await existing(message.model_id)
        return await accept(message.model_id, message.seq_id, "forward_backward", body, encoding, message)

    @app.post(f"{API}/optim_step", dependencies=keyed)
    async def optim_step(request: Request) -> dict:
        body = await read_body(request)
        step = parse(body, types.OptimStepRequest)
        if not isinstance(step.optim_params, types.AdamParams):
            detail = f"optim_params of type {step.optim_params.type!r}: only AdamParams in this version"
            raise await gap(step.model_id, step.seq_id, 400, detail)
        await existing(step.model_id)
        return await accept(step.model_id, step.seq_id, "optim_step", body, "", step)

    @app.post(f"{API}/save_weights", dependencies=keyed)
    async def save_weights(request: Request) -> dict:
        body = await read_body(request)
        save = parse(body, types.SaveWeightsRequest)
        if save.path is None:
            detail = "save_weights: path (the checkpoint's name) is required in this version"
            raise await gap(save.model_id, save.seq_id, 400, detail)
        await existing(save.model_id)
        return await accept(save.model_id, save.seq_id, "save_weights", body, "", save)

    @app.post(f"{API}/load_weights", dependencies=keyed)
    async def load_weights(request: Request) -> dict:
        body = await read_body(request)
        load = parse(body, types.LoadWeightsRequest)
        if load.session_id is not None:  # create_training_client_from_state*: the load creates the model (seq 0)
            if load.model_seq_id is None:
                raise refuse(400, "load_weights: session_id needs model_seq_id")
            await open_session(load.session_id)
            check_creation(load.base_model, load.optimizer_config)
            model_id = f"{load.session_id}:train:{load.model_seq_id}"
            return await accept(model_id, 0, "load_weights", body, "", load)
        if load.model_id is None:
            raise refuse(400, "load_weights: either model_id and seq_id, or session_id and model_seq_id")
        await existing(load.model_id)
        return await accept(load.model_id, load.seq_id, "load_weights", body, "", load)

    @app.post(f"{API}/retrieve_future", dependencies=keyed)
    async def retrieve_future(request: Request) -> Response:
        ask = await read_json(request, types.FutureRetrieveRequest)
        fields = await store.retrieve(ask.request_id, LONG_POLL_S)
        if fields is None:
            raise refuse(404, f"request_id {ask.request_id!r}: no such request")
        status = fields[b"status"]
        if status == b"pending":
            waiting = TryAgainResponse(request_id=ask.request_id, queue_state="active")
            return JSONResponse(waiting.model_dump())
        if status == b"failed":
            failure = types.RequestFailedResponse(
                error=fields[b"error"].decode(), category=types.RequestErrorCategory(fields[b"category"].decode())
            )
            return JSONResponse(failure.model_dump(mode="json"))
        media = PROTOBUF if fields[b"result_type"] == b"proto" else "application/json"
        return Response(fields[b"result"], media_type=media)

    @app.post(f"{API}/telemetry", dependencies=keyed)
    async def telemetry() -> dict:
        return types.TelemetryResponse(status="accepted").model_dump()

    for extension in extensions:  # before the catch-all below, which would answer their routes
        app.include_router(extension(tenants, store, accept), dependencies=keyed)

    @app.api_route(f"{API}/{{route:path}}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], dependencies=keyed)
    async def everything_else(route: str, request: Request) -> JSONResponse:
        await unsupported_gap(request)
        return unsupported(route)

    async def unsupported_gap(request: Request) -> None:
        """A refused TrainingClient method (save_weights_external) took a seq_id, and the SDK goes on after it."""
        try:
            body = json.loads(await read_body(request) or b"null")
        except (ValueError, HTTPException):
            return
        if isinstance(body, dict) and isinstance(body.get("model_id"), str) and isinstance(body.get("seq_id"), int):
            await gap(body["model_id"], body["seq_id"], 400, "")

    return app
