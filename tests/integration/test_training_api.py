"""The training API (services/reinforce/training_api/) as its own process, driven by the real `tinker` SDK
(tinker==0.38.0, the `api` extra) on a tiny random model: a supervised loop whose held-out loss falls, save_state and
a client created from it continuing bit for bit, a response lost on the way and retried being applied once, another
payload under a used seq_id refused with 409, a method this version does not support refused at once by name, and
the built-in ppo (with loss_fn_config) taking the same step as ppo written client-side for forward_backward_custom,
the API killed with -9 mid-loop and restarted and the loop ending bit-identically, requests sent out of seq_id order
applied in order, and an expired session's models saved and refused. docs/training-api.md's loop runs here too."""

from __future__ import annotations

import http.server
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import torch
import yaml
from conftest import stop_process
from safetensors.torch import load_file
from transformers import AutoTokenizer

from reinforce.core.names import LOCAL_HOST
from reinforce.supervisor.ports import free_port

tinker = pytest.importorskip("tinker", reason="the `api` extra (tinker==0.38.0) is not installed")
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as public_pb  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from reinforce.training_api.wire import PROTOBUF  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KEY = "tml-integration-test-key"
BASE_MODEL = "random_init"  # main.py's name of a random_init policy
HEADERS = {"X-API-Key": KEY}
# One sentence per datum, of one pattern; the supervised loop holds the last one out.
TEXTS = [f"the {animal} sat on the {thing}." for animal in ("cat", "dog", "hen") for thing in ("mat", "rug", "bed")]


class Api:
    """`python -m reinforce.training_api` on examples/tiny.yaml's model with an untied output layer (so the SDK's
    default train_unembed=True adapts lm_head), on one port for its life: a test can kill it with -9 and start it
    again, as the supervisor would."""

    def __init__(self, folder: Path, redis_url: str) -> None:
        spec = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
        spec["run_dir"] = str(folder / "run")
        spec["data"]["prompts"] = str(ROOT / "examples" / spec["data"]["prompts"])
        spec["policy"]["random_init"]["tie_word_embeddings"] = False
        (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
        self.folder, self.port = folder, free_port()
        self.command = [sys.executable, "-m", "reinforce.training_api", "--spec", str(folder / "spec.yaml")]
        self.command += ["--port", str(self.port), "--redis-url", redis_url]
        self.url = f"http://{LOCAL_HOST}:{self.port}"
        self.checkpoints = folder / "run" / "training_api"
        self.start()

    def start(self) -> None:
        env = {**os.environ, "REINFORCE_TRAINING_API_KEY": KEY}
        with (self.folder / "api.log").open("a") as log:
            self.proc = subprocess.Popen(self.command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_until_ready(self) -> None:
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, (self.folder / "api.log").read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}/api/v1/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the training API did not answer within 120 s"
            time.sleep(0.2)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def api_process(tmp_path_factory: pytest.TempPathFactory, redis_server: str) -> Iterator[Api]:
    process = Api(tmp_path_factory.mktemp("training-api"), redis_server)
    try:
        process.wait_until_ready()
        yield process
    finally:
        stop_process(process.proc)


@pytest.fixture(scope="module")
def api(api_process: Api) -> str:
    """The server's base URL."""
    return api_process.url


@pytest.fixture(scope="module")
def service(api: str) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=api, api_key=KEY)
    yield client
    client.close("success").result()


def datum(tokenizer, text: str) -> types.Datum:
    tokens = tokenizer.encode(text)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def logprobs(training, data: list[types.Datum]) -> list[list[float]]:
    return [out["logprobs"].tolist() for out in training.forward(data, "cross_entropy").result().loss_fn_outputs]


