"""Pre-tokenized prompt shards read with NVIDIA DALI (`data.loader: dali`; the `dali` extra).

`reinforce shard-prompts SPEC OUT_DIR` tokenizes the spec's prompt file once, exactly as the trainer's default
loader would (chat template, system prompt, max_prompt_tokens, on_long_prompt), and writes

    OUT_DIR/
        00000000.npy ...   one int32 array of token ids per prompt, in file order
        prompts.jsonl      {"text": ...} per prompt, same order: the text the reward server scores, and its
                           record's reference answer ({"text": ..., "answer": ...}) where it had one
        index.json         count, the prompt file's fingerprint, the tokenization settings it was made with

:class:`DaliPromptCursor` walks those shards epoch after epoch in the default loader's seeded order
(data.epoch_order): each epoch it builds a CPU pipeline of DALI's numpy reader over the files in that order,
so for the same seed it yields the same prompts, in the same order, as PromptCursor over the prompt file, and its
state (epoch, index) is the same checkpointed cursor. The reader is sharded (shard_id, num_shards): each shard
reads its own contiguous part of every epoch's order.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from reinforce.core.data import (
    ANSWER_FIELD,
    AnsweredPrompt,
    DataError,
    EncodedPrompts,
    Encoder,
    check_same,
    cursor_state,
    epoch_order,
    prompts_fingerprint,
    read_prompt_file,
)
from reinforce.core.environment_api import prompt_data
from reinforce.core.spec import DataSpec, load_spec

INDEX = "index.json"
TEXTS = "prompts.jsonl"
FORMAT = 1
# The DataSpec fields the tokens depend on: a shard folder is refused by a spec that tokenizes otherwise.
TOKENIZATION_FIELDS = ("chat_template", "system_prompt", "max_prompt_tokens", "on_long_prompt")
READ_BATCH = 256  # samples per DALI pipeline run


def write_shards(prompts: list[str], encode: Encoder, data: DataSpec, out_dir: Path) -> dict[str, Any]:
    """Tokenize `prompts` with `encode` (models.encode_prompt_checked) into `out_dir`; returns the index.

    Prompts `encode` refuses (on_long_prompt skip) are left out and counted: a run over the shards never sees them.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    texts, skipped, truncated = [], 0, 0
    for text in prompts:
        ids, too_long = encode(text)
        if ids is None:
            skipped += 1
            continue
        truncated += too_long
        np.save(out_dir / f"{len(texts):08d}.npy", np.asarray(ids, dtype=np.int32))
        texts.append(text)
    if not texts:
        raise DataError(f"all {len(prompts)} prompts are longer than data.max_prompt_tokens")
    (out_dir / TEXTS).write_text("".join(json.dumps(_text_record(t)) + "\n" for t in texts))
    index = {
        "format": FORMAT,
        "count": len(texts),
        "fingerprint": prompts_fingerprint(texts),
        "skipped_long_prompts": skipped,
        "truncated_prompts": truncated,
        "tokenization": data.model_dump(include=set(TOKENIZATION_FIELDS)),
    }
    (out_dir / INDEX).write_text(json.dumps(index, indent=1))
    return index


def _text_record(prompt: str) -> dict[str, str]:
    """A prompt's line of prompts.jsonl: its text, and its reference answer when its record had one."""
    record = {"text": str(prompt)}
    if hasattr(prompt, "answer"):  # AnsweredPrompt, ChatPrompt: the answer travels to the reward server
        record[ANSWER_FIELD] = prompt.answer
    return record


def _prompt(record: dict[str, str]) -> str:
    """The prompt of a prompts.jsonl line, carrying its answer (data.prompt_answer reads it) when it has one."""
    return AnsweredPrompt(record["text"], record[ANSWER_FIELD]) if ANSWER_FIELD in record else record["text"]


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
        self.texts = [_prompt(json.loads(line)) for line in (self.folder / TEXTS).read_text().splitlines()]
        self.seed, self.shuffle, self.data = seed, shuffle, data
        self.shard_id, self.num_shards = shard_id, num_shards
        self.epoch, self.index = 0, 0
        if state is not None:
            self._seek(state)
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

    def _seek(self, state: dict[str, Any]) -> None:
        check_same(state, "seed", self.seed)
        check_same(state, "shuffle", self.shuffle)
        check_same(state, "num_prompts", self.index_record["count"])
        check_same(state, "fingerprint", self.index_record["fingerprint"])
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self.epoch_size:
            raise DataError(f"data cursor out of range: epoch {epoch}, index {index}")
        self.epoch, self.index = epoch, index

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


def read_shard_index(folder: Path, data: DataSpec) -> dict[str, Any]:
    """The index of a shard folder; a DataError if it is none, or was tokenized with other data settings."""
    path = folder / INDEX
    if not path.is_file():
        raise DataError(f"{folder}: not a prompt shard folder (no {INDEX}); write one with `reinforce shard-prompts`")
    index = json.loads(path.read_text())
    made_with = index["tokenization"]
    now = data.model_dump(include=set(TOKENIZATION_FIELDS))
    if changed := [f"data.{k}" for k in TOKENIZATION_FIELDS if made_with.get(k) != now[k]]:
        raise DataError(f"{folder}: the shards were tokenized with other {', '.join(changed)}: shard the prompts again")
    return index


def add_shard_prompts_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "shard-prompts",
        help="tokenize a run spec's prompt file into .npy shards for data.loader dali",
        description="Tokenize SPEC's data.prompts with its policy's tokenizer and data settings into OUT_DIR; "
        "then set data.prompts to OUT_DIR and data.loader to dali.",
    )
    parser.add_argument("spec", type=Path, help="the run spec (its policy, data.prompts and data settings)")
    parser.add_argument("out_dir", type=Path, help="folder for the shards (created)")
    parser.set_defaults(handler=_shard_prompts)


def _shard_prompts(args: argparse.Namespace) -> int:
    from reinforce.core.policy import load_tokenizer, materialize_policy
    from reinforce.core.prompt_encoding import encode_prompt_checked

    spec = load_spec(args.spec)
    data = prompt_data(spec)  # as the trainer encodes: the tools' instructions in the system prompt, if they go there
    prompts = read_prompt_file(data.prompts, data.on_bad_line, data.prompt_field).prompts
    with tempfile.TemporaryDirectory() as policy:  # the tokenizer, as the trainer builds it
        tokenizer = load_tokenizer(materialize_policy(spec.policy, Path(policy) / "policy", spec.seed))
    index = write_shards(prompts, lambda text: encode_prompt_checked(tokenizer, text, data), data, args.out_dir)
    print(
        f"{index['count']} prompts in {args.out_dir} ({index['truncated_prompts']} truncated, "
        f"{index['skipped_long_prompts']} longer than data.max_prompt_tokens skipped)"
    )
    return 0
