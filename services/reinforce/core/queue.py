"""The rollout queue: Redis Streams with consumer groups, namespaced by run.

Keys of run ``R`` (all deleted by :meth:`RolloutQueue.delete_run_keys`)::

    reinforce:R:prompts     stream, consumer group ``generators``: trainer -> generators
    reinforce:R:rollouts    stream, consumer group ``trainer``: generators -> trainer
    reinforce:R:validation  stream, consumer group ``trainer``: validation groups, generators -> trainer's main
                            rank (never the rollouts stream: a validation group can never be trained on)
    reinforce:R:weights     string: the latest published WeightVersion
    reinforce:R:deadletter  stream: entries that could not be decoded

Every entry holds one protobuf record under the field ``data`` (never pickle).

Delivery is at least once. Acknowledging an entry also deletes it (XACK + XDEL in one transaction):
each stream has exactly one consumer group, so an acked entry is never needed again, and deleting it
keeps a long run's memory bounded by what is in flight rather than by everything ever sent. Because a
dead generator's prompts are reclaimed by another (XAUTOCLAIM), the same prompt may be sampled twice;
the trainer drops duplicate rollout groups by ``prompt_id``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import redis
from google.protobuf.message import DecodeError, Message
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from reinforce.core.names import REDIS_URL_ENV
from reinforce.core.records_pb2 import Prompt, PromptKind, RelayPlan, RolloutGroup, WeightVersion

GENERATORS_GROUP = "generators"
TRAINER_GROUP = "trainer"
DATA_FIELD = b"data"
# A handed-back prompt looks idle this long (a year): longer than any generation.reclaim_idle_s, so any generator's
# next reclaim takes it. MAX_HANDED_BACK bounds one hand-back (a generator holds a few batches at most).
HANDED_BACK_IDLE_MS = 365 * 24 * 3600 * 1000
MAX_HANDED_BACK = 100_000

# A blocking read must return before the client's socket times out, or redis-py would raise (or retry
# and lose the entries the server already delivered into our pending list until they are reclaimed).
_BLOCK_MARGIN_MS = 1000
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
T = TypeVar("T")
# The field that names a record; an entry whose record lacks it is dead-lettered.
_IDENTITY = {"Prompt": "id", "RolloutGroup": "prompt_id"}


# Services read the Redis URL (it may carry a password) from this variable when --redis-url is not given.


def add_redis_url_argument(parser: argparse.ArgumentParser) -> None:
    """--redis-url, defaulting to $REINFORCE_REDIS_URL (which keeps a password off the command line)."""
    parser.add_argument(
        "--redis-url",
        default=os.environ.get(REDIS_URL_ENV),
        required=REDIS_URL_ENV not in os.environ,
        help=f"redis://[:PASSWORD@]HOST:PORT/DB (default: ${REDIS_URL_ENV})",
    )


def connect(
    url: str, socket_timeout: float = 30.0, max_outage_s: float = 60.0, stopping: threading.Event | None = None
) -> redis.Redis:
    """A client for ``redis://[[user]:password@]host:port/db`` that rides out Redis restarts.

    ``socket_timeout`` bounds every command; blocking reads of :class:`RolloutQueue` are shortened to
    fit inside it. Connection errors, timeouts and "loading the dataset" answers are retried with jittered
    back-off for up to ``max_outage_s`` (`queue.max_outage_s` of the spec): a Redis restart replaying its
    append-only file takes seconds, and a client that gave up sooner would take its whole service down. Once
    ``stopping`` is set (the process was told to stop) an outage is not waited out: Redis may be gone for good.
    Responses stay bytes: the records are binary protobuf.
    """
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=5.0,
        # Connections idle behind a NAT or a restarted server are checked before use, not found dead mid-read.
        health_check_interval=15,
        retry_on_timeout=True,
        retry=OutageRetry(max_outage_s, stopping),
        decode_responses=False,
    )


class OutageRetry(Retry):
    """redis-py's Retry bounded by time rather than by a count of attempts (whose total time depends on luck)."""

    def __init__(self, max_outage_s: float, stopping: threading.Event | None = None) -> None:
        super().__init__(ExponentialWithJitterBackoff(base=0.1, cap=2.0), retries=-1)
        self.max_outage_s = max_outage_s
        self.stopping = stopping or threading.Event()

    def __deepcopy__(self, memo: dict) -> OutageRetry:
        # redis-py copies its retry into every connection; the copies must share the process's one stop signal
        return OutageRetry(self.max_outage_s, self.stopping)

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        deadline = time.monotonic() + self.max_outage_s
        self._backoff.reset()
        failures = 0
        while True:
            try:
                return do()
            except self._supported_errors as error:
                # redis-py's AuthenticationError is a ConnectionError, but a wrong password does not heal with time
                if isinstance(error, redis.AuthenticationError) or (is_retryable and not is_retryable(error)):
                    raise
                failures += 1
                fail(error, failures) if with_failure_count else fail(error)
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping.is_set():
                    raise
                if failures == 1:
                    log.warning("Redis unreachable (%s); retrying for up to %.0f s", error, self.max_outage_s)
                self.stopping.wait(min(self._backoff.compute(failures), left))