def train(training, data: list[types.Datum], steps: int, lr: float = 1e-2, clip: float = 0.0) -> list[float]:
    """`steps` of forward_backward + optim_step, each step's submitted before the one before it is awaited. Without
    clipping (clip 0) a gradient counted twice changes the second and later AdamW steps: clipping would scale it
    back to the same norm, and AdamW's first step is the same for any scale of the gradient."""
    losses = []
    for _ in range(steps):
        fb = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=lr, grad_clip_norm=clip))
        losses.append(fb.result().metrics["loss:sum"])
        optim.result()
    return losses


def test_a_supervised_loop_lowers_the_held_out_loss(service: tinker.ServiceClient):
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    assert training.get_info().lora_rank == 4
    tokenizer = training.get_tokenizer()  # loaded by the SDK from the folder get_info names
    data = [datum(tokenizer, text) for text in TEXTS[:-1]]
    held_out = [datum(tokenizer, TEXTS[-1])]
    before = training.forward(held_out, "cross_entropy").result()
    # the loss is the sum over tokens with the client's weights, nothing divided by the server
    weights = held_out[0].loss_fn_inputs["weights"].tolist()
    summed = -sum(w * lp for w, lp in zip(weights, before.loss_fn_outputs[0]["logprobs"].tolist(), strict=True))
    assert before.metrics["loss:sum"] == pytest.approx(summed, rel=1e-5)
    losses = train(training, data, steps=10, clip=10.0)
    after = training.forward(held_out, "cross_entropy").result().metrics["loss:sum"]
    assert losses[-1] < 0.6 * losses[0], losses
    assert after < before.metrics["loss:sum"]


def test_save_state_and_a_client_from_it_continue_bit_identically(service: tinker.ServiceClient):
    first = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
    data = [datum(first.get_tokenizer(), text) for text in TEXTS]
    train(first, data, steps=3)
    saved = first.save_state("after-3").result()
    assert re.fullmatch(rf"tinker://{re.escape(first.model_id)}/weights/after-3", saved.path)
    second = service.create_training_client_from_state_with_optimizer(saved.path).result()
    assert second.model_id != first.model_id
    assert logprobs(second, data) == logprobs(first, data)
    # the restored AdamW moments and step count make the next step the same step
    assert train(second, data, steps=2) == train(first, data, steps=2)
    assert logprobs(second, data) == logprobs(first, data)
    weights_only = service.create_training_client_from_state(saved.path).result()
    train(weights_only, data, steps=2)  # a fresh AdamW from the same weights: another trajectory
    assert logprobs(weights_only, data) != logprobs(first, data)


CLIP = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}  # not the defaults (0.8, 1.2): config must arrive


