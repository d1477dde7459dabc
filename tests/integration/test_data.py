"""Prompt files and the resumable data cursor."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from reinforce.core.data import DataError, load_prompts, read_prompt_file
from reinforce.core.metrics import STEP_METRICS
from reinforce.core.policy import build_char_tokenizer, materialize_policy
from reinforce.core.prompt_encoding import encode_prompt, encode_prompt_checked
from reinforce.core.queue import RolloutQueue, connect
from reinforce.core.spec import DataSpec, RunSpec
from reinforce.trainer.cursors import PromptCursor
from reinforce.trainer.main import Trainer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "data"
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


# ---- malformed lines: on_bad_line ------------------------------------------------------------------

MIXED = '{"prompt": "one"}\nnot json\n\n{"text": "no prompt"}\n{"prompt": "two"}\n{"prompt": 3}\n'


def test_bad_lines_stop_by_default(tmp_path: Path) -> None:
    path = write(tmp_path, "mixed.jsonl", MIXED)
    for load in (load_prompts, read_prompt_file):
        with pytest.raises(DataError, match="invalid JSON") as err:
            load(path)
        assert str(err.value).startswith(f"{path}:2: ")
    assert DataSpec(prompts="p.txt").on_bad_line == "error"


def test_bad_lines_skipped_are_counted_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, "mixed.jsonl", MIXED)
    with caplog.at_level(logging.WARNING, logger="reinforce.core.data"):
        got = read_prompt_file(path, on_bad_line="skip")
    assert (got.prompts, got.skipped) == (["one", "two"], 3)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith(f"{path}:2: invalid JSON")
    assert messages[1].startswith(f'{path}:4: missing "prompt" field')
    assert messages[2].startswith(f'{path}:6: "prompt" must be a string')
    assert messages[3] == f"{path}: skipped 3 malformed lines, kept 2 prompts"
    assert len(messages) == 4


def test_good_file_skips_nothing_and_logs_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, "good.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\n')
    with caplog.at_level(logging.WARNING, logger="reinforce.core.data"):
        got = read_prompt_file(path, on_bad_line="skip")
    assert (got.prompts, got.skipped, caplog.records) == (["a", "b"], 0, [])


def test_all_bad_lines_are_still_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "bad.jsonl", "nope\n[1]\n")
    with pytest.raises(DataError, match=r"no prompts in the file \(2 malformed lines skipped\)") as err:
        read_prompt_file(path, on_bad_line="skip")
    assert str(err.value).startswith(str(path))


def test_data_spec_refuses_unknown_policies() -> None:
    with pytest.raises(ValidationError, match="on_bad_line"):
        DataSpec(prompts="p.txt", on_bad_line="ignore")
    with pytest.raises(ValidationError, match="on_long_prompt"):
        DataSpec(prompts="p.txt", on_long_prompt="drop")


# ---- over-long prompts: on_long_prompt -------------------------------------------------------------

CHARS = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz .,!?")
SHORT = DataSpec(prompts="unused", chat_template=False, max_prompt_tokens=5)  # BOS + 4 characters


def test_encode_prompt_truncates_or_skips_long_prompts() -> None:
    skip = SHORT.model_copy(update={"on_long_prompt": "skip"})
    bos = CHARS.bos_token_id
    assert SHORT.on_long_prompt == "truncate"
    fits = encode_prompt_checked(CHARS, "abcd", SHORT)
    assert fits == encode_prompt_checked(CHARS, "abcd", skip) == ([bos, *CHARS.encode("abcd")[1:]], False)
    ids, too_long = encode_prompt_checked(CHARS, "abcdefgh", SHORT)
    assert too_long and ids == encode_prompt(CHARS, "abcdefgh", SHORT)
    assert ids is not None and ids[0] == bos and CHARS.decode(ids[1:]) == "efgh"
    assert encode_prompt_checked(CHARS, "abcdefgh", skip) == (None, True)
    assert encode_prompt(CHARS, "abcdefgh", skip) is None


def fake_encode(text: str) -> tuple[list[int] | None, bool]:
    """Prompts named "long ..." are refused, "trunc ..." truncated: what encode_prompt_checked answers."""
    if text.startswith("long"):
        return None, True
    return [len(text)], text.startswith("trunc")


MIXED_LENGTHS = ["ok 0", "long 1", "trunc 2", "ok 3", "long 4", "ok 5", "long 6"]


def test_take_encoded_passes_over_refused_prompts() -> None:
    cursor = PromptCursor(MIXED_LENGTHS, seed=0, shuffle=False)
    first = cursor.take_encoded(3, fake_encode)
    assert first.prompts == [("ok 0", [4]), ("trunc 2", [7]), ("ok 3", [4])]
    assert (first.truncated, first.skipped, cursor.position) == (1, 1, 4)
    second = cursor.take_encoded(3, fake_encode)  # crosses into the next epoch
    assert [text for text, _ in second.prompts] == ["ok 5", "ok 0", "trunc 2"]
    assert (second.truncated, second.skipped, cursor.position) == (1, 3, 10)


def test_take_encoded_resumes_exactly() -> None:
    original = PromptCursor(MIXED_LENGTHS, seed=5, shuffle=True)
    original.take_encoded(4, fake_encode)
    resumed = PromptCursor.from_state(MIXED_LENGTHS, 5, True, json.loads(json.dumps(original.state())))
    assert resumed.take_encoded(9, fake_encode) == original.take_encoded(9, fake_encode)


def test_take_encoded_refuses_when_no_prompt_fits() -> None:
    cursor = PromptCursor(["long a", "long b", "long c"], seed=0, shuffle=True)
    with pytest.raises(DataError, match=r"all 3 prompts are longer than data\.max_prompt_tokens"):
        cursor.take_encoded(1, fake_encode)
    # One usable prompt among many is enough, however many the step needs.
    rare = PromptCursor([*(f"long {i}" for i in range(9)), "ok"], seed=1, shuffle=True)
    batch = rare.take_encoded(4, fake_encode)
    assert [text for text, _ in batch.prompts] == ["ok"] * 4
    assert batch.skipped == rare.position - 4 >= 3 * 9  # up to 18 refused in a row between two "ok"s


def tiny_trainer(tmp_path: Path, redis_url: str, on_long_prompt: str) -> Trainer:
    prompts = write(tmp_path, "p.txt", "ab\nabcdefgh\nabc\nabcdefghijkl\nabcd\n")
    spec = RunSpec.model_validate(
        {
            "name": "data-test",
            "run_dir": str(tmp_path / "run"),
            "policy": {"random_init": {"hidden_size": 8, "intermediate_size": 8, "num_layers": 1, "num_heads": 1}},
            "data": {"prompts": str(prompts), "chat_template": False, "max_prompt_tokens": 5, "shuffle": False,
                     "on_long_prompt": on_long_prompt},
            "training": {"prompts_per_step": 3},
        }
    )  # fmt: skip
    materialize_policy(spec.policy, spec.resolved_run_dir() / "initial_policy", spec.seed)
    torch.set_num_threads(1)  # the test machine's cores are shared
    return Trainer(spec, redis_url)


@pytest.mark.parametrize(
    ("on_long_prompt", "texts", "stats"),
    [
        ("truncate", ["ab", "abcdefgh", "abc"], (1.0, 0.0)),
        ("skip", ["ab", "abc", "abcd"], (0.0, 2.0)),
    ],
)
def test_trainer_enqueues_a_full_step_and_counts_long_prompts(
    tmp_path: Path, redis_url: str, on_long_prompt: str, texts: list[str], stats: tuple[float, float]
) -> None:
    trainer = tiny_trainer(tmp_path, redis_url, on_long_prompt)
    try:
        prompts = trainer.feeder.enqueue_prompts(step=0)
        assert [p.text for p in prompts] == texts
        assert [p.id for p in prompts] == ["0-0", "0-1", "0-2"]
        assert all(len(p.token_ids) <= 5 for p in prompts)
        stats_of_step = trainer.feeder.data_stats[0]
        assert set(stats_of_step) <= set(STEP_METRICS)
        counts = (stats_of_step["data/truncated_prompts"], stats_of_step["data/skipped_long_prompts"])
        assert counts == stats
        queued = RolloutQueue(connect(redis_url), "data-test").read_prompts("g", count=10, block_ms=0)
        assert [p for _, p in queued] == prompts
    finally:
        trainer.metrics.close()


def test_a_non_utf8_line_a_directory_and_a_huge_line_are_named(tmp_path: Path) -> None:
    """Issue #13, finding 8 (and the 10 MB prompt line): file:line, not a byte offset; a directory by name; a
    runaway line refused by its line number before it is decoded or tokenised."""
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"fine\nalso fine\ncaf\xe9\n")
    with pytest.raises(DataError, match=r"latin1\.txt:3: not UTF-8 text \(.* at column 4\)"):
        load_prompts(bad)
    assert read_prompt_file(bad, on_bad_line="skip").prompts == ["fine", "also fine"]
    folder = tmp_path / "prompts.jsonl"
    folder.mkdir()
    with pytest.raises(DataError, match=r"prompts\.jsonl: is a directory, not a prompt file"):
        load_prompts(folder)
    huge = tmp_path / "huge.txt"
    huge.write_bytes(b"short\n" + b"a" * (10 << 20) + b"\nafter\n")
    with pytest.raises(DataError, match=r"huge\.txt:2: line longer than 1048576 bytes"):
        load_prompts(huge)
    assert read_prompt_file(huge, on_bad_line="skip").prompts == ["short", "after"]
