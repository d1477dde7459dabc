"""What crosses the environment service's HTTP boundary: paths and JSON bodies, in OpenEnv's words (reset, step,
observation, done, state).

Shared by the service (which validates every request with these models) and `EnvironmentClient`, so the two cannot
drift apart. Importing it pulls in pydantic only.

An episode, as a generator runs it (all /v1 requests with `Authorization: Bearer $REINFORCE_CONTROL_TOKEN`):
    POST   /v1/episodes              {"prompt": "..."}
        -> 201 ResetResponse: episode_id, observation.text (how to call the tools: put it in the system prompt),
           tools (JSON schemas, for a chat template's `tools=`), max_turns
    POST   /v1/episodes/{id}/step    {"action": "<the assistant turn's text, as sampled>"}
        -> 200 StepResponse: done false and the observation (the tool's output, to append as the tool's message
           and continue sampling), or done true (reason no_tool_call: the turn answered; max_turns: the turn was
           the episode's last, its call not run) and no observation
    GET    /v1/episodes/{id}         -> EpisodeState (turn, done, tool calls)
    DELETE /v1/episodes/{id}         -> EpisodeState; always delete an episode when its sample is finished
One program, outside any episode (the reward server's code checking, reward.function
reinforce.reward.rewards:code_tests):
    POST   /v1/run                   {"code": "..."}
        -> 200 RunResponse: stdout, stderr, exit code, timeout, signal; run in the sandbox with the python tool's
           limits (environment.time_limit_s, memory_limit_mb, ...), each stream cut to environment.output_limit_chars
Errors: 401 (token), 404 (no such episode: never started, deleted, or idle past environment.episode_idle_s),
409 (a step on a done episode, or while another step of it runs), 413 (body over MAX_REQUEST_BYTES), 422 (body),
429 (environment.max_episodes open). The reward is not the environment's: the reward server scores the trajectory.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EPISODES_PATH = "/v1/episodes"
RUN_PATH = "/v1/run"
# A tool call's closing tag: generators stop an assistant turn there and send it (tools.py parses the call).
TOOL_CALL_CLOSE = "</tool_call>"
MAX_REQUEST_BYTES = 1 << 20  # a prompt or one assistant turn


def episode_path(episode_id: str) -> str:
    return f"{EPISODES_PATH}/{episode_id}"


def step_path(episode_id: str) -> str:
    return f"{EPISODES_PATH}/{episode_id}/step"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Observation(_Body):
    """What the model sees after its turn (`text`, cut to environment.output_limit_chars), and what the text says in
    fields a program can read."""

    text: str
    tool: str | None = Field(None, description="The tool that ran; None for a call that named no known tool.")
    exit_code: int | None = Field(None, description="python: the program's exit code; None after a timeout.")
    timed_out: bool = Field(False, description="The call was stopped at environment.time_limit_s.")
    error: bool = Field(
        False, description="The call failed: a malformed call, a tool error, a nonzero exit, a timeout."
    )
    signal: str | None = Field(None, description="python: the signal that ended the program (SIGKILL, SIGXCPU, ...).")
    truncated: bool = Field(False, description="`text` was cut to environment.output_limit_chars.")


class ResetRequest(_Body):
    prompt: str = Field(description="The sample's prompt (tools may use it; the service keeps nothing else).")


class ResetResponse(_Body):
    episode_id: str
    observation: Observation = Field(description="text: how to call the tools (for the system prompt).")
    tools: list[dict] = Field(description="Each tool's name, description and JSON Schema of its arguments.")
    max_turns: int
    done: bool = False


class StepRequest(_Body):
    action: str = Field(description="The assistant turn's text, as sampled (a tool call in it is run).")


DoneReason = Literal["no_tool_call", "max_turns"]


class StepResponse(_Body):
    observation: Observation | None = Field(description="The tool's output; None when done.")
    done: bool
    reason: DoneReason | None = Field(None, description="Why the episode is done.")
    turn: int = Field(description="Assistant turns taken, this one included.")


class EpisodeState(_Body):
    episode_id: str
    turn: int
    max_turns: int
    done: bool
    tool_calls: int


class ReadyResponse(_Body):
    ready: bool
    isolation: str = Field(description="The sandbox's isolation: namespaces, user_namespaces or none.")
    python: str = Field(description="The interpreter the python tool runs.")
    tools: list[str]
    open_episodes: int


class RunRequest(_Body):
    code: str = Field(description="A Python 3 program, run as the python tool runs one (its stdin is empty).")


class RunResponse(_Body):
    """A program's result; stdout and stderr are each cut to environment.output_limit_chars (the head is kept)."""

    stdout: str
    stderr: str
    exit_code: int | None = Field(description="None when it was stopped at environment.time_limit_s.")
    timed_out: bool
    signal: str | None = Field(None, description="The signal that ended the program (SIGKILL, SIGXCPU, ...).")
    truncated: bool = Field(False, description="stdout or stderr was cut.")
