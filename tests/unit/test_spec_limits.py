"""Issue #30, findings R3-15 and R3-16: what the spec loader refuses before it could hang, recurse or blow up, each
with one line naming the file (and line) or field: YAML aliases, deep nesting, huge files, a FIFO as prompt file."""

import os
import time

import pytest
import yaml
from runs import reinforce, write_spec

from reinforce.core.data import DataError, read_prompt_file
from reinforce.core.spec import MAX_SPEC_BYTES, MAX_SPEC_DEPTH, SpecError, dump_spec, load_spec, parse_spec

SPEC = "name: t\npolicy: {random_init: {}}\ndata: {prompts: p.txt}\nreward:\n  type: python\n  function: m:f\n"


def alias_bomb(levels: int) -> str:
    """reward.kwargs of nine-fold nested aliases: 9**levels strings once expanded, in about 1.3 KB."""
    lines = ['    l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels + 1):
        lines.append(f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return SPEC + "  kwargs:\n" + "\n".join(lines) + "\n"


def test_yaml_aliases_are_refused_naming_the_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(8))
    start = time.monotonic()
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert time.monotonic() - start < 1.0
    assert str(err.value) == f"{path}: line 9: YAML aliases (*l0) are not allowed in a run spec"


def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text(SPEC + "  kwargs:\n    x: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(SpecError, match=rf"deep\.yaml: line 8: nested deeper than {MAX_SPEC_DEPTH} levels"):
        load_spec(path)
    # the same value from another source than YAML (the operator's custom resource): named by its field
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    data = {**yaml.safe_load(SPEC), "reward": {"type": "python", "function": "m:f", "kwargs": {"x": deep}}}
    with pytest.raises(SpecError, match=r"^run: reward\.kwargs\.x\.\.\.: nested deeper than"):
        parse_spec(data, "run")


def test_a_nesting_within_the_cap_loads_and_dumps():
    kwargs = {"x": [[[[{"y": [1, 2]}]]]]}
    spec = parse_spec({**yaml.safe_load(SPEC), "reward": {"type": "python", "function": "m:f", "kwargs": kwargs}})
    assert yaml.safe_load(dump_spec(spec))["reward"]["kwargs"] == kwargs


def test_a_huge_spec_file_is_refused_unparsed(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text(SPEC + ("# padding\n" * (MAX_SPEC_BYTES // 10 + 1)))
    start = time.monotonic()
    with pytest.raises(SpecError, match=rf"huge\.yaml: larger than {MAX_SPEC_BYTES} bytes"):
        load_spec(path)
    assert time.monotonic() - start < 1.0


def test_a_fifo_is_no_prompt_file(tmp_path):
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    # `reinforce run` says so at once, as a bad spec (exit 2), instead of waiting for a writer forever
    spec = write_spec(tmp_path, data={"prompts": str(fifo)})
    result = reinforce("run", str(spec), timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"error: {spec}: data.prompts: {fifo}: not a regular file" in result.stderr
    with pytest.raises(DataError, match=r"prompts\.jsonl: not a regular file \(a FIFO"):
        read_prompt_file(fifo)
