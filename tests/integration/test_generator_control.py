"""The generator's HTTP control plane, in-process: probes, the token, and loading weight versions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from google.protobuf.json_format import MessageToDict
from transformers import PreTrainedModel

from reinforce.core.models import load_policy, materialize_policy
from reinforce.core.records_pb2 import WeightVersion
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import RunSpec
from reinforce.core.weights import publish
from reinforce.generator.worker import Generator, control_plane

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


def post(http: TestClient, weights: WeightVersion) -> None:
    """POST a version as the supervisor's reconciler does (proto3 JSON) and expect it accepted."""
    reply = http.post("/v1/weights", json=MessageToDict(weights), headers=AUTH)
    assert reply.status_code == 202, reply.text
    assert reply.json() == {"accepted_version": weights.version}


def weights_status(http: TestClient) -> dict:
    reply = http.get("/v1/weights", headers=AUTH)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_probes_and_metrics_are_open(http: TestClient) -> None:
    assert http.get("/healthz").json() == {"ok": True}
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json() == {"ready": True, "weight_version": 0}
    metrics = http.get("/metrics")
    assert metrics.status_code == 200
    assert "reinforce_generator_weight_version 0.0" in metrics.text


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
    assert http.get("/v1/weights", headers=headers).status_code == 401
    body = MessageToDict(WeightVersion(version=3, uri="/nowhere", sha256="00"))
    assert http.post("/v1/weights", json=body, headers=headers).status_code == 401
    assert gen.weights.desired is None  # a refused request changes nothing


def test_posted_version_is_loaded(http: TestClient, gen: Generator, spec: RunSpec, tmp_path: Path) -> None:
    assert weights_status(http) == {"loaded_version": 0, "loads": 0, "desired_version": None, "last_error": ""}
    trained = perturbed_policy(spec, seed=1)
    assert not same_weights(gen.engine.model, state(trained))
    post(http, publish(trained, tmp_path / "weights", version=1))
    # Accepting only records the wish: the worker loads it between batches.
    assert weights_status(http) == {"loaded_version": 0, "loads": 0, "desired_version": 1, "last_error": ""}
    gen.apply_desired_weights()
    assert weights_status(http) == {"loaded_version": 1, "loads": 1, "desired_version": 1, "last_error": ""}
    assert same_weights(gen.engine.model, state(trained))
    assert "reinforce_generator_weight_version 1.0" in http.get("/metrics").text


def test_corrupted_weight_file_is_refused(http: TestClient, gen: Generator, spec: RunSpec, tmp_path: Path) -> None:
    good = perturbed_policy(spec, seed=1)
    post(http, publish(good, tmp_path / "weights", version=1))
    gen.apply_desired_weights()
    bad = publish(perturbed_policy(spec, seed=2), tmp_path / "weights", version=2)
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


def test_rollback_to_an_older_version(http: TestClient, gen: Generator, spec: RunSpec, tmp_path: Path) -> None:
    older, newer = perturbed_policy(spec, seed=1), perturbed_policy(spec, seed=2)
    v1 = publish(older, tmp_path / "weights", version=1)
    v2 = publish(newer, tmp_path / "weights", version=2)
    post(http, v2)
    gen.apply_desired_weights()
    assert same_weights(gen.engine.model, state(newer))
    # A trainer resumed from an earlier checkpoint publishes an older version: the latest request wins.
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
    reply = http.post("/v1/weights", json=body, headers=AUTH)
    assert reply.status_code == 422, reply.text
    assert gen.weights.desired is None


def test_a_body_that_is_not_json_is_422(http: TestClient, gen: Generator) -> None:
    headers = {**AUTH, "Content-Type": "application/json"}
    assert http.post("/v1/weights", content=b"{not json", headers=headers).status_code == 422
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
