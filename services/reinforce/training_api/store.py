"""Futures in Redis: every request that changes a model is accepted once per (model, seq_id), and its future, its
payload and its result live in Redis, not in this process.

    tinker:seq:MODEL:SEQ      the request id that (model, seq_id) was accepted as, or `refused` where the server
                              refused the request that named it (the worker does not wait for that seq_id);
                              create_model and a create-from-state load_weights take seq 0 of the model they create
    tinker:request:ID         hash: model, seq_id, kind, body (the request as it came), encoding, status
                              (pending | done | failed), result and result_type (proto | json), or error and category
    tinker:queue              request ids accepted and not yet taken by the worker, in the order accepted
    tinker:running            those the worker has taken and not finished (computing, or waiting for an earlier
                              seq_id of their model); at start they go back to the queue's head
    tinker:session:ID         hash: created, heartbeat, finished, expired (seconds since the epoch), and once
                              expired `expiry`, the error its models' requests get

Accepting is one Lua script (atomic in Redis): the first request under (model, seq_id) stores its payload and joins
the queue; a retry (the SDK retries on lost responses and 5xx, with a new idempotency key each time) finds the
stored id and returns it, so it is applied once. The caller compares a retry's payload with the stored one, parsed,
and refuses another payload under a used seq_id with 409 naming both. A request stays pending until the worker has
applied it and written its model's live snapshot (live.py), so after a crash every pending one is computed again,
and only those.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import redis
import redis.asyncio

from reinforce.training_api.live import Outcome

PREFIX = "tinker:"
QUEUE = f"{PREFIX}queue"
RUNNING = f"{PREFIX}running"
POLL_S = 0.02  # how often a long poll looks at a pending request's status
REFUSED = "refused"  # a seq key's value where the request that named it was refused before acceptance

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


def session_of(model_id: str) -> str:
    """The session a model (`SESSION:train:N`) belongs to."""
    return model_id.rsplit(":train:", 1)[0]


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
    status: str = "pending"  # as it was read: done or failed for one re-queued after it was finished


class SeqRefused(Exception):
    """A request under a seq_id whose first request was refused: a seq_id is used once."""


def _stored(request_id: str, fields: dict[bytes, bytes]) -> Stored:
    return Stored(
        request_id, fields[b"model"].decode(), int(fields[b"seq_id"]), fields[b"kind"].decode(), fields[b"body"],
        fields[b"encoding"].decode(), fields[b"status"].decode(),
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
        if held == REFUSED:
            raise SeqRefused(f"model {model_id} seq_id {seq_id} was refused before: a seq_id is used once")
        return held, _stored(held, await self.redis.hgetall(request_key(held)))

    async def refused(self, model_id: str, seq_id: int) -> None:
        """Record that a request naming (model_id, seq_id) was refused, so the worker does not wait for it (unless
        that seq_id was accepted already: then it is not a gap)."""
        await self.redis.set(seq_key(model_id, seq_id), REFUSED, nx=True)

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


# KEYS: running, queue. What a previous process had taken goes back to the queue's head, in the order it was taken;
# returns how many requests the queue then holds.
_REQUEUE = """
local running = redis.call('LRANGE', KEYS[1], 0, -1)
for i = #running, 1, -1 do redis.call('LPUSH', KEYS[2], running[i]) end
redis.call('DEL', KEYS[1])
return redis.call('LLEN', KEYS[2])
"""


class WorkQueue:
    """The worker's side (blocking)."""

    def __init__(self, url: str) -> None:
        self.redis = redis.Redis.from_url(url)
        self._requeue = self.redis.register_script(_REQUEUE)

    def requeue_unfinished(self) -> int:
        """At start: every request a previous process took and did not finish goes back to the queue (the worker
        puts each model's in seq_id order and skips those finished since); how many the queue then holds."""
        return int(self._requeue(keys=[RUNNING, QUEUE]))

    def status(self, request_id: str) -> str | None:
        status = self.redis.hget(request_key(request_id), "status")
        return None if status is None else status.decode()

    def held_by(self, model_id: str, seq_id: int) -> str | None:
        """The request id (model_id, seq_id) was accepted as, REFUSED, or None (nothing came under it)."""
        held = self.redis.get(seq_key(model_id, seq_id))
        return None if held is None else held.decode()

    def session_state(self, session_id: str) -> tuple[float | None, str | None]:
        """(the session's last sign of life, its heartbeat or else its creation; the error of its expiry, once it
        expired): (None, None) for an unknown session."""
        beat, created, expiry = self.redis.hmget(session_key(session_id), "heartbeat", "created", "expiry")
        alive = [float(value) for value in (beat, created) if value is not None]
        return (max(alive) if alive else None), (None if expiry is None else expiry.decode())

    def expire_session(self, session_id: str, message: str) -> None:
        self.redis.hset(session_key(session_id), mapping={"expired": time.time(), "expiry": message})

    def drop(self, request_id: str) -> None:
        """Forget a taken request finished before (re-queued at a start)."""
        self.redis.lrem(RUNNING, 0, request_id)

    def record(self, request_id: str, outcome: Outcome) -> None:
        if outcome.status == "done":
            self.finish(request_id, outcome.result, outcome.result_type)
        else:
            self.fail(request_id, outcome.error, outcome.category)

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
