"""reward.function reinforce.reward.rewards:code_tests through the real processes: the environment service (python -m
reinforce.environment) runs each response's code with the prompt's tests in its sandbox (POST /v1/run), called by
the reward function in-process and by the reward server (Triton, via PyTriton) holding the environment's URL and
token, scored by the real reward client."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from conftest import stop_process

from reinforce.core import launch
from reinforce.core.environment_client import EnvironmentClient, EnvironmentServiceError
from reinforce.core.launch_flags import EnvironmentFlags, RewardFlags
from reinforce.core.metrics import read_metrics
from reinforce.core.names import ENVIRONMENT_TOKEN_ENV
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import CODE_TESTS_REWARD
from reinforce.generator.reward_client import RewardClient
from reinforce.reward.rewards import code_tests
from reinforce.supervisor.children import CREDENTIALS
from reinforce.supervisor.ports import free_port
from tests.runs import EXAMPLES, assert_reward_rose, flag, service_of, start, wait_for_step, write_spec

TOKEN = "code-reward-test-token"
TIME_LIMIT_S = 2.0
OUTPUT_LIMIT = 200
READY_LINE = "reward server ready:"
TINY_TOOLS_INIT = yaml.safe_load((EXAMPLES / "tiny-tools.yaml").read_text())["policy"]["random_init"]
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def answer(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\nDone."


# (response, reward): hand-written solutions of the prompt "write add(a, b)" against TESTS
SOLUTIONS = {
    "passes": (answer("def add(a, b):\n    return a + b\n"), 1.0),
    "the last block counts": ("```python\ndef add(a, b):\n    return 0\n```\n" + answer("add = int.__add__\n"), 1.0),
    "prints and passes": (answer("def add(a, b):\n    print('debug', a, b)\n    return a + b\n"), 1.0),
    "fails an assert": (answer("def add(a, b):\n    return a - b\n"), 0.0),
    "raises": (answer("def add(a, b):\n    raise RuntimeError('no')\n"), 0.0),
    "syntax error": (answer("def add(a, b)\n    return a + b\n"), 0.0),
    "no code block": ("add(a, b) returns a + b", 0.0),
    "times out": (answer("while True:\n    pass\n"), 0.0),
    # its output goes nowhere and the verdict reads none: flooding it changes nothing
    "floods stdout": (answer("import os\nos.write(1, b'x' * 10**6)\ndef add(a, b):\n    return a + b\n"), 1.0),
    # escapes: leave before the tests run with a success code, answer with an object equal to everything, read the
    # tests' secrets from the caller's frame (the red team's R4-1), or stop the judge
    "exits 0 first": (answer("import sys\nsys.exit(0)\n"), 0.0),
    "os._exit(0) first": (answer("import os\nos._exit(0)\n"), 0.0),
    "rigged __eq__": (
        answer("class R:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return R()\n"), 0.0),
    "reads its caller's frame": (answer(
        "import os, sys\nfor c in sys._getframe(1).f_code.co_consts:\n    if isinstance(c, str):\n"
        "        sys.__stdout__.write(c + '\\n')\nsys.__stdout__.flush()\nos._exit(0)\n"), 0.0),
    "kills the judge": (answer("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"), 0.0),
    # a failed test's exit code 1 turned into 0 by an exit handler
    "atexit exits 0": (answer("import atexit, os\natexit.register(os._exit, 0)\ndef add(a, b):\n    return 0\n"), 0.0),
}  # fmt: skip


def _spec(run_dir: Path) -> dict:
    return {
        "name": "code-reward-test",
        "run_dir": str(run_dir),
        "policy": {"random_init": {}},
        "data": {"prompts": "p.jsonl"},
        "generation": {"batch_prompts": 2},
        "reward": {"type": "python", "function": CODE_TESTS_REWARD, "max_batch_size": 16},
        "environment": {
            "enabled": True,
            "max_turns": 1,
            "time_limit_s": TIME_LIMIT_S,
            "output_limit_chars": OUTPUT_LIMIT,
            "memory_limit_mb": 256,
            "max_concurrent_calls": 4,
        },
    }


def _wait(ready: callable, process: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{process.args[2]} did not get ready:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(the environment service's URL, the reward server's URL), both running the same spec."""
    tmp = tmp_path_factory.mktemp("code-reward")
    spec_file = tmp / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(_spec(tmp / "run")))
    env = {**os.environ, ENVIRONMENT_TOKEN_ENV: TOKEN}
    port = free_port()
    environment_url = f"http://127.0.0.1:{port}"
    http, grpc, metrics = free_port(), free_port(), free_port()
    logs = [tmp / "environment.log", tmp / "reward.log"]
    argvs = [
        launch.ENVIRONMENT.command(sys.executable, str(spec_file), EnvironmentFlags(port=port)),
        launch.REWARD.command(
            sys.executable, str(spec_file), RewardFlags(
                http_port=http, grpc_port=grpc, metrics_port=metrics, environment_url=environment_url
            ),
        ),
    ]  # fmt: skip
    processes = [
        subprocess.Popen(argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        for argv, log in zip(argvs, logs, strict=True)
    ]
    try:
        _wait(lambda: _ready(environment_url + launch.ENVIRONMENT.ready_path), processes[0], logs[0])
        _wait(lambda: READY_LINE in logs[1].read_text(errors="replace"), processes[1], logs[1])
        yield environment_url, f"http://127.0.0.1:{http}"
    finally:
        for process in processes:
            stop_process(process, timeout_s=30)


def test_run_executes_one_program_in_the_sandbox_with_the_tools_limits(services) -> None:
    environment_url, _ = services

    async def run(code: str, token: str = TOKEN):
        async with EnvironmentClient(environment_url, token) as env:
            return await env.run(code)

    printed = asyncio.run(run("import os\nprint('hi', sorted(os.environ))\nraise SystemExit(3)"))
    assert printed.stdout.startswith("hi ") and ENVIRONMENT_TOKEN_ENV not in printed.stdout  # an empty environment
    assert printed.exit_code == 3 and not printed.timed_out
    flood = asyncio.run(run("print('x' * 100_000)"))
    assert flood.truncated and len(flood.stdout) == OUTPUT_LIMIT and flood.exit_code == 0
    start = time.monotonic()
    loop = asyncio.run(run("while True: pass"))
    assert loop.timed_out and loop.exit_code is None and time.monotonic() - start < TIME_LIMIT_S + 3
    with pytest.raises(EnvironmentServiceError) as refused:
        asyncio.run(run("print(1)", token="wrong"))
    assert refused.value.status == 401


def test_code_tests_scores_hand_written_solutions(services) -> None:
    """In-process: the reward function against the real service."""
    environment_url, _ = services
    responses = [response for response, _ in SOLUTIONS.values()]
    rewards = code_tests(
        ["write add(a, b)"] * len(responses), responses, [TESTS] * len(responses), environment_url, TOKEN
    )
    assert dict(zip(SOLUTIONS, rewards, strict=True)) == {name: reward for name, (_, reward) in SOLUTIONS.items()}


def assert_scores_the_solutions(reward_url: str) -> None:
    """The reward server at `reward_url` (Triton's HTTP, reward.function code_tests) gives each of SOLUTIONS its
    reward, asked by the generators' reward client (tests/e2e/test_compose.py asks the compose services too)."""
    names = list(SOLUTIONS)
    responses = [SOLUTIONS[name][0] for name in names]
    client = RewardClient(reward_url, timeout_s=60.0, max_retries=0, max_batch_size=16)
    try:
        rewards = client.score(["write add(a, b)"] * len(names), responses, [TESTS] * len(names))
    finally:
        client.close()
    assert dict(zip(names, rewards, strict=True)) == {name: SOLUTIONS[name][1] for name in names}


def test_the_reward_server_scores_code_with_the_environments_sandbox(services) -> None:
    """Through Triton: the reward server holds the environment's URL and token and scores by running the tests."""
    assert_scores_the_solutions(services[1])


CODE = "```python\nanswer = 9*9\n```"  # one token of the tiny policy's vocabulary


@pytest.mark.slow
def test_a_run_learns_to_write_code_that_passes_and_only_its_reward_server_gets_the_token(tmp_path: Path) -> None:
    """`reinforce run` (the local supervisor) with code_tests: it starts the environment before the reward server,
    hands the reward server the environment's URL and token (and no other credential), and a tiny policy whose
    vocabulary holds a code block that passes the prompts' tests learns to write it."""
    prompts = tmp_path / "code.jsonl"
    prompts.write_text('{"prompt": "9*9", "answer": "assert answer == 81"}\n' * 8)
    spec = write_spec(
        tmp_path, "tiny-tools",
        policy={"random_init": {**TINY_TOOLS_INIT, "tokens": [CODE]}},
        reward={"type": "python", "function": CODE_TESTS_REWARD},
        data={"prompts": str(prompts)},
        environment={"enabled": True, "tools": ["python"], "max_turns": 1},
        generation={"max_new_tokens": 8},
        training={"steps": 20, "checkpoint_every": 10},
    )  # fmt: skip
    proc = start("run", str(spec))
    try:
        wait_for_step(proc, tmp_path / "run", 1)
        children = psutil.Process(proc.pid).children(recursive=True)
        held = {service_of(p): {k for k in p.environ() if k in CREDENTIALS} for p in children}
        reward = next(p for p in children if service_of(p) == "reinforce.reward")
        environment = next(p for p in children if service_of(p) == "reinforce.environment")
        assert held["reinforce.reward"] == {ENVIRONMENT_TOKEN_ENV}
        assert reward.environ()[ENVIRONMENT_TOKEN_ENV] == environment.environ()[ENVIRONMENT_TOKEN_ENV]
        assert flag(reward, "--environment-url") == f"http://127.0.0.1:{flag(environment, '--port')}"
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    rows = read_metrics(RunPaths(tmp_path / "run").metrics)
    print("rewards by step:", [round(r["train_rollouts/rewards"], 2) for r in rows])
    assert_reward_rose(rows, window=5, by=0.2)
