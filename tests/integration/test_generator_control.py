"""The generator's HTTP control plane, in-process: probes, the token, and loading weight versions."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import uvicorn
from conftest import free_port
from fastapi.testclient import TestClient
from google.protobuf.json_format import MessageToDict
from prometheus_client import generate_latest
from transformers import PreTrainedModel

from reinforce.core.generator_api import HEALTH_PATH, METRICS_PATH, READY_PATH, WEIGHTS_PATH, load_request_json
from reinforce.core.policy import load_policy, materialize_policy
from reinforce.core.queue import RolloutQueue
from reinforce.core.records_pb2 import Prompt, RelayPlan, WeightVersion
from reinforce.core.rollout import WeightReconciler
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import RunSpec
from reinforce.core.weights import publish
from reinforce.generator.reward_client import RewardFunctionError
from reinforce.generator.worker import Generator, control_plane
from reinforce.trainer.weight_server import WeightServer

TOKEN = "s3cret-control-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Nothing listens there: the constructor does not contact the reward server, and no test samples.
REWARD_URL = "http://127.0.0.1:9"


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> RunSpec:
    """A resolved spec whose run folder holds a tiny random initial policy (shared: tests only read it)."""
    run_dir = tmp_path_factory.mktemp("gen") / "run"
    spec = RunSpec.model_validate(
        {
            "name": "control-test",
            "run_dir": str(run_dir),
            "policy": {"random_init": {"hidden_size": 16, "intermediate_size": 16, "num_layers": 1}},
            "data": {"prompts": str(run_dir / "unused.txt"), "chat_template": False},
        }
    )
    materialize_policy(spec.policy, RunPaths(run_dir).initial_policy, spec.seed)
    return spec


@pytest.fixture
def gen(spec: RunSpec, redis_url: str) -> Iterator[Generator]:
    torch.set_num_threads(1)  # the test machine's cores are shared
    generator = Generator(spec, redis_url, REWARD_URL, "gen-test")
    generator.queue.delete_run_keys()  # no published version left over from another test
    yield generator
    generator.reward.close()
    generator.queue.client.close()


@pytest.fixture
def http(gen: Generator) -> Iterator[TestClient]:
    with TestClient(control_plane(gen, TOKEN)) as client:
        yield client


def perturbed_policy(spec: RunSpec, seed: int) -> PreTrainedModel:
    """The initial policy with every weight moved by seeded noise: a stand-in for a trained version."""
    model = load_policy(RunPaths(spec.resolved_run_dir()).initial_policy)
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=noise))
    return model


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_weights(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> bool:
    got = model.state_dict()
    return got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def publish_in_run(gen: Generator, model: torch.nn.Module, version: int) -> WeightVersion:
    """What the run's trainer does: write the version into the run's weights folder and announce it in Redis."""
    weights = publish(model, RunPaths(gen.spec.resolved_run_dir()).weights, version)
    gen.queue.publish_weights(weights)
    return weights


def post(http: TestClient, weights: WeightVersion) -> None:
    """POST a version as the supervisor's reconciler does (proto3 JSON) and expect it accepted."""
    reply = http.post(WEIGHTS_PATH, json=MessageToDict(weights), headers=AUTH)
    assert reply.status_code == 202, reply.text
    assert reply.json() == {"accepted_version": weights.version}


def weights_status(http: TestClient) -> dict:
    reply = http.get(WEIGHTS_PATH, headers=AUTH)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_probes_and_metrics_are_open(http: TestClient) -> None:
    assert http.get(HEALTH_PATH).json() == {"ok": True}
    ready = http.get(READY_PATH)
    assert ready.status_code == 200 and ready.json() == {"ready": True, "weight_version": 0}
    metrics = http.get(METRICS_PATH)
    assert metrics.status_code == 200
    assert "reinforce_generator_weight_version 0.0" in metrics.text
    # the requests before this one, counted by route and code (core/http_kit.py's count_requests)
    assert 'reinforce_generator_requests_total{code="200",endpoint="/healthz"} 1.0' in metrics.text
    assert 'reinforce_generator_request_seconds_count{endpoint="/readyz"} 1.0' in metrics.text


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token"},
        {"Authorization": TOKEN},  # the token without the scheme
        {"Authorization": f"Bearer {TOKEN}x"},
        {"X-Token": TOKEN},
    ],
)
def test_weight_endpoints_refuse_a_missing_or_wrong_token(http: TestClient, gen: Generator, headers: dict) -> None:
    assert http.get(WEIGHTS_PATH, headers=headers).status_code == 401
    body = MessageToDict(WeightVersion(version=3, uri="/nowhere", sha256="00"))
    assert http.post(WEIGHTS_PATH, json=body, headers=headers).status_code == 401
    assert gen.weights.desired is None  # a refused request changes nothing