class UnreadableRecord(ValueError):
    """A record stored under a plain key (not a stream entry, which is dead-lettered) that does not decode."""


class RolloutQueue:
    """Prompts out to generators, rollout groups back to the trainer, and the latest weight version."""

    def __init__(self, client: redis.Redis, run_name: str, max_record_bytes: int | None = None) -> None:
        """max_record_bytes: a larger entry is dead-lettered unparsed (the trainer sets it from the spec)."""
        if not _RUN_NAME.match(run_name):
            raise ValueError(f"run name {run_name!r} must be letters, digits, '.', '_' or '-'")
        kwargs = client.connection_pool.connection_kwargs
        if kwargs.get("decode_responses"):
            raise ValueError("the Redis client must not decode responses: records are binary protobuf")
        self.client = client
        self.run_name = run_name
        self.prefix = f"reinforce:{run_name}:"
        self.prompts_key = self.prefix + "prompts"
        self.rollouts_key = self.prefix + "rollouts"
        self.weights_key = self.prefix + "weights"
        self.relay_plan_key = self.prefix + "relay-plan"
        self.deadletter_key = self.prefix + "deadletter"
        self.validation_key = self.prefix + "validation"
        self._socket_timeout: float | None = kwargs.get("socket_timeout")
        self._published: bytes | None = None  # the record publish_weights wrote last
        self.max_record_bytes = max_record_bytes

    # --- setup and teardown -------------------------------------------------------------------------

    def ensure_groups(self) -> None:
        """Create both consumer groups (and their streams); safe to call from every process, any order."""
        for key, group in (
            (self.prompts_key, GENERATORS_GROUP),
            (self.rollouts_key, TRAINER_GROUP),
            (self.validation_key, TRAINER_GROUP),
        ):
            try:
                # From id 0, not $: entries added before the group existed must still be delivered.
                self.client.xgroup_create(key, group, id="0", mkstream=True)
            except redis.ResponseError as err:
                if "BUSYGROUP" not in str(err):
                    raise

    def delete_run_keys(self) -> int:
        """Delete every key of this run (including keys other components put under its prefix)."""
        pattern = _glob_escape(self.prefix) + "*"
        keys = list(self.client.scan_iter(match=pattern, count=500))
        return int(self.client.delete(*keys)) if keys else 0

    # --- prompts ------------------------------------------------------------------------------------

    def put_prompts(self, prompts: Sequence[Prompt]) -> list[str]:
        """Append prompts in order (one round trip); returns their entry ids."""
        pipe = self.client.pipeline(transaction=False)
        for prompt in prompts:
            pipe.xadd(self.prompts_key, {DATA_FIELD: prompt.SerializeToString()})
        return [_text(entry_id) for entry_id in pipe.execute()]

    def read_prompts(self, consumer: str, count: int, block_ms: int, pending: bool = False) -> list[tuple[str, Prompt]]:
        """Up to ``count`` prompts never delivered before; waits up to ``block_ms`` (0: do not wait).

        pending=True instead returns the prompts already delivered to ``consumer`` and not acknowledged:
        a restarted generator (same consumer name) picks up its own unfinished work first.
        """
        return self._read(self.prompts_key, GENERATORS_GROUP, consumer, count, block_ms, Prompt, pending)

    def ack_prompts(self, entry_ids: Iterable[str]) -> int:
        """Acknowledge (and delete) prompts; returns how many were still pending.

        Fewer than given means another consumer reclaimed and finished some of them meanwhile.
        """
        return self._ack(self.prompts_key, GENERATORS_GROUP, entry_ids)

    def reclaim_prompts(self, consumer: str, min_idle_ms: int, count: int) -> list[tuple[str, Prompt]]:
        """Take over up to ``count`` prompts delivered to any consumer but unacked for ``min_idle_ms``.

        This is how a dead generator's prompts get sampled by the living ones.
        """
        claimed: list[tuple[bytes, dict[bytes, bytes] | None]] = []
        cursor: bytes | str = "0-0"
        # One XAUTOCLAIM scans at most 10*count pending entries; continue until enough or the end.
        while len(claimed) < count:
            reply = self.client.xautoclaim(
                self.prompts_key,
                GENERATORS_GROUP,
                consumer,
                min_idle_time=min_idle_ms,
                start_id=cursor,
                count=count - len(claimed),
            )
            cursor, entries = reply[0], reply[1]
            claimed.extend(entries)
            if _text(cursor) == "0-0":
                break
        return self._decode_entries(self.prompts_key, GENERATORS_GROUP, claimed, Prompt)

    def hand_back_prompts(self, consumer: str) -> int:
        """Make every prompt delivered to ``consumer`` and not acknowledged claimable by the others at once: a
        generator told to stop. They stay pending (nothing is copied or lost), idle as a dead generator's would
        be after HANDED_BACK_IDLE_MS, so the next reclaim_prompts of any generator takes them. Returns how many."""
        pending = self.client.xpending_range(
            self.prompts_key, GENERATORS_GROUP, min="-", max="+", count=MAX_HANDED_BACK, consumername=consumer
        )
        ids = [entry["message_id"] for entry in pending]
        if ids:
            # JUSTID: ownership and idle time only, the delivery count stays (it counts real deliveries)
            self.client.xclaim(
                self.prompts_key, GENERATORS_GROUP, consumer, 0, ids, idle=HANDED_BACK_IDLE_MS, justid=True
            )
        return len(ids)

    # --- rollouts -----------------------------------------------------------------------------------

    def put_rollout(self, group: RolloutGroup) -> str:
        """A group onto the rollouts stream, or the validation stream for a VALIDATION prompt's group."""
        key = self.validation_key if group.kind == PromptKind.VALIDATION else self.rollouts_key
        return _text(self.client.xadd(key, {DATA_FIELD: group.SerializeToString()}))

    def read_rollouts(
        self, consumer: str, count: int, block_ms: int, pending: bool = False
    ) -> list[tuple[str, RolloutGroup]]:
        """Up to ``count`` rollout groups never delivered before; waits up to ``block_ms`` (0: no wait).

        pending=True: the groups already delivered to ``consumer`` and not acknowledged (see read_prompts).
        """
        return self._read(self.rollouts_key, TRAINER_GROUP, consumer, count, block_ms, RolloutGroup, pending)

    def ack_rollouts(self, entry_ids: Iterable[str]) -> int:
        return self._ack(self.rollouts_key, TRAINER_GROUP, entry_ids)

    def read_validation(
        self, consumer: str, count: int, block_ms: int, pending: bool = False
    ) -> list[tuple[str, RolloutGroup]]:
        """Validation groups (the trainer's main rank evaluates them; nothing trains on them)."""
        return self._read(self.validation_key, TRAINER_GROUP, consumer, count, block_ms, RolloutGroup, pending)

    def ack_validation(self, entry_ids: Iterable[str]) -> int:
        return self._ack(self.validation_key, TRAINER_GROUP, entry_ids)

    # --- weights ------------------------------------------------------------------------------------

    def publish_weights(self, weights: WeightVersion) -> None:
        """Make ``weights`` the latest version (last writer wins: the trainer is the only writer)."""
        record = weights.SerializeToString()
        self.client.set(self.weights_key, record)
        self._published = record

    def restore_published_weights(self) -> bool:
        """Put back what this queue published last if the key holds anything else (bytes that do not decode, another
        record); True if it did. The trainer calls it while it waits for groups: generators hold their prompts while
        the record is unreadable, and only its writer can end that wait."""
        if self._published is None or self.client.get(self.weights_key) == self._published:
            return False
        self.client.set(self.weights_key, self._published)
        log.warning("%s held something other than the published weight version: published again", self.weights_key)
        return True

    def latest_weights(self) -> WeightVersion | None:
        """The published version, None before the first; UnreadableRecord if the key holds bytes that do not decode
        (readers treat that like an outage: the trainer's next publish overwrites it)."""
        raw = self.client.get(self.weights_key)
        if raw is None:
            return None
        weights = WeightVersion()
        try:
            weights.ParseFromString(raw)
        except DecodeError as err:
            raise UnreadableRecord(
                f"{self.weights_key} holds {len(raw)} bytes that are not a WeightVersion: {err}"
            ) from err
        return weights

    def plan_relays(self, plan: RelayPlan) -> None:
        """Name the relays generators may fetch `plan.version` from (the weight reconciler is the only writer)."""
        self.client.set(self.relay_plan_key, plan.SerializeToString())

    def relay_plan(self) -> RelayPlan | None:
        """The reconciler's latest plan, None before the first or where the key holds bytes that do not decode (a
        generator then fetches from the trainer only)."""
        raw = self.client.get(self.relay_plan_key)
        if raw is None:
            return None
        plan = RelayPlan()
        try:
            plan.ParseFromString(raw)
        except DecodeError:
            return None
        return plan

    # --- metrics ------------------------------------------------------------------------------------

    def dead_letters(self) -> int:
        """How many entries were moved to the dead-letter stream."""
        return int(self.client.xlen(self.deadletter_key))

    def depths(self) -> dict[str, int]:
        """Queue depths for metrics.

        ``prompts``/``rollouts``: entries not yet acknowledged (``*_unread`` not yet delivered to any
        consumer plus ``*_pending`` delivered but unacked). Unread is the group's ``lag`` (Redis >= 7);
        where Redis cannot tell it, XLEN - pending, exact here because acked entries are deleted.
        """
        out: dict[str, int] = {}
        for name, key, group in (
            ("prompts", self.prompts_key, GENERATORS_GROUP),
            ("rollouts", self.rollouts_key, TRAINER_GROUP),
        ):
            unread, pending = self._group_depth(key, group)
            out[name] = unread + pending
            out[f"{name}_unread"] = unread
            out[f"{name}_pending"] = pending
        out["deadletter"] = self.dead_letters()
        return out

    # --- internals ----------------------------------------------------------------------------------

    def _group_depth(self, key: str, group: str) -> tuple[int, int]:
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(key)
        pipe.xinfo_groups(key)
        try:
            length, groups = pipe.execute()
        except redis.ResponseError:  # no stream yet: nothing queued
            return 0, 0
        info = next((g for g in groups if _text(g["name"]) == group), None)
        if info is None:
            return int(length), 0
        pending = int(info["pending"])
        lag = info.get("lag")
        unread = int(lag) if lag is not None else max(int(length) - pending, 0)
        return unread, pending

    def _block_ms(self, block_ms: int) -> int | None:
        """The BLOCK argument: None for no blocking (Redis's BLOCK 0 would wait forever)."""
        if block_ms <= 0:
            return None
        if self._socket_timeout is None:
            return block_ms
        limit_ms = int(self._socket_timeout * 1000)
        margin = min(_BLOCK_MARGIN_MS, limit_ms // 2)
        return max(min(block_ms, limit_ms - margin), 1)

    def _read(
        self, key: str, group: str, consumer: str, count: int, block_ms: int, cls: type[M], pending: bool
    ) -> list[tuple[str, M]]:
        # ">" asks for new entries; "0" for this consumer's delivered-but-unacknowledged ones (never blocks).
        start, block = ("0", None) if pending else (">", self._block_ms(block_ms))
        reply = self.client.xreadgroup(group, consumer, {key: start}, count=count, block=block)
        return self._decode_entries(key, group, _stream_entries(reply), cls)

    def _decode_entries(
        self, key: str, group: str, entries: Sequence[tuple[Any, Any]], cls: type[M]
    ) -> list[tuple[str, M]]:
        good: list[tuple[str, M]] = []
        for raw_id, fields in entries:
            entry_id = _text(raw_id)
            record, reason = _decode(fields, cls, self.max_record_bytes)
            if record is None:
                self._dead_letter(key, group, entry_id, reason, (fields or {}).get(DATA_FIELD, b""))
            else:
                good.append((entry_id, record))
        return good

    def dead_letter_group(self, entry_id: str, group: RolloutGroup, reason: str, validation: bool = False) -> None:
        """Move a group that decoded but cannot be used aside, with the reason, and acknowledge it; read from the
        rollouts stream, or with `validation` from the validation stream."""
        key = self.validation_key if validation else self.rollouts_key
        self._dead_letter(key, TRAINER_GROUP, entry_id, reason, group.SerializeToString())

    def _dead_letter(self, key: str, group: str, entry_id: str, reason: str, data: bytes) -> None:
        """Move a bad entry aside and ack it, atomically, so no reader ever sees it again."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.deadletter_key, {"stream": key, "entry_id": entry_id, "reason": reason, "data": data})
        pipe.xack(key, group, entry_id)
        pipe.xdel(key, entry_id)
        pipe.execute()

    def _ack(self, key: str, group: str, entry_ids: Iterable[str]) -> int:
        ids = list(entry_ids)
        if not ids:
            return 0
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(key, group, *ids)
        pipe.xdel(key, *ids)
        acked, _ = pipe.execute()
        return int(acked)


def _decode(fields: dict[bytes, bytes] | None, cls: type[M], max_bytes: int | None) -> tuple[M | None, str]:
    """The record in an entry, or None and why not."""
    if not fields or DATA_FIELD not in fields:
        return None, "missing 'data' field"
    if max_bytes is not None and len(fields[DATA_FIELD]) > max_bytes:
        return None, f"{cls.__name__} of {len(fields[DATA_FIELD])} bytes, more than this run's {max_bytes}"
    record = cls()
    try:
        record.ParseFromString(fields[DATA_FIELD])
    except DecodeError as err:
        return None, f"cannot decode {cls.__name__}: {err}"
    # Protobuf parses many byte strings (the empty one included) into a default message; a record
    # without its identity is as useless as an undecodable one.
    ident = _IDENTITY.get(cls.__name__)
    if ident and not getattr(record, ident):
        return None, f"{cls.__name__} has an empty {ident}"
    return record, ""


def _stream_entries(reply: Any) -> list[tuple[Any, Any]]:
    """The entries of a single-stream XREADGROUP reply: RESP2 [[key, entries]], RESP3 {key: [entries]}."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [tuple(entry) for batches in reply.values() for batch in batches for entry in batch]
    return [entry for _, entries in reply for entry in entries]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
