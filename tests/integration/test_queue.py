"""The Redis Streams rollout queue against a real redis-server."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from conftest import REDIS_SERVER, free_port
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reinforce.core.queue import GENERATORS_GROUP, RolloutQueue, connect
from reinforce.core.records_pb2 import Prompt, RolloutGroup, Sample, WeightVersion


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = connect(redis_url)
    yield c
    c.close()


@pytest.fixture
def queue(client: redis.Redis) -> RolloutQueue:
    q = RolloutQueue(client, "test-run")
    q.ensure_groups()
    return q


def make_prompt(i: int) -> Prompt:
    return Prompt(id=f"0-{i}", step=0, policy_version=1, text=f"prompt {i}", token_ids=[1, 2, i], num_samples=2, seed=i)


def make_group(i: int) -> RolloutGroup:
    samples = [
        Sample(token_ids=[5, 6], logprobs=[-0.5, -1.25], reward=0.75, is_end=True, text="yes"),
        Sample(token_ids=[7], logprobs=[-2.0], reward=-0.5, is_end=False, text="n"),
    ]
    return RolloutGroup(
        prompt_id=f"0-{i}", step=0, policy_version=1, prompt_text=f"prompt {i}", prompt_token_ids=[1, 2],
        samples=samples, generator_id="gen-0", generate_seconds=0.25, reward_seconds=0.125,
    )  # fmt: skip


def test_prompts_round_trip_in_order(queue: RolloutQueue) -> None:
    prompts = [make_prompt(i) for i in range(3)]
    ids = queue.put_prompts(prompts)
    got = queue.read_prompts("gen-a", count=10, block_ms=0)
    assert [entry_id for entry_id, _ in got] == ids
    assert [p for _, p in got] == prompts
    assert queue.ack_prompts(ids) == 3
    assert queue.read_prompts("gen-a", count=10, block_ms=0) == []
    assert queue.depths()["prompts"] == 0


def test_rollouts_round_trip(queue: RolloutQueue) -> None:
    groups = [make_group(i) for i in range(2)]
    ids = [queue.put_rollout(g) for g in groups]
    got = queue.read_rollouts("trainer-0", count=5, block_ms=0)
    assert got == list(zip(ids, groups, strict=True))
    assert got[0][1].samples[0].logprobs == [-0.5, -1.25]
    assert queue.ack_rollouts(ids) == 2
    assert queue.ack_rollouts(ids) == 0  # already acknowledged


def test_entries_put_before_the_groups_exist_are_delivered(client: redis.Redis) -> None:
    q = RolloutQueue(client, "late-groups")
    q.put_prompts([make_prompt(0)])
    q.ensure_groups()
    q.ensure_groups()  # idempotent
    assert [p.id for _, p in q.read_prompts("g", 5, 0)] == ["0-0"]


def test_two_consumers_share_prompts_without_duplicates(queue: RolloutQueue) -> None:
    queue.put_prompts([make_prompt(i) for i in range(10)])
    first = queue.read_prompts("gen-a", count=4, block_ms=0)
    second = queue.read_prompts("gen-b", count=10, block_ms=0)
    ids_a = {p.id for _, p in first}
    ids_b = {p.id for _, p in second}
    assert len(ids_a) == 4 and len(ids_b) == 6
    assert ids_a.isdisjoint(ids_b)
    assert ids_a | ids_b == {f"0-{i}" for i in range(10)}


def test_dead_consumers_prompts_are_reclaimed_after_min_idle(queue: RolloutQueue) -> None:
    queue.put_prompts([make_prompt(i) for i in range(3)])
    taken = queue.read_prompts("gen-dead", count=3, block_ms=0)
    assert queue.reclaim_prompts("gen-alive", min_idle_ms=60_000, count=10) == []  # not idle long enough
    time.sleep(0.1)
    reclaimed = queue.reclaim_prompts("gen-alive", min_idle_ms=50, count=10)
    assert reclaimed == taken
    assert queue.read_prompts("gen-alive", count=10, block_ms=0) == []  # reclaim is not a new delivery
    assert queue.ack_prompts([entry_id for entry_id, _ in reclaimed]) == 3
    assert queue.ack_prompts([entry_id for entry_id, _ in taken]) == 0  # the dead one's late ack is a no-op


def test_a_restarted_consumer_reads_its_own_pending_entries(queue: RolloutQueue) -> None:
    queue.put_prompts([make_prompt(i) for i in range(3)])
    taken = queue.read_prompts("gen-0", count=2, block_ms=0)
    assert queue.read_prompts("gen-0", count=10, block_ms=0, pending=True) == taken
    assert queue.read_prompts("gen-1", count=10, block_ms=0, pending=True) == []
    queue.ack_prompts([taken[0][0]])
    assert queue.read_prompts("gen-0", count=10, block_ms=0, pending=True) == taken[1:]
    queue.put_rollout(make_group(0))
    [(entry_id, _)] = queue.read_rollouts("trainer", count=5, block_ms=0)
    assert [e for e, _ in queue.read_rollouts("trainer", count=5, block_ms=0, pending=True)] == [entry_id]


def test_reclaim_respects_count(queue: RolloutQueue) -> None:
    queue.put_prompts([make_prompt(i) for i in range(5)])
    queue.read_prompts("gen-dead", count=5, block_ms=0)
    time.sleep(0.05)
    assert len(queue.reclaim_prompts("gen-alive", min_idle_ms=10, count=2)) == 2
    assert len(queue.reclaim_prompts("gen-other", min_idle_ms=10_000, count=10)) == 0


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"data": b"\xff\xff\xff garbage"}, "cannot decode Prompt"),
        ({"other": b"x"}, "missing 'data' field"),
        ({"data": b""}, "empty id"),
    ],
)
def test_malformed_prompt_goes_to_dead_letter(
    queue: RolloutQueue, client: redis.Redis, fields: dict[str, bytes], reason: str
) -> None:
    queue.put_prompts([make_prompt(1)])
    bad_id = client.xadd(queue.prompts_key, fields).decode()
    queue.put_prompts([make_prompt(2)])
    got = queue.read_prompts("gen-a", count=10, block_ms=0)
    assert [p.id for _, p in got] == ["0-1", "0-2"]
    assert queue.dead_letters() == 1
    [(_, letter)] = client.xrange(queue.deadletter_key)
    assert letter[b"stream"] == queue.prompts_key.encode()
    assert letter[b"entry_id"] == bad_id.encode()
    assert reason in letter[b"reason"].decode()
    assert letter[b"data"] == fields.get("data", b"")
    depths = queue.depths()
    assert (depths["prompts_pending"], depths["deadletter"]) == (2, 1)  # the bad entry was acked


def test_malformed_rollout_goes_to_dead_letter(queue: RolloutQueue, client: redis.Redis) -> None:
    client.xadd(queue.rollouts_key, {"data": b"\x08"})  # truncated varint
    queue.put_rollout(make_group(3))
    got = queue.read_rollouts("trainer-0", count=10, block_ms=0)
    assert [g.prompt_id for _, g in got] == ["0-3"]
    assert queue.dead_letters() == 1


def test_malformed_entry_found_by_reclaim_goes_to_dead_letter(queue: RolloutQueue, client: redis.Redis) -> None:
    client.xadd(queue.prompts_key, {"data": b"\xff\xff"})
    queue.put_prompts([make_prompt(4)])
    # A consumer that read the raw entries and died before acking them.
    client.xreadgroup(GENERATORS_GROUP, "gen-dead", {queue.prompts_key: ">"}, count=10)
    time.sleep(0.05)
    got = queue.reclaim_prompts("gen-alive", min_idle_ms=10, count=10)
    assert [p.id for _, p in got] == ["0-4"]
    assert queue.dead_letters() == 1


def test_runs_do_not_collide(client: redis.Redis) -> None:
    a, b = RolloutQueue(client, "run-a"), RolloutQueue(client, "run-b")
    for q in (a, b):
        q.ensure_groups()
    a.put_prompts([make_prompt(1)])
    a.publish_weights(WeightVersion(version=3))
    assert b.read_prompts("g", 10, 0) == []
    assert b.latest_weights() is None
    b.put_prompts([make_prompt(2)])
    a.delete_run_keys()
    assert client.keys("reinforce:run-a:*") == []
    assert [p.id for _, p in b.read_prompts("g", 10, 0)] == ["0-2"]


def test_delete_run_keys_removes_every_key(queue: RolloutQueue, client: redis.Redis) -> None:
    queue.put_prompts([make_prompt(1)])
    queue.put_rollout(make_group(1))
    queue.publish_weights(WeightVersion(version=1))
    client.xadd(queue.prompts_key, {"junk": b"1"})
    queue.read_prompts("g", 10, 0)  # dead-letters the junk entry
    assert len(client.keys("reinforce:test-run:*")) == 5  # prompts, rollouts, validation, weights, deadletter
    assert queue.delete_run_keys() == 5
    assert client.keys("*") == []


def test_latest_weights_round_trip(queue: RolloutQueue) -> None:
    assert queue.latest_weights() is None
    queue.publish_weights(WeightVersion(version=1, uri="/w/1.safetensors", sha256="aa", num_bytes=10))
    latest = WeightVersion(version=2, uri="http://trainer:8000/weights/2", sha256="bb", num_bytes=12,
                           published_at=1.5)  # fmt: skip
    queue.publish_weights(latest)
    assert queue.latest_weights() == latest


def test_depths(queue: RolloutQueue) -> None:
    assert queue.depths() == {
        "prompts": 0, "prompts_unread": 0, "prompts_pending": 0,
        "rollouts": 0, "rollouts_unread": 0, "rollouts_pending": 0, "deadletter": 0,
    }  # fmt: skip
    queue.put_prompts([make_prompt(i) for i in range(5)])
    read = queue.read_prompts("g", count=2, block_ms=0)
    queue.put_rollout(make_group(0))
    d = queue.depths()
    assert (d["prompts"], d["prompts_unread"], d["prompts_pending"]) == (5, 3, 2)
    assert (d["rollouts"], d["rollouts_unread"]) == (1, 1)
    queue.ack_prompts([entry_id for entry_id, _ in read])
    assert queue.depths()["prompts"] == 3


def test_depths_without_groups(client: redis.Redis) -> None:
    q = RolloutQueue(client, "no-groups")
    assert q.depths()["prompts"] == 0
    q.put_prompts([make_prompt(0)])
    assert q.depths()["prompts_unread"] == 1


def test_blocking_read_is_shortened_to_fit_the_socket_timeout(redis_url: str) -> None:
    client = connect(redis_url, socket_timeout=0.5)
    q = RolloutQueue(client, "short-timeout")
    q.ensure_groups()
    start = time.monotonic()
    assert q.read_prompts("g", count=1, block_ms=5_000) == []  # no TimeoutError
    assert time.monotonic() - start < 0.5
    client.close()


def test_blocking_read_returns_entries(queue: RolloutQueue) -> None:
    queue.put_rollout(make_group(7))
    got = queue.read_rollouts("trainer-0", count=1, block_ms=200)
    assert [g.prompt_id for _, g in got] == ["0-7"]


def test_connect_with_password_in_url(redis_url: str, client: redis.Redis) -> None:
    client.execute_command("ACL", "SETUSER", "alice", "on", ">s3cret", "~*", "&*", "+@all")
    try:
        authed = connect(redis_url.replace("redis://", "redis://alice:s3cret@"))
        assert authed.acl_whoami() == "alice"
        authed.close()
        start = time.monotonic()
        with pytest.raises(redis.AuthenticationError):  # at once: a wrong password does not heal with time
            connect(redis_url.replace("redis://", "redis://alice:wrong@")).ping()
        assert time.monotonic() - start < 5
    finally:
        client.execute_command("ACL", "DELUSER", "alice")


def test_rejects_decoding_client_and_bad_run_name(redis_url: str, client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="decode"):
        RolloutQueue(redis.Redis.from_url(redis_url, decode_responses=True), "r")
    with pytest.raises(ValueError, match="run name"):
        RolloutQueue(client, "a:b*")


# ---- fuzzing the record decoder ------------------------------------------------------------------------

# The fixtures are function-scoped, so every example shares one queue: each example empties it first.
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _entries_near(good: bytes) -> st.SearchStrategy[dict[bytes, bytes]]:
    """Entry field dicts: arbitrary bytes as data, arbitrary fields, and a good record cut or spliced."""
    return st.one_of(
        st.binary(max_size=64).map(lambda data: {b"data": data}),
        st.dictionaries(st.binary(max_size=12), st.binary(max_size=32), min_size=1, max_size=4),
        st.builds(
            lambda cut, junk: {b"data": good[:cut] + junk},
            st.integers(0, len(good)),
            st.binary(max_size=8),
        ),
    )


PROMPT_ENTRIES = st.lists(_entries_near(make_prompt(9).SerializeToString()), min_size=1, max_size=5)
GROUP_ENTRIES = st.lists(_entries_near(make_group(9).SerializeToString()), min_size=1, max_size=5)


def expected_outcome(fields: dict[bytes, bytes], cls: type[Message], ident: str) -> Message | str:
    """What the reader must do with an entry: the record it holds, or the start of the dead-letter reason.

    Protobuf accepts many byte strings (any run of valid tags), so "bad" is decided by parsing, as a
    reader would: an entry is bad when it has no data, data that does not parse, or a record without id.
    """
    if b"data" not in fields:
        return "missing 'data' field"
    try:
        record = cls.FromString(fields[b"data"])
    except DecodeError:
        return f"cannot decode {cls.__name__}"
    return record if getattr(record, ident) else f"{cls.__name__} has an empty {ident}"


def interleave(client: redis.Redis, key: str, goods: list[bytes], fuzz: list[dict[bytes, bytes]]) -> list[str]:
    """XADD good, fuzz, good, fuzz, ..., good; returns the entry ids in stream order."""
    ids = [client.xadd(key, {b"data": goods[0]}).decode()]
    for fields, good in zip(fuzz, goods[1:], strict=True):
        ids.append(client.xadd(key, fields).decode())
        ids.append(client.xadd(key, {b"data": good}).decode())
    return ids


def _labelled(
    ids: list[str], goods: list[Message], fuzz: list[dict[bytes, bytes]], cls: type[Message], ident: str
) -> list[tuple[str, dict[bytes, bytes], Message | str]]:
    """(entry id, fields, expected outcome) of every entry :func:`interleave` added."""
    out = []
    for i, entry_id in enumerate(ids):
        if i % 2 == 0:
            good = goods[i // 2]
            out.append((entry_id, {b"data": good.SerializeToString()}, good))
        else:
            fields = fuzz[i // 2]
            out.append((entry_id, fields, expected_outcome(fields, cls, ident)))
    return out


def check_outcome(
    queue: RolloutQueue,
    client: redis.Redis,
    key: str,
    entries: list[tuple[str, dict[bytes, bytes], Message | str]],
    got: list[tuple[str, Message]],
) -> None:
    """Accepted entries came back intact and in order; every refused one is dead-lettered with its reason."""
    assert got == [(entry_id, want) for entry_id, _, want in entries if isinstance(want, Message)]
    refused = [(entry_id, fields, want) for entry_id, fields, want in entries if isinstance(want, str)]
    letters = [fields for _, fields in client.xrange(queue.deadletter_key)]
    assert len(letters) == len(refused)
    for letter, (entry_id, fields, reason) in zip(letters, refused, strict=True):
        assert letter[b"stream"] == key.encode()
        assert letter[b"entry_id"] == entry_id.encode()
        assert letter[b"reason"].decode().startswith(reason)
        assert letter[b"data"] == fields.get(b"data", b"")
    # Dead letters were acked and deleted; the accepted entries wait, delivered, for their ack.
    assert client.xlen(key) == len(got)


@FUZZ
@given(fuzz=PROMPT_ENTRIES, reclaim=st.booleans())
def test_fuzzed_prompt_entries_are_dead_lettered_and_good_ones_kept(
    queue: RolloutQueue, client: redis.Redis, fuzz: list[dict[bytes, bytes]], reclaim: bool
) -> None:
    queue.delete_run_keys()
    queue.ensure_groups()
    goods = [make_prompt(i) for i in range(len(fuzz) + 1)]
    ids = interleave(client, queue.prompts_key, [g.SerializeToString() for g in goods], fuzz)
    if reclaim:  # the other decoding path: entries a dead generator read raw and never acked
        client.xreadgroup(GENERATORS_GROUP, "gen-dead", {queue.prompts_key: ">"}, count=100)
        got = queue.reclaim_prompts("gen-alive", min_idle_ms=0, count=100)
    else:
        got = queue.read_prompts("gen-a", count=100, block_ms=0)
    check_outcome(queue, client, queue.prompts_key, _labelled(ids, goods, fuzz, Prompt, "id"), got)


@FUZZ
@given(fuzz=GROUP_ENTRIES)
def test_fuzzed_rollout_entries_are_dead_lettered_and_good_ones_kept(
    queue: RolloutQueue, client: redis.Redis, fuzz: list[dict[bytes, bytes]]
) -> None:
    queue.delete_run_keys()
    queue.ensure_groups()
    goods = [make_group(i) for i in range(len(fuzz) + 1)]
    ids = interleave(client, queue.rollouts_key, [g.SerializeToString() for g in goods], fuzz)
    got = queue.read_rollouts("trainer-0", count=100, block_ms=0)
    check_outcome(queue, client, queue.rollouts_key, _labelled(ids, goods, fuzz, RolloutGroup, "prompt_id"), got)
    # A restarted trainer re-reads exactly the accepted groups; the dead letters are gone for good.
    assert queue.read_rollouts("trainer-0", count=100, block_ms=0, pending=True) == got


def _redis_on(port: int, folder: Path) -> subprocess.Popen[bytes]:
    cmd = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", ""]
    cmd += ["--appendonly", "yes", "--appendfsync", "always", "--logfile", str(folder / "redis.log")]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_clients_ride_out_a_redis_restart_within_max_outage(tmp_path: Path) -> None:
    """Issue #13, finding 7: Redis down for ~4 s (longer than a restart replaying its AOF) costs a client a wait,
    not its life; past max_outage_s the error comes through."""
    port = free_port()
    servers = [_redis_on(port, tmp_path)]
    restart = threading.Timer(4.0, lambda: servers.append(_redis_on(port, tmp_path)))
    url = f"redis://127.0.0.1:{port}/0"
    try:
        patient = RolloutQueue(connect(url, socket_timeout=5.0, max_outage_s=30.0), "outage")
        impatient = RolloutQueue(connect(url, socket_timeout=5.0, max_outage_s=1.0), "outage")
        deadline = time.monotonic() + 10
        while True:  # wait for the server
            try:
                patient.ensure_groups()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        patient.put_prompts([make_prompt(0)])
        servers[0].kill()
        servers[0].wait()
        restart.start()
        with pytest.raises(redis.ConnectionError):
            impatient.depths()
        start = time.monotonic()
        patient.put_prompts([make_prompt(1)])  # waits for the restarted server
        assert time.monotonic() - start > 2.0
        read = patient.read_prompts("g", count=10, block_ms=0)
        assert [p.id for _, p in read] == [make_prompt(0).id, make_prompt(1).id]  # the AOF kept the first
    finally:
        restart.cancel()
        if restart.is_alive():
            restart.join()
        for proc in servers:
            proc.kill()
            proc.wait()
