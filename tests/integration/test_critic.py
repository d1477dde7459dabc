"""The critic service on a tiny random Llama: the real server (uvicorn) and the real client over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
import yaml
from transformers import LlamaConfig, LlamaForSequenceClassification

from reinforce.core.checkpoints import checkpoint_step, list_checkpoints
from reinforce.core.critic_api import Minibatch, TrainRequest, ValuesRequest
from reinforce.core.names import CRITIC_TOKEN_ENV
from reinforce.core.policy import load_policy, materialize_policy
from reinforce.core.spec import CriticSpec, PolicySpec, RandomInit, dump_spec, parse_spec
from reinforce.critic.checkpoint import SET_ASIDE
from reinforce.critic.config import CriticConfig
from reinforce.critic.critic import Critic
from reinforce.critic.main import main
from reinforce.critic.server import create_app
from reinforce.critic.value_model import load_value_model, response_values
from reinforce.supervisor.ports import free_port
from reinforce.trainer.critic_client import CriticClient, CriticError

TOKEN = "critic-test-token"
TINY = RandomInit(hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2)
# Rows of different lengths (and an empty response) so that padding is exercised; ids < 35, the tiny vocabulary.
PROMPTS = [[1, 5, 6], [1, 7], [1, 8, 9, 10]]
RESPONSES = [[11, 12, 13], [], [14, 15, 16, 17, 2]]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)  # the test machine's cores are shared
    return materialize_policy(PolicySpec(random_init=TINY), tmp_path_factory.mktemp("critic") / "policy", seed=0)


@pytest.fixture
def config(policy_dir: Path, tmp_path: Path) -> CriticConfig:
    # a learning rate that moves a tiny model visibly in a few steps; a token budget that splits PROMPTS and RESPONSES
    # into micro-batches, so that they are exercised
    return CriticConfig(
        model=policy_dir, checkpoints=tmp_path / "checkpoints", critic=CriticSpec(lr=1e-2, micro_batch_tokens=8)
    )


@contextmanager
def serving(critic: Critic) -> Iterator[CriticClient]:
    """The real app under uvicorn in a thread, and a client of it."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(critic, TOKEN), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    client = CriticClient(f"http://127.0.0.1:{port}", TOKEN, max_retries=2, backoff_s=0.05)
    try:
        yield client
    finally:
        client.close()
        server.should_exit = True
        thread.join(timeout=20)


def minibatch(prompts: list[list[int]], responses: list[list[int]], target: float, old: list[list[float]]) -> Minibatch:
    return Minibatch(
        prompt_token_ids=prompts,
        response_token_ids=responses,
        returns=[[target] * len(r) for r in responses],
        old_values=old,
    )


def randomize_head(critic: Critic, seed: int = 1) -> None:
    """The policy init's head is zero (every value 0); alignment tests need values that differ per position."""
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        critic.model.head.weight.copy_(torch.randn(critic.model.head.weight.shape, generator=noise))
        critic.model.head.bias.fill_(0.1)


def test_policy_init_values_start_at_zero(config: CriticConfig) -> None:
    with serving(Critic(config)) as client:
        assert client.values(PROMPTS, RESPONSES) == [[0.0] * 3, [], [0.0] * 5]


def test_policy_init_body_is_the_policy_without_its_lm_head(policy_dir: Path) -> None:
    body = load_value_model(policy_dir, "policy").body.state_dict()
    policy = load_policy(policy_dir).base_model.state_dict()
    assert body.keys() == policy.keys()
    assert all(torch.equal(body[k], policy[k]) for k in policy)


