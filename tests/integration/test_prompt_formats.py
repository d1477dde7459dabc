"""Prompt datasets besides JSON lines and text: Parquet (veRL's format), `datasets` folders (save_to_disk),
`data.prompt_field`, and chat-format message lists with the chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reinforce.core.data import ChatPrompt, DataError, prompt_answer, read_prompt_file
from reinforce.core.policy import build_char_tokenizer
from reinforce.core.prompt_encoding import encode_prompt
from reinforce.core.spec import DataSpec
from reinforce.trainer.cursors import PromptCursor

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

CHAT = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say a"}],
    [{"role": "user", "content": "hello"}],
]


def _parquet(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def test_parquet_strings_and_prompt_field(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "p.parquet", {"question": ["one", "two"], "answer": ["1", "2"]})
    assert read_prompt_file(path, prompt_field="question").prompts == ["one", "two"]
    with pytest.raises(DataError, match=r"no column 'prompt' \(columns: question, answer\); set data.prompt_field"):
        read_prompt_file(path)


def test_parquet_in_verls_chat_format(tmp_path: Path) -> None:
    # veRL's prompt column: a list of {role, content} structs, with other columns beside it
    path = _parquet(tmp_path / "train.parquet", {"prompt": CHAT, "data_source": ["x", "y"]})
    prompts = read_prompt_file(path).prompts
    assert prompts == ["say a", "hello"]  # the reward model sees the user's content
    assert isinstance(prompts[0], ChatPrompt) and prompts[0].messages == CHAT[0]


def test_parquet_bad_row_is_named(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "p.parquet", {"prompt": ["fine", "", "also fine"]})
    with pytest.raises(DataError) as err:
        read_prompt_file(path)
    assert str(err.value) == f'{path}: row 1: "prompt" is empty'
    got = read_prompt_file(path, on_bad_line="skip")
    assert (got.prompts, got.skipped) == (["fine", "also fine"], 1)


def test_parquet_bad_chat_row_is_named(tmp_path: Path) -> None:
    rows = [CHAT[1], [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    path = _parquet(tmp_path / "p.parquet", {"prompt": rows})
    with pytest.raises(DataError, match=r"row 1: \"prompt\": the last message must be the user's"):
        read_prompt_file(path)


def test_datasets_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["alpha", "beta", "gamma"]}).save_to_disk(str(folder))
    assert read_prompt_file(folder, prompt_field="text").prompts == ["alpha", "beta", "gamma"]
    # a DatasetDict with one split is read as that split
    both = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": CHAT})}).save_to_disk(str(both))
    assert read_prompt_file(both).prompts == ["say a", "hello"]


def test_datasets_folder_bad_row_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"prompt": ["ok", "  ", "ok too"]}).save_to_disk(str(folder))
    with pytest.raises(DataError) as err:
        read_prompt_file(folder)
    assert str(err.value) == f'{folder}: row 1: "prompt" is empty'


def test_jsonl_chat_messages_and_field(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHAT) + '{"messages": [{"role": "x"}]}\n')
    with pytest.raises(DataError, match=rf'{path}:3: "messages"\[0\] is not a chat message'):
        read_prompt_file(path, prompt_field="messages")
    got = read_prompt_file(path, on_bad_line="skip", prompt_field="messages")
    assert got.prompts == ["say a", "hello"] and got.skipped == 1


def test_chat_prompts_with_the_chat_template() -> None:
    tokenizer = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz .,!?")
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}.{% endfor %}assistant "
    data = DataSpec(prompts="p.parquet", system_prompt="be kind", max_prompt_tokens=100)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    with_system, without = ChatPrompt(CHAT[0]), ChatPrompt(CHAT[1])
    # the prompt's own system message wins over data.system_prompt; otherwise data.system_prompt is added
    assert decode(encode_prompt(tokenizer, with_system, data)) == "system be brief.user say a.assistant "
    assert decode(encode_prompt(tokenizer, without, data)) == "system be kind.user hello.assistant "
    # without the chat template only the user's content is the prompt
    plain = data.model_copy(update={"chat_template": False})
    assert decode(encode_prompt(tokenizer, with_system, plain)) == "say a"


def test_cursor_fingerprint_sees_the_whole_conversation() -> None:
    a = [ChatPrompt([{"role": "system", "content": "x"}, {"role": "user", "content": "q"}])]
    b = [ChatPrompt([{"role": "system", "content": "y"}, {"role": "user", "content": "q"}])]
    state = PromptCursor(a, 0, False).state()
    with pytest.raises(DataError, match="fingerprint"):
        PromptCursor.from_state(b, 0, False, state)


def test_a_records_answer_travels_with_its_prompt(tmp_path: Path) -> None:
    """The `answer` field (a string or a number) of JSON lines, Parquet and datasets rows, for verifiable rewards."""
    lines = [
        {"prompt": "2+2?", "answer": 4},
        {"prompt": CHAT[1], "answer": "hi"},
        {"prompt": "no answer"},
    ]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    parquet = _parquet(tmp_path / "p.parquet", {"prompt": ["2+2?", "3+3?"], "answer": ["4", "6"]})
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"prompt": ["2+2?"], "answer": ["4"]}).save_to_disk(str(folder))
    got = read_prompt_file(jsonl).prompts
    assert [prompt_answer(p) for p in got] == ["4", "hi", ""]
    assert got[:2] == ["2+2?", "hello"] and isinstance(got[1], ChatPrompt) and got[1].messages == CHAT[1]
    assert [prompt_answer(p) for p in read_prompt_file(parquet).prompts] == ["4", "6"]
    assert [prompt_answer(p) for p in read_prompt_file(folder).prompts] == ["4"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": 1}\n{"prompt": "y", "answer": [1]}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: \"answer\" must be a string or a number, got list"):
        read_prompt_file(bad)