def test_posted_version_is_loaded(http: TestClient, gen: Generator, spec: RunSpec) -> None:
    assert weights_status(http) == {"loaded_version": 0, "loads": 0, "desired_version": None, "last_error": ""}
    trained = perturbed_policy(spec, seed=1)
    assert not same_weights(gen.engine.model, state(trained))
    post(http, publish_in_run(gen, trained, version=1))
    # Accepting only records the wish: the worker loads it between batches.
    assert weights_status(http) == {"loaded_version": 0, "loads": 0, "desired_version": 1, "last_error": ""}
    gen.apply_desired_weights()
    assert weights_status(http) == {"loaded_version": 1, "loads": 1, "desired_version": 1, "last_error": ""}
    assert same_weights(gen.engine.model, state(trained))
    assert "reinforce_generator_weight_version 1.0" in http.get(METRICS_PATH).text


def test_corrupted_weight_file_is_refused(http: TestClient, gen: Generator, spec: RunSpec) -> None:
    good = perturbed_policy(spec, seed=1)
    post(http, publish_in_run(gen, good, version=1))
    gen.apply_desired_weights()
    bad = publish_in_run(gen, perturbed_policy(spec, seed=2), version=2)
    path = Path(bad.uri)
    data = bytearray(path.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])  # flip bytes inside the tensor data
    path.write_bytes(bytes(data))
    post(http, bad)
    gen.apply_desired_weights()
    status = weights_status(http)
    assert status["loaded_version"] == 1
    assert "sha256" in status["last_error"] and "weight version 2" in status["last_error"]
    assert status["desired_version"] is None  # not retried: the file will not heal; a new request will come
    assert same_weights(gen.engine.model, state(good))


def test_rollback_to_an_older_version(http: TestClient, gen: Generator, spec: RunSpec) -> None:
    older, newer = perturbed_policy(spec, seed=1), perturbed_policy(spec, seed=2)
    v1 = publish_in_run(gen, older, version=1)
    v2 = publish_in_run(gen, newer, version=2)
    post(http, v2)
    gen.apply_desired_weights()
    assert same_weights(gen.engine.model, state(newer))
    # A trainer resumed from an earlier checkpoint publishes an older version: the latest request wins.
    gen.queue.publish_weights(v1)
    post(http, v1)
    gen.apply_desired_weights()
    assert weights_status(http) == {"loaded_version": 1, "loads": 2, "desired_version": 1, "last_error": ""}
    assert same_weights(gen.engine.model, state(older))


@pytest.mark.parametrize(
    "body",
    [
        {"version": "two"},
        {"version": 2, "no_such_field": True},
        {"sha256": 5},
        [1, 2],
        "v2",
    ],
)
def test_a_body_that_is_not_a_weight_version_is_422(http: TestClient, gen: Generator, body: object) -> None:
    reply = http.post(WEIGHTS_PATH, json=body, headers=AUTH)
    assert reply.status_code == 422, reply.text
    assert gen.weights.desired is None


def test_a_body_that_is_not_json_is_422(http: TestClient, gen: Generator) -> None:
    headers = {**AUTH, "Content-Type": "application/json"}
    assert http.post(WEIGHTS_PATH, content=b"{not json", headers=headers).status_code == 422
    assert gen.weights.desired is None


def test_a_generator_without_a_supervisor_prepares_the_same_initial_policy(
    spec: RunSpec, redis_url: str, tmp_path: Path
) -> None:
    """On Kubernetes no supervisor writes initial_policy/: the generator builds it, identical to the one the
    supervisor (and the trainer's reference) has."""
    pod_spec = spec.model_copy(update={"run_dir": str(tmp_path / "pod-run")})
    generator = Generator(pod_spec, redis_url, REWARD_URL, "gen-pod")
    try:
        expected = load_policy(RunPaths(spec.resolved_run_dir()).initial_policy)
        assert RunPaths(pod_spec.resolved_run_dir()).initial_policy.is_dir()
        assert same_weights(generator.engine.model, state(expected))
    finally:
        generator.reward.close()
        generator.queue.client.close()