def ppo_by_hand(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO with CLIP's thresholds written client-side, as forward_backward_custom takes a loss."""
    loss = torch.zeros(())
    for one, lp in zip(data, logprobs, strict=True):
        ratio = torch.exp(lp - one.loss_fn_inputs["logprobs"].to_torch())
        advantages = one.loss_fn_inputs["advantages"].to_torch()
        clipped = torch.clamp(ratio, CLIP["clip_low_threshold"], CLIP["clip_high_threshold"])
        loss = loss - torch.min(ratio * advantages, clipped * advantages).sum()
    return loss, {}


def test_ppo_and_the_same_loss_through_forward_backward_custom_take_the_same_step(service: tinker.ServiceClient):
    """The built-in ppo with loss_fn_config, against ppo written client-side through forward_backward_custom (the
    SDK's `forward`, then a weighted cross_entropy): the same loss:sum, and the same AdamW step from the same
    adapter."""
    builtin = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    custom = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    plain = [datum(builtin.get_tokenizer(), text) for text in TEXTS[:3]]
    before = logprobs(builtin, plain)
    assert logprobs(custom, plain) == before
    data = []
    for one, lp in zip(plain, before, strict=True):
        # a sampler 0.3 nats off either way: ratios e^0.3 and e^-0.3, both outside [0.9, 1.1]
        sampler = [v + (0.3 if t % 2 else -0.3) for t, v in enumerate(lp)]
        advantages = [1.0 if t % 3 else -1.0 for t in range(len(lp))]
        inputs = {"target_tokens": one.loss_fn_inputs["target_tokens"], "logprobs": sampler, "advantages": advantages}
        data.append(types.Datum(model_input=one.model_input, loss_fn_inputs=inputs))
    fb = builtin.forward_backward(data, "ppo", loss_fn_config=CLIP).result()
    expected, _ = ppo_by_hand(data, [torch.tensor(lp) for lp in before])
    assert fb.metrics["loss:sum"] == pytest.approx(expected.item(), rel=1e-5)
    custom_fb = custom.forward_backward_custom(data, ppo_by_hand).result()
    assert custom_fb.metrics["loss:sum"] == pytest.approx(fb.metrics["loss:sum"], rel=1e-5)
    step = types.AdamParams(learning_rate=1e-3)
    builtin.optim_step(step).result()
    custom.optim_step(step).result()
    after, custom_after = logprobs(builtin, plain), logprobs(custom, plain)
    moved = max(abs(a - b) for new, old in zip(after, before, strict=True) for a, b in zip(new, old, strict=True))
    assert moved > 1e-3  # the step changed the model
    apart = max(abs(a - b) for x, y in zip(after, custom_after, strict=True) for a, b in zip(x, y, strict=True))
    assert apart < 1e-3 * moved, (apart, moved)


class DroppingProxy(http.server.ThreadingHTTPServer):
    """Forwards every request to the API; the response to the `drop_at`-th forward_backward is read from the API
    and never sent: the client's connection closes, and the SDK sends the request again."""

    def __init__(self, upstream: str, drop_at: int) -> None:
        self.upstream, self.drop_at, self.forward_backwards = upstream, drop_at, 0
        super().__init__((LOCAL_HOST, 0), _Forward)

    @property
    def url(self) -> str:
        return f"http://{LOCAL_HOST}:{self.server_address[1]}"


class _Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: DroppingProxy

    def do_GET(self) -> None:
        self._relay()

    def do_POST(self) -> None:
        self._relay()

    def _relay(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
        answer = httpx.request(
            self.command, self.server.upstream + self.path, headers=headers, content=body, timeout=60
        )
        if self.path == "/api/v1/forward_backward":
            self.server.forward_backwards += 1
            if self.server.forward_backwards == self.server.drop_at:
                self.close_connection = True  # the API has accepted it; its answer is lost
                return
        self.send_response(answer.status_code)
        for name, value in answer.headers.items():
            if name.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                self.send_header(name, value)
        self.send_header("content-length", str(len(answer.content)))
        self.end_headers()
        self.wfile.write(answer.content)

    def log_message(self, *args: object) -> None:
        """Quiet."""


def test_a_retried_request_is_applied_once(api: str, service: tinker.ServiceClient):
    proxy = DroppingProxy(api, drop_at=2)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    proxied = tinker.ServiceClient(base_url=proxy.url, api_key=KEY)
    try:
        disturbed = proxied.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
        undisturbed = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
        data = [datum(undisturbed.get_tokenizer(), text) for text in TEXTS]
        assert train(disturbed, data, steps=3) == train(undisturbed, data, steps=3)
        assert proxy.forward_backwards == 4  # 3 calls, the second sent twice
        # applied twice, its gradients would have counted double in the second step
        assert logprobs(disturbed, data) == logprobs(undisturbed, data)
    finally:
        proxied.close("success").result()
        proxy.shutdown()


def wait_for(api: str, request_id: str) -> dict:
    while True:
        answer = httpx.post(f"{api}/api/v1/retrieve_future", json={"request_id": request_id}, headers=HEADERS)
        assert answer.status_code == 200, answer.text
        if answer.json().get("type") != "try_again":
            return answer.json()


def test_another_payload_under_a_used_seq_id_is_refused_naming_both(api: str):
    post = lambda route, **body: httpx.post(f"{api}/api/v1/{route}", json=body, headers=HEADERS)  # noqa: E731
    session = post("create_session", tags=[], user_metadata=None, sdk_version="test").json()["session_id"]
    lora = {"rank": 2}
    created = post("create_model", session_id=session, model_seq_id=0, base_model=BASE_MODEL, lora_config=lora)
    model_id = wait_for(api, created.json()["request_id"])["model_id"]
    step = {"learning_rate": 1e-3, "beta1": 0.9}
    first = post("optim_step", model_id=model_id, seq_id=1, adam_params=step).json()
    # the same request again, its fields in another order: parsed, it is the same payload
    again = post("optim_step", seq_id=1, adam_params=dict(reversed(step.items())), model_id=model_id).json()
    assert again["request_id"] == first["request_id"]
    other = post("optim_step", model_id=model_id, seq_id=1, adam_params={**step, "learning_rate": 2e-3})
    assert other.status_code == 409
    detail = other.json()["detail"]
    assert first["request_id"] in detail and "optim_step" in detail and "seq_id 1" in detail
    assert "metrics" in wait_for(api, first["request_id"])  # applied, once


def test_an_unsupported_method_is_refused_at_once_by_name(service: tinker.ServiceClient):
    start = time.monotonic()
    with pytest.raises(tinker.BadRequestError, match=r"RestClient training-run.*not supported in this version"):
        service.create_rest_client().list_training_runs().result()
    assert time.monotonic() - start < 10  # refused, not retried for minutes


def test_the_docs_loop_runs(api: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    page = (ROOT / "docs" / "training-api.md").read_text()
    [code] = re.findall(r"^```python\n(.*?)^```", page, re.S | re.M)
    monkeypatch.setenv("TINKER_BASE_URL", api)
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    exec(compile(code, "docs/training-api.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    losses = [float(line.split()[1]) for line in printed[:10]]
    assert losses[-1] < losses[0]
    assert printed[10].startswith("tinker://") and printed[10].endswith("/weights/final")


PROMPT = "the cat"


def sample(sampler, prompt: list[int], n: int = 1, **params) -> list[types.SampledSequence]:
    return sampler.sample(types.ModelInput.from_ints(prompt), n, types.SamplingParams(**params)).result().sequences


def test_samples_with_a_seed_repeat_and_their_log_probs_are_forwards(service: tinker.ServiceClient):
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=4).result()
    tokenizer = training.get_tokenizer()
    train(training, [datum(tokenizer, text) for text in TEXTS], steps=2)
    saved = training.save_weights_for_sampler("two-steps").result()
    assert saved.path == f"tinker://{training.model_id}/sampler_weights/two-steps"
    sampler = service.create_sampling_client(model_path=saved.path)
    prompt = tokenizer.encode(PROMPT)
    first = sample(sampler, prompt, n=3, max_tokens=12, seed=11, temperature=1.0)
    assert [s.tokens for s in sample(sampler, prompt, n=3, max_tokens=12, seed=11)] == [s.tokens for s in first]
    assert len(first) == 3 and len({tuple(s.tokens) for s in first}) > 1  # three draws, not one repeated
    assert len({s.sequence_id for s in first}) == 3
    # each sampled token's log-prob is the training client's forward of the same tokens (both fp32)
    for seq in first:
        full = prompt + seq.tokens
        data = [types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
        )]  # fmt: skip
        [forward] = logprobs(training, data)
        assert seq.logprobs == pytest.approx(forward[len(prompt) - 1 :], abs=1e-5)
        assert forward[: len(prompt) - 1] == pytest.approx(
            sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:], abs=1e-5
        )


def test_num_samples_and_a_stop_sequence_hold(service: tinker.ServiceClient):
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    prompt = training.get_tokenizer().encode(PROMPT)
    sampler = training.save_weights_and_get_sampling_client().result()
    space = training.get_tokenizer().encode(" ")[-1]  # after the BOS it begins with
    stopped = sample(sampler, prompt, n=5, max_tokens=30, seed=3, stop=" ")
    assert len(stopped) == 5
    for seq in stopped:
        # a random model: a sample stops at its first space or runs to max_tokens
        assert (seq.stop_reason, seq.tokens.count(space)) in {("stop", 1), ("length", 0)}
        assert seq.stop_reason == "length" or seq.tokens[-1] == space
        assert len(seq.tokens) <= 30
    assert any(seq.stop_reason == "stop" for seq in stopped)
    unstopped = sample(sampler, prompt, n=2, max_tokens=30, seed=3, stop=[])
    assert [len(seq.tokens) for seq in unstopped] == [30, 30]
    greedy = sample(sampler, prompt, n=2, max_tokens=8, temperature=0.0)
    assert greedy[0].tokens == greedy[1].tokens
    # a new adapter (B = 0) is the base model: a sampling client of the base alone draws the same tokens
    base = service.create_sampling_client(base_model=BASE_MODEL).result()
    assert [s.tokens for s in sample(base, prompt, n=5, max_tokens=30, seed=3, stop=" ")] == [s.tokens for s in stopped]


def test_a_snapshot_samples_as_it_was_while_training_goes_on(service: tinker.ServiceClient):
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=6).result()
    tokenizer = training.get_tokenizer()
    prompt = tokenizer.encode(PROMPT)
    before = training.save_weights_and_get_sampling_client().result()
    drawn = [s.tokens for s in sample(before, prompt, n=4, max_tokens=10, seed=9)]
    train(training, [datum(tokenizer, text) for text in TEXTS], steps=3, lr=5e-2)
    assert [s.tokens for s in sample(before, prompt, n=4, max_tokens=10, seed=9)] == drawn
    after = training.save_weights_and_get_sampling_client().result()
    assert [s.tokens for s in sample(after, prompt, n=4, max_tokens=10, seed=9)] != drawn
    # the prompt's log-probs under each snapshot: the old one's unchanged, the new one's the trained model's
    [now] = logprobs(training, [datum(tokenizer, PROMPT)])
    scored = types.ModelInput.from_ints(prompt)
    assert after.compute_logprobs(scored).result()[1:] == pytest.approx(now, abs=1e-5)
    assert before.compute_logprobs(scored).result()[1:] != pytest.approx(now, abs=1e-3)


def adapter_tensors(api_process: Api, training, name: str) -> dict[str, torch.Tensor]:
    """The adapter of `training` as save_state writes it, read from the run folder."""
    path = training.save_state(name).result().path
    assert path == f"tinker://{training.model_id}/weights/{name}"
    return load_file(api_process.checkpoints / training.model_id / "weights" / name / "adapter.safetensors")


def split_steps(training, data: list[types.Datum], steps: int, disturb: Disturbance | None = None) -> list[float]:
    """`steps` of two forward_backwards (their gradients add up) and an optim_step. In the second step, once the
    first forward_backward is done (its gradients then live in the model's memory and its live snapshot alone),
    `disturb.before` runs, then the second and the step are submitted, then `disturb.after`."""
    losses = []
    for step in range(steps):
        first = training.forward_backward(data[:4], "cross_entropy")
        losses.append(first.result().metrics["loss:sum"])
        if disturb is not None and step == 1:
            disturb.before()
        second = training.forward_backward(data[4:], "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=1e-2))
        if disturb is not None and step == 1:
            disturb.after(training.model_id, 6)  # the step's seq_id: 3 requests a step
        losses.append(second.result().metrics["loss:sum"])
        optim.result()
    return losses


class Disturbance:
    """Keep the API's one worker thread busy with a long sample of the base model, so that the requests submitted
    next wait in its queue, accepted and unfinished; once the last of them is accepted, kill the API with -9 and
    start it again (the supervisor's job under `reinforce serve`)."""

    def __init__(self, api_process: Api, redis_url: str) -> None:
        self.api_process, self.redis = api_process, redis.Redis.from_url(redis_url)

    def before(self) -> None:
        raw = Raw(self.api_process.url)
        raw.post("create_sampling_session", session_id=raw.session, sampling_session_seq_id=0, base_model=BASE_MODEL)
        sample = types.SampleRequest(
            sampling_session_id=f"{raw.session}:sample:0", seq_id=1, num_samples=8,
            prompt=types.ModelInput.from_ints([1, 2, 3]),
            sampling_params=types.SamplingParams(max_tokens=100, seed=1, stop=[]),
        )  # fmt: skip
        answer = httpx.post(f"{raw.api}/api/v1/asample", content=sample.model_dump_json(), headers=HEADERS, timeout=60)
        assert answer.status_code == 200, answer.text

    def after(self, model_id: str, seq_id: int) -> None:
        deadline = time.monotonic() + 30
        while not self.redis.exists(f"tinker:seq:{model_id}:{seq_id}"):
            assert time.monotonic() < deadline, f"seq_id {seq_id} of {model_id} was not accepted within 30 s"
            time.sleep(0.005)
        self.api_process.kill()
        self.api_process.start()


def test_a_killed_api_comes_back_where_it_was_and_the_loop_finishes_bit_identically(
    api_process: Api, service: tinker.ServiceClient, redis_server: str
):
    """kill -9 of the API in the middle of an SDK loop, then a restart (the supervisor's job under `reinforce
    serve`): the SDK retries, the worker brings every model back from its live snapshot and computes what was
    accepted and not finished once; the losses and the final adapter equal an undisturbed loop's bit for bit."""
    undisturbed = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=8).result()
    disturbed = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=8).result()
    data = [datum(undisturbed.get_tokenizer(), text) for text in TEXTS]
    expected = split_steps(undisturbed, data, steps=3)
    killed = api_process.proc.pid
    assert split_steps(disturbed, data, steps=3, disturb=Disturbance(api_process, redis_server)) == expected
    assert api_process.proc.pid != killed
    assert (api_process.folder / "api.log").read_text().count("recovered") == 2  # a start, and the restart's
    got, want = adapter_tensors(api_process, disturbed, "final"), adapter_tensors(api_process, undisturbed, "final")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in got)
    assert logprobs(disturbed, data) == logprobs(undisturbed, data)


