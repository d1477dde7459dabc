"""The environment service as a real process (python -m reinforce.environment on a free port), driven over HTTP
with the real client: episodes, tools, limits, authentication, metrics, and the sandbox's escape attempts.

The escape attempts also run against the service in its container image as docker-compose.yml's profile `tools`
starts it (docker-marked: the images are built with scripts/build-images.sh, the API reached through the container's
Unix socket on its volume): each attempt must be contained there too, by the container's confinement."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import secrets
import shutil
import site
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import pytest
import yaml
from conftest import free_port

from generate.escapes import MODES, PROBES
from reinforce.core import launch
from reinforce.core.environment_api import CALLER_HEADER, EPISODES_PATH
from reinforce.core.environment_client import (
    UNIX_BASE_URL,
    EnvironmentClient,
    EnvironmentServiceError,
    EpisodeLost,
    unix_socket,
)
from reinforce.core.names import ENVIRONMENT_TOKEN_ENV
from reinforce.core.spec import EnvironmentSpec, dump_spec, parse_spec
from reinforce.environment.sandbox import SANDBOX_UID_BASE, UID_LOCKS
from reinforce.operator import children
from reinforce.supervisor.children import PROMETHEUS_TARGETS, Children

T = TypeVar("T")
TOKEN = "environment-test-token"
SECRET = "the-parent-secret-4c1d"  # in the server's environment: no tool call may see it
TIME_LIMIT_S = 3.0
OUTPUT_LIMIT = 500
ROOT = Path(__file__).resolve().parents[2]
COMPOSE_PROJECT = "reinforce-environment-test"
ESCAPE_PREFIX = "test_escape_"  # an escape probe: generate/escapes.py's PROBES name it without the prefix


def _spec(run_dir: Path, **environment: object) -> dict:
    env = {
        "enabled": True,
        "tools": ["python", "calculator", "environment_tools:Echo"],
        "max_turns": 3,
        "time_limit_s": TIME_LIMIT_S,
        "output_limit_chars": OUTPUT_LIMIT,
        "memory_limit_mb": 256,
        "max_episodes": 8,
        "max_episodes_per_caller": 4,
        **environment,
    }
    return {
        "name": "env-test",
        "run_dir": str(run_dir),
        "policy": {"random_init": {}},
        "data": {"prompts": "p.txt"},
        "generation": {"batch_prompts": 1},  # 1 prompt x 4 samples: a generator's episodes fit max_episodes_per_caller
        "environment": env,
    }


class Server:
    """The service under test: a local process, or (container set) docker-compose's `environment` container, whose
    API is a Unix socket (url `unix:/PATH`) and whose process is PID 1 of the container (pid: its host pid)."""

    def __init__(
        self,
        url: str,
        pid: int,
        run_dir: Path,
        process: subprocess.Popen[bytes] | None = None,
        container: str = "",
        user: int | None = None,
    ) -> None:
        self.url, self.pid, self.run_dir, self.container, self.user = url, pid, run_dir, container, user
        self._process = process

    @property
    def process(self) -> subprocess.Popen[bytes]:
        assert self._process is not None, "the service runs in a container"
        return self._process

    def client(self, caller: str = "") -> EnvironmentClient:
        return EnvironmentClient(self.url, TOKEN, caller=caller)

    def get(self, path: str) -> httpx.Response:
        socket_path = unix_socket(self.url)
        if socket_path is None:
            return httpx.get(self.url + path, timeout=10)
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), base_url=UNIX_BASE_URL) as http:
            return http.get(path, timeout=10)

    def metric(self, name: str, labels: str = "") -> float:
        """A sample's value from /metrics (0 when absent)."""
        text = self.get("/metrics").text
        for line in text.splitlines():
            if line.startswith(f"{name}{{{labels}}} " if labels else f"{name} "):
                return float(line.split()[-1])
        return 0.0