def test_values_are_one_per_response_token_and_equal_a_direct_forward(config: CriticConfig) -> None:
    critic = Critic(config)
    randomize_head(critic)
    with serving(critic) as client:
        values = client.values(PROMPTS, RESPONSES)
    assert [len(v) for v in values] == [len(r) for r in RESPONSES]
    with torch.no_grad():
        for prompt, response, got in zip(PROMPTS, RESPONSES, values, strict=True):
            # one unpadded sequence at a time: V(s_t) is the head on the hidden state at len(prompt) - 1 + t, the
            # state that predicts response token t (where response_logprobs reads log pi(y_t))
            ids = torch.tensor([prompt + response])
            hidden = critic.model.body(input_ids=ids).last_hidden_state[0]
            direct = critic.model.head(hidden).squeeze(-1)[len(prompt) - 1 : len(prompt) - 1 + len(response)]
            assert torch.allclose(torch.tensor(got), direct, atol=1e-5)


def test_a_value_is_the_state_before_its_token(config: CriticConfig) -> None:
    critic = Critic(config)
    randomize_head(critic)
    with serving(critic) as client:
        base = client.values([[1, 5]], [[11, 12, 13]])[0]
        last_changed = client.values([[1, 5]], [[11, 12, 20]])[0]
        first_changed = client.values([[1, 5]], [[20, 12, 13]])[0]
    assert last_changed == base  # no value sees the last token: it is emitted after the last state
    assert first_changed[0] == base[0]  # V(s_0) is the prompt's state
    assert first_changed[1] != base[1] and first_changed[2] != base[2]


def test_training_on_a_fixed_target_lowers_the_critic_loss(config: CriticConfig) -> None:
    losses = []
    with serving(Critic(config)) as client:
        for _ in range(8):
            old = client.values(PROMPTS, RESPONSES)
            result = client.train([minibatch(PROMPTS, RESPONSES, 1.0, old)])
            assert len(result.minibatches) == 1 and result.minibatches[0].tokens == 8
            losses.append(result.critic_loss)
        assert result.train_steps == 8
    # V = 0 and R = 1 everywhere at first: 0.5 * 1^2
    assert losses[0] == pytest.approx(0.5)
    assert losses[-1] < 0.25 * losses[0], losses


def test_micro_batches_by_token_budget_give_the_values_and_step_of_one_batch(config: CriticConfig) -> None:
    """critic.micro_batch_tokens 8 splits the rows three ways, packed longest first (the values come back in the
    request's order); unlimited, they are one forward. The values and the step's weights agree."""
    assert [p.rows.tolist() for p in Critic(config)._micro_batches(PROMPTS, RESPONSES)] == [[2], [0], [1]]
    whole = replace(config, critic=config.critic.model_copy(update={"micro_batch_tokens": None}))
    critics = [Critic(config), Critic(whole)]
    assert len(critics[1]._micro_batches(PROMPTS, RESPONSES)) == 1
    values, weights = [], []
    for critic in critics:
        randomize_head(critic)
        values.append(critic.values(ValuesRequest(prompt_token_ids=PROMPTS, response_token_ids=RESPONSES)).values)
        critic.train(TrainRequest(minibatches=[minibatch(PROMPTS, RESPONSES, 1.0, values[-1])]))
        weights.append(torch.cat([p.detach().flatten() for p in critic.model.parameters()]))
    assert [len(v) for v in values[0]] == [3, 0, 5]
    for split, one in zip(values[0], values[1], strict=True):
        assert split == pytest.approx(one, abs=1e-6)
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=1e-6)


def test_one_optimizer_step_per_minibatch(config: CriticConfig) -> None:
    with serving(Critic(config)) as client:
        zeros = [[0.0] * len(r) for r in RESPONSES]
        result = client.train(
            [minibatch(PROMPTS, RESPONSES, 1.0, zeros), minibatch(PROMPTS[:1], RESPONSES[:1], -1.0, [[0.0] * 3])]
        )
        assert [m.tokens for m in result.minibatches] == [8, 3]
        assert result.train_steps == 2
        assert client.wait_ready(deadline_s=5).train_steps == 2