def forward_backward_body(model_id: str, seq_id: int, data: list[types.Datum]) -> bytes:
    """The protobuf body the SDK would send."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id,
    )  # fmt: skip
    return forward_backward_request_to_proto(request).SerializeToString()


class Raw:
    """A client that speaks the API over raw HTTP, posting requests in any seq_id order."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.session = self.post("create_session", tags=[], user_metadata=None, sdk_version="raw").json()["session_id"]
        self.models = 0

    def post(self, route: str, **body: object) -> httpx.Response:
        return httpx.post(f"{self.api}/api/v1/{route}", json=body, headers=HEADERS, timeout=60)

    def create(self, seed: int) -> str:
        lora = {"rank": 4, "seed": seed}
        created = self.post("create_model", session_id=self.session, model_seq_id=self.models, base_model=BASE_MODEL,
                            lora_config=lora)  # fmt: skip
        self.models += 1
        return wait_for(self.api, created.json()["request_id"])["model_id"]

    def send(self, model_id: str, seq_id: int, kind: str, data: list[types.Datum]) -> httpx.Response:
        if kind == "forward_backward":
            headers = {**HEADERS, "content-type": PROTOBUF}
            body = forward_backward_body(model_id, seq_id, data)
            return httpx.post(f"{self.api}/api/v1/forward_backward", content=body, headers=headers, timeout=60)
        if kind == "optim_step":
            return self.post("optim_step", model_id=model_id, seq_id=seq_id, adam_params={"learning_rate": 1e-2})
        return self.post("save_weights", model_id=model_id, seq_id=seq_id, path=f"seq-{seq_id}")