def test_a_forged_version_is_refused_and_the_real_one_still_loads(
    http: TestClient, gen: Generator, spec: RunSpec
) -> None:
    """Issue #13, finding 1: the control token alone cannot make a generator load weights the trainer never
    published, even a well-formed file in the run's folder with its correct sha256 and the next version number."""
    v1 = publish_in_run(gen, perturbed_policy(spec, seed=1), version=1)
    post(http, v1)
    gen.apply_desired_weights()
    weights_dir = RunPaths(spec.resolved_run_dir()).weights
    forged = publish(perturbed_policy(spec, seed=66), weights_dir, version=2)  # written, never announced
    forged_same_version = publish(perturbed_policy(spec, seed=67), weights_dir / "forged", version=1)
    for attempt in (forged, forged_same_version):
        reply = http.post(WEIGHTS_PATH, json=MessageToDict(attempt), headers=AUTH)
        assert reply.status_code == 409 and "not the run's published weight version" in reply.json()["detail"]
    assert gen.weights.desired.version == 1  # the genuine request stands
    real = publish_in_run(gen, perturbed_policy(spec, seed=2), version=2)  # the trainer's v2 overwrites the file
    post(http, real)
    gen.apply_desired_weights()
    assert weights_status(http)["loaded_version"] == 2
    assert same_weights(gen.engine.model, state(perturbed_policy(spec, seed=2)))


def test_a_published_record_naming_another_host_or_file_is_refused(
    http: TestClient, gen: Generator, spec: RunSpec
) -> None:
    """Issue #13, finding 2: even a record in Redis cannot point the generator at /etc/passwd or another host."""
    for uri in ("/etc/passwd", "http://any-host.invalid/v1/weights/v000001.safetensors"):
        weights = WeightVersion(version=1, uri=uri, sha256="0" * 64)
        gen.queue.publish_weights(weights)
        post(http, weights)
        gen.apply_desired_weights()
        status = weights_status(http)
        assert status["loaded_version"] == 0 and "is not this run's" in status["last_error"]


async def _asgi_post(app: object, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int, int]:
    """POST /v1/weights straight into the ASGI app: (status, how many body chunks the app pulled)."""
    pulled = 0

    async def receive() -> dict:
        nonlocal pulled
        if pulled < len(chunks):
            pulled += 1
            return {"type": "http.request", "body": chunks[pulled - 1], "more_body": pulled < len(chunks)}
        return {"type": "http.disconnect"}

    statuses: list[int] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": WEIGHTS_PATH, "raw_path": WEIGHTS_PATH.encode(), "query_string": b"", "root_path": "",
        "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    await app(scope, receive, send)  # type: ignore[operator]
    return statuses[0], pulled


def test_an_unauthenticated_body_is_never_read_and_a_large_one_is_413(gen: Generator) -> None:
    """Issue #13, finding 3: the token is checked before the body is read; a body over the cap is refused."""
    app = control_plane(gen, TOKEN)
    chunks = [b"[" + b"0," * 512 * 1024] * 64  # 64 MiB of JSON, sent in 1 MiB chunks, no Content-Length
    assert asyncio.run(_asgi_post(app, [], chunks)) == (401, 0)
    status, pulled = asyncio.run(_asgi_post(app, [(b"authorization", f"Bearer {TOKEN}".encode())], chunks))
    assert status == 413 and pulled == 1  # given up after the first chunk passed the cap
    declared = [(b"authorization", f"Bearer {TOKEN}".encode()), (b"content-length", b"300000000")]
    assert asyncio.run(_asgi_post(app, declared, chunks)) == (413, 0)
    assert gen.weights.desired is None