def start_server(tmp: Path, user: int | None = None, **environment: object) -> Server:
    """The service as a local process (as `user`, when given: the test runs as root)."""
    run_dir = tmp / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.bin").write_text("trainer state")  # what the sandbox must not see
    spec_file = run_dir / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(_spec(run_dir, **environment)))
    port = free_port()
    paths = [str(Path(__file__).parents[1])]  # environment_tools.py
    python = sys.executable
    if user is not None:  # this interpreter may live where only root reads (pyenv under /root): the system's 3.11
        python, paths = SYSTEM_PYTHON, [*paths, *site.getsitepackages(), str(ROOT / "services")]
    env = {**os.environ, ENVIRONMENT_TOKEN_ENV: TOKEN, "PARENT_SECRET": SECRET, "PYTHONPATH": os.pathsep.join(paths)}
    log = (tmp / "environment.log").open("wb")
    process = subprocess.Popen(
        [python, "-m", "reinforce.environment", "--spec", str(spec_file), "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        user=user,
        group=user,
        extra_groups=[] if user is not None else None,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"environment exited {process.returncode}: {(tmp / 'environment.log').read_text()}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return Server(url, process.pid, run_dir, process=process, user=user)
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


UNPRIVILEGED_UID = 100010  # a uid no other process on the machine runs as
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture(scope="module")
def unprivileged() -> Iterator[Server]:
    """The local service as a user without privileges, as a developer or a CI job without root runs it: the
    sandbox's user namespaces (skipped where the kernel allows an unprivileged user none)."""
    if os.getuid() != 0:
        pytest.skip("needs root to start the service as another user")
    version = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True)
    if version.stdout.decode().strip() != str(sys.version_info[:2]):
        pytest.skip(
            f"{SYSTEM_PYTHON} is not Python {sys.version_info[0]}.{sys.version_info[1]}: it cannot load these packages"
        )
    tmp = Path(tempfile.mkdtemp(prefix="reinforce-environment-unprivileged-"))
    tmp.chmod(0o755)  # pytest's own folders are root's alone
    try:
        s = start_server(tmp, user=UNPRIVILEGED_UID)
        try:
            if s.get("/readyz").json()["isolation"] != "user_namespaces":
                pytest.skip("this kernel allows an unprivileged user no namespaces")
            yield s
        finally:
            s.process.terminate()
            s.process.wait(10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def docker(*args: str) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.fixture(scope="module")
def container(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """docker-compose.yml's `environment` service (profile tools) in its image, built from this checkout, with this
    module's spec and token; reached through its Unix socket on the volume environment-socket (on the host: the
    volume's mount point). No generator runs: the container is confined on its own."""
    compose_bin = shutil.which("docker-compose")
    if os.geteuid() != 0 or compose_bin is None:
        pytest.skip("needs root and Debian's docker-compose: scripts/build-images.sh runs debootstrap and dockerd")
    tmp = tmp_path_factory.mktemp("environment-container")
    with (tmp / "build.log").open("w") as log:
        built = subprocess.run(
            ["bash", str(ROOT / "scripts" / "build-images.sh")], stdout=log, stderr=log, timeout=1800
        )
    assert built.returncode == 0, (tmp / "build.log").read_text()[-3000:]
    run_dir = Path("/data/run")  # the spec's run folder: not in the container (it has no `run` volume)
    spec = _spec(run_dir, tools=["python", "calculator"])  # environment_tools.py is not in the image
    (tmp / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "REINFORCE_SPEC": str(tmp / "spec.yaml"), ENVIRONMENT_TOKEN_ENV: TOKEN}
    compose = [compose_bin, "--project-name", COMPOSE_PROJECT, "--file", str(ROOT / "docker-compose.yml"),
               "--profile", "tools"]  # fmt: skip
    subprocess.run([*compose, "down", "--volumes"], env=env, capture_output=True)  # what an interrupted run left
    try:
        up = subprocess.run([*compose, "up", "--detach", "environment"], env=env, capture_output=True, text=True)
        assert up.returncode == 0, up.stderr[-3000:]
        name = docker("ps", "--quiet", "--filter", f"label=com.docker.compose.project={COMPOSE_PROJECT}")
        volume = docker("volume", "inspect", "--format", "{{.Mountpoint}}", f"{COMPOSE_PROJECT}_environment-socket")
        server = Server(f"unix:{volume}/api.sock", int(docker("inspect", "--format", "{{.State.Pid}}", name)),
                        run_dir, container=name)  # fmt: skip
        deadline = time.monotonic() + 120
        while docker("inspect", "--format", "{{.State.Health.Status}}", name) != "healthy":
            assert docker("inspect", "--format", "{{.State.Running}}", name) == "true", docker("logs", name)
            assert time.monotonic() < deadline, f"not healthy in 120 s:\n{docker('logs', name)}"
            time.sleep(1)
        yield server
    finally:
        subprocess.run([*compose, "down", "--volumes"], env=env, capture_output=True, timeout=300)


@pytest.fixture(
    scope="module", params=[pytest.param(m, marks=pytest.mark.docker) if m == "container" else m for m in MODES]
)
def sandboxed(request: pytest.FixtureRequest) -> Server:
    """The service the escape attempts run against, in each isolation it offers: the local process (`server`: as
    root, namespaces), the local process as a user without privileges (user namespaces), and its container (none,
    as in the operator's pod)."""
    return request.getfixturevalue("server" if request.param == "process" else request.param)


@pytest.fixture(autouse=True)
def _probe_applies(request: pytest.FixtureRequest) -> None:
    """An escape probe skips in the modes where generate/escapes.py's table says it has nothing to try, and only
    there (the table in docs/environments.md is that one's)."""
    name = request.node.originalname
    if name.startswith(ESCAPE_PREFIX) and (why := PROBES[name.removeprefix(ESCAPE_PREFIX)].not_in.get(
        request.node.callspec.params["sandboxed"]
    )):  # fmt: skip
        pytest.skip(why)


def test_the_escape_table_names_every_probe() -> None:
    assert {name.removeprefix(ESCAPE_PREFIX) for name in globals() if name.startswith(ESCAPE_PREFIX)} == set(PROBES)


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
        async with server.client("generator-0") as first, server.client("generator-1") as second:
            ids = [(env, (await env.reset("p")).episode_id) for env in (first, second) for _ in range(4)]
            for env in (first, second, server.client("generator-2")):
                with pytest.raises(EnvironmentServiceError, match=r"environment\.max_episodes\b") as full:
                    await env.reset("one too many")
                assert full.value.status == 429
            for env, episode_id in ids:
                await env.delete(episode_id)

    run(fill())


def test_episodes_belong_to_their_caller_each_with_a_bound(server: Server) -> None:
    """The red team's R4-14: any holder of the token could step and delete every episode, and one could open all of
    them. Another caller's episode is as absent as none (404), and a caller holds max_episodes_per_caller (4 here)."""

    async def other_callers() -> None:
        async with server.client("generator-0") as owner, server.client("generator-1") as other:
            mine = [(await owner.reset("What is 6 * 7?")).episode_id for _ in range(4)]
            with pytest.raises(EnvironmentServiceError, match="max_episodes_per_caller") as full:
                await owner.reset("a fifth")
            assert full.value.status == 429
            for attempt in (other.state(mine[0]), other.step(mine[0], "6 * 7 = 42"), other.delete(mine[0])):
                with pytest.raises(EnvironmentServiceError) as refused:
                    await attempt
                assert refused.value.status == 404
            theirs = (await other.reset("p")).episode_id  # the other caller's own bound is untouched
            assert (await owner.state(mine[0])).turn == 0  # and the owner's episode is as it was
            for env, episode_id in [*((owner, m) for m in mine), (other, theirs)]:
                await env.delete(episode_id)
        caller = {"Authorization": f"Bearer {TOKEN}", CALLER_HEADER: "not a caller id/"}
        assert httpx.post(server.url + EPISODES_PATH, json={"prompt": "p"}, headers=caller).status_code == 422

    run(other_callers())


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
    # every request counted and timed by its route (core/http_kit.py): the scrapes above among them
    assert server.metric("reinforce_environment_requests_total", 'code="200",endpoint="/metrics"') >= 5
    assert server.metric("reinforce_environment_request_seconds_count", 'endpoint="/metrics"') >= 5


# ---- the sandbox: each escape attempt is contained ---------------------------------------------------------------
# Against the local process (`server`) and against docker-compose's container (`container`). In the container the
# sandbox finds no namespaces (no capabilities, Docker's seccomp refuses unshare), as in the operator's pod: there
# the container's own confinement contains what the sandbox alone would not (network, files).
def test_isolation_is_what_the_kernel_allows(sandboxed: Server) -> None:
    ready = sandboxed.get("/readyz").json()
    if sandboxed.container:
        expected: tuple[str, ...] = ("none",)
    elif sandboxed.user is not None:
        expected = ("user_namespaces",)  # the fixture skips where there are none
    else:
        expected = ("namespaces",) if os.getuid() == 0 else ("user_namespaces", "none")
    assert ready["isolation"] in expected, ready


def host_addresses() -> list[str]:
    """This machine's IPv4 addresses (`hostname -I`: a container's gateway, the machine's own interfaces)."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return ["127.0.0.1", *(address for address in out if "." in address)]


def test_escape_network(sandboxed: Server) -> None:
    listener = socket.create_server(("0.0.0.0", 0))  # every address of this machine
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    addresses = host_addresses() if sandboxed.container else ["127.0.0.1"]
    code = (
        f"import socket\nprint(sorted(name for _, name in socket.if_nameindex()))\nfor host in {addresses!r}:\n"
        f"    try:\n        socket.create_connection((host, {port}), timeout=2)\n        print('in', host)\n"
        "    except OSError as err:\n        print('out', host, err)"
    )
    try:
        out = python(sandboxed, code)
        if sandboxed.get("/readyz").json()["isolation"] == "none" and not sandboxed.container:
            pytest.skip("no network namespace on this kernel: the sandbox's network is the host's")
        interfaces, *attempts = out["text"].splitlines()
        assert out["exit_code"] == 0 and interfaces == "['lo']", out  # no interface but loopback
        assert len(attempts) == len(addresses) and all(line.startswith("out ") for line in attempts), out
        if not sandboxed.container:  # its loopback is down too
            assert all("Network is unreachable" in line for line in attempts), out
        time.sleep(0.2)
        assert not accepted
    finally:
        listener.close()


def test_escape_write_outside_scratch(sandboxed: Server, tmp_path: Path) -> None:
    # the container: its image's folders and the volume folders it has no mount of; locally: a folder of this test
    outside = ["/etc/escaped", "/opt/venv/escaped", "/data/escaped", "/escaped"] if sandboxed.container else []
    outside.append(str(tmp_path / "escaped.txt"))
    code = (
        "import os\nprint(os.listdir('.'))\nopen('own.txt', 'w').write('mine')\nprint(open('own.txt').read())\n"
        f"for path in {outside!r}:\n    try:\n        open(path, 'w').write('escaped')\n        print('wrote', path)\n"
        "    except OSError as err:\n        print('refused', path, err.strerror)"
    )
    out = python(sandboxed, code)
    assert out["text"].startswith("[]\nmine"), out  # an empty scratch folder, writable
    refused = [line for line in out["text"].splitlines()[2:] if line.startswith("refused ")]
    assert out["exit_code"] == 0 and len(refused) == len(outside), out
    if sandboxed.container:
        assert all(line.endswith("Read-only file system") for line in refused[:-1]), out
    assert not (tmp_path / "escaped.txt").exists(), out
    if not sandboxed.container:  # in the container, /tmp is the scratch folders' tmpfs (the pod's emptyDir)
        tmp_write = python(sandboxed, "open('/tmp/escaped-by-sandbox', 'w').write('x')\nprint('wrote')")
        assert not Path("/tmp/escaped-by-sandbox").exists(), tmp_write  # its /tmp is a tmpfs of its own


# Links from the scratch folder to each target, then a read and an append through each.
SYMLINKS = (
    "import os\nfor i, target in enumerate({targets!r}):\n    os.symlink(target, f'link-{{i}}')\n"
    "    for how, mode in (('read', 'r'), ('write', 'a')):\n        try:\n"
    "            with open(f'link-{{i}}', mode) as f:\n"
    "                f.read() if mode == 'r' else f.write('escaped')\n"
    "            print('did', how, target)\n        except OSError as err:\n"
    "            print('refused', how, target, err.strerror)"
)


def test_escape_symlinks(sandboxed: Server, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"  # locally: a file of the test's; in the container: its shadow file
    secret.write_text(SECRET)
    targets = ["/etc/shadow"] if sandboxed.container else [str(secret)]
    out = python(sandboxed, SYMLINKS.format(targets=targets))
    lines = out["text"].splitlines()
    assert out["exit_code"] == 0 and len(lines) == 2 * len(targets), out
    assert all(line.startswith("refused ") for line in lines), out
    assert secret.read_text() == SECRET


# Files of 4 MiB (under RLIMIT_FSIZE) until a write is refused; then how many MiB were written.
DISK_BOMB = (
    "written = 0\ntry:\n    for i in range(1000):\n        with open(f'fill-{i}', 'wb') as f:\n"
    "            f.write(b'x' * (4 << 20))\n        written += 4\nexcept OSError as err:\n    print('refused', written)"
)


def test_escape_disk_bomb(sandboxed: Server) -> None:
    """The scratch folder is a tmpfs of file_limit_mb (16 MB here) in namespaces; in the container, /tmp is one of
    64 MB (docker-compose.yml; the operator's pod: an emptyDir with a size limit) that the calls take in turn."""
    out = python(sandboxed, DISK_BOMB)
    refused, written = out["text"].split()
    limit_mb = 64 if sandboxed.container else EnvironmentSpec().file_limit_mb
    assert out["exit_code"] == 0 and refused == "refused" and int(written) <= limit_mb, out
    assert python(sandboxed, "import os\nprint(os.listdir('.'))")["text"].strip() == "[]"  # the next call's own


def test_the_working_folder_is_there_by_its_absolute_path(sandboxed: Server) -> None:
    """The red team's R4-9: in namespaces a fresh /tmp covered the scratch folder's path, so a file named through
    os.getcwd() could not be written, and a size check through absolute paths tested nothing. The same folder, with
    the same limit, by either name."""
    code = (
        "import os\nhere = os.getcwd()\nopen(os.path.join(here, 'a.txt'), 'w').write('by path')\n"
        "print(open('a.txt').read(), os.listdir('.'), os.path.samefile(here, '.'))\n"
        "try:\n    open(os.path.join(here, 'big'), 'wb').write(b'x' * (64 << 20))\n    print('wrote 64 MiB')\n"
        "except OSError as err:\n    print('refused')"
    )
    out = python(sandboxed, code)
    assert out["exit_code"] == 0 and out["text"].splitlines() == ["by path ['a.txt'] True", "refused"], out


def test_escape_read_the_parents_environment_and_run_folder(sandboxed: Server) -> None:
    code = (
        "import os, glob\nprint(sorted(os.environ))\nfound = []\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n        found.append(open(path, 'rb').read())\n    except OSError:\n        pass\n"
        f"print({SECRET!r}.encode() in b''.join(found), {TOKEN!r}.encode() in b''.join(found))\n"
        f"print(os.listdir({str(sandboxed.run_dir)!r}) if os.path.isdir({str(sandboxed.run_dir)!r}) else 'gone')"
    )
    out = python(sandboxed, code)
    assert out["exit_code"] == 0, out
    names, leaked, run_dir = out["text"].splitlines()
    assert names == "['HOME', 'LANG', 'PATH']" and leaked == "False False", out
    assert "checkpoint.bin" not in run_dir, out
    if sandboxed.container:  # the container's own variables: its token, no other service's secret
        held = {v.split("=", 1)[0] for v in json.loads(docker("inspect", "--format", "{{json .Config.Env}}",
                                                               sandboxed.container))}  # fmt: skip
        secrets = {name for s in launch.SERVICES.values() for name in s.credentials} | set(launch.ROLLOUT_CREDENTIALS)
        assert held & secrets == {ENVIRONMENT_TOKEN_ENV}, held
        assert run_dir == "gone", out


def test_escape_replace_the_api_socket(sandboxed: Server) -> None:
    """In its container the service is reached through a Unix socket, and the tools' code runs as the service's uid:
    the service binds the socket as root in root's folder, then runs as user 100000 with no capability left (--run-as),
    so that code cannot remove the socket or put a listener of its own in its place."""
    command = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["environment"]["command"]
    path = command[command.index("--uds") + 1]
    code = (
        f"import os, socket\npath = {path!r}\nprint(os.getuid())\n"
        "for name, attempt in [('unlink', lambda: os.unlink(path)), ('rename', lambda: os.rename(path, path + '.x')),"
        " ('bind', lambda: socket.socket(socket.AF_UNIX).bind(path + '.2'))]:\n"
        "    try:\n        attempt()\n        print('did', name)\n"
        "    except OSError as err:\n        print('refused', name, err.strerror)"
    )
    out = python(sandboxed, code)
    uid, *attempts = out["text"].splitlines()
    assert uid == "100000" and attempts == [f"refused {n} Permission denied" for n in ("unlink", "rename", "bind")], out
    status = dict(line.split(":", 1) for line in Path(f"/proc/{sandboxed.pid}/status").read_text().splitlines())
    assert status["Uid"].split() == ["100000"] * 4 and int(status["CapEff"], 16) == 0, status
    assert sandboxed.get("/readyz").status_code == 200


def test_escape_fork_bomb(sandboxed: Server) -> None:
    out = python(sandboxed, "import os\nwhile True:\n    os.fork()")
    assert out["timed_out"] or out["exit_code"] != 0, out
    assert python(sandboxed, "print('alive')")["text"] == "alive"  # the next call runs normally


# Five processes at once (the call's and four children), all alive for a second.
FOUR_CHILDREN = (
    "import os, time\npids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n        time.sleep(1)\n"
    "        os._exit(0)\n    pids.append(pid)\nprint(sum(os.waitpid(pid, 0)[1] for pid in pids))"
)


def test_concurrent_calls_each_have_their_process_limit(sandboxed: Server) -> None:
    """max_processes (16 here) is each call's: in the container every call runs as the service's uid, whose every
    process and thread the kernel counts, the service's own threads and its other calls' processes as well. A
    reward's test runner (two processes a call) under max_concurrent_calls calls at once failed there to start."""
    slots = EnvironmentSpec().max_concurrent_calls
    with ThreadPoolExecutor(slots) as pool:
        outs = list(pool.map(lambda _: python(sandboxed, FOUR_CHILDREN), range(slots)))
    assert [(out["exit_code"], out["text"].strip()) for out in outs] == [(0, "0")] * slots, outs


# Every signal that ends a process by default, to the call's parent and to PID 1 (in the container: the service;
# in namespaces: the call itself, left out).
SIGNAL_THE_SERVICE = (
    "import os, signal\nfor target in sorted({os.getppid(), 1} - {0, os.getpid()}):\n"
    "    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT, signal.SIGKILL):\n"
    "        try:\n            os.kill(target, sig)\n        except OSError:\n            pass\nprint('sent')"
)


def test_escape_signals_to_the_service(sandboxed: Server) -> None:
    """The red team's R4-3: in a pod or container (isolation none) the calls run as the service's uid, and a call's
    os.kill(os.getppid(), SIGTERM) stopped it (four restarts and the run was Failed). The service takes SIGTERM
    and SIGINT only from outside its calls (sandbox.guard_shutdown_signals); PID 1 of the container ignores the
    others, which it has no handler for."""
    assert python(sandboxed, SIGNAL_THE_SERVICE)["text"].strip() == "sent"
    time.sleep(1)  # a graceful stop would have begun by now
    assert python(sandboxed, "print('alive')")["text"] == "alive"
    if sandboxed.container:
        assert docker("inspect", "--format", "{{.State.Running}} {{.RestartCount}}", sandboxed.container) == "true 0"


def test_escape_memory_bomb(sandboxed: Server) -> None:
    out = python(sandboxed, "x = bytearray(1 << 30)")  # 1 GiB over the 256 MB limit
    assert out["exit_code"] == 1 and "MemoryError" in out["text"], out
    assert python(sandboxed, "print('alive')")["text"] == "alive"


# Four children holding 150 MB each (touched, so resident): under the 256 MB limit each, over it together.
FOUR_HOLDERS = (
    "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        held = b'1' * (150 << 20)\n"
    "        time.sleep(2)\n        os._exit(0)\nfor _ in range(4):\n    os.wait()\nprint('held')"
)


def test_escape_memory_spread_over_processes(sandboxed: Server) -> None:
    """The red team's R4-5: memory_limit_mb bounded each process (RLIMIT_AS), not a call: one call forking 8
    children held 3.3 GB under 512 MB. The call's processes together are held to it (summed every
    MEMORY_POLL_S): the call is stopped and says so."""
    start = time.monotonic()
    out = python(sandboxed, FOUR_HOLDERS)
    assert out["memory_exceeded"] and out["text"].endswith("[memory limit of 256 MB exceeded]"), out
    assert out["signal"] == "SIGKILL" and not out["timed_out"] and time.monotonic() - start < 2
    assert python(sandboxed, "print('alive')")["text"] == "alive"


# Leaves a file in each folder every process can write, and one in its working folder; then waits.
LEAVE_FILES = (
    "import os, time\nfor folder in ('/tmp', '/var/tmp', '/dev/shm', '.'):\n    try:\n"
    "        with open(os.path.join(folder, 'left-{tag}.txt'), 'w') as f:\n            f.write('secret')\n"
    "    except OSError:\n        pass\nprint('left', flush=True)\ntime.sleep({wait})"
)
# Every file named left-* it can reach: in the shared folders, their subfolders, and other processes' cwd.
FIND_FILES = (
    "import glob\nfound = []\nfor pattern in ('/tmp/left-*', '/tmp/*/left-*', '/var/tmp/left-*', '/dev/shm/left-*',"
    " '/proc/*/cwd/left-*'):\n    found += glob.glob(pattern)\nprint(sorted(found))"
)


def test_escape_another_calls_files_and_files_left_behind(sandboxed: Server) -> None:
    """The red team's R4-4: under isolation none (a pod, the container) calls of different episodes read and rewrote
    each other's files (/tmp/*/, /proc/*/cwd/), and files left in /tmp were there for the next call. There, calls
    now run one at a time (environment.unsafe_concurrent_calls off) and what one left in /tmp, /var/tmp or /dev/shm
    is removed before the next; in namespaces each call has those folders of its own."""
    with ThreadPoolExecutor(2) as pool:
        writer = pool.submit(python, sandboxed, LEAVE_FILES.format(tag="a", wait=1.5))
        time.sleep(0.5)  # the writer's call has begun (or, one at a time, this one waits for it to end)
        reader = pool.submit(python, sandboxed, FIND_FILES)
        assert writer.result()["text"].strip() == "left" and reader.result()["text"].strip() == "[]", reader.result()
    python(sandboxed, LEAVE_FILES.format(tag="b", wait=0))
    assert python(sandboxed, FIND_FILES)["text"].strip() == "[]"


def test_escape_infinite_loop(sandboxed: Server) -> None:
    start = time.monotonic()
    out = python(sandboxed, "while True:\n    pass")
    assert out["timed_out"] and out["text"] == f"[timeout after {TIME_LIMIT_S:g} s]", out
    assert out["signal"] == "SIGKILL" and time.monotonic() - start < TIME_LIMIT_S + 2


def test_escape_100_mb_print(sandboxed: Server) -> None:
    out = python(sandboxed, "import sys\nsys.stdout.write('z' * 100_000_000)\nprint('end', file=sys.stderr)")
    assert out["exit_code"] == 0 and out["truncated"] and len(out["text"]) == OUTPUT_LIMIT, out
    rss_kb = int(next(line for line in Path(f"/proc/{sandboxed.pid}/status").read_text().splitlines()
                      if line.startswith("VmRSS")).split()[1])  # fmt: skip
    assert rss_kb < 400_000  # the service kept the first bytes only


# System V shared memory: a segment of 64 MB, written and left (its id printed); then whether a key still finds one.
SHARED_MEMORY = (
    "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
    "shm = libc.shmget({key}, 64 << 20, 0o1000 | 0o600)\naddress = libc.shmat(shm, None, 0)\n"
    "ctypes.memset(address, 1, 64 << 20)\nprint(shm)"
)
SHARED_MEMORY_FOUND = "import ctypes\nprint(ctypes.CDLL(None).shmget({key}, 0, 0))"


def test_escape_shared_memory_left_behind(sandboxed: Server) -> None:
    """A shared memory segment outlives its process unless removed: left by a call, its pages would stay in memory
    outside every limit, call after call. Namespaced calls have an IPC namespace of their own (unshare --ipc); in
    the container, the calls share its namespace, where kernel.shm_rmid_forced (docker-compose.yml, as the operator's
    pod) ends a segment with its last user."""
    isolation = sandboxed.get("/readyz").json()["isolation"]
    if isolation == "none" and not sandboxed.container:
        pytest.skip("calls share this machine's IPC namespace: only a pod or container confines it")
    key = secrets.randbelow(1 << 30) + 1
    libc = ctypes.CDLL(None)
    try:
        out = python(sandboxed, SHARED_MEMORY.format(key=key))
        assert out["exit_code"] == 0 and int(out["text"]) >= 0, out  # it made and filled one
        later = python(sandboxed, SHARED_MEMORY_FOUND.format(key=key))
        assert later["text"].strip() == "-1", later  # the next call finds none
        if not sandboxed.container:
            assert libc.shmget(key, 0, 0) == -1  # nor does this machine
    finally:
        if not sandboxed.container and (left := libc.shmget(key, 0, 0)) >= 0:
            libc.shmctl(left, 0, None)  # IPC_RMID: a failure leaves nothing behind


# A process that holds many threads (a trainer's, say) until its stdin closes; it says when they run.
THREAD_HOLDER = (
    "import sys, threading\nfor _ in range(40):\n    threading.Thread(target=sys.stdin.read, daemon=True).start()\n"
    "print('holding', flush=True)\nsys.stdin.read()"
)
FORK = "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('forked')"


@pytest.mark.skipif(os.getuid() != 0, reason="needs root: the threads run as the run pods' uid")
def test_threads_of_the_run_pods_uid_leave_a_call_its_process_limit(sandboxed: Server) -> None:
    """The kernel counts RLIMIT_NPROC (max_processes, 16 here) over every process and thread of a uid on the machine,
    and every run pod and container but the environment's runs as uid 1000: 40 threads of that uid (fewer than a
    trainer has) must not leave a tool call unable to start a process."""
    holder = subprocess.Popen(
        ["/usr/bin/python3", "-c", THREAD_HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        user=children.RUN_AS_USER, group=children.RUN_AS_USER,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        out = python(sandboxed, FORK)
        assert out["exit_code"] == 0 and out["text"].strip() == "forked", out
    finally:
        holder.communicate(timeout=30)


UID = "import os\nprint(os.getuid())"


@pytest.mark.skipif(os.getuid() != 0, reason="needs root: only root gives each call slot a uid of its own")
def test_two_environment_services_never_run_calls_as_the_same_uid(server: Server, tmp_path: Path) -> None:
    """The kernel counts RLIMIT_NPROC per uid: a second service on the machine whose calls ran as the first one's
    uids would count the first one's calls against their limit. Calls one after another take each slot in turn."""
    slots = EnvironmentSpec().max_concurrent_calls
    other = start_server(tmp_path)
    try:
        first = {int(python(server, UID)["text"]) for _ in range(slots)}
        second = {int(python(other, UID)["text"]) for _ in range(slots)}
    finally:
        other.process.terminate()
        other.process.wait(10)
    assert len(first) == len(second) == slots and not first & second, (first, second)
    assert min(first | second) >= SANDBOX_UID_BASE


# A daemon: setsid and a double fork take it out of the call's process group (which the time limit's kill ends), its
# output closed so that the call returns at once; it prints its pid.
DAEMON = (
    "import os, time\nif os.fork() == 0:\n    os.setsid()\n    pid = os.fork()\n    if pid == 0:\n"
    "        os.close(1)\n        os.close(2)\n        time.sleep(60)\n    print(pid, flush=True)\n"
    "    os._exit(0)\nos.wait()"
)
PROCESS_STATE = (  # "False" when no process has the pid, else its state ("S" sleeping, "Z" a zombie)
    "import os\np = '/proc/{pid}/stat'\nprint(os.path.exists(p) and open(p).read().rsplit(')', 1)[1].split()[0])"
)


def claimed_uids(pid: int) -> set[int]:
    """The uids the service `pid` runs its calls as: those whose lock files it holds open (sandbox.claim_uids). Not
    every uid from SANDBOX_UID_BASE up: another test's environment service may run calls meanwhile."""
    uids = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = Path(os.readlink(fd))
        except OSError:  # closed since listed
            continue
        if target.parent == UID_LOCKS:
            uids.add(int(target.stem))
    return uids


def test_escape_a_process_left_behind(sandboxed: Server) -> None:
    """In namespaces killing the call ends its daemon too; without them the service, a child subreaper, kills it
    once the call ends. Left alive it would run beside every later call (in compose: replace the API's socket)."""
    out = python(sandboxed, DAEMON)
    assert out["exit_code"] == 0 and out["text"].strip().isdigit(), out
    isolation = sandboxed.get("/readyz").json()["isolation"]
    if isolation == "namespaces":  # its pid is its namespace's: look for any process of this service's calls' uids
        uids = claimed_uids(sandboxed.pid)
        assert uids, "the service holds no sandbox uid"
        left = [p.info for p in psutil.process_iter(["pid", "uids"]) if p.info["uids"].real in uids]
        assert left == [], left
        return
    state = python(sandboxed, PROCESS_STATE.format(pid=int(out["text"])))  # no pid namespace: the next call looks
    assert state["text"] in ("False", "Z"), state


def test_without_namespaces_a_daemon_dies_when_its_call_ends() -> None:
    """The sweep itself, in a process of its own (it kills every child but the calls): a sandbox without namespaces
    (the container's case, here forced) runs the daemon; after the call it is gone, without the sweep it lives."""
    script = (
        "import asyncio, subprocess, sys\nfrom reinforce.environment.sandbox import Limits, Sandbox\n"
        "sandbox = Sandbox(Limits(3.0, 256 << 20, 16 << 20, 32, 4000), 1, [], 'none', reap_strays=sys.argv[1] == 'y')\n"
        f"pid = int(asyncio.run(sandbox.run({DAEMON!r})).stdout)\n"
        f"state = subprocess.run([sys.executable, '-c', {PROCESS_STATE!r}.format(pid=pid)], capture_output=True)\n"
        "print(state.stdout.decode().strip())\nsubprocess.run(['kill', '-9', str(pid)], capture_output=True)"
    )
    states = [
        subprocess.run([sys.executable, "-c", script, reap], capture_output=True, text=True, timeout=120)
        for reap in ("y", "n")
    ]
    assert [s.stdout.strip() for s in states] == ["False", "S"], [s.stderr[-2000:] for s in states]


# A daemon that keeps the call's stdout and stderr: a double fork out of the call's session, its pipes left open.
DAEMON_WITH_PIPES = (
    "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n"
    "    os._exit(0)\nprint('left one behind', flush=True)"
)


def test_without_namespaces_a_daemon_holding_the_pipes_does_not_hold_the_answer() -> None:
    """The red team's R4-11: the call ends when its program does. A daemon that kept copies of the output pipes made
    the answer wait for the time limit (or the daemon's end) and come back as a timeout; now it comes back at once,
    with the program's output and exit code, and the sweep ends the daemon. In a process of its own, as above."""
    script = (
        "import asyncio, json, sys, time\nfrom reinforce.environment.sandbox import Limits, Sandbox\n"
        "sandbox = Sandbox(Limits(20.0, 256 << 20, 16 << 20, 32, 4000), 1, [], 'none', reap_strays=True)\n"
        f"start = time.monotonic()\nresult = asyncio.run(sandbox.run({DAEMON_WITH_PIPES!r}))\n"
        "print(json.dumps([result.stdout, result.exit_code, result.timed_out, time.monotonic() - start]))"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    stdout, exit_code, timed_out, seconds = json.loads(run.stdout.splitlines()[-1])
    assert (stdout, exit_code, timed_out) == ("left one behind\n", 0, False), run.stderr[-2000:]
    assert seconds < 5, seconds  # the time limit is 20 s; the daemon would live 60


@pytest.mark.skipif(os.getuid() != 0, reason="namespaces (a uid per call) need root")
def test_a_namespaced_call_leaves_no_zombie_to_the_host() -> None:
    """A call past its time limit is killed with its `unshare`, whose child, the namespace's PID 1, is then an orphan:
    the service (a subreaper) must reap it, for the process that would adopt it otherwise may never do so. Here that
    process is this script's parent, a subreaper that reaps nothing (as a container's or a sandbox VM's PID 1 may):
    after the call nothing is left under it with the sweep, and without the sweep the namespace's PID 1 is (so the
    test can fail). The code prints once it runs, so the call proves its jail ran within the time limit. It also
    leaves a process of its own session behind, which the kill of the call's process group misses: PID 1 must then
    kill it and wait for it, which gives `unshare` time to die first. Without that, `unshare` often wins the race to
    its dying child and reaps it itself (woken by SIGKILL in wait4, it still looks for a dead child first), and
    nothing would be left to count. A race still, so the orphan must show in one of three tries."""
    code = "import os, time\nif os.fork():\n    print('up', flush=True)\nelse:\n    os.setsid()\ntime.sleep(60)"
    call = (
        "import asyncio, sys\nfrom reinforce.environment.sandbox import Limits, Sandbox\n"
        "limits = Limits(3.0, 256 << 20, 16 << 20, 32, 4000)\n"
        "sandbox = Sandbox(limits, 1, [], 'namespaces', reap_strays=sys.argv[1] == 'y')\n"
        f"result = asyncio.run(sandbox.run({code!r}))\n"
        "assert result.timed_out and result.stdout == 'up\\n', result"
    )
    host = (  # becomes a subreaper, runs the call in a child and counts the processes it adopted
        "import subprocess, sys, time, psutil\n"
        "from reinforce.environment.sandbox import become_subreaper\nbecome_subreaper()\n"
        "subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]], check=True)\ntime.sleep(0.5)\n"
        "print(len(psutil.Process().children()))"
    )

    def adopted(sweep: str) -> str:
        run = subprocess.run([sys.executable, "-c", host, call, sweep], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout.strip()

    assert adopted("y") == "0"
    assert "1" in (adopted("n") for _ in range(3))  # a generator: stops at the first orphan


def test_the_supervisor_starts_the_service_with_its_token_only(tmp_path: Path) -> None:
    spec = parse_spec({**_spec(tmp_path / "run"), "environment": {"enabled": True, "tools": ["calculator"]}})
    children = Children(spec)
    children.paths.root.mkdir(parents=True)
    children.paths.spec.write_text(dump_spec(spec))
    try:
        url = children.start_environment()
        children.wait_until_ready()
        [component] = children.components
        assert set(component.credentials) == {ENVIRONMENT_TOKEN_ENV}  # no Redis URL, no other service's token
        assert httpx.get(url + "/readyz").json()["tools"] == ["calculator"]
        headers = {"Authorization": f"Bearer {children.credentials[ENVIRONMENT_TOKEN_ENV]}"}
        assert httpx.post(url + EPISODES_PATH, json={"prompt": "p"}, headers=headers).status_code == 201
        targets = json.loads((children.paths.root / PROMETHEUS_TARGETS).read_text())
        assert [t["labels"]["component"] for t in targets] == ["environment"]
    finally:
        children.stop()
