"""data.loader dali: the trainer's cursor over pre-tokenized prompt shards (core/prompt_shards.py), read with NVIDIA
DALI (the `dali` extra).

:class:`DaliPromptCursor` walks the shards epoch after epoch in the default loader's seeded order
(cursors.epoch_order): each epoch it builds a CPU pipeline of DALI's numpy reader over the files in that order,
so for the same seed it yields the same prompts, in the same order, as PromptCursor over the prompt file, and its
state (epoch, index) is the same checkpointed cursor. The reader is sharded (shard_id, num_shards): each shard
reads its own contiguous part of every epoch's order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from reinforce.core.prompt_encoding import Encoder
from reinforce.core.prompt_shards import read_shard_index, read_shard_texts
from reinforce.core.spec import DataSpec
from reinforce.trainer.cursors import EncodedPrompts, cursor_state, epoch_order, resumed_position

READ_BATCH = 256  # samples per DALI pipeline run


class DaliPromptCursor:
    """PromptCursor's interface (take_encoded, state, restored) over a shard folder, read by DALI."""

    def __init__(
        self,
        folder: str | Path,
        seed: int,
        shuffle: bool,
        data: DataSpec,
        *,
        shard_id: int = 0,
        num_shards: int = 1,
        state: dict[str, Any] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.index_record = read_shard_index(self.folder, data)
        self.texts = read_shard_texts(self.folder)
        self.seed, self.shuffle, self.data = seed, shuffle, data
        self.shard_id, self.num_shards = shard_id, num_shards
        self.epoch, self.index = 0, 0
        if state is not None:
            count, fingerprint = self.index_record["count"], self.index_record["fingerprint"]
            self.epoch, self.index = resumed_position(self, state, count, fingerprint, self.epoch_size)
        self._samples: Iterator[tuple[int, np.ndarray]] = self._read_epoch()

    @property
    def epoch_size(self) -> int:
        """Prompts one shard visits per epoch (DALI gives shard s the s-th contiguous part of the order)."""
        count = self.index_record["count"]
        return (count * (self.shard_id + 1)) // self.num_shards - (count * self.shard_id) // self.num_shards

    def take_encoded(self, n: int, encode: Encoder | None = None) -> EncodedPrompts:
        """The next `n` prompts as (text, token ids); `encode` is not needed: the shards hold the tokens."""
        out = EncodedPrompts()
        for _ in range(n):
            number, ids = next(self._samples)
            out.prompts.append((self.texts[number], ids.tolist()))
            self.index += 1
            if self.index == self.epoch_size:
                self.epoch, self.index = self.epoch + 1, 0
                self._samples = self._read_epoch()
        return out

    def state(self) -> dict[str, Any]:
        """The same cursor state as PromptCursor's over the same prompts (a checkpoint reads either)."""
        return cursor_state(self, self.index_record["count"], self.index_record["fingerprint"])

    def restored(self, state: dict[str, Any]) -> DaliPromptCursor:
        return DaliPromptCursor(
            self.folder, self.seed, self.shuffle, self.data,
            shard_id=self.shard_id, num_shards=self.num_shards, state=state,
        )  # fmt: skip

    def _read_epoch(self) -> Iterator[tuple[int, np.ndarray]]:
        """(prompt number, token ids) of this shard's rest of the current epoch, read by a DALI pipeline."""
        order = epoch_order(self.index_record["count"], self.seed, self.epoch, self.shuffle)
        count = len(order)
        mine = order[(count * self.shard_id) // self.num_shards : (count * (self.shard_id + 1)) // self.num_shards]
        rest = mine[self.index :]
        files = [str(self.folder / f"{number:08d}.npy") for number in rest]
        numbers = deque(rest)
        for batch in _dali_batches(files):
            for ids in batch:
                yield numbers.popleft(), ids


def _dali_batches(files: list[str]) -> Iterator[list[np.ndarray]]:
    """The arrays of `files`, in order, in batches, from DALI's numpy reader on the CPU (device_id None)."""
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=min(READ_BATCH, len(files)), num_threads=1, device_id=None)
    def reader():
        # Files in the order given (no reader shuffle): the order is the epoch's seeded permutation. The shard
        # split was applied to the list already, so this reader is one shard of one. pad_last_batch repeats the
        # last file to fill the final batch; those repeats are dropped below.
        return fn.readers.numpy(files=files, random_shuffle=False, pad_last_batch=True, name="prompts")

    pipe = reader()
    pipe.build()
    left = len(files)
    while left > 0:
        (tokens,) = pipe.run()
        batch = [np.array(tokens[i]) for i in range(min(len(tokens), left))]
        left -= len(batch)
        yield batch
