"""Prompt files and the resumable data cursor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reinforce.core.data import DataError, PromptCursor, load_prompts

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "data"
TINY_VOCAB = set("abcdefghijklmnopqrstuvwxyz .,!?")


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_load_jsonl(tmp_path: Path) -> None:
    path = write(tmp_path, "p.jsonl", '{"prompt": "first", "id": 1}\n\n{"prompt": " two words "}\n')
    assert load_prompts(path) == ["first", " two words "]


def test_load_txt_skips_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "p.txt", "tell me a story\n\n   \n  say hi  \r\nlast")
    assert load_prompts(str(path)) == ["tell me a story", "say hi", "last"]


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ('{"prompt": "ok"}\nnot json\n', 2, "invalid JSON"),
        ('{"prompt": "ok"}\n\n{"text": "no prompt"}\n', 3, 'missing "prompt" field'),
        ('{"prompt": 3}\n', 1, '"prompt" must be a string, got int'),
        ('{"prompt": null}\n', 1, '"prompt" must be a string, got NoneType'),
        ('{"prompt": "ok"}\n{"prompt": "   "}\n', 2, '"prompt" is empty'),
        ('["a list"]\n', 1, "expected a JSON object, got list"),
        ('{"prompt": "ok"}\n{"prompt": "cut', 2, "invalid JSON"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path: Path, text: str, line: int, message: str) -> None:
    path = write(tmp_path, "bad.jsonl", text)
    with pytest.raises(DataError) as err:
        load_prompts(path)
    assert str(err.value).startswith(f"{path}:{line}: ")
    assert message in str(err.value)


@pytest.mark.parametrize(("name", "text"), [("e.jsonl", ""), ("e.txt", "\n  \n\n")])
def test_empty_file_is_an_error(tmp_path: Path, name: str, text: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(DataError, match="no prompts") as err:
        load_prompts(path)
    assert str(path) in str(err.value)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "p.jsonl"
    with pytest.raises(DataError, match="no such prompt file") as err:
        load_prompts(path)
    assert str(err.value).startswith(str(path))


def test_unknown_suffix_and_bad_encoding(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="unknown prompt file type"):
        load_prompts(write(tmp_path, "p.csv", "a\n"))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        load_prompts(bad)


def test_example_prompt_files() -> None:
    reviews = load_prompts(EXAMPLES / "reviews.jsonl")
    assert 300 <= len(reviews) <= 400
    assert len(set(reviews)) == len(reviews)
    tiny = load_prompts(EXAMPLES / "tiny.txt")
    assert len(tiny) >= 40 and len(set(tiny)) == len(tiny)
    assert all(set(p) <= TINY_VOCAB for p in tiny)


PROMPTS = [f"prompt {i}" for i in range(7)]


def test_cursor_covers_every_prompt_once_per_epoch() -> None:
    cursor = PromptCursor(PROMPTS, seed=3, shuffle=True)
    taken = cursor.take(3 * len(PROMPTS))
    assert [i for i, _ in taken] == list(range(21))
    epochs = [[p for _, p in taken[e * 7 : (e + 1) * 7]] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(PROMPTS)
    assert len({tuple(e) for e in epochs}) > 1  # a fresh permutation per epoch
    assert (cursor.epoch, cursor.index) == (3, 0)


def test_cursor_is_deterministic_per_seed() -> None:
    def order(seed: int) -> list[str]:
        return [p for _, p in PromptCursor(PROMPTS * 3, seed=seed, shuffle=True).take(40)]

    assert order(1) == order(1)
    assert order(1) != order(2)


def test_cursor_without_shuffle_keeps_file_order() -> None:
    cursor = PromptCursor(PROMPTS, seed=0, shuffle=False)
    assert [p for _, p in cursor.take(9)] == PROMPTS + PROMPTS[:2]
    assert (cursor.epoch, cursor.index) == (1, 2)


@pytest.mark.parametrize("stop_after", [0, 5, 7, 12])
def test_cursor_resumes_exactly(stop_after: int) -> None:
    original = PromptCursor(PROMPTS, seed=11, shuffle=True)
    original.take(stop_after)
    state = json.loads(json.dumps(original.state()))  # as a checkpoint stores it
    resumed = PromptCursor.from_state(PROMPTS, 11, True, state)
    assert (resumed.epoch, resumed.index) == divmod(stop_after, len(PROMPTS))
    assert resumed.take(20) == original.take(20)


@pytest.mark.parametrize(
    ("prompts", "seed", "shuffle", "what"),
    [
        (PROMPTS, 12, True, "seed"),
        (PROMPTS, 11, False, "shuffle"),
        (PROMPTS[:-1], 11, True, "num_prompts"),
        ([*PROMPTS[:-1], "edited"], 11, True, "fingerprint"),
    ],
)
def test_cursor_refuses_to_resume_with_other_data(prompts: list[str], seed: int, shuffle: bool, what: str) -> None:
    state = PromptCursor(PROMPTS, seed=11, shuffle=True).state()
    with pytest.raises(DataError, match=what):
        PromptCursor.from_state(prompts, seed, shuffle, state)


def test_cursor_rejects_no_prompts_and_bad_state() -> None:
    with pytest.raises(DataError):
        PromptCursor([], seed=0, shuffle=True)
    with pytest.raises(DataError, match="out of range"):
        PromptCursor.from_state(PROMPTS, 0, True, {"epoch": 0, "index": 7})
