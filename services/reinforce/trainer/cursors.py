"""The trainer's resumable cursors over its prompts: the protocol its feeder takes, PromptCursor over a prompt file
(data.loader default), and the seeded order every loader visits an epoch in (dali_cursor.py reads the shards in it)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from reinforce.core.data import DataError, prompts_fingerprint
from reinforce.core.prompt_encoding import Encoder


@dataclass
class EncodedPrompts:
    """A step's prompts as (text, token ids), and how many over-long prompts were truncated or skipped."""

    prompts: list[tuple[str, list[int]]] = field(default_factory=list)
    truncated: int = 0
    skipped: int = 0


class DataCursor(Protocol):
    """What the trainer's feeder needs of a data loader (data.loader): PromptCursor, dali_cursor.DaliPromptCursor."""

    epoch: int
    index: int  # the position within the epoch
    seed: int
    shuffle: bool

    def take_encoded(self, n: int, encode: Encoder) -> EncodedPrompts: ...

    def state(self) -> dict[str, Any]: ...

    def restored(self, state: dict[str, Any]) -> DataCursor: ...


def cursor_state(cursor: DataCursor, num_prompts: int, fingerprint: str) -> dict[str, Any]:
    """A cursor's checkpointed state: its position and what that position means (the prompts, seed and order)."""
    return {
        "epoch": cursor.epoch,
        "index": cursor.index,
        "seed": cursor.seed,
        "shuffle": cursor.shuffle,
        "num_prompts": num_prompts,
        "fingerprint": fingerprint,
    }


def resumed_position(
    cursor: DataCursor, state: dict[str, Any], num_prompts: int, fingerprint: str, epoch_size: int
) -> tuple[int, int]:
    """(epoch, index) of a checkpointed :func:`cursor_state`, for `cursor` to continue from; a DataError if the
    prompts, seed or shuffle differ from the saved run's, or the index lies outside an epoch of `epoch_size`."""
    _check_same(state, "seed", cursor.seed)
    _check_same(state, "shuffle", cursor.shuffle)
    _check_same(state, "num_prompts", num_prompts)
    _check_same(state, "fingerprint", fingerprint)
    epoch, index = int(state["epoch"]), int(state["index"])
    if epoch < 0 or not 0 <= index < epoch_size:
        raise DataError(f"data cursor out of range: epoch {epoch}, index {index}")
    return epoch, index


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
        return cursor_state(self, len(self.prompts), prompts_fingerprint(self.prompts))

    @classmethod
    def from_state(cls, prompts: list[str], seed: int, shuffle: bool, state: dict[str, Any]) -> PromptCursor:
        """A cursor at ``state``; refuses if the prompts, seed or shuffle differ from the saved run's."""
        cursor = cls(prompts, seed, shuffle)
        count = len(cursor.prompts)
        cursor.epoch, cursor.index = resumed_position(cursor, state, count, prompts_fingerprint(cursor.prompts), count)
        return cursor

    def restored(self, state: dict[str, Any]) -> PromptCursor:
        """This cursor's prompts at a checkpoint's `state` (see :meth:`from_state`)."""
        return PromptCursor.from_state(self.prompts, self.seed, self.shuffle, state)

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            self._order = epoch_order(len(self.prompts), self.seed, self.epoch, self.shuffle)
            self._order_epoch = self.epoch
        return self._order


def epoch_order(count: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The order in which an epoch visits prompts 0..count-1 (every loader's: data.loader default and dali).

    It depends only on (seed, epoch): a resumed cursor rebuilds it exactly.
    """
    order = list(range(count))
    if shuffle:
        # A string seed is hashed with SHA-512: stable across Python versions and processes.
        random.Random(f"reinforce-data:{seed}:{epoch}").shuffle(order)
    return order


def _check_same(state: dict[str, Any], key: str, value: Any) -> None:
    if key in state and state[key] != value:
        raise DataError(
            f"cannot resume the data cursor: {key} was {state[key]!r}, now {value!r} "
            "(the prompt file or data settings changed since the checkpoint)"
        )
