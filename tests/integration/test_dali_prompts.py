"""data.loader dali: `reinforce shard-prompts` writes pre-tokenized .npy shards of the tiny example's prompts, and
DALI's numpy reader (CPU pipeline) yields the same prompts, in the same order, as the default loader for the same
seed, across epochs and from a checkpointed cursor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runs import BASELINE_TRAINING, max_weight_difference, reinforce, write_spec

from reinforce.core.data import DataError, prompt_answer, read_prompt_file
from reinforce.core.policy import load_tokenizer, materialize_policy
from reinforce.core.prompt_encoding import encode_prompt_checked
from reinforce.core.spec import DataSpec, RunSpec, load_spec
from reinforce.trainer.cursors import PromptCursor

pytest.importorskip("nvidia.dali")

from reinforce.core.prompt_shards import write_shards
from reinforce.trainer.dali_cursor import DaliPromptCursor


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunSpec, Path, list]:
    """(the tiny spec, its shard folder, the default loader's encoder)."""
    folder = tmp_path_factory.mktemp("dali")
    spec_path = write_spec(folder)
    result = reinforce("shard-prompts", str(spec_path), str(folder / "shards"))
    assert result.returncode == 0, result.stderr[-3000:]
    spec = load_spec(spec_path)
    tokenizer = load_tokenizer(materialize_policy(spec.policy, folder / "policy", spec.seed))
    return spec, folder / "shards", lambda text: encode_prompt_checked(tokenizer, text, spec.data)


def _default_cursor(spec: RunSpec) -> PromptCursor:
    return PromptCursor(read_prompt_file(spec.data.prompts).prompts, spec.seed, spec.data.shuffle)


def _dali_cursor(spec: RunSpec, shards: Path, **kwargs) -> DaliPromptCursor:
    return DaliPromptCursor(shards, spec.seed, spec.data.shuffle, spec.data, **kwargs)


def test_same_prompts_in_the_same_order_as_the_default_loader(sharded) -> None:
    spec, shards, encode = sharded
    default, dali = _default_cursor(spec), _dali_cursor(spec, shards)
    epoch = len(default.prompts)
    for _ in range(2 * epoch // 8 + 1):  # steps of 8 prompts across two epoch boundaries
        assert dali.take_encoded(8).prompts == default.take_encoded(8, encode).prompts
        assert dali.state() == default.state()
    assert dali.epoch == 2


def test_each_epoch_is_shuffled_with_the_seed(sharded) -> None:
    spec, shards, _ = sharded
    dali = _dali_cursor(spec, shards)
    epoch = dali.epoch_size
    first, second = (dali.take_encoded(epoch).prompts for _ in range(2))
    assert first != second and sorted(first) == sorted(second)


def test_resumes_at_the_checkpointed_cursor(sharded) -> None:
    spec, shards, encode = sharded
    default = _default_cursor(spec)
    default.take_encoded(len(default.prompts) + 5, encode)  # mid-way through the second epoch
    state = default.state()
    resumed = _dali_cursor(spec, shards).restored(state)
    assert resumed.state() == state
    assert resumed.take_encoded(20).prompts == default.take_encoded(20, encode).prompts


def test_shards_split_every_epoch_between_them(sharded) -> None:
    spec, shards, _ = sharded
    readers = [_dali_cursor(spec, shards, shard_id=s, num_shards=2) for s in range(2)]
    parts = [r.take_encoded(r.epoch_size).prompts for r in readers]
    whole = _dali_cursor(spec, shards).take_encoded(readers[0].epoch_size + readers[1].epoch_size).prompts
    assert parts[0] + parts[1] == whole  # each shard reads its contiguous part of the epoch's order


def test_prompts_carry_their_reference_answer_through_the_shards(tmp_path) -> None:
    """A record's `answer` (math_answer's reference) reaches the trainer from the shards as from the file, and a
    record without one has none."""
    prompts_file = tmp_path / "answers.jsonl"
    records = [{"prompt": f"{i}+{i}", "answer": 2 * i} for i in range(5)] + [{"prompt": "no answer"}]
    prompts_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    prompts = read_prompt_file(prompts_file).prompts
    data = DataSpec(prompts=str(tmp_path / "shards"), chat_template=False)
    write_shards(prompts, lambda text: ([ord(c) for c in text], False), data, tmp_path / "shards")
    dali = DaliPromptCursor(tmp_path / "shards", seed=1, shuffle=False, data=data)
    texts = [text for text, _ in dali.take_encoded(len(records)).prompts]
    assert texts == [r["prompt"] for r in records]
    assert [prompt_answer(t) for t in texts] == ["0", "2", "4", "6", "8", ""]
    assert [prompt_answer(t) for t in texts] == [prompt_answer(p) for p in prompts]


def test_shards_made_with_other_tokenization_are_refused(sharded) -> None:
    spec, shards, _ = sharded
    other = spec.data.model_copy(update={"max_prompt_tokens": 8})
    with pytest.raises(DataError, match=r"data\.max_prompt_tokens: shard the prompts again"):
        DaliPromptCursor(shards, spec.seed, spec.data.shuffle, other)


@pytest.mark.slow
def test_a_run_on_dali_shards_trains_like_the_default_loader(tmp_path, sharded, tiny_baseline) -> None:
    """The tiny example through real processes with data.loader dali: the same prompts, so the same weights."""
    _, shards, _ = sharded
    spec = write_spec(tmp_path, training=BASELINE_TRAINING, data={"prompts": str(shards), "loader": "dali"})
    result = reinforce("run", str(spec))
    assert result.returncode == 0, result.stderr[-3000:]
    assert max_weight_difference(tiny_baseline, tmp_path / "run") == 0.0
