"""Prompt data: reading a prompt file (text, jsonl, Parquet or a datasets folder) into prompts, and their fingerprint.

The trainer's resumable cursors over them are trainer/cursors.py and trainer/dali_cursor.py."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A prompt file that cannot be used; the message names the file (and line, where there is one)."""


JSONL_SUFFIXES = (".jsonl", ".ndjson")
# A prompt line longer than this is malformed (no prompt is a megabyte): refused by file:line before it is
# decoded, parsed or tokenised, so one runaway line cannot exhaust the trainer's memory.
MAX_LINE_BYTES = 1 << 20
TEXT_SUFFIXES = (".txt",)
PARQUET_SUFFIXES = (".parquet",)
DATASETS_MARKERS = ("dataset_info.json", "dataset_dict.json")  # what save_to_disk writes into a folder
OnBadLine = Literal["error", "skip"]  # DataSpec.on_bad_line


ANSWER_FIELD = "answer"  # a record's reference answer (jsonl key, Parquet or datasets column), for verifiable rewards


class AnsweredPrompt(str):
    """A prompt with its reference answer (the record's `answer` field), which the reward function checks against."""

    answer: str

    def __new__(cls, text: str, answer: str) -> AnsweredPrompt:
        prompt = super().__new__(cls, text)
        prompt.answer = answer
        return prompt

    def __reduce__(self) -> tuple:
        return (AnsweredPrompt, (str(self), self.answer))


class ChatPrompt(str):
    """A prompt given as a chat message list: the string is its last user message (what the reward model sees),
    `messages` the whole list ({role, content}), fed to the chat template as they are. A system message in the
    list takes the place of data.system_prompt for this prompt. `answer`: the record's reference answer ("": none)."""

    messages: list[dict[str, str]]
    answer: str

    def __new__(cls, messages: list[dict[str, str]], answer: str = "") -> ChatPrompt:
        users = [m["content"] for m in messages if m["role"] == "user"]
        prompt = super().__new__(cls, users[-1])
        prompt.messages = [dict(m) for m in messages]
        prompt.answer = answer
        return prompt

    def __reduce__(self) -> tuple:
        return (ChatPrompt, (self.messages, self.answer))


def prompt_answer(prompt: str) -> str:
    """A prompt's reference answer; "" when its record had none."""
    return getattr(prompt, "answer", "")


@dataclass(frozen=True)
class PromptFile:
    """The usable prompts of a file, in file order, and how many malformed lines were left out."""

    prompts: list[str]
    skipped: int = 0


def load_prompts(path: str | Path) -> list[str]:
    """Prompts of a file, in file order; a malformed line is a :class:`DataError` naming file:line.

    ``.jsonl``: one JSON object per line with a non-empty string ``prompt`` (other fields ignored).
    ``.txt``: one prompt per line, surrounding whitespace stripped. Blank lines are skipped in both.
    """
    return read_prompt_file(path).prompts


def read_prompt_file(path: str | Path, on_bad_line: OnBadLine = "error", prompt_field: str = "prompt") -> PromptFile:
    """Prompts of a file (format as :func:`load_prompts`); what a malformed line does is ``on_bad_line``.

    Besides ``.jsonl`` and ``.txt``: a ``.parquet`` file (veRL's format) or a Hugging Face ``datasets`` folder
    written by ``save_to_disk``, whose column ``prompt_field`` holds a string or a chat message list. Rows are
    named "row N" (0-based, as a data frame counts them), lines "file:N" (1-based, as an editor counts them).

    "error": raise a :class:`DataError` naming file:line (file: row N). "skip": log a warning naming it and the
    reason, leave it out and count it. A file without a single usable prompt is an error either way.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if path.is_dir() and any((path / m).exists() for m in DATASETS_MARKERS):
        records, where = _dataset_rows(path, prompt_field), "row"
    elif path.exists() and not (path.is_file() or path.is_dir()):
        # a FIFO would block the reader forever (a device or socket no better): only files and folders are read
        raise DataError(f"{path}: not a regular file (a FIFO, device or socket), so not a prompt file")
    elif suffix in PARQUET_SUFFIXES:
        records, where = _parquet_rows(path, prompt_field), "row"
    elif path.is_dir():
        raise DataError(f"{path}: is a directory, not a prompt file (nor a datasets folder saved with save_to_disk)")
    elif suffix in JSONL_SUFFIXES + TEXT_SUFFIXES:
        parse = (lambda line: _jsonl_prompt(line, prompt_field)) if suffix in JSONL_SUFFIXES else _text_prompt
        records, where = _line_records(path, parse), "line"
    else:
        raise DataError(
            f"{path}: unknown prompt file type {suffix!r} (use .jsonl, .txt, .parquet or a datasets folder "
            "saved with save_to_disk)"
        )
    prompts: list[str] = []
    skipped = 0
    for number, raw, parse in records:
        try:
            prompts.append(parse(raw))
        except DataError as err:
            place = f"{path}:{number}" if where == "line" else f"{path}: row {number}"
            if on_bad_line == "error":
                raise DataError(f"{place}: {err}") from None
            log.warning("%s: %s; %s skipped", place, err, where)
            skipped += 1
    if not prompts:
        bad = f" ({skipped} malformed lines skipped)" if skipped else ""
        raise DataError(f"{path}: no prompts in the file{bad}")
    if skipped:
        # One summary besides the per-line warnings: the count is what an operator compares runs by.
        log.warning("%s: skipped %d malformed lines, kept %d prompts", path, skipped, len(prompts))
    return PromptFile(prompts, skipped)


def _line_records(path: Path, parse: Callable[[str], str]) -> Iterator[tuple[int, bytes, Callable[[bytes], str]]]:
    """(line number, raw line, its parser) of every non-blank line; decoding is part of parsing, so a line that
    is not UTF-8 or too long is named by its number like any other malformed line."""
    for lineno, raw in enumerate(_read_lines(path), start=1):
        if raw.strip():
            yield lineno, raw, lambda raw, first=lineno == 1: parse(_decode(raw, first))


def _read_lines(path: Path) -> Iterator[bytes]:
    """The file's lines as bytes, one at a time; a line over MAX_LINE_BYTES comes back cut to one byte more."""
    try:
        f = path.open("rb")
    except FileNotFoundError:
        raise DataError(f"{path}: no such prompt file") from None
    with f:
        while line := f.readline(MAX_LINE_BYTES + 1):
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                _skip_rest_of_line(f)
            yield line


