"""The training API's durability pieces on a tiny random base model (services/reinforce/training_api/live.py,
worker.py): a live snapshot brings a tenant back bit for bit (adapter, unstepped gradients, AdamW state), a crash
mid-write leaves the previous snapshot, a replayed save finds its own checkpoint done, the worker applies a model's
requests in seq_id order and goes past a refused one at once, a restart recomputes exactly the requests after each
model's snapshot, and a silent session's models are saved, unloaded and refused by the session's name."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis
import torch

tinker = pytest.importorskip("tinker", reason="the `api` extra (tinker==0.38.0) is not installed")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from reinforce.core.policy import materialize_policy  # noqa: E402
from reinforce.core.spec import PolicySpec, RandomInit  # noqa: E402
from reinforce.training_api import checkpoint, live  # noqa: E402
from reinforce.training_api.store import FutureStore, WorkQueue, session_key  # noqa: E402
from reinforce.training_api.tenants import Tenants  # noqa: E402
from reinforce.training_api.wire import Batch  # noqa: E402
from reinforce.training_api.worker import EXPIRED_CHECKPOINT, Worker, attempt, recover  # noqa: E402

LORA = types.LoraConfig(rank=2, train_unembed=False, seed=3)  # tiny's output layer is tied to its embeddings
SESSION = "session-unit"
MODEL = f"{SESSION}:train:0"
TOKENS = [[1, 5, 7, 9, 3, 2], [4, 4, 8, 1]]
ADAM = types.AdamParams(learning_rate=1e-2)
T = TypeVar("T")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("base") / "base"
    materialize_policy(PolicySpec(random_init=RandomInit(tie_word_embeddings=True)), folder, seed=0)
    return folder


def tenants_of(base: Path, root: Path) -> Tenants:
    return Tenants(base, "random_init", 16.0, 0, root, "run")


def batch(tokens: list[list[int]]) -> Batch:
    inputs = [
        {"target_tokens": torch.tensor([*t[1:], 0]), "weights": torch.ones(len(t), dtype=torch.float32)} for t in tokens
    ]
    return Batch("cross_entropy", tokens, inputs, forward_only=False)


def state_of(tenants: Tenants) -> dict[str, torch.Tensor]:
    return tenants.capture(MODEL).tensors


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_live_snapshot_brings_a_tenant_back_bit_for_bit(base: Path, tmp_path: Path):
    first = tenants_of(base, tmp_path / "a")
    first.create(MODEL, LORA)
    first.forward_backward(MODEL, batch(TOKENS))
    first.optim_step(MODEL, ADAM)
    first.forward_backward(MODEL, batch(TOKENS[:1]))  # gradients added and not stepped: part of the state
    snapshot = live.Snapshot(MODEL, 3, "r3", live.Outcome.done(b"\x00result", "proto"), first.capture(MODEL))
    live.write(tmp_path / "a", snapshot)
    [read] = live.snapshots(tmp_path / "a")
    assert (read.seq_id, read.request_id, read.outcome, read.expired) == (3, "r3", snapshot.outcome, None)
    second = tenants_of(base, tmp_path / "b")
    second.restore(MODEL, read.state)
    assert any(key.startswith("grad.") for key in state_of(second))
    assert_same(state_of(first), state_of(second))
    # the next step from the restored state is the same step, AdamW's moments and step count included
    for tenants in (first, second):
        tenants.optim_step(MODEL, ADAM)
        tenants.forward_backward(MODEL, batch(TOKENS[1:]))
    assert_same(state_of(first), state_of(second))


def test_a_crash_mid_write_leaves_the_previous_snapshot(base: Path, tmp_path: Path):
    tenants = tenants_of(base, tmp_path)
    tenants.create(MODEL, LORA)
    done = live.Outcome.done(b"{}", "json")
    live.write(tmp_path, live.Snapshot(MODEL, 0, "r0", done, tenants.capture(MODEL)))
    live.write(tmp_path, live.Snapshot(MODEL, 1, "r1", done, tenants.capture(MODEL)), tensors_changed=False)
    folder = live.folder_of(tmp_path, MODEL)
    assert sorted(p.name for p in folder.iterdir()) == ["live.json", "tensors-0.safetensors"]  # reused
    # a crash after the next tensors were written, and one in the middle of writing live.json
    (folder / "tensors-2.safetensors").write_bytes(b"partial")
    (folder / ".live.json.tmp").write_text("{")
    [read] = live.snapshots(tmp_path)
    assert read.seq_id == 1 and read.request_id == "r1"
    live.remove_temporaries(tmp_path)
    assert not (folder / ".live.json.tmp").exists()


def test_a_replayed_save_finds_its_own_checkpoint_done(base: Path, tmp_path: Path):
    tenants = tenants_of(base, tmp_path)
    tenants.create(MODEL, LORA)
    path = tenants.save(MODEL, "once", overwrite=False, request_id="r1")
    assert tenants.save(MODEL, "once", overwrite=False, request_id="r1") == path  # the same request, after a crash
    with pytest.raises(ValueError, match="exists already"):
        tenants.save(MODEL, "once", overwrite=False, request_id="r2")
    assert checkpoint.saved_by(checkpoint.folder_of(tmp_path, path)) == "r1"


# ---- the worker on a real Redis --------------------------------------------------------------------------------


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """A database of the session's Redis of this test's own (the training API's keys are not namespaced)."""
    url = redis_server.rsplit("/", 1)[0] + "/7"
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.hset(session_key(SESSION), mapping={"created": time.time(), "heartbeat": time.time()})
    yield url
    client.flushdb()


def on_store(url: str, call: Callable[[FutureStore], Awaitable[T]]) -> T:
    """`call(store)` on the server's side of the store, as the server calls it."""

    async def go() -> T:
        store = FutureStore(url)
        try:
            return await call(store)
        finally:
            await store.close()

    return asyncio.run(go())


def accept(url: str, seq_id: int, kind: str, body: bytes) -> str:
    request_id, held = on_store(url, lambda store: store.accept(MODEL, seq_id, kind, body, ""))
    assert held is None
    return request_id


def bodies() -> list[tuple[str, bytes]]:
    """A model's requests by seq_id: create, two forward_backwards, a step, a save, a step."""
    create = types.CreateModelRequest(session_id=SESSION, model_seq_id=0, base_model="random_init", lora_config=LORA)
    out = [("create_model", create.model_dump_json().encode())]
    for seq, tokens in ((1, TOKENS[:1]), (2, TOKENS[1:])):
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(t[:-1]),
                loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)},
            )
            for t in tokens
        ]
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
            model_id=MODEL, seq_id=seq,
        )  # fmt: skip
        out.append(("forward_backward", forward_backward_request_to_proto(request).SerializeToString()))
    out.append(("optim_step", types.OptimStepRequest(model_id=MODEL, seq_id=3, adam_params=ADAM).model_dump_json()))
    out.append(("save_weights", types.SaveWeightsRequest(model_id=MODEL, seq_id=4, path="four").model_dump_json()))
    out.append(("optim_step", types.OptimStepRequest(model_id=MODEL, seq_id=5, adam_params=ADAM).model_dump_json()))
    return [(kind, body.encode() if isinstance(body, str) else body) for kind, body in out]


