"""A client of the environment service (asynchronous: a generator runs many episodes at once on one event loop).

    async with EnvironmentClient(url, token) as env:
        episode = await env.reset(prompt)               # episode.observation.text: how to call the tools
        result = await env.step(episode.episode_id, turn_text)
        ...                                             # until result.done
        await env.delete(episode.episode_id)
        result = await env.run(program)                 # one program in the sandbox (the reward's code checking)

No request is retried: a step runs a tool, and repeating it is not harmless. An episode the service no longer has
(404: it restarted, or the episode sat idle past environment.episode_idle_s) raises EpisodeLost; the generator
redoes that sample.
"""

from __future__ import annotations

import httpx
from pydantic import BaseModel

from reinforce.core.environment_api import (
    CALLER_HEADER,
    EPISODES_PATH,
    RUN_PATH,
    EpisodeState,
    ResetRequest,
    ResetResponse,
    RunRequest,
    RunResponse,
    StepRequest,
    StepResponse,
    episode_path,
    step_path,
)

UNIX_SCHEME = "unix:"
UNIX_BASE_URL = "http://environment"  # the Host header of requests over a Unix socket


def unix_socket(url: str) -> str | None:
    """The socket path of a `unix:/PATH` URL (docker-compose's environment service has no network), else None."""
    return url.removeprefix(UNIX_SCHEME) if url.startswith(UNIX_SCHEME) else None


class EnvironmentServiceError(RuntimeError):
    """The service refused a request (the status code and its reason) or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EpisodeLost(EnvironmentServiceError):
    """404: the service does not have the episode (restarted, or expired)."""


class EnvironmentClient:
    def __init__(self, base_url: str, token: str, timeout_s: float = 120.0, caller: str = "") -> None:
        """timeout_s bounds one request; a step waits for a free call slot, then for the tool's time limit. caller:
        whose episodes these are (a generator's id; environment_api.CALLER_HEADER)."""
        headers = {"Authorization": f"Bearer {token}", CALLER_HEADER: caller}
        socket_path = unix_socket(base_url)
        if socket_path is None:
            self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        else:
            transport = httpx.AsyncHTTPTransport(uds=socket_path)
            self._http = httpx.AsyncClient(
                transport=transport, base_url=UNIX_BASE_URL, headers=headers, timeout=timeout_s
            )

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EnvironmentClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def reset(self, prompt: str) -> ResetResponse:
        return ResetResponse.model_validate_json(await self._send("POST", EPISODES_PATH, ResetRequest(prompt=prompt)))

    async def step(self, episode_id: str, action: str) -> StepResponse:
        body = StepRequest(action=action)
        return StepResponse.model_validate_json(await self._send("POST", step_path(episode_id), body))

    async def state(self, episode_id: str) -> EpisodeState:
        return EpisodeState.model_validate_json(await self._send("GET", episode_path(episode_id)))

    async def delete(self, episode_id: str) -> EpisodeState:
        return EpisodeState.model_validate_json(await self._send("DELETE", episode_path(episode_id)))

    async def run(self, code: str) -> RunResponse:
        return RunResponse.model_validate_json(await self._send("POST", RUN_PATH, RunRequest(code=code)))

    async def _send(self, method: str, path: str, body: BaseModel | None = None) -> bytes:
        content = body.model_dump_json() if body is not None else None
        headers = {"Content-Type": "application/json"} if body is not None else None
        try:
            response = await self._http.request(method, path, content=content, headers=headers)
        except httpx.HTTPError as err:
            raise EnvironmentServiceError(f"{method} {path}: {err!r}") from err
        if response.status_code == 404:
            raise EpisodeLost(f"{method} {path}: {response.text}", 404)
        if response.status_code >= 400:
            raise EnvironmentServiceError(
                f"{method} {path}: {response.status_code} {response.text}", response.status_code
            )
        return response.content
