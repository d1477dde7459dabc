"""Tools, how an assistant turn calls one, and the built-in ones (`python`, `calculator`).

A tool call in an assistant turn is either (the first one in the turn is run; the rest of the turn is ignored)
  <tool_call>{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}</tool_call>
(the JSON format of Qwen's and SmolLM2's chat templates; a list of calls runs its first; `arguments` may also be
a JSON string holding the object; the closing tag may be missing when it was the generator's stop string), or,
for the `python` tool, a fenced block, which small models write without being taught:
  ```python
  print(sum(range(10)))
  ```
A turn with neither ends the episode.

Writing a tool: subclass `Tool`, set `name`, `description` and `parameters` (a JSON Schema of the arguments), and
implement `async step(arguments) -> Observation`; list it in the spec as `environment.tools: ["pkg.mod:MyTool"]`.
One instance per episode: `reset(prompt)` runs when the episode starts, `close()` when it ends, so a tool may keep
per-episode state (a session with an OpenEnv server, a database). The service stops a step at
`environment.time_limit_s` (the model sees `timeout`) and cuts its text to `environment.output_limit_chars`; blocking
work belongs in `asyncio.to_thread` (a thread cannot be stopped: the service answers `timeout` and moves on, the
thread runs to its end). Raise `ToolError` to answer the model with an error it can read.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import json
import math
import operator
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from reinforce.core.environment_api import CALCULATOR_TOOL, FENCED_PYTHON, PYTHON_TOOL, Observation
from reinforce.core.spec import EnvironmentSpec
from reinforce.environment.sandbox import RunResult, Sandbox


class ToolError(Exception):
    """A call the tool refuses (bad arguments, a failed computation); its message is the model's observation."""


@dataclass(frozen=True)
class ToolContext:
    """What a tool may use: the environment's settings and the sandbox (for running code)."""

    spec: EnvironmentSpec
    sandbox: Sandbox


class Tool:
    """Base class of every tool. Subclasses set the three class attributes and implement `step`."""

    name: ClassVar[str]
    description: ClassVar[str]
    parameters: ClassVar[dict[str, Any]]  # JSON Schema of the arguments object

    def __init__(self, context: ToolContext) -> None:
        self.context = context

    async def reset(self, prompt: str) -> None:
        """The episode starts (its prompt, as the generator sent it)."""

    async def step(self, arguments: dict[str, Any]) -> Observation:
        raise NotImplementedError

    async def close(self) -> None:
        """The episode ended (done, deleted or expired)."""

    @classmethod
    def schema(cls) -> dict[str, Any]:
        """The tool as chat templates take it (`tools=[...]`): name, description, parameters."""
        return {"name": cls.name, "description": cls.description, "parameters": cls.parameters}


def _argument(arguments: dict[str, Any], name: str) -> str:
    value = arguments.get(name)
    if not isinstance(value, str):
        raise ToolError(f'error: the arguments need "{name}" (a string)')
    return value


class PythonTool(Tool):
    name = PYTHON_TOOL["name"]  # the built-ins' descriptions live in core: prompts carry them (prompt_data)
    description = PYTHON_TOOL["description"]
    parameters: ClassVar[dict[str, Any]] = PYTHON_TOOL["parameters"]

    async def step(self, arguments: dict[str, Any]) -> Observation:
        result = await self.context.sandbox.run(_argument(arguments, "code"))
        return python_observation(result, self.context.spec)


def python_observation(result: RunResult, limits: EnvironmentSpec) -> Observation:
    """stdout, then `[stderr]` and stderr, then `[exit code N]` when nonzero, `[timeout after T s]` or `[memory
    limit of M MB exceeded]`."""
    parts = [result.stdout] if result.stdout else []
    if result.stderr:
        parts.append(f"[stderr]\n{result.stderr}")
    if result.timed_out:
        parts.append(f"[timeout after {limits.time_limit_s:g} s]")
    elif result.memory_exceeded:
        parts.append(f"[memory limit of {limits.memory_limit_mb} MB exceeded]")
    elif result.exit_code:
        parts.append(f"[exit code {result.exit_code}]")
    text = "\n".join(part.rstrip("\n") for part in parts) or "[no output]"
    return Observation(
        text=text,
        tool=PythonTool.name,
        exit_code=result.exit_code,
        timed_out=result.timed_out,
        memory_exceeded=result.memory_exceeded,
        error=result.timed_out or result.exit_code != 0,
        signal=result.signal,
    )