def run_until_done(worker: Worker, url: str, ids: list[str], deadline_s: float = 30.0) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + deadline_s
    while any(client.hget(f"tinker:request:{i}", "status") == b"pending" for i in ids):
        assert time.monotonic() < deadline, "requests still pending"
        worker.step(0.05)


def statuses(url: str, ids: list[str]) -> list[bytes]:
    client = redis.Redis.from_url(url)
    return [client.hget(f"tinker:request:{i}", "status") for i in ids]


def test_requests_are_applied_in_seq_id_order_whatever_order_they_come_in(base: Path, tmp_path: Path, redis_url: str):
    reference = tenants_of(base, tmp_path / "reference")
    worker = Worker(reference, WorkQueue(redis_url))
    ids = [accept(redis_url, seq, kind, body) for seq, (kind, body) in enumerate(bodies())]
    run_until_done(worker, redis_url, ids)
    expected = state_of(reference)
    redis.Redis.from_url(redis_url).flushdb()

    shuffled = tenants_of(base, tmp_path / "shuffled")
    worker = Worker(shuffled, WorkQueue(redis_url))
    order = [0, 5, 3, 4, 2]  # the step and the save before the gradients they follow
    ids = [accept(redis_url, seq, *bodies()[seq]) for seq in order]
    for _ in range(10):
        worker.step(0.05)
    assert statuses(redis_url, ids) == [b"done"] + [b"pending"] * 4  # all wait for seq 1
    assert sorted(worker.waiting[MODEL]) == [2, 3, 4, 5]
    ids.append(accept(redis_url, 1, *bodies()[1]))
    run_until_done(worker, redis_url, ids)
    assert statuses(redis_url, ids) == [b"done"] * 6
    assert_same(state_of(shuffled), expected)


