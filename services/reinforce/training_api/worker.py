"""The worker: one thread that applies accepted requests to their models (tenants.py) and stores each one's result
or failure in Redis for retrieve_future.

Order. Each model's requests are applied in seq_id order (the SDK numbers a training client's requests from 1;
create_model and a create-from-state load_weights are seq 0): a request taken from the queue before its
predecessor waits (in memory, and in tinker:running) until that one has come and been applied. So optim_step and
load_weights are barriers: nothing after them runs before them, nothing before them after. The chunks of one large
forward_backward, which the SDK sends in parallel with the first chunk last, add their gradients in seq_id order:
the same float sum every time. The worker goes past a seq_id that will not come: one whose request the server
refused (recorded in Redis, store.py), one applied before a restart (a model whose creation failed has no snapshot
to say so), or, after GAP_WAIT_S, one nothing was accepted under (a raw client that skipped it); a request that
comes later under it fails. asample only reads an immutable snapshot: it runs as it comes.

Durability. After each request applied to a model, done or failed, the model's live snapshot (live.py) is written,
then its outcome recorded in Redis. At start, `recover` loads every live snapshot, records the outcome of a
snapshot's request where the crash came between the two writes, and puts every request taken and not finished back
on the queue: each pending one after its model's snapshot is then computed once, in order, and none before it.

Sessions. A session with no heartbeat for session_timeout_s (counted from the later of its last heartbeat and this
process's start: a restart is no client's silence) expires: each of its models is saved as the checkpoint
`session-expired`, marked expired in its live snapshot and unloaded, and its requests fail naming the session.

One thread computes everything: the base model is shared, and on CPU a second computing thread would only contend
for the cores.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from tinker import types

from reinforce.core.names import TRAINING_API_SESSION_TIMEOUT_S
from reinforce.training_api import live
from reinforce.training_api.live import Outcome
from reinforce.training_api.sampling import KINDS as SAMPLING_KINDS
from reinforce.training_api.sampling import Sampler
from reinforce.training_api.store import REFUSED, Stored, WorkQueue, session_of
from reinforce.training_api.tenants import Tenants
from reinforce.training_api.wire import batch_of, encode_output, parse_forward_backward, to_request

log = logging.getLogger(__name__)

GAP_WAIT_S = 60.0  # how long a model waits for a seq_id nothing was accepted under
TICK_S = 0.2  # how long the worker waits for a request before it looks at gaps and sessions
EXPIRY_CHECK_S = 1.0
EXPIRED_CHECKPOINT = "session-expired"
UNORDERED = ("asample",)  # reads a sampler snapshot, changes nothing


@dataclass(frozen=True)
class Applied:
    outcome: Outcome
    changed: bool  # whether it may have changed the model's tensors (False: its live snapshot keeps its tensors)


def _json(result: types.BaseModel, changed: bool) -> Applied:
    return Applied(Outcome.done(result.model_dump_json().encode(), "json"), changed)


def apply(tenants: Tenants, sampler: Sampler, request: Stored) -> Applied:
    """What one accepted request came to; ValueError where the client's request cannot be applied."""
    if request.kind in SAMPLING_KINDS:
        result, result_type = sampler.apply(request)
        return Applied(Outcome.done(result, result_type), changed=False)
    if request.kind == "forward_backward":
        message = parse_forward_backward(request.body, request.encoding or None)
        batch = batch_of(to_request(message), message.forward_only, tenants.vocab_size)
        logprobs, loss = tenants.forward_backward(request.model_id, batch)
        return Applied(Outcome.done(encode_output(logprobs, loss), "proto"), changed=not message.forward_only)
    if request.kind == "optim_step":
        params = types.OptimStepRequest.model_validate_json(request.body).optim_params
        assert isinstance(params, types.AdamParams)  # the server accepts no other
        return _json(types.OptimStepResponse(metrics=tenants.optim_step(request.model_id, params)), True)
    if request.kind == "create_model":
        create = types.CreateModelRequest.model_validate_json(request.body)
        assert create.lora_config is not None  # the server accepts no full fine-tuning
        tenants.create(request.model_id, create.lora_config)
        return _json(types.CreateModelResponse(model_id=request.model_id), True)
    if request.kind == "save_weights":
        save = types.SaveWeightsRequest.model_validate_json(request.body)
        assert save.path is not None  # the server names one where the client gives none
        path = tenants.save(request.model_id, save.path, save.overwrite, request.request_id)
        return _json(types.SaveWeightsResponse(path=path, type="save_weights"), False)
    if request.kind == "load_weights":
        load = types.LoadWeightsRequest.model_validate_json(request.body)
        tenants.load(request.model_id, load.path, load.optimizer, create=load.session_id is not None)
        return _json(types.LoadWeightsResponse(path=load.path, model_id=request.model_id, type="load_weights"), True)
    raise AssertionError(f"the server accepted a request of kind {request.kind!r}")


