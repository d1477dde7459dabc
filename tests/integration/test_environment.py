"""The environment service as a real process (python -m reinforce.environment on a free port), driven over HTTP
with the real client: episodes, tools, limits, authentication, metrics, and the sandbox's escape attempts."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml
from conftest import free_port

from reinforce.core.environment_api import EPISODES_PATH
from reinforce.core.environment_client import EnvironmentClient, EnvironmentServiceError, EpisodeLost
from reinforce.core.names import ENVIRONMENT_TOKEN_ENV
from reinforce.core.spec import dump_spec, parse_spec
from reinforce.supervisor.main import PROMETHEUS_TARGETS, Supervisor

T = TypeVar("T")
TOKEN = "environment-test-token"
SECRET = "the-parent-secret-4c1d"  # in the server's environment: no tool call may see it
TIME_LIMIT_S = 3.0
OUTPUT_LIMIT = 500


def _spec(run_dir: Path, **environment: object) -> dict:
    env = {
        "enabled": True,
        "tools": ["python", "calculator", "environment_tools:Echo"],
        "max_turns": 3,
        "time_limit_s": TIME_LIMIT_S,
        "output_limit_chars": OUTPUT_LIMIT,
        "memory_limit_mb": 256,
        "max_episodes": 8,
        **environment,
    }
    return {
        "name": "env-test",
        "run_dir": str(run_dir),
        "policy": {"random_init": {}},
        "data": {"prompts": "p.txt"},
        "generation": {"batch_prompts": 2},  # 2 prompts x 4 samples: the generators' episodes fit max_episodes
        "environment": env,
    }


class Server:
    def __init__(self, url: str, process: subprocess.Popen[bytes], run_dir: Path) -> None:
        self.url, self.process, self.run_dir = url, process, run_dir

    def client(self) -> EnvironmentClient:
        return EnvironmentClient(self.url, TOKEN)

    def metric(self, name: str, labels: str = "") -> float:
        """A sample's value from /metrics (0 when absent)."""
        text = httpx.get(self.url + "/metrics").text
        for line in text.splitlines():
            if line.startswith(f"{name}{{{labels}}} " if labels else f"{name} "):
                return float(line.split()[-1])
        return 0.0


