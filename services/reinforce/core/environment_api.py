"""What crosses the environment service's HTTP boundary: paths and JSON bodies, in OpenEnv's words (reset, step,
observation, done, state).

Shared by the service (which validates every request with these models) and `EnvironmentClient`, so the two cannot
drift apart; and the tools' instructions, which the environment's reset answers and prompts carry (`prompt_data`).
Importing it pulls in pydantic and the spec only.

An episode, as a generator runs it (all /v1 requests with `Authorization: Bearer $REINFORCE_ENVIRONMENT_TOKEN`):
    POST   /v1/episodes              {"prompt": "..."}
        -> 201 ResetResponse: episode_id, observation.text (how to call the tools; prompt_data puts it in prompts),
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

import importlib
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from reinforce.core.spec import DataSpec, RunSpec

EPISODES_PATH = "/v1/episodes"
# Who opens an episode (a generator's id): only that caller may step, read or delete it, and each caller has
# environment.max_episodes_per_caller open at most. Claimed, not proven: every caller holds the same token.
CALLER_HEADER = "X-Reinforce-Caller"
CALLER_PATTERN = r"^[A-Za-z0-9._-]{0,64}$"
RUN_PATH = "/v1/run"
# A tool call's closing tag: generators stop an assistant turn there and send it (tools.py parses the call).
TOOL_CALL_CLOSE = "</tool_call>"
# The python tool called as a fenced block (its code is group 1); a generator ends the turn where the first one closes.
FENCE = "```"
FENCED_PYTHON = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)


def holds_tool_call(turn: str) -> bool:
    """Whether an assistant turn's text has reached the end of a tool call (a closing tag or a closed fenced python
    block): a generator ends the turn there, since the environment runs the turn's first call and ignores the rest."""
    return TOOL_CALL_CLOSE in turn or FENCED_PYTHON.search(turn) is not None


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
    memory_exceeded: bool = Field(
        False, description="python: stopped when its processes together held over environment.memory_limit_mb."
    )
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
    concurrent_calls: int = Field(
        description="Calls the sandbox runs at once: environment.max_concurrent_calls, or 1 where the calls would "
        "share a uid without namespaces (environment.unsafe_concurrent_calls)."
    )
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
    memory_exceeded: bool = Field(
        False, description="Stopped when its processes together held over environment.memory_limit_mb."
    )
    signal: str | None = Field(None, description="The signal that ended the program (SIGKILL, SIGXCPU, ...).")
    truncated: bool = Field(False, description="stdout or stderr was cut.")


# ---- the tools' instructions, for the prompt --------------------------------------------------------------------
# The built-in tools as they describe themselves (name, description, JSON Schema of the arguments): the environment
# service's tool classes take these, and the trainer writes them into prompts without importing that service.
PYTHON_TOOL: dict[str, Any] = {
    "name": "python",
    "description": "Runs a Python 3 program and returns what it prints (stdout, then stderr) and its exit code.",
    "parameters": {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The program; print what you need to see."}},
        "required": ["code"],
    },
}
CALCULATOR_TOOL: dict[str, Any] = {
    "name": "calculator",
    "description": "Evaluates an arithmetic expression: + - * / // % ** ( ), sqrt, log, exp, sin, cos, pi, e.",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "For example (12.5 * 4) ** 2 - sqrt(2)"}},
        "required": ["expression"],
    },
}
BUILTIN_TOOL_SCHEMAS = {t["name"]: t for t in (PYTHON_TOOL, CALCULATOR_TOOL)}


def tool_schema(ref: str) -> dict[str, Any]:
    """A configured tool's name, description and parameters: a built-in's from BUILTIN_TOOL_SCHEMAS, a user tool's
    (`module:Class`) from its class attributes, so its module must be importable where prompts are encoded too."""
    if ref in BUILTIN_TOOL_SCHEMAS:
        return BUILTIN_TOOL_SCHEMAS[ref]
    module_name, _, class_name = ref.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
        return {"name": cls.name, "description": cls.description, "parameters": cls.parameters}
    except (ImportError, AttributeError) as err:
        raise ValueError(f"environment.tools: cannot describe {ref!r} for the prompt's instructions: {err}") from None


def tool_instructions(schemas: list[dict[str, Any]]) -> str:
    """How to call the tools: the environment's `reset` answers it, and the prompts' system message carries it
    (environment.tool_instructions)."""
    lines = [
        "You can use tools. To call one, write",
        '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>',
        "and stop; the tool's output comes back in the next message.",
    ]
    if any(s["name"] == PYTHON_TOOL["name"] for s in schemas):
        lines.append("To run Python you can also write a ```python code block; print what you need to see.")
    lines.append("When you have the answer, write it without a tool call. Tools:")
    lines += [
        f"- {s['name']}: {s['description']} Arguments: {json.dumps(s['parameters'].get('properties', {}))}"
        for s in schemas
    ]
    return "\n".join(lines)


def prompt_data(spec: RunSpec) -> DataSpec:
    """The data settings prompts are encoded with: spec.data, with the tools' instructions appended to
    data.system_prompt when environment.enabled, environment.tool_instructions and data.chat_template (without a
    chat template there is no system message, as data.system_prompt has none). Every encoder of prompts (trainer,
    validation, `reinforce generate`, `reinforce shard-prompts`) uses it, so they all encode alike."""
    data, environment = spec.data, spec.environment
    if not (environment.enabled and environment.tool_instructions and data.chat_template):
        return data
    text = tool_instructions([tool_schema(ref) for ref in environment.tools])
    system = f"{data.system_prompt}\n\n{text}" if data.system_prompt else text
    return data.model_copy(update={"system_prompt": system})