def result_of(api: str, request_id: str) -> object:
    """A finished request's result: a forward_backward's parsed protobuf, the others' JSON less the model's path."""
    answer = httpx.post(f"{api}/api/v1/retrieve_future", json={"request_id": request_id}, headers=HEADERS, timeout=60)
    if answer.headers["content-type"].startswith(PROTOBUF):
        output = public_pb.ForwardBackwardOutput()
        output.ParseFromString(answer.content)
        return output
    found = answer.json()
    assert found.get("type") != "try_again" and "error" not in found, found
    return {key: value for key, value in found.items() if key != "path"}


def test_requests_sent_out_of_seq_id_order_are_applied_in_order(api_process: Api, redis_server: str):
    """Two models of one seed get the same requests, one in seq_id order, the other shuffled (the step and the save
    before the gradients they come after): each request waits for its predecessor, so every result and the saved
    adapters are the same bit for bit. A seq_id the server refused is no gap to wait for."""
    raw = Raw(api_process.url)
    tokenizer = AutoTokenizer.from_pretrained(api_process.folder / "run" / "initial_policy")
    data = [datum(tokenizer, text) for text in TEXTS]
    plan = {1: ("forward_backward", data[:4]), 2: ("forward_backward", data[4:]),
            3: ("optim_step", []), 4: ("forward_backward", data[:2]), 5: ("save_weights", [])}  # fmt: skip
    ordered, shuffled = raw.create(seed=9), raw.create(seed=9)
    in_order = {seq: raw.send(ordered, seq, *plan[seq]).json()["request_id"] for seq in sorted(plan)}
    out_of_order = {seq: raw.send(shuffled, seq, *plan[seq]).json()["request_id"] for seq in (5, 3, 4, 2)}
    time.sleep(1.0)  # time for the worker to apply them, were it to take them as they came
    statuses = redis.Redis.from_url(redis_server)
    assert [statuses.hget(f"tinker:request:{i}", "status") for i in out_of_order.values()] == [b"pending"] * 4
    out_of_order[1] = raw.send(shuffled, 1, *plan[1]).json()["request_id"]
    for seq in sorted(plan):
        assert result_of(raw.api, out_of_order[seq]) == result_of(raw.api, in_order[seq]), seq
    first = load_file(api_process.checkpoints / ordered / "weights" / "seq-5" / "adapter.safetensors")
    second = load_file(api_process.checkpoints / shuffled / "weights" / "seq-5" / "adapter.safetensors")
    assert all(torch.equal(first[name], second[name]) for name in first)

    gapped = raw.create(seed=10)
    bad = [types.Datum(model_input=types.ModelInput.from_ints([10**6]), loss_fn_inputs={"target_tokens": [1]})]
    assert raw.send(gapped, 1, "forward_backward", bad).status_code == 400
    start = time.monotonic()
    assert "path" in wait_for(raw.api, raw.send(gapped, 2, "save_weights", []).json()["request_id"])
    assert time.monotonic() - start < 20  # not the worker's GAP_WAIT_S for a seq_id nothing came under


def test_an_expired_sessions_models_are_saved_and_its_requests_refused_naming_it(api_process: Api, redis_server: str):
    """A session marked expired in Redis (as the worker marks one silent for --session-timeout-s; the unit tests
    time one out) has its models saved and unloaded by the worker, and every request on them refused with 410."""
    raw = Raw(api_process.url)
    model_id = raw.create(seed=11)
    redis.Redis.from_url(redis_server).hset(f"tinker:session:{raw.session}", "expiry", f"session {raw.session} expired")
    saved = api_process.checkpoints / model_id / "weights" / "session-expired"
    deadline = time.monotonic() + 20
    while not saved.is_dir():
        assert time.monotonic() < deadline, "the worker did not save the expired session's model"
        time.sleep(0.1)
    refused = raw.send(model_id, 1, "optim_step", [])
    assert refused.status_code == 410 and raw.session in refused.json()["detail"]
    assert raw.post("session_heartbeat", session_id=raw.session).status_code == 410  # the SDK stops its heartbeats
    info = raw.post("get_info", model_id=model_id)
    assert info.status_code == 404  # unloaded
