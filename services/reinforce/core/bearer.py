"""What every authenticated control plane (generator, critic, environment) shares: the bearer-token check and a
request body read with a size cap.

The token comes from $REINFORCE_CONTROL_TOKEN (names.CONTROL_TOKEN_ENV); probes and metrics stay open.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import TypeVar

from fastapi import Header, HTTPException, Request
from pydantic import BaseModel, ValidationError

Body = TypeVar("Body", bound=BaseModel)


def bearer_dependency(token: str, what: str = "bearer token") -> Callable[[str | None], None]:
    """A FastAPI dependency that answers 401 unless `Authorization: Bearer <token>` is sent.

    Handlers that use it declare no body parameter, so FastAPI resolves it before anything reads the body: an
    unauthenticated client cannot make the service read (or buffer) a large upload. Constant-time comparison.
    """
    expected = f"Bearer {token}".encode()

    def authorized(authorization: str | None = Header(default=None)) -> None:
        if authorization is None or not hmac.compare_digest(authorization.encode(), expected):
            raise HTTPException(status_code=401, detail=f"missing or wrong {what}")

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
