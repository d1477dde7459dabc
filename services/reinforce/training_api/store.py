"""Futures in Redis: every request that changes a model is accepted once per (model, seq_id), and its future, its
payload and its result live in Redis, not in this process.

    tinker:seq:MODEL:SEQ      the request id that (model, seq_id) was accepted as; create_model and a create-from-
                              state load_weights take seq 0 of the model they create
    tinker:request:ID         hash: model, seq_id, kind, body (the request as it came), encoding, status
                              (pending | done | failed), result and result_type (proto | json), or error and category
    tinker:queue              request ids accepted and not yet taken by the worker, in the order accepted
    tinker:running            the one the worker has taken and not finished
    tinker:session:ID         hash: created, heartbeat, finished (seconds since the epoch)

Accepting is one Lua script (atomic in Redis): the first request under (model, seq_id) stores its payload and joins
the queue; a retry (the SDK retries on lost responses and 5xx, with a new idempotency key each time) finds the
stored id and returns it, so it is applied once. The caller compares a retry's payload with the stored one, parsed,
and refuses another payload under a used seq_id with 409 naming both.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import redis
import redis.asyncio

PREFIX = "tinker:"
QUEUE = f"{PREFIX}queue"
RUNNING = f"{PREFIX}running"
POLL_S = 0.02  # how often a long poll looks at a pending request's status

# KEYS: seq key, request key, queue. ARGV: request id, model, seq_id, kind, body, encoding. Returns the id the
# (model, seq_id) pair is held by: ARGV[1] when this call accepted it.
_ACCEPT = """
local held = redis.call('GET', KEYS[1])
if held then return held end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], 'model', ARGV[2], 'seq_id', ARGV[3], 'kind', ARGV[4], 'body', ARGV[5],
           'encoding', ARGV[6], 'status', 'pending')
redis.call('RPUSH', KEYS[3], ARGV[1])
return ARGV[1]
"""


def seq_key(model_id: str, seq_id: int) -> str:
    return f"{PREFIX}seq:{model_id}:{seq_id}"


def request_key(request_id: str) -> str:
    return f"{PREFIX}request:{request_id}"


def session_key(session_id: str) -> str:
    return f"{PREFIX}session:{session_id}"


@dataclass(frozen=True)
class Stored:
    """A request as accepted."""

    request_id: str
    model_id: str
    seq_id: int
    kind: str
    body: bytes
    encoding: str  # the body's Content-Encoding ("" for none)


def _stored(request_id: str, fields: dict[bytes, bytes]) -> Stored:
    return Stored(
        request_id, fields[b"model"].decode(), int(fields[b"seq_id"]), fields[b"kind"].decode(), fields[b"body"],
        fields[b"encoding"].decode(),
    )  # fmt: skip


class FutureStore:
    """The server's side (asyncio)."""

    def __init__(self, url: str) -> None:
        self.redis = redis.asyncio.Redis.from_url(url)
        self._accept = self.redis.register_script(_ACCEPT)

    async def accept(
        self, model_id: str, seq_id: int, kind: str, body: bytes, encoding: str
    ) -> tuple[str, Stored | None]:
        """(this request's new id, None) when this call accepted it; else (the id (model_id, seq_id) was accepted
        as, that request)."""
        request_id = uuid.uuid4().hex
        keys = [seq_key(model_id, seq_id), request_key(request_id), QUEUE]
        held = (await self._accept(keys=keys, args=[request_id, model_id, seq_id, kind, body, encoding])).decode()
        if held == request_id:
            return request_id, None
        return held, _stored(held, await self.redis.hgetall(request_key(held)))

    async def created(self, model_id: str) -> bool:
        """Whether a request that creates `model_id` (its seq 0) was accepted."""
        return bool(await self.redis.exists(seq_key(model_id, 0)))

    async def retrieve(self, request_id: str, wait_s: float) -> dict[bytes, bytes] | None:
        """The request's hash once it is done or failed, or while pending after `wait_s`; None if unknown."""
        deadline = time.monotonic() + wait_s
        while True:
            fields = await self.redis.hgetall(request_key(request_id))
            if not fields or fields[b"status"] != b"pending" or time.monotonic() >= deadline:
                return fields or None
            await asyncio.sleep(POLL_S)

    async def open_session(self) -> str:
        session_id = f"session-{uuid.uuid4().hex}"
        now = time.time()
        await self.redis.hset(session_key(session_id), mapping={"created": now, "heartbeat": now})
        return session_id

    async def session(self, session_id: str) -> dict[bytes, bytes]:
        return await self.redis.hgetall(session_key(session_id))

    async def touch_session(self, session_id: str, field: str) -> None:
        await self.redis.hset(session_key(session_id), field, time.time())

    async def close(self) -> None:
        await self.redis.aclose()


class WorkQueue:
    """The worker's side (blocking)."""

    def __init__(self, url: str) -> None:
        self.redis = redis.Redis.from_url(url)

    def abandon_unfinished(self) -> int:
        """At start: fail every request a previous process accepted and did not finish (its models lived in that
        process's memory); how many."""
        ids = self.redis.lrange(RUNNING, 0, -1) + self.redis.lrange(QUEUE, 0, -1)
        for request_id in ids:
            self.fail(request_id.decode(), "the training API restarted before this request ran", "server")
        self.redis.delete(RUNNING, QUEUE)
        return len(ids)

    def next(self, timeout_s: float) -> Stored | None:
        """The oldest accepted request, moved to RUNNING (None after `timeout_s` without one)."""
        taken = self.redis.blmove(QUEUE, RUNNING, timeout_s, "LEFT", "RIGHT")
        if taken is None:
            return None
        request_id = taken.decode()
        return _stored(request_id, self.redis.hgetall(request_key(request_id)))

    def finish(self, request_id: str, result: bytes, result_type: str) -> None:
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(request_key(request_id), mapping={"status": "done", "result": result, "result_type": result_type})
            pipe.lrem(RUNNING, 0, request_id)
            pipe.execute()

    def fail(self, request_id: str, error: str, category: str) -> None:
        """category: the SDK's RequestErrorCategory, user (the request is wrong) or server."""
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(request_key(request_id), mapping={"status": "failed", "error": error, "category": category})
            pipe.lrem(RUNNING, 0, request_id)
            pipe.execute()
