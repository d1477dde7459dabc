"""What every authenticated control plane (generator, critic, environment) shares: the bearer-token check, a
request body read with a size cap, one shape of error body, the open probes and the request metrics.

Each service's token comes from its own variable (names.CONTROL_TOKEN_ENV, CRITIC_TOKEN_ENV, ENVIRONMENT_TOKEN_ENV);
probes and metrics stay open. Every 4xx a handler answers is FastAPI's {"detail": ...}: raise HTTPException.
The token comparison and the error body are framework-free (bearer_matches, error_body): the weight endpoints, on the
standard library's http.server (core/weight_http.py), answer with the same two.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Callable
from typing import TypeVar

from fastapi import FastAPI, Header, HTTPException, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reinforce.core.metrics import RequestMetrics
from reinforce.core.names import HEALTH_PATH, METRICS_PATH, READY_PATH

Body = TypeVar("Body", bound=BaseModel)
Ready = TypeVar("Ready", bound=BaseModel)


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an Authorization header is exactly `Bearer <token>`, compared in constant time."""
    return authorization is not None and hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode())


def unauthorized_detail(what: str) -> str:
    """The detail of a 401: which credential was missing or wrong."""
    return f"missing or wrong {what}"


def error_body(detail: object) -> bytes:
    """An error answer's JSON body, FastAPI's shape: {"detail": ...}."""
    return json.dumps({"detail": detail}).encode()


def bearer_dependency(token: str, what: str = "bearer token") -> Callable[[str | None], None]:
    """A FastAPI dependency that answers 401 unless `Authorization: Bearer <token>` is sent (bearer_matches).

    Handlers that use it declare no body parameter, so FastAPI resolves it before anything reads the body: an
    unauthenticated client cannot make the service read (or buffer) a large upload.
    """

    def authorized(authorization: str | None = Header(default=None)) -> None:
        if not bearer_matches(authorization, token):
            raise HTTPException(status_code=401, detail=unauthorized_detail(what))

    return authorized


async def read_capped(request: Request, limit: int) -> bytes | None:
    """The request's body, or None as soon as it is known to exceed `limit` bytes (or declares no valid length): by
    Content-Length before reading, and by counting while reading (a chunked body has no length)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


async def read_body(request: Request, model: type[Body], max_bytes: int) -> Body:
    """The request's JSON body as `model`: 413 past max_bytes (see read_capped), 422 when it does not validate."""
    body = await read_capped(request, max_bytes)
    if body is None:
        raise HTTPException(status_code=413, detail=f"request body over {max_bytes} bytes")
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        # without the offending input: it may be inf, which a JSON answer cannot carry
        raise HTTPException(
            status_code=422, detail=json.loads(err.json(include_url=False, include_input=False))
        ) from None


def add_probes(app: FastAPI, registry: CollectorRegistry, ready: Callable[[], Ready], model: type[Ready]) -> None:
    """The open routes: GET HEALTH_PATH {"ok": true} while the process serves; GET READY_PATH `ready()`'s body, 503
    while its `ready` field is false; GET METRICS_PATH the registry in Prometheus's text format."""

    def healthz() -> dict:
        return {"ok": True}

    def readyz(response: Response) -> Ready:
        body = ready()
        response.status_code = 200 if getattr(body, "ready", True) else 503
        return body

    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route(HEALTH_PATH, healthz, methods=["GET"])
    app.add_api_route(READY_PATH, readyz, methods=["GET"], response_model=model)
    app.add_api_route(METRICS_PATH, metrics, methods=["GET"])


OTHER_ENDPOINT = "other"  # the endpoint label of every request that matched no route


def count_requests(app: FastAPI, metrics: RequestMetrics) -> None:
    """Count every request of `app` and time it, by route template and status code."""
    app.add_middleware(_CountRequests, metrics=metrics)


class _CountRequests:
    """Pure ASGI, not BaseHTTPMiddleware: the request body stays a stream the handler pulls chunk by chunk (read_capped
    stops pulling past its cap)."""

    def __init__(self, app: ASGIApp, metrics: RequestMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        code = 500  # an exception that escapes the app: Starlette answers 500

        async def send_and_note(message: Message) -> None:
            nonlocal code
            if message["type"] == "http.response.start":
                code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            # the matched route's template (the router notes it in the scope), so that ids in a path do not become
            # series; unknown paths share one label, so a scanner cannot blow up the series count
            endpoint = getattr(scope.get("route"), "path", OTHER_ENDPOINT)
            self.metrics.requests.labels(endpoint, str(code)).inc()
            self.metrics.seconds.labels(endpoint).observe(time.perf_counter() - start)
