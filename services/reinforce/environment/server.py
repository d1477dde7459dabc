"""The environment service: episodes of tools for multi-turn rollouts, behind a small authenticated HTTP API.

    python -m reinforce.environment --spec RUN_DIR/spec.yaml [--host H] [--port N] [--metrics-port N]
        [--uds PATH [--run-as UID:GID]]
        (the bearer token comes from $REINFORCE_ENVIRONMENT_TOKEN, which the run's generators also hold)

The API (reset, step, state, delete; bodies and status codes in reinforce/core/environment_api.py, and a client in
reinforce/core/environment_client.py) in OpenEnv's words: a generator starts an episode per sample (POST
/v1/episodes), sends each assistant turn as it was sampled (POST /v1/episodes/{id}/step), appends the observation it
gets back as the tool's message and samples on, until `done`; then it deletes the episode. The first tool call of a
turn runs (tools.py: the call format and how to write a tool); a turn without one, or the episode's
environment.max_turns-th turn, is `done`. POST /v1/run runs one program in the sandbox outside any episode (the reward
server's code checking). Open probes: GET /healthz, /readyz (the sandbox's isolation), /metrics
(reinforce_environment_*).

Limits (the run spec's `environment` section): environment.max_concurrent_calls tool calls run at once (others
wait), each stopped at environment.time_limit_s, its text cut to environment.output_limit_chars;
environment.max_episodes open episodes; an episode idle for environment.episode_idle_s is ended. The python tool's
sandbox: sandbox.py. Episodes live in this process's memory: a restarted service answers 404 for the episodes it
had, and their samples are redone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Annotated

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from prometheus_client import start_http_server

from reinforce.core.environment_api import (
    CALLER_HEADER,
    CALLER_PATTERN,
    EPISODES_PATH,
    MAX_REQUEST_BYTES,
    RUN_PATH,
    EpisodeState,
    Observation,
    ReadyResponse,
    ResetRequest,
    ResetResponse,
    RunRequest,
    RunResponse,
    StepRequest,
    StepResponse,
    tool_instructions,
)
from reinforce.core.http_kit import add_probes, bearer_dependency, count_requests, read_body
from reinforce.core.launch import ENVIRONMENT
from reinforce.core.launch_flags import EnvironmentFlags
from reinforce.core.metrics import EnvironmentMetrics
from reinforce.core.names import (
    ENVIRONMENT_TOKEN_ENV,
    INVALID_TOOL,
)
from reinforce.core.spec import EnvironmentSpec, load_spec
from reinforce.environment.sandbox import Isolation, Limits, Sandbox, guard_shutdown_signals, make_undumpable
from reinforce.environment.tools import (
    Tool,
    ToolContext,
    ToolError,
    parse_tool_call,
    tool_class,
)

log = logging.getLogger("reinforce.environment")
# A tool's own limit comes first (the python tool kills its process at time_limit_s); this much later the service
# stops waiting for any tool.
TIME_LIMIT_GRACE_S = 1.0
TRUNCATED = "\n[output truncated]"


def unconfined_refusal(isolation: Isolation, pid_1: bool, spec: EnvironmentSpec) -> str | None:
    """Why the service must not start: isolation none contains neither the network nor the files (the escape
    suite's table, docs/environments.md), so only a container or pod (where the service is PID 1) may run it so,
    unless the spec names the risk."""
    if isolation != "none" or pid_1 or spec.unsafe_unconfined_calls:
        return None
    return (
        "the sandbox's isolation is none (no namespaces for this user on this kernel) and no container confines this "
        "service (it is not PID 1): a tool call could open network connections and read and write what this user "
        "can. Run it as root, where unprivileged user namespaces are allowed, or in its container; "
        "environment.unsafe_unconfined_calls: true runs it so anyway"
    )


class NoEpisode(LookupError):
    """404: never started, deleted, or expired."""


class EpisodeConflict(RuntimeError):
    """409: a step on a done episode, or beside another step of the same episode."""


class TooManyEpisodes(RuntimeError):
    """429: environment.max_episodes are open."""


@dataclass
class Episode:
    id: str
    tools: dict[str, Tool]
    turn: int = 0
    tool_calls: int = 0
    done: bool = False
    busy: bool = False  # a step is running
    caller: str = ""  # who opened it: only that caller may step, read or delete it
    last_active: float = field(default_factory=time.monotonic)


class Environment:
    """The episodes and their tools; one event loop runs every request (tools await or run in threads)."""

    def __init__(self, spec: EnvironmentSpec, sandbox: Sandbox, metrics: EnvironmentMetrics | None = None) -> None:
        self.spec = spec
        self.sandbox = sandbox
        self.metrics = metrics or EnvironmentMetrics()
        self.tool_classes = [tool_class(ref) for ref in spec.tools]
        self.context = ToolContext(spec, sandbox)
        self.instructions = tool_instructions([cls.schema() for cls in self.tool_classes])
        self.episodes: dict[str, Episode] = {}
        # the sandbox's slots (max_concurrent_calls, or 1: Sandbox.slots): a call's time limit never counts a wait
        self.calls = asyncio.Semaphore(sandbox.slots)
        self._export_zeros()

    def _export_zeros(self) -> None:
        """Every tool's series from the start, at 0: a labelled series is exported only once its labels are used,
        and a dashboard's error rate or an alert over a series that does not exist yet has no value at all."""
        m = self.metrics
        for name in (cls.name for cls in self.tool_classes):
            for counter in (m.tool_calls, m.tool_errors, m.timeouts):
                counter.labels(name)
            m.seconds.labels(name)
        m.tool_errors.labels(INVALID_TOOL)

    def _episode(self, episode_id: str, caller: str) -> Episode:
        episode = self.episodes.get(episode_id)
        if episode is None or episode.caller != caller:  # another caller's episode is as absent as none
            raise NoEpisode(f"no episode {episode_id!r} (never started, deleted, or idle past episode_idle_s)")
        return episode

    def state(self, episode_id: str, caller: str) -> EpisodeState:
        e = self._episode(episode_id, caller)
        return EpisodeState(
            episode_id=e.id, turn=e.turn, max_turns=self.spec.max_turns, done=e.done, tool_calls=e.tool_calls
        )

    async def reset(self, prompt: str, caller: str) -> ResetResponse:
        if len(self.episodes) >= self.spec.max_episodes:
            raise TooManyEpisodes(f"{len(self.episodes)} episodes open (environment.max_episodes)")
        if (held := sum(e.caller == caller for e in self.episodes.values())) >= self.spec.max_episodes_per_caller:
            raise TooManyEpisodes(f"{held} episodes of caller {caller!r} open (environment.max_episodes_per_caller)")
        tools = {cls.name: cls(self.context) for cls in self.tool_classes}
        for tool in tools.values():
            await tool.reset(prompt)
        episode = Episode(uuid.uuid4().hex, tools, caller=caller)
        self.episodes[episode.id] = episode
        self.metrics.episodes.inc()
        self.metrics.open_episodes.set(len(self.episodes))
        return ResetResponse(
            episode_id=episode.id,
            observation=Observation(text=self.instructions),
            tools=[cls.schema() for cls in self.tool_classes],
            max_turns=self.spec.max_turns,
        )

    async def step(self, episode_id: str, action: str, caller: str) -> StepResponse:
        episode = self._episode(episode_id, caller)
        if episode.done or episode.busy:
            raise EpisodeConflict(f"episode {episode_id} is {'done' if episode.done else 'taking another step'}")
        episode.busy = True
        try:
            episode.turn += 1
            return await self._step(episode, action)
        finally:
            episode.busy = False
            episode.last_active = time.monotonic()

    async def _step(self, episode: Episode, action: str) -> StepResponse:
        try:
            call = parse_tool_call(action)
        except ToolError as err:
            self.metrics.tool_errors.labels(INVALID_TOOL).inc()
            return self._answer(episode, Observation(text=str(err), error=True))
        if call is None or episode.turn >= self.spec.max_turns:
            reason = "no_tool_call" if call is None else "max_turns"
            await self._finish(episode, reason)
            return StepResponse(observation=None, done=True, reason=reason, turn=episode.turn)
        tool = episode.tools.get(call.name)
        if tool is None:
            self.metrics.tool_errors.labels(INVALID_TOOL).inc()
            known = ", ".join(episode.tools)
            return self._answer(episode, Observation(text=f"error: no tool {call.name!r} (tools: {known})", error=True))
        episode.tool_calls += 1
        return self._answer(episode, await self._call(tool, call.arguments))

    def _answer(self, episode: Episode, observation: Observation) -> StepResponse:
        limit = self.spec.output_limit_chars
        if len(observation.text) > limit:
            text = observation.text[: limit - len(TRUNCATED)] + TRUNCATED
            observation = observation.model_copy(update={"text": text, "truncated": True})
        return StepResponse(observation=observation, done=False, turn=episode.turn)

    async def _call(self, tool: Tool, arguments: dict) -> Observation:
        name, m = tool.name, self.metrics
        start = time.perf_counter()
        async with self.calls:
            try:
                observation = await asyncio.wait_for(tool.step(arguments), self.spec.time_limit_s + TIME_LIMIT_GRACE_S)
            except TimeoutError:
                text = f"[timeout after {self.spec.time_limit_s:g} s]"
                observation = Observation(text=text, tool=name, timed_out=True, error=True)
            except ToolError as err:
                observation = Observation(text=str(err), tool=name, error=True)
            except Exception as err:  # a user tool's bug is the episode's error, not the service's
                log.exception("tool %s failed", name)
                observation = Observation(text=f"error: the tool failed ({type(err).__name__})", tool=name, error=True)
        m.seconds.labels(name).observe(time.perf_counter() - start)
        m.tool_calls.labels(name).inc()
        if observation.timed_out:
            m.timeouts.labels(name).inc()
        elif observation.error:
            m.tool_errors.labels(name).inc()
        if observation.signal:
            m.sandbox_kills.labels(observation.signal).inc()
        return observation

    async def _finish(self, episode: Episode, reason: str) -> None:
        """Done (or deleted, or expired): the tools close and the metrics count it, once."""
        if episode.done:
            return
        episode.done = True
        self.metrics.episodes_ended.labels(reason).inc()
        self.metrics.turns.observe(episode.turn)
        for tool in episode.tools.values():
            try:
                await tool.close()
            except Exception:
                log.exception("closing tool %s failed", tool.name)

    async def delete(self, episode_id: str, caller: str, reason: str = "deleted") -> EpisodeState:
        state = self.state(episode_id, caller)
        episode = self.episodes.pop(episode_id)
        self.metrics.open_episodes.set(len(self.episodes))
        await self._finish(episode, reason)
        return state

    async def expire_idle(self) -> None:
        """End episodes without a step for environment.episode_idle_s (their generator died or forgot them)."""
        deadline = time.monotonic() - self.spec.episode_idle_s
        for episode in [e for e in self.episodes.values() if not e.busy and e.last_active < deadline]:
            await self.delete(episode.id, episode.caller, "expired")

    async def run(self, code: str) -> RunResponse:
        """One program in the sandbox, outside any episode (the reward server's code checking): a call slot and the
        python tool's limits, each stream cut to output_limit_chars. Not a tool call: it counts in no tool's series."""
        async with self.calls:
            result = await self.sandbox.run(code)
        if result.signal:
            self.metrics.sandbox_kills.labels(result.signal).inc()
        limit = self.spec.output_limit_chars
        stdout, stderr = (_cut(text, limit) for text in (result.stdout, result.stderr))
        return RunResponse(
            stdout=stdout,
            stderr=stderr,
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            memory_exceeded=result.memory_exceeded,
            signal=result.signal,
            truncated=(stdout, stderr) != (result.stdout, result.stderr),
        )

    def ready(self) -> ReadyResponse:
        return ReadyResponse(
            ready=True,
            isolation=self.sandbox.isolation,
            python=self.sandbox.python,
            concurrent_calls=self.sandbox.slots,
            tools=[cls.name for cls in self.tool_classes],
            open_episodes=len(self.episodes),
        )


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - len(TRUNCATED)] + TRUNCATED


