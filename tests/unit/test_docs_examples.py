"""Every command and code block of the docs that is meant to run is checked against the code (issue 31, item 4).

Each fenced block but a `text` one (program output, diagrams) follows a marker line: `<!-- check: NAME -->`, run by
the checker NAME below, or `<!-- not run: REASON -->` saying why not here and which test does it elsewhere. A block
without a marker fails the suite, so the docs cannot gain a command that nothing checks. The generated blocks (the
algorithms' source code) are the code itself.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from k8s import example_run

from generate.chart_values import ChartValues
from reinforce.cli import build_parser
from reinforce.core.environment_api import Observation
from reinforce.core.spec import RewardSpec, parse_spec
from reinforce.environment.tools import Tool
from reinforce.operator.podtemplate import validate_template
from reinforce.operator.resource import ReinforceRunSpec
from reinforce.reward.rewards import build_reward_fn

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"(?:<!-- (check|not run): (.+?) -->\n)?^```(\w*)\n(.*?)^```", re.S | re.M)
GENERATED = re.compile(r"<!-- generated:(\S+) -->.*?<!-- end:\1 -->", re.S)


class Block(NamedTuple):
    where: str
    marker: str | None  # check, not run, or None
    argument: str  # the checker's name, or the reason
    language: str
    body: str


def blocks() -> list[Block]:
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        text = GENERATED.sub("", page.read_text())
        for m in BLOCK.finditer(text):
            where = f"{page.relative_to(ROOT)}:{text[: m.start(3)].count(chr(10)) + 1}"
            found.append(Block(where, m.group(1), m.group(2) or "", m.group(3), m.group(4)))
    return found


def command_lines(body: str) -> list[str]:
    """Shell lines with continuations joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    lines = [re.sub(r"\s#\s.*$", "", line).strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def flags(line: str) -> list[str]:
    return re.findall(r"(?<![\w-])(--[a-z][\w-]*)", line)


def without_optional(line: str) -> str:
    """The command without its `[--flag VALUE]` parts (their flags are checked by name only)."""
    return re.sub(r"\s*\[[^\]]*\]", "", line)


def check_make(body: str) -> None:
    phony = next(line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith(".PHONY:"))
    for line in command_lines(body):
        target = shlex.split(line)[1]
        assert target in phony.split(), f"make {target}: not a target of the Makefile"
        done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def check_reinforce_line(line: str) -> None:
    """A `reinforce ...` line parses with the real parser, and each optional flag it shows exists."""
    parser = build_parser()
    words = shlex.split(without_optional(line))[1:]
    parser.parse_args(words)  # exits (SystemExit) on an unknown command or flag
    command = parser._subparsers._group_actions[0].choices[words[0]]
    options = {s for action in command._actions for s in action.option_strings}
    unknown = [flag for flag in flags(line) if flag not in options]
    assert not unknown, f"{line}: no such option {unknown}"


def check_reinforce_cli(body: str) -> None:
    lines = command_lines(body)
    assert lines and all(line.startswith("reinforce ") for line in lines), body
    for line in lines:
        check_reinforce_line(line)


def check_service_flags(body: str) -> None:
    """`python -m reinforce.SERVICE --flags`: each flag is in the service's own --help; `reinforce` lines parse."""
    for line in command_lines(body):
        if line.startswith("reinforce "):
            check_reinforce_line(line)
            continue
        module = re.match(r"python -m (reinforce\.\w+)", line).group(1)
        helped = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
        assert helped.returncode == 0, helped.stderr
        unknown = [flag for flag in flags(line) if flag not in helped.stdout]
        assert not unknown, f"{module} has no option {unknown}"


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in patch.items():
        out[key] = merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def check_spec_fragment(body: str) -> None:
    """A part of a run spec: put into examples/tiny.yaml, the whole is a valid spec."""
    tiny = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    parse_spec(merged(tiny, yaml.safe_load(body)), "docs fragment")


def check_reinforcerun_fragment(body: str) -> None:
    """A part of a ReinforceRun: merged into the tiny example's, the spec validates and so does every template."""
    fragment = yaml.safe_load(body)["spec"]
    spec = ReinforceRunSpec.model_validate({**merged(example_run()["spec"], fragment), "name": "tiny"})
    for component in fragment.get("kubernetes", {}).values():
        if "template" in component:
            validate_template(component["template"])
    assert spec.kubernetes is not None


def check_chart_values(body: str) -> None:
    ChartValues.model_validate(yaml.safe_load(body))


def check_prometheus_config(body: str) -> None:
    """Its rule files exist, and the targets file is the one `reinforce run` writes into the run folder."""
    config = yaml.safe_load(body)
    for rules in config["rule_files"]:
        assert (ROOT / rules).is_file(), rules
    from reinforce.supervisor.children import PROMETHEUS_TARGETS

    files = [f for job in config["scrape_configs"] for sd in job["file_sd_configs"] for f in sd["files"]]
    assert files and all(Path(f).name == PROMETHEUS_TARGETS for f in files)


def check_tool(body: str) -> None:
    """The tool class, defined as the page shows it, answers a step."""
    namespace: dict[str, Any] = {"Tool": Tool, "Observation": Observation}
    exec(body, namespace)  # the docs' own example, run as written
    tools = [v for v in namespace.values() if isinstance(v, type) and issubclass(v, Tool) and v is not Tool]
    [tool_class] = tools
    observation = asyncio.run(tool_class(context=None).step({"text": "hello"}))
    assert isinstance(observation, Observation) and observation.text == "hello"
    assert tool_class.schema()["name"] == tool_class.name


def check_reward_function(body: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The function, saved as the module the page names, is built and called as the reward server does."""
    (tmp_path / "my_rewards.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = re.search(r"^def (\w+)", body, re.M).group(1)
    reward = build_reward_fn(RewardSpec(type="python", function=f"my_rewards:{name}", kwargs={"target": 20}))
    scores = reward(["p", "p"], ["x" * 20, "x" * 10])
    assert scores == [1.0, 0.5]


CHECKERS: dict[str, Callable[..., None]] = {
    "make": check_make,
    "reinforce-cli": check_reinforce_cli,
    "service-flags": check_service_flags,
    "spec-fragment": check_spec_fragment,
    "reinforcerun-fragment": check_reinforcerun_fragment,
    "chart-values": check_chart_values,
    "prometheus-config": check_prometheus_config,
    "tool": check_tool,
    "reward-function": check_reward_function,
}
CHECKED = [b for b in blocks() if b.marker == "check"]


def test_every_block_is_checked_or_says_why_not() -> None:
    unmarked = [b.where for b in blocks() if b.language != "text" and b.marker is None]
    assert not unmarked, f"code blocks without a check or a not-run reason: {unmarked}"
    unknown = [f"{b.where}: {b.argument}" for b in CHECKED if b.argument not in CHECKERS]
    assert not unknown, unknown
    assert len(CHECKED) >= 10 and set(CHECKERS) == {b.argument for b in CHECKED}


def test_not_run_blocks_name_what_runs_them_elsewhere() -> None:
    for block in blocks():
        if block.marker == "not run":
            assert re.search(r"tests/\S+\.py", block.argument), f"{block.where}: say which test runs it"
            if block.language == "yaml":
                assert list(yaml.safe_load_all(block.body)), block.where


@pytest.mark.parametrize("block", CHECKED, ids=[f"{b.where}:{b.argument}" for b in CHECKED])
def test_docs_block(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checker = CHECKERS[block.argument]
    if checker is check_reward_function:
        checker(block.body, tmp_path, monkeypatch)
    else:
        checker(block.body)


def test_the_checks_catch_a_wrong_block() -> None:
    """Each kind of check fails on what a stale doc would say."""
    with pytest.raises(SystemExit):
        check_reinforce_cli("reinforce run spec.yaml --no-such-flag")
    with pytest.raises(AssertionError):
        check_reinforce_cli("reinforce samples runs/tiny [--stepp N]")
    with pytest.raises(Exception, match="lr"):
        check_spec_fragment("training: {lr: -1}")
    with pytest.raises(AssertionError):
        check_make("make no-such-target")