def attempt(tenants: Tenants, sampler: Sampler, request: Stored) -> Applied:
    """`apply`, a failure included: the client hears of it (a bug's trace goes to the log)."""
    try:
        return apply(tenants, sampler, request)
    except ValueError as err:
        return Applied(Outcome.failed(str(err), "user"), changed=True)
    except Exception as err:  # a bug or a broken machine
        log.exception("%s %s of model %s failed", request.kind, request.request_id, request.model_id)
        return Applied(Outcome.failed(f"{type(err).__name__}: {err}", "server"), changed=True)


@dataclass
class Recovered:
    """What a start found: each model's next seq_id, the expired ones (model -> its error), how many requests wait
    on the queue (those re-queued included)."""

    next_seq: dict[str, int] = field(default_factory=dict)
    expired: dict[str, str] = field(default_factory=dict)
    requeued: int = 0


def recover(tenants: Tenants, queue: WorkQueue) -> Recovered:
    """At start, before the worker runs: every model back as its live snapshot has it, the outcome of a snapshot's
    request recorded where the crash came before Redis heard of it, and every request taken and not finished back
    on the queue."""
    live.remove_temporaries(tenants.checkpoints)
    found = Recovered()
    for snapshot in live.snapshots(tenants.checkpoints):
        found.next_seq[snapshot.model_id] = snapshot.seq_id + 1
        if snapshot.expired is not None:
            found.expired[snapshot.model_id] = snapshot.expired
        else:
            tenants.restore(snapshot.model_id, snapshot.state)
        if queue.status(snapshot.request_id) == "pending":
            queue.record(snapshot.request_id, snapshot.outcome)
    found.requeued = queue.requeue_unfinished()
    return found


