"""Pre-tokenized prompt shards for `data.loader: dali`: written by `reinforce shard-prompts`, checked by the
supervisor at start, read by the trainer's DALI cursor (trainer/dali_cursor.py).

`reinforce shard-prompts SPEC OUT_DIR` tokenizes the spec's prompt file once, exactly as the trainer's default
loader would (chat template, system prompt, max_prompt_tokens, on_long_prompt), and writes

    OUT_DIR/
        00000000.npy ...   one int32 array of token ids per prompt, in file order
        prompts.jsonl      {"text": ...} per prompt, same order: the text the reward server scores, and its
                           record's reference answer ({"text": ..., "answer": ...}) where it had one
        index.json         count, the prompt file's fingerprint, the tokenization settings it was made with
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from reinforce.core.data import ANSWER_FIELD, AnsweredPrompt, DataError, prompts_fingerprint, read_prompt_file
from reinforce.core.environment_api import prompt_data
from reinforce.core.prompt_encoding import Encoder
from reinforce.core.spec import DataSpec, load_spec

INDEX = "index.json"
TEXTS = "prompts.jsonl"
FORMAT = 1
# The DataSpec fields the tokens depend on: a shard folder is refused by a spec that tokenizes otherwise.
TOKENIZATION_FIELDS = ("chat_template", "system_prompt", "max_prompt_tokens", "on_long_prompt")


def write_shards(prompts: list[str], encode: Encoder, data: DataSpec, out_dir: Path) -> dict[str, Any]:
    """Tokenize `prompts` with `encode` (prompt_encoding.encode_prompt_checked) into `out_dir`; returns the index.

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


def read_shard_texts(folder: Path) -> list[str]:
    """The prompts of a shard folder in shard order, each carrying its answer (data.prompt_answer reads it) when its
    prompts.jsonl line has one."""
    return [_prompt(json.loads(line)) for line in (folder / TEXTS).read_text().splitlines()]


def _prompt(record: dict[str, str]) -> str:
    return AnsweredPrompt(record["text"], record[ANSWER_FIELD]) if ANSWER_FIELD in record else record["text"]


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