# ---- the calculator: arithmetic on a parsed expression, never eval ----------------------------------------------
MAX_EXPRESSION_CHARS = 500
MAX_INT_BITS = 4096  # larger integers are refused: 9**9**9 must not take the service's CPU
# round(2, -10**8) computes 10**(10**8): ndigits past a 4096-bit integer's 1234 decimal digits changes nothing
MAX_ROUND_DIGITS = math.ceil(MAX_INT_BITS * math.log10(2))
# Each operation is bounded above; the deadline is the second wall: an expression is evaluated off the event loop
# (so no call can stall the service's other episodes) and gives up between operations once it has passed.
CALCULATE_TIMEOUT_S = 1.0
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _round(number: int | float, ndigits: int | float | None = None) -> int | float:
    if ndigits is not None and (not isinstance(ndigits, int) or abs(ndigits) > MAX_ROUND_DIGITS):
        raise ToolError(f"error: round's digits must be an integer within +-{MAX_ROUND_DIGITS}")
    return round(number, ndigits)


_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs,
    "round": _round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
    "exp": math.exp,
    "log": math.log,
    "log10": math.log10,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "factorial": math.factorial,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}


def _checked(value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ToolError("error: not a number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError(f"error: a number over {MAX_INT_BITS} bits")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    # bound the result's size before computing it: bits(base ** n) ~ n * bits(base)
    if isinstance(base, int) and isinstance(exponent, int) and exponent * max(base.bit_length(), 1) > MAX_INT_BITS:
        raise ToolError(f"error: a number over {MAX_INT_BITS} bits")
    return base**exponent


class _PastDeadline(Exception):
    """The evaluation ran past its deadline (calculate names the time limit)."""


def _evaluate(node: ast.AST, deadline: float) -> int | float:
    if time.monotonic() > deadline:
        raise _PastDeadline
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, deadline)
    if isinstance(node, ast.Constant):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, deadline), _evaluate(node.right, deadline)
        fn = _power if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)]
        return _checked(fn(left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand, deadline)))
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords:
            raise ToolError("error: functions take positional arguments only")
        args = [_evaluate(arg, deadline) for arg in node.args]
        if node.func.id == "factorial" and args and args[0] > 500:
            raise ToolError("error: factorial of more than 500")
        return _checked(_FUNCTIONS[node.func.id](*args))
    raise ToolError(f"error: {ast.unparse(node)!r} is not arithmetic")


def calculate(expression: str, timeout_s: float = CALCULATE_TIMEOUT_S) -> int | float:
    """+ - * / // % ** and parentheses on numbers, pi and e, and the functions of _FUNCTIONS; ToolError for anything
    else, and for an evaluation still running after `timeout_s`."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"error: an expression over {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ToolError(f"error: not an expression ({err.msg})") from None
    try:
        return _evaluate(tree, time.monotonic() + timeout_s)
    except _PastDeadline:
        raise ToolError(f"error: the expression took over {timeout_s:g} s") from None
    except (ArithmeticError, ValueError, TypeError) as err:  # 1/0, sqrt(-1), min() ...
        raise ToolError(f"error: {err}") from None


class Calculator(Tool):
    name = CALCULATOR_TOOL["name"]
    description = CALCULATOR_TOOL["description"]
    parameters: ClassVar[dict[str, Any]] = CALCULATOR_TOOL["parameters"]

    async def step(self, arguments: dict[str, Any]) -> Observation:
        value = await asyncio.to_thread(calculate, _argument(arguments, "expression"))
        text = str(int(value)) if isinstance(value, float) and value.is_integer() and abs(value) < 1e15 else str(value)
        return Observation(text=text, tool=self.name)


BUILTIN: dict[str, type[Tool]] = {PythonTool.name: PythonTool, Calculator.name: Calculator}


def tool_class(ref: str) -> type[Tool]:
    """A built-in tool's class by name, or a user tool's from `module:Class` (errors name environment.tools)."""
    if ref in BUILTIN:
        return BUILTIN[ref]
    module_name, _, class_name = ref.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"environment.tools: cannot load {ref!r}: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(f"environment.tools: {ref!r} is not a subclass of reinforce.environment.tools.Tool")
    for attribute in ("name", "description", "parameters"):
        if not hasattr(cls, attribute):
            raise ValueError(f"environment.tools: {ref!r} does not set `{attribute}`")
    return cls


# ---- parsing a turn ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def parse_tool_call(turn: str) -> ToolCall | None:
    """The turn's first tool call (tagged or a fenced python block), None without one; ToolError when a tagged
    call does not parse."""
    tagged, fenced = _TAGGED.search(turn), FENCED_PYTHON.search(turn)
    if fenced and (tagged is None or fenced.start() < tagged.start()):
        return ToolCall(PythonTool.name, {"code": fenced.group(1)})
    if tagged is None:
        return None
    try:
        call = json.loads(tagged.group(1))
    except json.JSONDecodeError as err:
        raise ToolError(f"error: the tool call is not JSON ({err.msg})") from None
    if isinstance(call, list) and call:
        call = call[0]
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolError('error: a tool call is {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        raise ToolError('error: "arguments" must be a JSON object')
    return ToolCall(call["name"], arguments)