# ---- HTTP ------------------------------------------------------------------------------------------------------
ERRORS: dict[type[Exception], int] = {NoEpisode: 404, EpisodeConflict: 409, TooManyEpisodes: 429}


@contextlib.contextmanager
def _http_errors() -> Iterator[None]:
    try:
        yield
    except tuple(ERRORS) as err:
        raise HTTPException(status_code=ERRORS[type(err)], detail=str(err)) from None


# The caller a request names (environment_api.CALLER_HEADER; none: ""); a malformed one is refused (422).
Caller = Annotated[str, Header(alias=CALLER_HEADER, pattern=CALLER_PATTERN)]


def create_app(env: Environment, token: str) -> FastAPI:
    """Probes and metrics are open; /v1/* demand `Authorization: Bearer <token>`."""

    @contextlib.asynccontextmanager
    async def expiring(_: FastAPI) -> AsyncIterator[None]:
        async def sweep() -> None:
            while True:
                await asyncio.sleep(min(env.spec.episode_idle_s / 4, 30.0))
                await env.expire_idle()

        task = asyncio.create_task(sweep())
        yield
        task.cancel()

    app = FastAPI(title="reinforce environment", lifespan=expiring)
    authorized = bearer_dependency(token)

    count_requests(app, env.metrics.http)
    # listening only after the sandbox was probed: answering means ready
    add_probes(app, env.metrics.registry, env.ready, ReadyResponse)

    @app.post(EPISODES_PATH, status_code=201, dependencies=[Depends(authorized)])
    async def reset(request: Request, caller: Caller = "") -> dict:
        body = await read_body(request, ResetRequest, MAX_REQUEST_BYTES)
        with _http_errors():
            return (await env.reset(body.prompt, caller)).model_dump()

    @app.post(EPISODES_PATH + "/{episode_id}/step", dependencies=[Depends(authorized)])
    async def step(episode_id: str, request: Request, caller: Caller = "") -> dict:
        body = await read_body(request, StepRequest, MAX_REQUEST_BYTES)
        with _http_errors():
            return (await env.step(episode_id, body.action, caller)).model_dump()

    @app.post(RUN_PATH, dependencies=[Depends(authorized)])
    async def run(request: Request) -> dict:
        body = await read_body(request, RunRequest, MAX_REQUEST_BYTES)
        return (await env.run(body.code)).model_dump()

    @app.get(EPISODES_PATH + "/{episode_id}", dependencies=[Depends(authorized)])
    def state(episode_id: str, caller: Caller = "") -> dict:
        with _http_errors():
            return env.state(episode_id, caller).model_dump()

    @app.delete(EPISODES_PATH + "/{episode_id}", dependencies=[Depends(authorized)])
    async def delete(episode_id: str, caller: Caller = "") -> dict:
        with _http_errors():
            return (await env.delete(episode_id, caller)).model_dump()

    return app