def _skip_rest_of_line(f: BinaryIO) -> None:
    while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
        pass


def _decode(raw: bytes, first: bool) -> str:
    if len(raw) > MAX_LINE_BYTES:
        raise DataError(f"line longer than {MAX_LINE_BYTES} bytes")
    try:
        # utf-8-sig on the first line: files saved by some Windows editors start with a byte-order mark.
        return raw.decode("utf-8-sig" if first else "utf-8").rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise DataError(f"not UTF-8 text ({err.reason} at column {err.start + 1})") from None


def _text_prompt(line: str) -> str:
    return line.strip()


def _jsonl_prompt(line: str, field: str = "prompt") -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"invalid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"expected a JSON object, got {type(record).__name__}")
    if field not in record:
        raise DataError(f'missing "{field}" field')
    return _with_answer(_prompt_value(record[field], field), record.get(ANSWER_FIELD))


def _with_answer(prompt: str, answer: Any) -> str:
    """The prompt carrying its record's answer (a string or a number: 42 and "42" alike), or as it is without one."""
    if answer is None:
        return prompt
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise DataError(f'"{ANSWER_FIELD}" must be a string or a number, got {type(answer).__name__}')
    answer = str(answer)
    if isinstance(prompt, ChatPrompt):
        return ChatPrompt(prompt.messages, answer)
    return AnsweredPrompt(prompt, answer)


def _prompt_value(value: Any, field: str) -> str:
    """A prompt from a field's value: a non-empty string, or a chat message list ending in a user message."""
    if isinstance(value, list):
        return _chat_prompt(value, field)
    if not isinstance(value, str):
        raise DataError(f'"{field}" must be a string, got {type(value).__name__} (or a list of chat messages)')
    if not value.strip():
        raise DataError(f'"{field}" is empty')
    return value


def _chat_prompt(messages: list, field: str) -> ChatPrompt:
    if not messages:
        raise DataError(f'"{field}" is an empty message list')
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f'"{field}"[{i}] is not a chat message {{"role": str, "content": str}}')
        if m["role"] not in ("system", "user", "assistant"):
            raise DataError(f'"{field}"[{i}] has role {m["role"]!r} (expected system, user or assistant)')
        clean.append({"role": m["role"], "content": m["content"]})
    if clean[-1]["role"] != "user":
        raise DataError(f'"{field}": the last message must be the user\'s (the policy answers it)')
    if not clean[-1]["content"].strip():
        raise DataError(f'"{field}": the last user message is empty')
    if any(m["role"] == "system" for m in clean[1:]):
        raise DataError(f'"{field}": a system message may only come first')
    return ChatPrompt(clean)


def _parquet_rows(path: Path, field: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install 'reinforce-k8s[data]'") from None
    if not path.exists():
        raise DataError(f"{path}: no such prompt file")
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several kinds for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({err})") from None
    return _column_rows(path, table.column_names, lambda name: table.column(name).to_pylist(), field)


def _dataset_rows(path: Path, field: str):
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{path}: reading a datasets folder needs datasets: pip install 'reinforce-k8s[data]'"
        ) from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if list(loaded) != ["train"] and len(loaded) != 1:
            raise DataError(f"{path}: a DatasetDict with splits {list(loaded)}: point at one split's folder")
        loaded = next(iter(loaded.values()))
    return _column_rows(path, loaded.column_names, lambda name: loaded[name], field)


def _column_rows(path: Path, columns: list[str], column: Callable[[str], list], field: str):
    """(row, (prompt value, answer value or None), parser) of every row; `column(name)` reads a column."""
    if field not in columns:
        raise DataError(f"{path}: no column {field!r} (columns: {', '.join(columns)}); set data.prompt_field")
    prompts = column(field)
    answers = column(ANSWER_FIELD) if ANSWER_FIELD in columns else [None] * len(prompts)
    return (
        (row, value, lambda v: _with_answer(_prompt_value(v[0], field), v[1]))
        for row, value in enumerate(zip(prompts, answers, strict=True))
    )


def prompts_fingerprint(prompts: list[str]) -> str:
    """16 hex digits naming the prompts and their order: a checkpointed cursor and a shard folder record it, so a
    changed prompt file is noticed."""
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(prompt.encode())
        if isinstance(prompt, ChatPrompt):  # the whole conversation, not only its last user message
            digest.update(json.dumps(prompt.messages).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]