def start_server(tmp: Path, **environment: object) -> Server:
    run_dir = tmp / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.bin").write_text("trainer state")  # what the sandbox must not see
    spec_file = run_dir / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(_spec(run_dir, **environment)))
    port = free_port()
    tests = str(Path(__file__).parents[1])  # environment_tools.py
    env = {**os.environ, ENVIRONMENT_TOKEN_ENV: TOKEN, "PARENT_SECRET": SECRET, "PYTHONPATH": tests}
    log = (tmp / "environment.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "reinforce.environment", "--spec", str(spec_file), "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"environment exited {process.returncode}: {(tmp / 'environment.log').read_text()}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return Server(url, process, run_dir)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError("environment not ready in 60 s")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("environment"))
    yield s
    s.process.terminate()
    s.process.wait(10)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def _one_call(server: Server, turn: str) -> dict:
    async with server.client() as env:
        episode = await env.reset("What is 6 * 7?")
        result = await env.step(episode.episode_id, turn)
        await env.delete(episode.episode_id)
    assert not result.done and result.observation is not None
    return result.observation.model_dump()


def python(server: Server, code: str) -> dict:
    return run(_one_call(server, f"Let me compute.\n```python\n{code}\n```"))


# ---- episodes ----------------------------------------------------------------------------------------------------
def test_an_episode_runs_tools_until_the_model_answers(server: Server) -> None:
    async def episode() -> None:
        async with server.client() as env:
            start = await env.reset("What is 12 * (3 + 4)?")
            assert "<tool_call>" in start.observation.text and start.max_turns == 3
            assert [t["name"] for t in start.tools] == ["python", "calculator", "echo"]
            calc = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>'
            first = await env.step(start.episode_id, calc)
            assert (first.done, first.turn, first.observation.text) == (False, 1, "84")
            second = await env.step(start.episode_id, "```python\nprint(sum(range(10)))\n```")
            assert second.observation.text == "45" and second.observation.exit_code == 0
            final = await env.step(start.episode_id, "The answer is 84.")
            assert (final.done, final.reason, final.turn, final.observation) == (True, "no_tool_call", 3, None)
            state = await env.delete(start.episode_id)
            assert (state.turn, state.tool_calls, state.done) == (3, 2, True)
            with pytest.raises(EpisodeLost):
                await env.step(start.episode_id, "again")

    run(episode())


def test_the_last_turn_is_done_without_running_its_call(server: Server) -> None:
    async def episode() -> None:
        async with server.client() as env:
            start = await env.reset("p")
            for _ in range(2):
                assert not (await env.step(start.episode_id, "```python\nprint(1)\n```")).done
            last = await env.step(start.episode_id, "```python\nprint(1)\n```")
            assert (last.done, last.reason, last.turn) == (True, "max_turns", 3)
            assert (await env.state(start.episode_id)).tool_calls == 2
            with pytest.raises(EnvironmentServiceError) as refused:
                await env.step(start.episode_id, "more")
            assert refused.value.status == 409
            await env.delete(start.episode_id)

    run(episode())


def test_malformed_and_unknown_calls_are_errors_the_model_sees(server: Server) -> None:
    bad = run(_one_call(server, "<tool_call>{not json</tool_call>"))
    assert bad["error"] and "not JSON" in bad["text"] and bad["tool"] is None
    unknown = run(_one_call(server, '<tool_call>{"name": "search", "arguments": {}}</tool_call>'))
    assert unknown["error"] and "no tool 'search'" in unknown["text"]
    arithmetic_only = run(_one_call(server, '<tool_call>{"name": "calculator", "arguments": '
                                            '{"expression": "__import__(\'os\')"}}</tool_call>'))  # fmt: skip
    assert arithmetic_only["error"] and "not arithmetic" in arithmetic_only["text"]


def test_a_user_tool_is_loaded_from_module_and_class(server: Server) -> None:
    echoed = run(_one_call(server, '<tool_call>[{"name": "echo", "arguments": {"text": "hi"}}]</tool_call>'))
    assert echoed == {**echoed, "text": "hi", "tool": "echo", "error": False}


def test_output_is_cut_to_the_limit(server: Server) -> None:
    out = python(server, "print('y' * 10_000)")
    assert out["truncated"] and len(out["text"]) == OUTPUT_LIMIT and out["text"].endswith("[output truncated]")


def test_api_needs_the_token_and_bounds_episodes(server: Server) -> None:
    assert httpx.post(server.url + EPISODES_PATH, json={"prompt": "p"}).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(server.url + EPISODES_PATH, json={"prompt": "p"}, headers=wrong).status_code == 401
    assert httpx.get(server.url + "/healthz").status_code == 200

    async def fill() -> None:
        async with server.client() as env:
            ids = [(await env.reset("p")).episode_id for _ in range(8)]
            with pytest.raises(EnvironmentServiceError) as full:
                await env.reset("one too many")
            assert full.value.status == 429
            for episode_id in ids:
                await env.delete(episode_id)

    run(fill())


def test_metrics_count_episodes_calls_errors_and_timeouts(server: Server) -> None:
    before = {
        "calls": server.metric("reinforce_environment_tool_calls_total", 'tool="python"'),
        "timeouts": server.metric("reinforce_environment_tool_timeouts_total", 'tool="python"'),
        "errors": server.metric("reinforce_environment_tool_errors_total", 'tool="python"'),
        "kills": server.metric("reinforce_environment_sandbox_kills_total", 'signal="SIGKILL"'),
        "episodes": server.metric("reinforce_environment_episodes_total"),
    }
    python(server, "raise SystemExit(3)")
    python(server, "while True: pass")
    assert server.metric("reinforce_environment_tool_calls_total", 'tool="python"') == before["calls"] + 2
    assert server.metric("reinforce_environment_tool_errors_total", 'tool="python"') == before["errors"] + 1
    assert server.metric("reinforce_environment_tool_timeouts_total", 'tool="python"') == before["timeouts"] + 1
    assert server.metric("reinforce_environment_sandbox_kills_total", 'signal="SIGKILL"') == before["kills"] + 1
    assert server.metric("reinforce_environment_episodes_total") == before["episodes"] + 2
    assert server.metric("reinforce_environment_tool_call_seconds_count", 'tool="python"') >= 2
    assert server.metric("reinforce_environment_turns_per_episode_count") >= 2


# ---- the sandbox: each escape attempt is contained ---------------------------------------------------------------
def test_isolation_is_what_the_kernel_allows(server: Server) -> None:
    ready = httpx.get(server.url + "/readyz").json()
    expected = "namespaces" if os.getuid() == 0 else ("user_namespaces", "none")
    assert ready["isolation"] in expected, ready


def test_escape_network(server: Server) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    try:
        out = python(server, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')")
        if httpx.get(server.url + "/readyz").json()["isolation"] == "none":
            pytest.skip("no network namespace on this kernel: the sandbox's network is the host's")
        assert out["exit_code"] == 1 and "Network is unreachable" in out["text"], out
        time.sleep(0.2)
        assert not accepted
    finally:
        listener.close()


def test_escape_write_outside_scratch(server: Server, tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    out = python(
        server,
        f"import os\nprint(os.listdir('.'))\nopen('own.txt', 'w').write('mine')\nprint(open('own.txt').read())\n"
        f"open({str(target)!r}, 'w').write('escaped')",
    )
    assert out["text"].startswith("[]\nmine"), out  # an empty scratch folder, writable
    assert out["exit_code"] == 1 and not target.exists(), out
    tmp_write = python(server, "open('/tmp/escaped-by-sandbox', 'w').write('x')\nprint('wrote')")
    assert not Path("/tmp/escaped-by-sandbox").exists(), tmp_write  # its /tmp is a tmpfs of its own


def test_escape_read_the_parents_environment_and_run_folder(server: Server) -> None:
    code = (
        "import os, glob\nprint(sorted(os.environ))\nfound = []\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n        found.append(open(path, 'rb').read())\n    except OSError:\n        pass\n"
        f"print({SECRET!r}.encode() in b''.join(found), {TOKEN!r}.encode() in b''.join(found))\n"
        f"print(os.listdir({str(server.run_dir)!r}) if os.path.isdir({str(server.run_dir)!r}) else 'gone')"
    )
    out = python(server, code)
    assert out["exit_code"] == 0, out
    names, leaked, run_dir = out["text"].splitlines()
    assert names == "['HOME', 'LANG', 'PATH']" and leaked == "False False", out
    assert "checkpoint.bin" not in run_dir, out


def test_escape_fork_bomb(server: Server) -> None:
    out = python(server, "import os\nwhile True:\n    os.fork()")
    assert out["timed_out"] or out["exit_code"] != 0, out
    assert python(server, "print('alive')")["text"] == "alive"  # the next call runs normally


def test_escape_memory_bomb(server: Server) -> None:
    out = python(server, "x = bytearray(1 << 30)")  # 1 GiB over the 256 MB limit
    assert out["exit_code"] == 1 and "MemoryError" in out["text"], out


def test_escape_infinite_loop(server: Server) -> None:
    start = time.monotonic()
    out = python(server, "while True:\n    pass")
    assert out["timed_out"] and out["text"] == f"[timeout after {TIME_LIMIT_S:g} s]", out
    assert out["signal"] == "SIGKILL" and time.monotonic() - start < TIME_LIMIT_S + 2


def test_escape_100_mb_print(server: Server) -> None:
    out = python(server, "import sys\nsys.stdout.write('z' * 100_000_000)\nprint('end', file=sys.stderr)")
    assert out["exit_code"] == 0 and out["truncated"] and len(out["text"]) == OUTPUT_LIMIT, out
    rss_kb = int(next(line for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines()
                      if line.startswith("VmRSS")).split()[1])  # fmt: skip
    assert rss_kb < 400_000  # the service kept the first bytes only


def test_the_supervisor_starts_the_service_with_its_token_only(tmp_path: Path) -> None:
    spec = parse_spec({**_spec(tmp_path / "run"), "environment": {"enabled": True, "tools": ["calculator"]}})
    supervisor = Supervisor(spec)
    supervisor.paths.root.mkdir(parents=True)
    supervisor.paths.spec.write_text(dump_spec(spec))
    try:
        url = supervisor.start_environment()
        [component] = supervisor.components
        assert set(component.credentials) == {ENVIRONMENT_TOKEN_ENV}  # no Redis URL, no other service's token
        assert httpx.get(url + "/readyz").json()["tools"] == ["calculator"]
        headers = {"Authorization": f"Bearer {supervisor.credentials[ENVIRONMENT_TOKEN_ENV]}"}
        assert httpx.post(url + EPISODES_PATH, json={"prompt": "p"}, headers=headers).status_code == 201
        targets = json.loads((supervisor.paths.root / PROMETHEUS_TARGETS).read_text())
        assert [t["labels"]["component"] for t in targets] == ["environment"]
    finally:
        supervisor.stop()