# ---- command line ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = ENVIRONMENT.parser(__doc__.splitlines()[0])
    spec_file, args = EnvironmentFlags.parse(parser, argv)
    token = os.environ.get(ENVIRONMENT_TOKEN_ENV)
    if not token:
        parser.error(f"${ENVIRONMENT_TOKEN_ENV} must hold the environment service's bearer token")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stopper = _Stopper()
    guard_shutdown_signals(stopper.stop, stopper.sandbox_busy)  # before any thread starts
    listener = bind_unix_socket(args.uds) if args.uds else None
    if args.run_as:
        if listener is None:
            parser.error("--run-as needs --uds: it keeps the socket from the code the tools run")
        drop_privileges(args.run_as)
    make_undumpable()  # before any tool runs: /proc/PID/environ (the token) unreadable to same-uid processes
    spec = load_spec(spec_file)
    e = spec.environment
    # In namespaces the sandbox never sees the run folder (an empty folder is mounted over it).
    sandbox = Sandbox(
        Limits.from_spec(e),
        e.max_concurrent_calls,
        hidden=[spec.resolved_run_dir()],
        reap_strays=True,
        shared_uid_concurrency=e.unsafe_concurrent_calls,
    )
    log.info("sandbox isolation %s, python %s", sandbox.isolation, sandbox.python)
    if refusal := unconfined_refusal(sandbox.isolation, os.getpid() == 1, e):
        raise SystemExit(refusal)
    env = Environment(e, sandbox)
    if args.metrics_port:  # in a pod: what Prometheus may reach, apart from the API
        start_http_server(args.metrics_port, addr=args.host, registry=env.metrics.registry)
    if listener is None:
        config = uvicorn.Config(create_app(env, token), host=args.host, port=args.port, log_level="warning")
    else:
        config = uvicorn.Config(create_app(env, token), log_level="warning")
    stopper.sandbox, stopper.server = sandbox, uvicorn.Server(config)
    stopper.server.run(sockets=None if listener is None else [listener])


