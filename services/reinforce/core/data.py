"""Prompt data: loading a prompt file, and the trainer's resumable cursor over it."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
OnBadLine = Literal["error", "skip"]  # DataSpec.on_bad_line
# A prompt's text -> (token ids, or None to skip it; whether it was over-long): models.encode_prompt_checked.
Encoder = Callable[[str], tuple[list[int] | None, bool]]


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


def read_prompt_file(path: str | Path, on_bad_line: OnBadLine = "error") -> PromptFile:
    """Prompts of a file (format as :func:`load_prompts`); what a malformed line does is ``on_bad_line``.

    "error": raise a :class:`DataError` naming file:line. "skip": log a warning naming file:line and the
    reason, leave the line out and count it. A file without a single usable prompt is an error either way.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if path.is_dir():
        raise DataError(f"{path}: is a directory, not a prompt file")
    if suffix not in JSONL_SUFFIXES + TEXT_SUFFIXES:
        raise DataError(f"{path}: unknown prompt file type {suffix!r} (use .jsonl or .txt)")
    parse = _jsonl_prompt if suffix in JSONL_SUFFIXES else _text_prompt
    prompts: list[str] = []
    skipped = 0
    for lineno, raw in enumerate(_read_lines(path), start=1):
        try:
            line = _decode(raw, first=lineno == 1)
            if not line.strip():
                continue
            prompts.append(parse(line))
        except DataError as err:
            if on_bad_line == "error":
                raise DataError(f"{path}:{lineno}: {err}") from None
            log.warning("%s:%d: %s; line skipped", path, lineno, err)
            skipped += 1
    if not prompts:
        bad = f" ({skipped} malformed lines skipped)" if skipped else ""
        raise DataError(f"{path}: no prompts in the file{bad}")
    if skipped:
        # One summary besides the per-line warnings: the count is what an operator compares runs by.
        log.warning("%s: skipped %d malformed lines, kept %d prompts", path, skipped, len(prompts))
    return PromptFile(prompts, skipped)


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


def _jsonl_prompt(line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"invalid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"expected a JSON object, got {type(record).__name__}")
    if "prompt" not in record:
        raise DataError('missing "prompt" field')
    prompt = record["prompt"]
    if not isinstance(prompt, str):
        raise DataError(f'"prompt" must be a string, got {type(prompt).__name__}')
    if not prompt.strip():
        raise DataError('"prompt" is empty')
    return prompt


@dataclass
class EncodedPrompts:
    """A step's prompts as (text, token ids), and how many over-long prompts were truncated or skipped."""

    prompts: list[tuple[str, list[int]]] = field(default_factory=list)
    truncated: int = 0
    skipped: int = 0


class PromptCursor:
    """An endless, deterministic stream of prompts: epoch after epoch, each a (seeded) permutation.

    ``epoch`` and ``index`` (position within the epoch) are the data cursor; a checkpoint stores
    :meth:`state` and :meth:`from_state` continues exactly where it stopped.
    """

    def __init__(self, prompts: list[str], seed: int, shuffle: bool) -> None:
        if not prompts:
            raise DataError("no prompts to iterate over")
        self.prompts = list(prompts)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def position(self) -> int:
        """Global index of the next prompt: prompts taken since the start of the run."""
        return self.epoch * len(self.prompts) + self.index

    def take(self, n: int) -> list[tuple[int, str]]:
        """The next ``n`` prompts as (global sample index, prompt); crosses epochs as needed."""
        out = []
        for _ in range(n):
            order = self._epoch_order()
            out.append((self.position, self.prompts[order[self.index]]))
            self.index += 1
            if self.index == len(self.prompts):
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def take_encoded(self, n: int, encode: Encoder) -> EncodedPrompts:
        """The next ``n`` prompts that ``encode`` accepts, as (text, token ids); refused ones are passed over.

        A refused prompt still advances the cursor, so a resumed run passes over the same ones.
        """
        out = EncodedPrompts()
        refused_in_a_row = 0
        while len(out.prompts) < n:
            [(_, text)] = self.take(1)
            ids, too_long = encode(text)
            if ids is None:
                out.skipped += 1
                refused_in_a_row += 1
                # Two epochs' worth of consecutive prompts cover a whole epoch: no prompt is usable.
                if refused_in_a_row > 2 * len(self.prompts):
                    raise DataError(f"all {len(self.prompts)} prompts are longer than data.max_prompt_tokens")
                continue
            refused_in_a_row = 0
            out.truncated += too_long
            out.prompts.append((text, ids))
        return out

    def state(self) -> dict[str, Any]:
        """JSON-serialisable cursor state, with what it depends on (checked by :meth:`from_state`)."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.prompts),
            "fingerprint": _fingerprint(self.prompts),
        }

    @classmethod
    def from_state(cls, prompts: list[str], seed: int, shuffle: bool, state: dict[str, Any]) -> PromptCursor:
        """A cursor at ``state``; refuses if the prompts, seed or shuffle differ from the saved run's."""
        cursor = cls(prompts, seed, shuffle)
        _check_same(state, "seed", seed)
        _check_same(state, "shuffle", shuffle)
        _check_same(state, "num_prompts", len(cursor.prompts))
        _check_same(state, "fingerprint", _fingerprint(cursor.prompts))
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < len(cursor.prompts):
            raise DataError(f"data cursor out of range: epoch {epoch}, index {index}")
        cursor.epoch, cursor.index = epoch, index
        return cursor

    def _epoch_order(self) -> list[int]:
        # Each epoch's permutation depends only on (seed, epoch): a resumed cursor rebuilds it exactly.
        if self._order_epoch != self.epoch:
            self._order = list(range(len(self.prompts)))
            if self.shuffle:
                # A string seed is hashed with SHA-512: stable across Python versions and processes.
                random.Random(f"reinforce-data:{self.seed}:{self.epoch}").shuffle(self._order)
            self._order_epoch = self.epoch
        return self._order


def _fingerprint(prompts: list[str]) -> str:
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(prompt.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _check_same(state: dict[str, Any], key: str, value: Any) -> None:
    if key in state and state[key] != value:
        raise DataError(
            f"cannot resume the data cursor: {key} was {state[key]!r}, now {value!r} "
            "(the prompt file or data settings changed since the checkpoint)"
        )