def test_v1_needs_the_token_and_probes_do_not(config: CriticConfig) -> None:
    with serving(Critic(config)) as client:
        url = client.base_url
        body = {"prompt_token_ids": [[1]], "response_token_ids": [[2]]}
        assert httpx.post(url + "/v1/values", json=body).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.post(url + "/v1/values", json=body, headers=wrong).status_code == 401
        assert httpx.post(url + "/v1/checkpoint", json={"step": 1}).status_code == 401
        assert httpx.get(url + "/healthz").status_code == 200
        assert httpx.get(url + "/readyz").json()["ready"] is True
        with pytest.raises(CriticError, match="401"):
            CriticClient(url, "wrong-token").values([[1]], [[2]])


def _raw_post(port: int, headers: str) -> str:
    """Send only the headers of a POST that announces a 1 GB body, and return the first line of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST /v1/train HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n{headers}\r\n".encode())
        return sock.recv(4096).decode().splitlines()[0]


def test_token_and_size_are_checked_before_the_body_is_read(config: CriticConfig) -> None:
    with serving(Critic(config)) as client:
        port = httpx.URL(client.base_url).port
        # the body never comes: an answer at all proves that nobody waited to read it
        assert " 401 " in _raw_post(port, "")
        assert " 413 " in _raw_post(port, f"Authorization: Bearer {TOKEN}\r\n")


def test_malformed_requests_are_422(config: CriticConfig) -> None:
    with serving(Critic(config)) as client:
        with pytest.raises(CriticError, match=r"422.*past the vocabulary"):
            client.values([[1]], [[2, 10_000]])
        url, auth = client.base_url, {"Authorization": f"Bearer {TOKEN}"}
        short_returns = {
            "minibatches": [{**minibatch([[1]], [[2, 3]], 1.0, [[0.0, 0.0]]).model_dump(), "returns": [[1.0]]}]
        }
        answer = httpx.post(url + "/v1/train", json=short_returns, headers=auth)
        assert answer.status_code == 422 and "returns[0] has 1 values for 2 response tokens" in answer.text
        # 1e999 parses as inf, which no return may be
        infinite = b'{"minibatches": [{"prompt_token_ids": [[1]], "response_token_ids": [[2]], "returns": [[1e999]], '
        infinite += b'"old_values": [[0.0]]}]}'
        assert httpx.post(url + "/v1/train", content=infinite, headers=auth).status_code == 422
        assert httpx.post(url + "/v1/values", content=b"not json", headers=auth).status_code == 422


def test_a_non_finite_gradient_is_refused_and_changes_nothing(config: CriticConfig) -> None:
    critic = Critic(config)
    with serving(critic) as client:
        before = _state(critic)
        zeros = [[0.0] * len(r) for r in RESPONSES]
        # 1e300 is a finite JSON number but inf in float32: the loss and its gradient overflow
        with pytest.raises(CriticError, match="minibatch 1: non-finite critic gradient"):
            client.train([minibatch(PROMPTS, RESPONSES, 1.0, zeros), minibatch(PROMPTS, RESPONSES, 1e300, zeros)])
        assert client.wait_ready(deadline_s=5).train_steps == 1  # the first minibatch's step stands
        after_first = _state(critic)
        with pytest.raises(CriticError, match="minibatch 0: non-finite"):
            client.train([minibatch(PROMPTS, RESPONSES, 1e300, zeros)])
    assert any(not torch.equal(before[k], v) for k, v in after_first.items())
    assert all(torch.equal(after_first[k], v) for k, v in _state(critic).items())


def _state(critic: Critic) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in critic.model.state_dict().items()}


def test_checkpoint_and_restart_give_bit_identical_values_and_next_step(config: CriticConfig) -> None:
    step = minibatch(PROMPTS, RESPONSES, 0.7, [[0.1] * len(r) for r in RESPONSES])
    first = Critic(config)
    with serving(first) as client:
        for target in (1.0, -0.5):
            client.train([minibatch(PROMPTS, RESPONSES, target, client.values(PROMPTS, RESPONSES))])
        saved = client.checkpoint(2)
        assert saved.train_steps == 2 and Path(saved.path).name == "step-000002"
        values_at_checkpoint = client.values(PROMPTS, RESPONSES)
        next_step = client.train([step])
        values_after = client.values(PROMPTS, RESPONSES)
    state_after = _state(first)

    second = Critic(config)  # a new process would do exactly this: build, then resume from the latest checkpoint
    assert (second.train_steps, second.checkpoint_step) == (2, 2)
    with serving(second) as client:
        assert client.values(PROMPTS, RESPONSES) == values_at_checkpoint
        again = client.train([step])
        assert again == next_step  # loss, gradient norm, clip fraction: the same floats
        assert client.values(PROMPTS, RESPONSES) == values_after
    assert all(torch.equal(state_after[k], v) for k, v in _state(second).items())


def test_restore_goes_back_and_drops_newer_checkpoints(config: CriticConfig) -> None:
    critic = Critic(replace(config, keep_checkpoints=3))
    with serving(critic) as client:
        for step in (1, 2, 3):
            client.train([minibatch(PROMPTS, RESPONSES, float(step), client.values(PROMPTS, RESPONSES))])
            client.checkpoint(step)
            if step == 1:
                at_one = client.values(PROMPTS, RESPONSES)
        restored = client.restore(1)
        assert restored.train_steps == 1
        assert client.values(PROMPTS, RESPONSES) == at_one
        with pytest.raises(CriticError, match="404"):
            client.restore(7)
    assert [checkpoint_step(p) for p in list_checkpoints(config.checkpoints)] == [1]


def test_only_the_newest_checkpoints_are_kept_and_a_step_can_be_rewritten(config: CriticConfig) -> None:
    with serving(Critic(config)) as client:
        for step in (1, 2, 3, 3):
            client.checkpoint(step)
    assert [p.name for p in list_checkpoints(config.checkpoints)] == ["step-000002", "step-000003"]
    assert sorted(p.name for p in config.checkpoints.iterdir()) == ["step-000002", "step-000003"]  # no leftovers


def test_metrics(config: CriticConfig) -> None:
    with serving(Critic(config)) as client:
        client.train([minibatch(PROMPTS, RESPONSES, 1.0, [[0.0] * len(r) for r in RESPONSES])])
        httpx.post(client.base_url + "/v1/values", json={})  # no token
        text = httpx.get(client.base_url + "/metrics").text
    assert "reinforce_critic_train_steps 1.0" in text
    assert "reinforce_critic_train_tokens_total 8.0" in text
    assert 'reinforce_critic_requests_total{code="200",endpoint="/v1/train"} 1.0' in text
    assert 'reinforce_critic_requests_total{code="401",endpoint="/v1/values"} 1.0' in text
    assert 'reinforce_critic_request_seconds_count{endpoint="/v1/train"} 1.0' in text
    assert "reinforce_critic_loss 0.5" in text


def tiny_reward_model(folder: Path, num_labels: int) -> Path:
    config = LlamaConfig(
        vocab_size=35, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, pad_token_id=0, num_labels=num_labels,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    return folder


def test_init_from_a_reward_model_copies_its_score_head(tmp_path: Path) -> None:
    folder = tiny_reward_model(tmp_path / "rm", num_labels=1)
    reward_model = LlamaForSequenceClassification.from_pretrained(folder).eval()
    critic = load_value_model(folder, "reward_model")
    prompt, response = [1, 5, 6], [11, 12, 13]
    with torch.no_grad():
        values, _ = response_values(critic, [prompt], [response])
        # the last value is V(s_{n-1}), the state after prompt + response[:-1]: where the reward model would score it
        score = reward_model(input_ids=torch.tensor([prompt + response[:-1]])).logits[0, 0]
    assert values[0, -1].item() == pytest.approx(score.item(), abs=1e-5)


def test_init_from_a_reward_model_needs_one_label(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_labels 1, not 2"):
        load_value_model(tiny_reward_model(tmp_path / "rm", num_labels=2), "reward_model")


@pytest.mark.slow
def test_client_rides_out_a_killed_and_restarted_critic(tmp_path: Path) -> None:
    """The command line service in its own process: killed with SIGKILL, restarted, resumed from its checkpoint.
    Its metrics on a port of their own, as in a pod (R3-9)."""
    port, metrics_port = free_port(), free_port()
    spec = write_run_spec(tmp_path, {"lr": 1e-2, "max_grad_norm": 0.5, "value_clip": 0.3})
    argv = [sys.executable, "-m", "reinforce.critic", "--spec", str(spec), "--port", str(port)]
    argv += ["--metrics-port", str(metrics_port)]
    env = {**os.environ, CRITIC_TOKEN_ENV: TOKEN, "OMP_NUM_THREADS": "1"}
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        started.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        return started[-1]

    client = CriticClient(f"http://127.0.0.1:{port}", TOKEN, max_retries=40, backoff_s=0.2, max_backoff_s=1.0)
    try:
        first = start()
        client.wait_ready(deadline_s=120)
        client.train([minibatch(PROMPTS, RESPONSES, 1.0, client.values(PROMPTS, RESPONSES))])
        client.checkpoint(1)
        before = client.values(PROMPTS, RESPONSES)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)

        answer: list[list[list[float]]] = []
        waiting = threading.Thread(target=lambda: answer.append(client.values(PROMPTS, RESPONSES)))
        waiting.start()  # the critic is down: this request retries until the new one listens
        time.sleep(1.0)
        start()
        waiting.join(timeout=120)
        assert answer == [before]  # resumed from step 1's checkpoint, in another process: the same floats
        ready = client.wait_ready(deadline_s=5)
        assert (ready.train_steps, ready.checkpoint_step) == (1, 1)
        assert "reinforce_critic_train_steps 1.0" in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    finally:
        client.close()
        for proc in started:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        for proc in started[1:]:
            assert proc.returncode in (0, -signal.SIGTERM), proc.stderr.read().decode() if proc.stderr else ""


def write_run_spec(folder: Path, critic: dict) -> Path:
    """A run spec of the tiny model whose run folder is `folder`/run, with this `critic` section."""
    spec = parse_spec(
        {
            "name": "critic-test",
            "run_dir": str(folder / "run"),
            "policy": {"random_init": TINY.model_dump()},
            "data": {"prompts": str(folder / "prompts.txt")},
            "algorithm": {"name": "ppo"},
            "critic": critic,
        }
    )
    path = folder / "spec.yaml"
    path.write_text(dump_spec(spec))
    return path


def test_config_from_the_run_spec(tmp_path: Path) -> None:
    spec = parse_spec(yaml.safe_load(write_run_spec(tmp_path, {"lr": 1e-3}).read_text()))
    config = CriticConfig.from_spec(spec, port=1234)
    assert config.model == tmp_path / "run" / "initial_policy"
    assert config.checkpoints == tmp_path / "run" / "critic_checkpoints"
    assert (config.critic.lr, config.critic.weight_decay, config.port) == (1e-3, 0.1, 1234)
    assert config.keep_checkpoints == spec.training.keep_checkpoints
    # what the run's trainer sends at most: a step's samples, every PPO epoch of them, in one train request
    assert config.max_rows == spec.training.prompts_per_step * spec.algorithm.num_rollouts_per_prompt
    assert config.max_row_tokens == spec.data.max_prompt_tokens + spec.generation.max_new_tokens
    assert config.trainer_checkpoints == tmp_path / "run" / "checkpoints"


def test_command_line_needs_a_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CRITIC_TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit, match=CRITIC_TOKEN_ENV):
        main(["--spec", str(write_run_spec(tmp_path, {}))])


def test_restore_of_step_zero_without_a_checkpoint_is_the_fresh_critic(config: CriticConfig) -> None:
    """A trainer that starts over before its first checkpoint takes the critic back to its start."""
    with serving(Critic(config)) as client:
        client.train([minibatch(PROMPTS, RESPONSES, 1.0, [[0.0] * len(r) for r in RESPONSES])])
        client.checkpoint(3)
        assert client.restore(0).train_steps == 0
        assert client.values(PROMPTS, RESPONSES) == [[0.0] * 3, [], [0.0] * 5]
    assert list_checkpoints(config.checkpoints) == []


def test_restore_moves_newer_checkpoints_aside_and_deletes_nothing(config: CriticConfig) -> None:
    """Issue #30, R3-7: `/v1/restore {"step": 0}` deleted every critic checkpoint; now they are moved aside, whole."""
    with serving(Critic(replace(config, keep_checkpoints=3))) as client:
        for step in (1, 2):
            client.train([minibatch(PROMPTS, RESPONSES, float(step), [[0.0] * len(r) for r in RESPONSES])])
            client.checkpoint(step)
        assert client.restore(0).train_steps == 0
    assert list_checkpoints(config.checkpoints) == []
    aside = sorted((config.checkpoints / SET_ASIDE).iterdir())
    assert [p.name.rsplit("-", 1)[0] for p in aside] == ["step-000001", "step-000002"]
    for folder in aside:  # each one complete: it could be moved back and resumed from
        assert {f.name for f in folder.iterdir()} == {
            "model.safetensors",
            "optimizer.pt",
            "rng.pt",
            "critic_state.json",
        }