class Worker(threading.Thread):
    def __init__(
        self, tenants: Tenants, queue: WorkQueue, session_timeout_s: float = TRAINING_API_SESSION_TIMEOUT_S,
        recovered: Recovered | None = None,
    ) -> None:  # fmt: skip
        super().__init__(name="training-api-worker", daemon=True)
        self.tenants = tenants
        self.sampler = Sampler(tenants)  # shares the tenants' model, so it runs on this thread only
        self.queue = queue
        self.session_timeout_s = session_timeout_s
        recovered = recovered or Recovered()
        self.next_seq = dict(recovered.next_seq)  # model -> the seq_id it applies next
        self.expired = dict(recovered.expired)  # model -> the error its requests get
        self.waiting: dict[str, dict[int, Stored]] = {}  # model -> requests taken before their predecessors
        self.blocked_since: dict[str, float] = {}  # model -> when it began to wait for its next seq_id
        self.started = time.time()
        self.last_expiry_check = 0.0
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self.step(TICK_S)
        except BaseException:  # Redis or the disk gone: exit so the supervisor restarts the API, never hang
            log.exception("the worker failed; exiting")
            os._exit(1)

    def step(self, timeout_s: float) -> None:
        """One turn: take a request (waiting up to timeout_s) and apply what is ready, go past gaps that will not
        fill, expire silent sessions."""
        request = self.queue.next(timeout_s)
        if request is not None:
            self.arrive(request)
        for model in list(self.blocked_since):
            self.drain(model)
        self.expire_sessions()

    def arrive(self, request: Stored) -> None:
        if request.status != "pending":  # finished before a restart, and re-queued with the unfinished
            self.queue.drop(request.request_id)
        elif request.kind in UNORDERED:
            self.compute(request)
        elif request.model_id in self.expired:
            self.queue.fail(request.request_id, self.expired[request.model_id], "user")
        elif request.seq_id < (expected := self.next_seq.get(request.model_id, 0)):
            detail = (
                f"model {request.model_id} seq_id {request.seq_id} came after seq_id {expected - 1} was applied "
                f"(the server waited {GAP_WAIT_S:g} s for it and went on)"
            )
            self.queue.fail(request.request_id, detail, "user")
        else:
            self.waiting.setdefault(request.model_id, {})[request.seq_id] = request
            self.drain(request.model_id)

    def drain(self, model_id: str) -> None:
        """Apply the model's waiting requests while the next one in seq_id order is there (or will never come)."""
        waiting = self.waiting.get(model_id, {})
        while waiting:
            expected = self.next_seq.get(model_id, 0)
            request = waiting.pop(expected, None)
            if request is not None:
                self.compute(request)
            elif self._passable(model_id, expected):
                log.warning("model %s: seq_id %d will not come; applying the next", model_id, expected)
                self.next_seq[model_id] = expected + 1
            else:
                self.blocked_since.setdefault(model_id, time.monotonic())
                return
            self.blocked_since.pop(model_id, None)
        self.waiting.pop(model_id, None)
        self.blocked_since.pop(model_id, None)

    def _passable(self, model_id: str, seq_id: int) -> bool:
        """Whether a seq_id that has not come will never come."""
        held = self.queue.held_by(model_id, seq_id)
        if held == REFUSED:
            return True
        if held is None:
            return time.monotonic() - self.blocked_since.get(model_id, time.monotonic()) > GAP_WAIT_S
        return self.queue.status(held) not in ("pending", None)

    def compute(self, request: Stored) -> None:
        applied = attempt(self.tenants, self.sampler, request)
        if request.kind not in UNORDERED:
            self.next_seq[request.model_id] = request.seq_id + 1
            self.persist(request, applied)
        self.queue.record(request.request_id, applied.outcome)

    def persist(self, request: Stored, applied: Applied) -> None:
        """The model's live snapshot after `request`, before Redis records its outcome (live.py says why)."""
        if request.model_id not in self.tenants.tenants:  # its creation failed: there is no state
            return
        state = self.tenants.capture(request.model_id)
        snapshot = live.Snapshot(request.model_id, request.seq_id, request.request_id, applied.outcome, state)
        live.write(self.tenants.checkpoints, snapshot, tensors_changed=applied.changed)

    def expire_sessions(self) -> None:
        now = time.time()
        if now - self.last_expiry_check < EXPIRY_CHECK_S:
            return
        self.last_expiry_check = now
        for session_id in sorted({session_of(model_id) for model_id in self.tenants.tenants}):
            beat, expiry = self.queue.session_state(session_id)
            silent = beat is not None and now - max(beat, self.started) > self.session_timeout_s
            if silent or expiry is not None:  # expiry: a crash came after Redis heard of it, before the unload
                self.expire(session_id)

    def expire(self, session_id: str) -> None:
        """Save and unload the session's models; from now on their requests fail naming the session."""
        message = (
            f"session {session_id} expired (no heartbeat for {self.session_timeout_s:g} s): its models were "
            f"unloaded, each saved as tinker://MODEL_ID/weights/{EXPIRED_CHECKPOINT}; create a training client from "
            "that path in a new session to go on"
        )
        self.queue.expire_session(session_id, message)  # first: the server refuses new requests at once
        for model_id in [m for m in self.tenants.tenants if session_of(m) == session_id]:
            self.tenants.save(model_id, EXPIRED_CHECKPOINT, overwrite=True)
            live.mark_expired(self.tenants.checkpoints, model_id, message)
            self.tenants.unload(model_id)
            self.expired[model_id] = message
            for request in self.waiting.pop(model_id, {}).values():
                self.queue.fail(request.request_id, message, "user")
            self.blocked_since.pop(model_id, None)
        log.info("session %s expired: its models were saved and unloaded", session_id)
