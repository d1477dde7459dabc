"""Reward functions in-process, and the reward server as a real Triton process driven by the real client."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from reinforce.core.spec import RewardSpec
from reinforce.generator.reward_client import RewardClient, RewardFunctionError, RewardServerError, backoff_s
from reinforce.reward.rewards import RewardError, build_reward_fn, char_fraction, vader_reward
from reinforce.supervisor.ports import free_port

READY_LINE = "reward server ready:"
FN_MODULE = "reward_test_fns"
# Rewards the server imports from a tmp folder on its PYTHONPATH: a failing one, NaN/inf, bad results.
FN_SOURCE = textwrap.dedent(
    """
    def flaky(prompts, responses):
        if any("boom" in r for r in responses):
            raise RuntimeError("kaboom in the reward function")
        special = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
        return [special.get(r, float(len(r))) for r in responses]

    def short(prompts, responses):
        return [0.0] * (len(responses) - 1)

    def words(prompts, responses):
        return ["high"] * len(responses)
    """
)
POSITIVE = "I love this, it is wonderful and great!"
NEGATIVE = "This is terrible, awful and I hate it."


class Server:
    """One `python -m reinforce.reward` process; restarts keep its ports so clients keep their URL."""

    def __init__(self, workdir: Path, reward: dict, fn_dir: Path) -> None:
        self.workdir = workdir
        self.spec = workdir / "spec.yaml"
        run = {"name": "reward-test", "policy": {"random_init": {}}, "data": {"prompts": "x.jsonl"}}
        self.spec.write_text(yaml.safe_dump({**run, "reward": reward}))
        self.ports = [free_port() for _ in range(3)]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fn_dir), os.environ.get("PYTHONPATH", "")])}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    def start(self) -> None:
        http, grpc, metrics = (str(p) for p in self.ports)
        cmd = [sys.executable, "-m", "reinforce.reward", "--spec", str(self.spec), "--host", "127.0.0.1"]
        cmd += ["--http-port", http, "--grpc-port", grpc, "--metrics-port", metrics]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir)

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while READY_LINE not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"reward server did not get ready:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        """SIGTERM (again, harmlessly, after terminate) and wait; return the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@pytest.fixture(scope="module")
def fn_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fns")
    (folder / f"{FN_MODULE}.py").write_text(FN_SOURCE)
    return folder


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, fn_dir: Path) -> Iterator[dict[str, Server]]:
    rewards = {
        "vader": {"type": "vader", "max_batch_size": 8},
        "char": {"type": "python", "function": "reinforce.reward.rewards:char_fraction", "kwargs": {"char": "b"}},
        "flaky": {"type": "python", "function": f"{FN_MODULE}:flaky", "max_batch_size": 4},
        "math": {"type": "python", "function": "reinforce.reward.rewards:math_answer"},
    }
    found = {name: Server(tmp_path_factory.mktemp(name), reward, fn_dir) for name, reward in rewards.items()}
    # Started together: Triton's start-up is mostly waiting, so the four overlap well even on two cores.
    for server in found.values():
        server.start()
    try:
        for server in found.values():
            server.wait_ready()
        yield found
    finally:
        # SIGTERM all first, then wait: each Triton takes a couple of seconds to unload its model.
        running = [s for s in found.values() if s.proc is not None and s.proc.poll() is None]
        for server in running:
            server.terminate()
        for server in running:
            server.stop()


def client(server: Server, **kwargs) -> RewardClient:
    options = {"timeout_s": 10.0, "max_retries": 0, "max_batch_size": 8} | kwargs
    return RewardClient(server.url, **options)


# ---- reward functions in-process --------------------------------------------------------------------


def test_char_fraction_counts_the_character():
    assert char_fraction(["p"] * 4, ["aab", "", "bbbb", "a"], char="a") == [2 / 3, 0.0, 0.0, 1.0]
    assert char_fraction(["p"], ["xbx"], char="b") == [1 / 3]


def test_vader_scores_sentiment_of_the_response():
    score = vader_reward()
    pos, neg, neutral = score(["ignored"] * 3, [POSITIVE, NEGATIVE, "the table"])
    assert pos > 0.5 and neg < -0.5 and neutral == 0.0


def test_python_reward_of_wrong_length_names_the_function(fn_dir: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(fn_dir))
    fn = build_reward_fn(RewardSpec(type="python", function=f"{FN_MODULE}:short"))
    with pytest.raises(RewardError, match=rf"{FN_MODULE}:short returned 2 rewards for 3 responses"):
        fn(["p"] * 3, ["a", "b", "c"])