def test_restore_behind_the_trainers_newest_checkpoint_is_refused(config: CriticConfig, tmp_path: Path) -> None:
    """Issue #30, R3-7: a trainer resumes from its newest checkpoint; a restore to an earlier step would leave the
    critic behind it, so it is refused (409) and changes nothing."""
    trainer = tmp_path / "trainer-checkpoints"
    (trainer / "step-000002").mkdir(parents=True)
    (trainer / ".tmp-step-000004").mkdir()  # an unfinished one does not count
    with serving(Critic(replace(config, keep_checkpoints=3, trainer_checkpoints=trainer))) as client:
        for step in (2, 4):
            client.checkpoint(step)
        for behind in (0, 1):
            with pytest.raises(CriticError, match=r"409.*behind the trainer's newest checkpoint.*step-000002"):
                client.restore(behind)
        assert [checkpoint_step(p) for p in list_checkpoints(config.checkpoints)] == [2, 4]
        assert client.restore(2).step == 2  # where the trainer resumes: allowed, and step 4 goes aside
    assert [checkpoint_step(p) for p in list_checkpoints(config.checkpoints)] == [2]


def test_requests_past_the_caps_are_413_naming_the_cap(config: CriticConfig) -> None:
    """Issue #30, R3-12: one request of 1.5M one-token rows held the model lock for minutes; rows and tokens per row
    are capped at what the run's trainer sends, refused before the lock is taken."""
    critic = Critic(replace(config, max_rows=3, max_row_tokens=9))
    zeros = [[0.0] * len(r) for r in RESPONSES]
    with serving(critic) as client:
        assert len(client.values(PROMPTS, RESPONSES)) == 3  # 3 rows of at most 4 + 5 tokens: within the caps
        with pytest.raises(CriticError, match=r"413.*4 rows, more than the cap of 3 per request \(training"):
            client.values([*PROMPTS, [1]], [*RESPONSES, [2]])
        with pytest.raises(CriticError, match=r"413.*row 0 has 10 tokens, more than the cap of 9 per row \(data"):
            client.values([[1] * 5], [[2] * 5])
        with pytest.raises(CriticError, match=r"413.*6 rows"):  # a train request's minibatches count together
            client.train([minibatch(PROMPTS, RESPONSES, 1.0, zeros)] * 2)
        with critic.lock:  # held: a refusal must not wait for it
            start = time.monotonic()
            with pytest.raises(CriticError, match="413"):
                client.values([[1]] * 100_000, [[2]] * 100_000)
            assert time.monotonic() - start < 30
        assert client.wait_ready(deadline_s=5).train_steps == 0
