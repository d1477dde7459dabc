"""The environment's parts that need no process: the tool-call parser, the calculator, tool loading, the spec."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from reinforce.core.environment_api import Observation, holds_tool_call
from reinforce.core.spec import EnvironmentSpec, SpecError, parse_spec
from reinforce.environment.sandbox import RunResult
from reinforce.environment.server import unconfined_refusal
from reinforce.environment.tools import (
    CALCULATE_TIMEOUT_S,
    MAX_INT_BITS,
    MAX_ROUND_DIGITS,
    Calculator,
    ToolCall,
    ToolError,
    calculate,
    parse_tool_call,
    python_observation,
    tool_class,
)

MINIMAL = {"name": "t", "policy": {"random_init": {}}, "data": {"prompts": "p.txt"}}


TURNS = [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>',
         ToolCall("calculator", {"expression": "1+2"})),
        # SmolLM2's list form, arguments as a JSON string (OpenAI's), a missing closing tag (the stop string)
        ('I will call.\n<tool_call>[{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}]',
         ToolCall("python", {"code": "print(1)"})),
        ("Run it:\n```python\nprint(2)\n```\nthen <tool_call>{}</tool_call>",
         ToolCall("python", {"code": "print(2)\n"})),
        ("```py\nx = 1\n```", ToolCall("python", {"code": "x = 1\n"})),
        ("The answer is 42.", None),
        ("```\nnot python\n```", None),
        ("```python\nprint('never closed')", None),
]  # fmt: skip


@pytest.mark.parametrize(("turn", "call"), TURNS)
def test_the_first_tool_call_of_a_turn_is_parsed(turn: str, call: ToolCall | None) -> None:
    assert parse_tool_call(turn) == call


@pytest.mark.parametrize(("turn", "call"), TURNS)
def test_a_turn_ended_where_the_generator_ends_it_holds_the_same_call(turn: str, call: ToolCall | None) -> None:
    """The generator ends a turn at the first prefix that holds_tool_call (the closing fence of the first python
    block, or a closing tag): the environment reads the same call from that prefix as from the whole turn."""
    ends = [n for n in range(1, len(turn) + 1) if holds_tool_call(turn[:n])]
    prefix = turn[: ends[0]] if ends else turn
    assert parse_tool_call(prefix) == call


@pytest.mark.parametrize(
    ("turn", "end"),
    [
        ("Sure:\n```python\nprint(3)\n```\nOutput: 3\nThe answer is 3.", "Sure:\n```python\nprint(3)\n```"),
        ("```\nplain\n```\n```py\nprint(4)\n```\n4", "```\nplain\n```\n```py\nprint(4)\n```"),
        ('<tool_call>{"name": "python"}</tool_call> and on', '<tool_call>{"name": "python"}</tool_call>'),
    ],
)
def test_a_turn_ends_where_its_first_call_closes(turn: str, end: str) -> None:
    """Not at a fence that opens a block, nor at the closing fence of a block that is not python."""
    assert next(turn[:n] for n in range(1, len(turn) + 1) if holds_tool_call(turn[:n])) == end


@pytest.mark.parametrize(
    ("turn", "error"),
    [
        ("<tool_call>{nope}</tool_call>", "not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', '{"name": ...'),
        ('<tool_call>{"name": "python", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ],
)
def test_a_malformed_call_is_an_error_for_the_model(turn: str, error: str) -> None:
    with pytest.raises(ToolError, match="error: ") as raised:
        parse_tool_call(turn)
    assert error in str(raised.value)


@pytest.mark.parametrize(
    ("expression", "value"),
    [("12 * (3 + 4)", 84), ("7 / 2", 3.5), ("7 // 2", 3), ("-2 ** 10", -1024), ("sqrt(16) + abs(-1)", 5.0),
     ("round(pi, 2)", 3.14), ("2 ** 4000 > 0", None), ("max(1, 5, 3) % 4", 1)],
)  # fmt: skip
def test_calculator_evaluates_arithmetic(expression: str, value: float | None) -> None:
    if value is None:  # a comparison is not arithmetic
        with pytest.raises(ToolError):
            calculate(expression)
    else:
        assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('true')", "().__class__", "open('/etc/passwd')", "lambda: 1", "[1, 2]", "'a' * 3",
     "9 ** 9 ** 9", "10 ** 5000", "factorial(10 ** 6)", "1 / 0", "sqrt(-1)", "(-8) ** 0.5", "1e308 * 10 ** 400",
     "x" * 501, "1 +", "round(2, -10 ** 8)", "round(2, 10 ** 8)", "round(2.5, 1.5)"],
)  # fmt: skip
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ToolError, match=r"^error: "):
        calculate(expression)
    assert time.perf_counter() - start < 0.1  # refused before any large computation


def test_calculator_gives_up_at_its_deadline_between_operations() -> None:
    """The second wall behind the bounds: a long chain of bounded operations stops once the deadline has passed."""
    expression = " + ".join(["factorial(500) % 7"] * 16)
    assert calculate(expression) == 0  # 500! is a multiple of 7
    with pytest.raises(ToolError, match="took over 0 s"):
        calculate(expression, timeout_s=0.0)


def test_calculator_runs_off_the_event_loop() -> None:
    """The service's other episodes go on while a call is evaluated: the loop ticks during Calculator.step."""

    async def ticks_during_a_call() -> tuple[Observation, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        calculator = Calculator(None)  # type: ignore[arg-type]  # the calculator needs no sandbox
        observation = await calculator.step({"expression": " + ".join(["factorial(500) % 7"] * 16)})
        ticker.cancel()
        return observation, ticks

    observation, ticks = asyncio.run(ticks_during_a_call())
    assert observation.text == "0" and ticks > 1


def test_python_observation_says_stderr_exit_timeout_and_memory() -> None:
    failed = python_observation(RunResult("out\n", "Traceback\n", 1, False, None, 14), EnvironmentSpec())
    assert failed.text == "out\n[stderr]\nTraceback\n[exit code 1]" and failed.error
    stopped = python_observation(RunResult("", "", None, True, "SIGKILL", 0), EnvironmentSpec(time_limit_s=2.5))
    assert stopped.text == "[timeout after 2.5 s]" and stopped.timed_out and stopped.signal == "SIGKILL"
    assert python_observation(RunResult("", "", 0, False, None, 0), EnvironmentSpec()).text == "[no output]"
    spent = python_observation(RunResult("", "", -9, False, "SIGKILL", 0, memory_exceeded=True), EnvironmentSpec())
    assert spent.text == "[memory limit of 512 MB exceeded]" and spent.memory_exceeded and spent.error


def test_tools_are_built_in_names_or_module_and_class() -> None:
    assert tool_class("calculator") is Calculator
    with pytest.raises(ValueError, match=r"environment\.tools: cannot load 'no_such_module:Tool'"):
        tool_class("no_such_module:Tool")
    with pytest.raises(ValueError, match=r"is not a subclass of reinforce\.environment\.tools\.Tool"):
        tool_class("pathlib:Path")


def test_spec_names_a_bad_tool_list() -> None:
    assert parse_spec(MINIMAL).environment.enabled is False
    with pytest.raises(SpecError, match=r"environment: .*'search' is neither a built-in tool"):
        parse_spec({**MINIMAL, "environment": {"tools": ["search"]}})
    with pytest.raises(SpecError, match="names a tool twice"):
        parse_spec({**MINIMAL, "environment": {"tools": ["python", "python"]}})
    with pytest.raises(SpecError, match=r"environment\.time_limit_s"):
        parse_spec({**MINIMAL, "environment": {"time_limit_s": 0}})


def test_the_docs_state_the_calculators_bounds_as_the_code_has_them() -> None:
    docs = " ".join((Path(__file__).parents[2] / "docs" / "environments.md").read_text().split())
    assert f"integers over {MAX_INT_BITS} bits" in docs
    assert f"`round`'s digits past {MAX_ROUND_DIGITS}" in docs
    assert f"gives up after {CALCULATE_TIMEOUT_S:g} s" in docs


@pytest.mark.parametrize(
    ("isolation", "pid_1", "unsafe", "refused"),
    [
        ("none", False, False, True),  # a local service without namespaces: nothing confines its calls
        ("none", True, False, False),  # a container's or pod's PID 1: the container confines them
        ("none", False, True, False),  # the spec names the risk
        ("namespaces", False, False, False),
        ("user_namespaces", False, False, False),
    ],
)
def test_an_unconfined_service_refuses_to_start_unless_the_spec_says_so(isolation, pid_1, unsafe, refused):
    refusal = unconfined_refusal(isolation, pid_1, EnvironmentSpec(unsafe_unconfined_calls=unsafe))
    assert (refusal is not None) == refused
    assert refusal is None or "environment.unsafe_unconfined_calls" in refusal