def test_python_reward_that_is_not_numeric_is_an_error(fn_dir: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(fn_dir))
    fn = build_reward_fn(RewardSpec(type="python", function=f"{FN_MODULE}:words"))
    with pytest.raises(RewardError, match=r"words returned a non-numeric reward at row 0: 'high'"):
        fn(["p"], ["a"])


def test_python_reward_that_cannot_be_imported_is_an_error():
    with pytest.raises(RewardError, match=r"no_such_module_xyz:f: cannot import module"):
        build_reward_fn(RewardSpec(type="python", function="no_such_module_xyz:f"))
    with pytest.raises(RewardError, match=r"has no callable 'nope'"):
        build_reward_fn(RewardSpec(type="python", function="reinforce.reward.rewards:nope"))


def test_python_reward_passes_nan_and_inf_through(fn_dir: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(fn_dir))
    fn = build_reward_fn(RewardSpec(type="python", function=f"{FN_MODULE}:flaky"))
    nan, inf, three = fn(["p"] * 3, ["nan", "inf", "abc"])
    assert math.isnan(nan) and inf == math.inf and three == 3.0


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer LlamaForSequenceClassification and a character tokenizer without a pad token."""
    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("classifier")
    vocab = {tok: i for i, tok in enumerate(["<unk>", "</s>", *"abcdefghijklmnopqrstuvwxyz ,.!?"])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # No pad token on purpose: the reward must fall back to EOS, as with real Llama classifiers.
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, num_labels=3, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    return folder


def test_hf_classifier_scores_each_row_deterministically(tiny_classifier: Path):
    spec = RewardSpec(type="hf_classifier", path=str(tiny_classifier), label=-1, kwargs={"batch_size": 2})
    prompts = ["hello", "say something", "x", "a longer prompt, with words!"]
    responses = ["good", "bad bad bad", "", "zzz"]
    first = build_reward_fn(spec)(prompts, responses)
    again = build_reward_fn(spec)(prompts, responses)
    assert len(first) == 4 and all(math.isfinite(r) for r in first)
    assert first == pytest.approx(again, abs=1e-6)
    assert len(set(first)) > 1  # a random model still tells different texts apart
    # Padding must not change a row's score: the same row scored alone gives the same logit.
    assert build_reward_fn(spec)(prompts[1:2], responses[1:2])[0] == pytest.approx(first[1], abs=1e-5)


def test_hf_classifier_response_input_ignores_the_prompt(tiny_classifier: Path):
    spec = RewardSpec(type="hf_classifier", path=str(tiny_classifier), label=0, kwargs={"input": "response"})
    fn = build_reward_fn(spec)
    a, b = fn(["first prompt", "another one"], ["same text", "same text"])
    assert a == pytest.approx(b, abs=1e-6)


def test_hf_classifier_errors_name_the_problem(tiny_classifier: Path, tmp_path: Path):
    with pytest.raises(RewardError, match=r"unknown kwargs \['colour'\]"):
        build_reward_fn(RewardSpec(type="hf_classifier", path=str(tiny_classifier), kwargs={"colour": 1}))
    with pytest.raises(RewardError, match=r"label 3 out of range for 3 logits"):
        build_reward_fn(RewardSpec(type="hf_classifier", path=str(tiny_classifier), label=3))
    with pytest.raises(RewardError, match=r"cannot load a sequence classifier from"):
        build_reward_fn(RewardSpec(type="hf_classifier", path=str(tmp_path / "missing")))


# ---- client alone ------------------------------------------------------------------------------------


def test_backoff_doubles_with_jitter_and_is_capped():
    for attempt, full in [(0, 0.5), (1, 1.0), (3, 4.0), (10, 10.0)]:
        delays = [backoff_s(attempt) for _ in range(50)]
        assert all(full / 2 <= d <= full for d in delays)
        assert len(set(delays)) > 1


def test_client_on_a_dead_port_raises_after_its_retries_fast():
    dead = RewardClient(f"http://127.0.0.1:{free_port()}", timeout_s=2.0, max_retries=2, max_batch_size=4)
    start = time.monotonic()
    with pytest.raises(RewardServerError, match=r"reward server at http://127\.0\.0\.1:\d+: 1 of 1 requests "
                       r"failed after 2 retries; last error: ConnectionRefusedError"):  # fmt: skip
        dead.score(["p"], ["r"])
    # Two back-offs of 0.25-0.5 s and 0.5-1 s: retried, but not for long.
    assert 0.7 <= time.monotonic() - start < 5.0
    with pytest.raises(RewardServerError, match=r"not ready after"):
        dead.wait_ready(deadline_s=0.3, poll_s=0.1)


def test_server_with_a_taken_port_exits_at_once(tmp_path: Path, fn_dir: Path):
    server = Server(tmp_path, {"type": "vader"}, fn_dir)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", server.ports[1]))
        taken.listen()
        server.start()
        assert server.proc is not None
        assert server.proc.wait(timeout=60) == 2
    assert f"cannot bind 127.0.0.1:{server.ports[1]}" in server.log.read_text()


# ---- through the server ------------------------------------------------------------------------------


def test_vader_through_server_equals_in_process(servers: dict[str, Server]):
    responses = [POSITIVE, NEGATIVE, "a plain sentence", ""]
    with client(servers["vader"]) as rc:
        assert rc.wait_ready(deadline_s=5) < 5
        remote = rc.score(["prompt"] * 4, responses)
    local = vader_reward()(["prompt"] * 4, responses)
    assert remote == pytest.approx(local, abs=1e-6)  # float32 on the wire
    assert remote[0] > 0.5 > -0.5 > remote[1]


def test_more_rows_than_max_batch_size_are_split_and_kept_in_order(servers: dict[str, Server]):
    responses = [f"{'good ' * (i % 5)}{'bad ' * (i % 3)}row {i}" for i in range(53)]
    with client(servers["vader"], max_batch_size=8, concurrency=4) as rc:
        remote = rc.score([f"p{i}" for i in range(53)], responses)
    assert remote == pytest.approx(vader_reward()([""] * 53, responses), abs=1e-6)


def test_request_larger_than_the_server_batch_is_refused_without_retries(servers: dict[str, Server]):
    start = time.monotonic()
    with (
        client(servers["vader"], max_batch_size=9, max_retries=3) as rc,
        pytest.raises(RewardServerError, match=r"batch-size must be <= 8"),
    ):
        rc.score(["p"] * 9, ["r"] * 9)
    assert time.monotonic() - start < 2.0


def test_char_fraction_with_kwargs_through_server(servers: dict[str, Server]):
    with client(servers["char"]) as rc:
        assert rc.score(["p"] * 3, ["abba", "", "bbb"]) == pytest.approx([0.5, 0.0, 1.0])
        assert rc.score([], []) == []


def test_math_answers_are_checked_against_each_prompts_reference_answer(servers: dict[str, Server]):
    """The reward server gets each row's reference answer beside the whole response (a trajectory, tools' output
    included): the last number, or a boxed answer, is compared with it."""
    responses = [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>\n42\nSo 6 * 7 = 42.',
        "Boxed: \\boxed{1,000} (the last number, 7, is not the answer)",
        "It is 41.",
        "No number at all.",
    ]
    with client(servers["math"]) as rc:
        assert rc.score(["p"] * 4, responses, ["42", "1000", "42", "3"]) == [1.0, 1.0, 0.0, 0.0]
        # an answer-less prompt is a data error the reward function names, not a silent 0
        with pytest.raises(RewardFunctionError, match="without a reference answer"):
            rc.score(["p"], ["42"])


def test_nan_and_inf_pass_through_the_server(servers: dict[str, Server]):
    with client(servers["flaky"]) as rc:
        nan, inf, minus_inf, two = rc.score(["p"] * 4, ["nan", "inf", "-inf", "ab"])
    assert math.isnan(nan) and inf == math.inf and minus_inf == -math.inf and two == 2.0


def test_failing_reward_fn_is_an_error_and_the_server_keeps_serving(servers: dict[str, Server]):
    with client(servers["flaky"], max_retries=3) as rc:
        start = time.monotonic()
        with pytest.raises(RewardFunctionError, match=r"reward function failed: RuntimeError: kaboom"):
            rc.score(["p"] * 2, ["fine", "boom"])
        assert time.monotonic() - start < 2.0  # not retried: it would fail again
        assert rc.score(["p"] * 2, ["fine", "ok"]) == [4.0, 2.0]
    assert servers["flaky"].proc is not None and servers["flaky"].proc.poll() is None


def test_client_rides_out_a_server_restart(servers: dict[str, Server]):
    server = servers["char"]
    assert server.stop() == 0  # SIGTERM is a clean shutdown
    assert "stop signal received" in server.log.read_text()

    restarter = threading.Timer(0.5, server.start)
    restarter.start()
    try:
        with client(server, max_retries=8) as rc:
            start = time.monotonic()
            assert rc.score(["p"] * 2, ["b", "ab"]) == pytest.approx([1.0, 0.5])
            assert time.monotonic() - start > 1.0  # it really waited for the new server
    finally:
        restarter.join()
        server.wait_ready()