@dataclass
class _Stopper:
    """What uvicorn's own signal handler does, for the signals guard_shutdown_signals lets through (uvicorn's never
    runs: they are blocked): a graceful stop, forced on the second signal; before the server exists, exit at once."""

    sandbox: Sandbox | None = None
    server: uvicorn.Server | None = None

    def stop(self, signum: signal.Signals) -> None:
        if self.server is None:
            os._exit(128 + signum)
        log.info("%s: stopping", signum.name)
        self.server.force_exit = self.server.should_exit
        self.server.should_exit = True

    def sandbox_busy(self) -> bool:
        return self.sandbox is not None and self.sandbox.busy()


def bind_unix_socket(path: str) -> socket.socket:
    """A listening Unix socket at `path` (a stale one from an earlier start replaced), open to every local user:
    its folder, not the socket, decides who may replace it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o666)
    listener.listen(128)
    return listener


def drop_privileges(run_as: str) -> None:
    """Become UID:GID for good (no supplementary groups; a uid change from root clears every capability)."""
    try:
        uid, gid = (int(part) for part in run_as.split(":"))
    except ValueError:
        raise SystemExit(f"--run-as {run_as!r}: expected UID:GID, two numbers") from None
    if os.geteuid() != 0:
        raise SystemExit(f"--run-as {run_as}: the service must start as root to change its user")
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
