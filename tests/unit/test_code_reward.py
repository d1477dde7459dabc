"""The built-in code-checking reward (reward/rewards.py code_tests) in parts that need no environment service: which
code of a response counts, what the test program does with hand-written solutions (run here by a plain interpreter;
tests/integration/test_code_reward_server.py runs them in the sandbox), and what the spec and the launchers require
of it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from reinforce.core import launch
from reinforce.core.names import CONTROL_TOKEN_ENV, ENVIRONMENT_TOKEN_ENV
from reinforce.core.spec import CODE_TESTS_REWARD, RewardSpec, SpecError, parse_spec
from reinforce.reward.rewards import RewardError, build_reward_fn, checking_program, code_tests, final_code

MINIMAL = {"name": "t", "policy": {"random_init": {}}, "data": {"prompts": "p.jsonl"}}
CODE_TESTS = {"type": "python", "function": CODE_TESTS_REWARD}
TESTS = "assert add(2, 3) == 5\n"


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


def run_program(solution: str, tests: str = TESTS, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The checking program as the sandbox's jail runs it: `python -I`, the program on stdin (not in argv, which
    the solution's process could read in /proc)."""
    program = checking_program(solution, tests)
    argv = [sys.executable, "-I", "-"]
    return subprocess.run(argv, input=program, capture_output=True, text=True, timeout=30, cwd=cwd)


# The red team's R4-1: a solution that found the old harness's marker in its caller's frame, printed it to the real
# stdout and left with 0 before the tests ran. Now nothing of the tests is in its process, and its exit is not the
# verdict.
FRAME_READER = """import os, sys
for const in sys._getframe(1).f_code.co_consts:
    if isinstance(const, str) and len(const) == 32:
        sys.__stdout__.write(const + "\\n")
sys.__stdout__.flush()
os._exit(0)
"""


@pytest.mark.parametrize(
    ("solution", "passes"),
    [
        ("def add(a, b):\n    return a + b\n", True),
        ("def add(a, b):\n    print('noise')\n    return a + b\n", True),  # its own output goes nowhere
        ("if __name__ == '__main__':\n    input()\ndef add(a, b):\n    return a + b\n", True),  # a main guard
        ("add = int.__add__\n", True),  # one of the solution's objects, called in its process
        # printing is nothing the verdict reads
        ("import builtins\nbuiltins.print = lambda *a, **k: None\ndef add(a, b):\n    return a + b\n", True),
        ("def add(a, b):\n    return a - b\n", False),
        ("import sys\nsys.exit(0)\n", False),  # exits 0 before the tests
        ("import os\nos._exit(0)\n", False),
        ("import atexit, os\natexit.register(os._exit, 0)\ndef add(a, b):\n    return 0\n", False),
        (FRAME_READER, False),
        # R4-1's rigged objects: equal to everything, or an int that says so
        ("class Rigged:\n    def __eq__(self, other):\n        return True\n"
         "def add(a, b):\n    return Rigged()\n", False),
        ("class Five(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
         "def add(a, b):\n    return Five(0)\n", False),
        ("def add(a, b):\n    raise SystemExit(0)\n", False),
        # an answer forged on every descriptor the channel could be, claiming the judge should exit 0
        ("import os\nfor fd in range(64):\n    try:\n        os.write(fd, b'[\"raise\", \"SystemExit\", \"0\"]\\n')\n"
         "    except OSError:\n        pass\ndef add(a, b):\n    return 0\n", False),
        ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", False),  # the judge killed: no verdict of 0
        ("import os, signal\nos.kill(os.getppid(), signal.SIGTERM)\ndef add(a, b):\n    return a + b\n", False),
    ],
)  # fmt: skip
def test_the_judge_exits_0_only_when_the_tests_passed(solution: str, passes: bool) -> None:
    done = run_program(solution)
    assert (done.returncode == 0) == passes, done.stderr[-2000:]
    assert "noise" not in done.stdout


@pytest.mark.parametrize(
    ("solution", "tests"),
    [
        ("def pair(n):\n    return (n, n)\ndef nested():\n    return {'a': [1, {2}], 3: b'x', 'c': 1j}\n",
         "assert pair(1) == (1, 1) and pair(1) != [1, 1]\nassert nested() == {'a': [1, {2}], 3: b'x', 'c': 1j}\n"),
        ("class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
         "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
         "    def __len__(self):\n        return len(self.items)\n",
         "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2 and len(s) == 1 and s.items == [1]\n"),
        ("def count_up(n):\n    yield from range(n)\n", "assert list(count_up(3)) == [0, 1, 2]\n"),
        ("def div(a, b):\n    return a / b\n",
         "try:\n    div(1, 0)\nexcept ZeroDivisionError:\n    pass\nelse:\n    raise AssertionError('no error')\n"),
        ("def square(n):\n    return n * n\n",
         "def check(n):\n    assert square(n) == n * n\nfor n in range(5):\n    check(n)\n"),
        ("from dataclasses import dataclass\n@dataclass\nclass Point:\n    x: int\n    y: int\n",
         "assert Point(1, 2) == Point(1, 2) and Point(1, 2) != Point(2, 1) and Point(1, 2).x == 1\n"),
        ("def nan():\n    return float('nan')\n", "import math\nassert math.isnan(nan())\n"),
    ],
    ids=["plain-values", "a-class", "a-generator", "an-expected-error", "a-test-function", "own-equality", "nan"],
)  # fmt: skip
def test_honest_solutions_pass_tests_of_every_usual_shape(solution: str, tests: str) -> None:
    done = run_program(solution, tests)
    assert done.returncode == 0, done.stderr[-2000:]


def test_builtins_the_solution_redefines_are_not_the_tests(tmp_path: Path) -> None:
    """The tests' `sorted` is Python's, whatever the solution calls its own; and a module the solution writes where
    it runs is never what the judge imports."""
    solution = "def my_sort(xs):\n    return [0]\ndef sorted(xs):\n    return [0]\n"
    assert run_program(solution, "assert my_sort([3, 1]) == sorted([3, 1])\n").returncode == 1
    planted = "open('statistics.py', 'w').write('import os\\nos._exit(0)\\n')\ndef add(a, b):\n    return 0\n"
    done = run_program(planted, "import statistics\n" + TESTS, cwd=tmp_path)
    assert (tmp_path / "statistics.py").is_file() and done.returncode == 1, done.stderr[-2000:]


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