class _FailingReward:
    """A reward client whose reward function raised on the server (what RewardClient.score then raises)."""

    def score(self, prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
        raise RewardFunctionError("reward server at http://x: request failed: reward function failed: boom")

    def close(self) -> None:
        pass


def test_a_failing_reward_function_costs_the_batch_its_rewards_not_the_generator(gen: Generator) -> None:
    """A reward function that raises (or returns the wrong count or strings) is a user bug no retry fixes: the
    group goes out with NaN rewards (the trainer drops and counts them), the prompt is acknowledged, the error
    is logged and counted, and the generator keeps working."""
    gen.reward.close()
    gen.reward = _FailingReward()  # type: ignore[assignment]
    gen.queue.ensure_groups()
    prompt = Prompt(id="0-0", step=0, policy_version=0, text="ab", token_ids=[1, 2], num_samples=2, seed=1)
    gen.queue.put_prompts([prompt])
    entries = gen.queue.read_prompts(gen.name, count=1, block_ms=0)
    gen.process(entries)
    [(_, group)] = gen.queue.read_rollouts("trainer-0", count=10, block_ms=0)
    assert group.prompt_id == "0-0" and all(math.isnan(s.reward) for s in group.samples)
    assert gen.queue.read_prompts(gen.name, count=10, block_ms=0, pending=True) == []  # acknowledged
    assert "reinforce_generator_reward_failures_total 4.0" in generate_latest(gen.metrics.registry).decode()


# Bytes that protobuf refuses as a WeightVersion (a field tag with an invalid wire type): what issue #30 wrote there.
GARBAGE = b"\xff\xff\xff\xff not a record"


def test_garbage_in_the_published_weights_key_is_waited_out_like_an_outage(
    http: TestClient, gen: Generator, spec: RunSpec
) -> None:
    """Issue #30, R3-6: undecodable bytes in the run's weights key neither kill the generator nor lose its
    prompts; a weight request is refused (409) naming the key, each read is counted, and the trainer, waiting for
    groups, puts its record back."""
    trainer_queue = RolloutQueue(gen.queue.client, gen.spec.name)
    trainer_queue.publish_weights(publish(gen.engine.model, RunPaths(spec.resolved_run_dir()).weights, 0))
    gen.queue.client.set(gen.queue.weights_key, GARBAGE)
    entries = [("1-0", Prompt(id="1-0", step=0, policy_version=0, token_ids=[1]))]
    assert gen.split_by_version(entries) == ([], entries)  # held, not sampled and not acknowledged as stale
    body = MessageToDict(WeightVersion(version=1, uri="/nowhere", sha256="0" * 64))
    reply = http.post(WEIGHTS_PATH, json=body, headers=AUTH)
    assert reply.status_code == 409 and gen.queue.weights_key in reply.json()["detail"], reply.text
    metrics = generate_latest(gen.metrics.registry).decode()
    assert "reinforce_generator_unreadable_weight_records_total 2.0" in metrics
    assert trainer_queue.restore_published_weights() and not trainer_queue.restore_published_weights()
    assert gen.split_by_version(entries) == (entries, [])


def test_the_weight_reconciler_rides_out_garbage_in_the_weights_key(gen: Generator) -> None:
    """Issue #30, R3-6: the reconciler the supervisor and the operator run counts the unreadable record and goes
    on; before, its DecodeError ended the supervisor."""
    reconciler = WeightReconciler(gen.queue, {}, TOKEN)
    try:
        gen.queue.client.set(gen.queue.weights_key, GARBAGE)
        assert reconciler.reconcile_once() == (None, [])
        assert reconciler.reconcile_once() == (None, [])
        assert reconciler.read_failures == 2
        gen.queue.publish_weights(WeightVersion(version=3, uri="/w", sha256="0" * 64))
        assert reconciler.reconcile_once() == (3, [])
    finally:
        reconciler.close()


def serve_control_plane(gen: Generator) -> tuple[str, uvicorn.Server]:
    """The generator's control plane on a real port, as `python -m reinforce.generator` serves it."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(control_plane(gen, TOKEN), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the control plane did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server


def test_a_version_superseded_while_it_is_pushed_is_no_warning(gen: Generator, spec: RunSpec, caplog) -> None:
    """The red team's R4-16: the trainer publishes v2 between the reconciler's read of v1 and its request, and the
    generator answers 409 (not the published version). An expected race is logged at INFO, without httpx's text,
    not as a WARNING through the progress bar; any other refusal still warns."""
    v1 = publish_in_run(gen, perturbed_policy(spec, seed=1), version=1)
    publish_in_run(gen, perturbed_policy(spec, seed=2), version=2)
    url, server = serve_control_plane(gen)
    reconciler = WeightReconciler(gen.queue, {gen.name: url}, TOKEN)
    try:
        with caplog.at_level(logging.INFO, logger="reinforce.rollout"):
            reconciler._push(gen.name, url, v1, None)
            # the reconciler's own lines (httpx logs each request at INFO wherever a test configured logging so)
            assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "reinforce.rollout"] == [
                ("INFO", f"generator {gen.name}: version 1 is no longer the published one; the next pass asks")
            ]
            caplog.clear()
            WeightReconciler(gen.queue, {gen.name: url}, "a wrong token")._push(gen.name, url, v1, None)
            assert [r.levelname for r in caplog.records if r.name == "reinforce.rollout"] == ["WARNING"]
            assert "(401)" in caplog.text
    finally:
        reconciler.close()
        server.should_exit = True


def test_the_reconciler_relays_a_version_along_a_chain_of_generators(spec: RunSpec, redis_url: str) -> None:
    """weights.distribution relay: the reconciler plans a chain over the generators it sees, each one's load request
    names its ancestors' relays, and every generator loads the trainer's version through its relay."""
    paths = RunPaths(spec.resolved_run_dir())
    with WeightServer(paths.weights, host="127.0.0.1") as trainer:
        trainer_url = trainer.base_url("127.0.0.1")
        gens = [Generator(spec, redis_url, REWARD_URL, f"gen-{i}", weights_url=trainer_url) for i in range(3)]
        gens[0].queue.delete_run_keys()
        served = {g.name: serve_control_plane(g) for g in gens}
        reconciler = WeightReconciler(gens[0].queue, {n: u for n, (u, _) in served.items()}, TOKEN, relay_fanout=1)
        try:
            expected = state(perturbed_policy(spec, seed=5))
            model = perturbed_policy(spec, seed=5)
            gens[0].queue.publish_weights(publish(model, paths.weights, 1, base_url=trainer_url))
            deadline = time.monotonic() + 30
            while not all(g.weights.loaded == 1 for g in gens):
                assert time.monotonic() < deadline, [g.weights.last_error for g in gens]
                reconciler.reconcile_once()
                for g in gens:
                    g.apply_desired_weights()
            _, states = reconciler.reconcile_once()
            assert [s.relay_version for s in states] == [1, 1, 1]  # each one loaded it through its relay
            chain = reconciler._relay_plan(gens[0].queue.latest_weights())
            assert chain["gen-2"] == [states[1].relay_url, states[0].relay_url] and chain["gen-0"] == []
            assert all(same_weights(g.engine.model, expected) for g in gens)
        finally:
            reconciler.close()
            for g in gens:
                served[g.name][1].should_exit = True
                g.relay.stop()
                g.reward.close()
                g.queue.client.close()


def test_a_load_request_naming_relays_the_reconciler_never_planned_is_refused(spec: RunSpec, redis_url: str) -> None:
    """The red team's R4-6: with the control token alone, a load request's relaySources made a generator send the
    run's weights token to any host. Only the relays of the reconciler's plan for that version (RelayPlan in Redis)
    are fetched from; a request naming another is refused (409) and that host is never asked."""
    asked: list[str] = []

    class Listener(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.headers.get("Authorization", ""))
            self.send_error(404)

    paths = RunPaths(spec.resolved_run_dir())
    with (
        WeightServer(paths.weights, host="127.0.0.1") as trainer,
        ThreadingHTTPServer(("127.0.0.1", 0), Listener) as attacker,
    ):
        threading.Thread(target=attacker.serve_forever, daemon=True).start()
        trainer_url = trainer.base_url("127.0.0.1")
        gen = Generator(spec, redis_url, REWARD_URL, "gen-relay", weights_url=trainer_url)
        gen.queue.delete_run_keys()
        try:
            v1 = publish(perturbed_policy(spec, seed=8), paths.weights, 1, base_url=trainer_url)
            gen.queue.publish_weights(v1)
            attacker_url = f"http://127.0.0.1:{attacker.server_address[1]}"
            gen.queue.plan_relays(RelayPlan(version=1, sha256=v1.sha256, sources=["http://127.0.0.1:9"]))
            with TestClient(control_plane(gen, TOKEN)) as client:
                for sources in ([attacker_url], ["http://127.0.0.1:9", attacker_url]):
                    body = load_request_json(v1, sources)
                    reply = client.post(WEIGHTS_PATH, json=body, headers=AUTH)
                    assert reply.status_code == 409 and "not planned" in reply.json()["detail"], reply.text
                gen.queue.plan_relays(RelayPlan(version=2, sha256="other", sources=[attacker_url]))  # another version's
                reply = client.post(WEIGHTS_PATH, json=load_request_json(v1, [attacker_url]), headers=AUTH)
                assert reply.status_code == 409 and "no relay plan" in reply.json()["detail"], reply.text
                reply = client.post(WEIGHTS_PATH, json=load_request_json(v1, None), headers=AUTH)  # direct: fine
                assert reply.status_code == 202, reply.text
            gen.apply_desired_weights()
            assert gen.weights.loaded == 1 and asked == []
        finally:
            attacker.shutdown()
            gen.relay.stop()
            gen.reward.close()
            gen.queue.client.close()
