"""The built-in code-checking reward (reward/rewards.py code_tests) in parts that need no environment service: which
code of a response counts, what the test program does with hand-written solutions (run here by a plain interpreter;
tests/integration/test_code_reward_server.py runs them in the sandbox), and what the spec and the launchers require
of it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from reinforce.core import launch
from reinforce.core.names import CONTROL_TOKEN_ENV, ENVIRONMENT_TOKEN_ENV
from reinforce.core.spec import CODE_TESTS_REWARD, RewardSpec, SpecError, parse_spec
from reinforce.reward.rewards import RewardError, build_reward_fn, checking_program, code_tests, final_code

MINIMAL = {"name": "t", "policy": {"random_init": {}}, "data": {"prompts": "p.jsonl"}}
CODE_TESTS = {"type": "python", "function": CODE_TESTS_REWARD}
TESTS = "assert add(2, 3) == 5\n"
MARKER = "marker-0123"


@pytest.mark.parametrize(
    ("response", "code"),
    [
        ("```python\nx = 1\n```", "x = 1\n"),
        ("```py\na\n```\ntext\n```python\nb\n```", "b\n"),  # the last block
        ("```\nplain\n```", None),
        ("```python\nnever closed", None),
        ("no code", None),
    ],
)
def test_the_final_code_is_the_last_python_block(response: str, code: str | None) -> None:
    assert final_code(response) == code


def run_program(solution: str) -> subprocess.CompletedProcess[str]:
    program = checking_program(solution, TESTS, MARKER)
    return subprocess.run([sys.executable, "-I", "-c", program], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("solution", "passes"),
    [
        ("def add(a, b):\n    return a + b\n", True),
        ("def add(a, b):\n    print('noise')\n    return a + b\n", True),  # its own output is discarded
        ("if __name__ == '__main__':\n    input()\ndef add(a, b):\n    return a + b\n", True),  # a main guard
        ("def add(a, b):\n    return a - b\n", False),
        ("import sys\nsys.exit(0)\n", False),  # exits 0 before the tests
        ("import os\nos._exit(0)\n", False),
        ("import atexit, os\natexit.register(os._exit, 0)\ndef add(a, b):\n    return 0\n", False),
        ("import builtins\nbuiltins.print = lambda *a, **k: None\ndef add(a, b):\n    return a + b\n", False),
    ],
)
def test_the_program_prints_the_marker_only_after_the_tests_passed(solution: str, passes: bool) -> None:
    done = run_program(solution)
    assert (done.returncode == 0 and done.stdout.rstrip("\n").endswith(MARKER)) == passes, done.stderr
    assert "noise" not in done.stdout


def test_a_prompt_without_tests_is_an_error() -> None:
    with pytest.raises(ValueError, match="1 prompts without tests"):
        code_tests(["p", "q"], ["```python\nx\n```"] * 2, [TESTS, " "], "http://127.0.0.1:9", "token")


def test_code_tests_needs_the_environment_service() -> None:
    with pytest.raises(SpecError, match=r"environment\.enabled"):
        parse_spec({**MINIMAL, "reward": CODE_TESTS})
    spec = parse_spec({**MINIMAL, "reward": CODE_TESTS, "environment": {"enabled": True, "max_turns": 1}})
    assert spec.reward.uses_environment
    assert not RewardSpec(type="python", function="reinforce.reward.rewards:math_answer").uses_environment
    with pytest.raises(RewardError, match="--environment-url"):
        build_reward_fn(spec.reward)


def test_the_reward_server_holds_the_environment_token_only_for_code_tests() -> None:
    tools = {**MINIMAL, "environment": {"enabled": True}}
    code = parse_spec({**tools, "reward": CODE_TESTS})
    other = parse_spec(tools)
    assert launch.holds(launch.REWARD, ENVIRONMENT_TOKEN_ENV, code)
    assert not launch.holds(launch.REWARD, ENVIRONMENT_TOKEN_ENV, other)
    assert not launch.holds(launch.REWARD, CONTROL_TOKEN_ENV, code)  # never another service's
    assert launch.holds(launch.GENERATOR, ENVIRONMENT_TOKEN_ENV, other)
    assert not launch.holds(launch.GENERATOR, ENVIRONMENT_TOKEN_ENV, parse_spec(MINIMAL))