def test_a_refused_seq_id_is_no_gap_to_wait_for(base: Path, tmp_path: Path, redis_url: str):
    tenants = tenants_of(base, tmp_path)
    worker = Worker(tenants, WorkQueue(redis_url))
    kinds = bodies()
    ids = [accept(redis_url, 0, *kinds[0])]
    on_store(redis_url, lambda store: store.refused(MODEL, 1))  # the server refused seq 1 and recorded it
    ids.append(accept(redis_url, 2, *kinds[2]))
    run_until_done(worker, redis_url, ids, deadline_s=10.0)  # far under GAP_WAIT_S
    assert statuses(redis_url, ids) == [b"done", b"done"]


def test_a_restart_computes_exactly_the_requests_after_each_snapshot(base: Path, tmp_path: Path, redis_url: str):
    reference = tenants_of(base, tmp_path / "reference")
    worker = Worker(reference, WorkQueue(redis_url))
    run_until_done(worker, redis_url, [accept(redis_url, seq, *kb) for seq, kb in enumerate(bodies())])
    expected = state_of(reference)
    redis.Redis.from_url(redis_url).flushdb()
    redis.Redis.from_url(redis_url).hset(session_key(SESSION), "heartbeat", time.time())

    root = tmp_path / "crashed"
    queue = WorkQueue(redis_url)
    before = Worker(tenants_of(base, root), queue)
    ids = [accept(redis_url, seq, *kb) for seq, kb in enumerate(bodies())]
    for _ in range(3):  # create and both forward_backwards
        before.arrive(queue.next(1.0))
    # the crash: the step (seq 3) applied and snapshotted but Redis never heard; the save (seq 4) taken, not run
    step = queue.next(1.0)
    applied = attempt(before.tenants, before.sampler, step)
    before.persist(step, applied)
    assert queue.next(1.0).seq_id == 4

    after = tenants_of(base, root)
    recovered = recover(after, queue)
    # seq 3 finished from its snapshot; seq 4 back on the queue, before seq 5
    assert recovered.next_seq == {MODEL: 4} and recovered.requeued == 2
    assert statuses(redis_url, ids) == [b"done"] * 4 + [b"pending"] * 2  # seq 3's outcome came from its snapshot
    assert redis.Redis.from_url(redis_url).hget(f"tinker:request:{ids[3]}", "result") == applied.outcome.result
    run_until_done(Worker(after, queue, recovered=recovered), redis_url, ids)
    assert statuses(redis_url, ids) == [b"done"] * 6
    assert_same(state_of(after), expected)  # seq 3 applied once: twice, AdamW would have stepped twice


def test_a_silent_session_expires_its_models_saved_and_refused_by_name(base: Path, tmp_path: Path, redis_url: str):
    tenants = tenants_of(base, tmp_path)
    queue = WorkQueue(redis_url)
    worker = Worker(tenants, queue, session_timeout_s=5.0)
    kinds = bodies()
    run_until_done(worker, redis_url, [accept(redis_url, seq, *kinds[seq]) for seq in (0, 1)])
    saved = state_of(tenants)
    worker.started -= 60  # as if the process had run a minute, the session silent all along
    redis.Redis.from_url(redis_url).hset(session_key(SESSION), mapping={"created": 0, "heartbeat": time.time() - 60})
    worker.last_expiry_check = 0.0
    worker.step(0.01)
    assert MODEL not in tenants.tenants
    expiry = queue.session_state(SESSION)[1]
    assert expiry is not None and SESSION in expiry
    late = accept(redis_url, 2, *kinds[2])
    run_until_done(worker, redis_url, [late])
    error = redis.Redis.from_url(redis_url).hget(f"tinker:request:{late}", "error").decode()
    assert SESSION in error and "expired" in error
    # saved, never lost: as a checkpoint a new session can load, and in the live snapshot (gradients too)
    path = checkpoint.folder_of(tmp_path, f"tinker://{MODEL}/weights/{EXPIRED_CHECKPOINT}")
    assert path.is_dir()
    [snapshot] = live.snapshots(tmp_path)
    assert snapshot.expired == expiry
    assert_same(snapshot.state.tensors, saved)
    again = tenants_of(base, tmp_path)
    assert recover(again, queue).expired == {MODEL: expiry} and not again.tenants  # not loaded after a restart
