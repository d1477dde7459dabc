"""The helpers the vLLM and TensorRT-LLM engines share (no engine package needed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from reinforce.core.policy import build_char_tokenizer, load_policy, load_tokenizer
from reinforce.core.weights import publish
from reinforce.generator.engines.common import (
    EMBEDDING,
    LM_HEAD,
    check_fits,
    check_prompts,
    checkpoint_shapes,
    engine_names,
    eos_token_ids,
    per_sample_requests,
    policy_files,
    read_checkpoint,
    sample_seeds,
    stop_prefix,
)


def test_engine_names_put_a_tied_head_back_under_the_embedding() -> None:
    names = ["model.norm.weight", LM_HEAD]
    assert engine_names(names, tie_word_embeddings=False) == {n: n for n in names}
    assert engine_names(names, tie_word_embeddings=True) == {
        "model.norm.weight": "model.norm.weight",
        LM_HEAD: EMBEDDING,
    }
    # Both names present (save_pretrained of an untied copy): the embedding is loaded, the head skipped.
    assert engine_names([EMBEDDING, LM_HEAD], tie_word_embeddings=True) == {EMBEDDING: EMBEDDING}
    with pytest.raises(ValueError, match="neither"):
        engine_names(["model.norm.weight"], tie_word_embeddings=True)


def test_a_published_version_reads_as_the_policy_folder_does(tiny_head32_policy: Path, tmp_path: Path) -> None:
    model = load_policy(tiny_head32_policy)
    path = Path(publish(model, tmp_path, 1).uri)  # the trainer's file: lm_head.weight only
    read = dict(read_checkpoint(path, tie_word_embeddings=True))
    assert EMBEDDING in read and LM_HEAD not in read
    torch.testing.assert_close(read[EMBEDDING], model.model.embed_tokens.weight, rtol=0, atol=0)
    expected = checkpoint_shapes(policy_files(tiny_head32_policy), tie_word_embeddings=True)
    assert checkpoint_shapes([path], tie_word_embeddings=True) == expected
    check_fits(path, expected, tie_word_embeddings=True)
    altered = {name: shape for name, shape in expected.items() if name != "model.norm.weight"}
    altered |= {EMBEDDING: (1, 1), "x": (1,)}
    refused = r"missing \['x'\], unexpected \['model.norm.weight'\], other shapes \['model.embed_tokens.weight'\]"
    with pytest.raises(ValueError, match=refused):
        check_fits(path, altered, tie_word_embeddings=True)


def test_sample_seeds_are_deterministic_and_do_not_overlap_for_nearby_prompt_seeds() -> None:
    # vLLM's n>1 would seed sample i with seed + i: prompts seeded 5 and 6 would share draws.
    assert sample_seeds(5, 4) == sample_seeds(5, 4)
    assert len(set(sample_seeds(5, 4) + sample_seeds(6, 4))) == 8
    assert all(0 <= s < 2**56 for s in sample_seeds(2**60, 4))


def test_eos_ids_are_the_tokenizers_and_the_generation_configs(tiny_head32_policy: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    folder = tmp_path / "policy"
    shutil.copytree(tiny_head32_policy, folder)
    config = AutoConfig.from_pretrained(folder)
    tokenizer = load_tokenizer(folder)
    assert eos_token_ids(folder, config, tokenizer) == {tokenizer.eos_token_id}
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [2, 9]}))
    assert eos_token_ids(folder, config, tokenizer) == {2, 9}


def test_stop_prefix_is_the_shortest_prefix_containing_a_stop_string() -> None:
    tokenizer = build_char_tokenizer("abc .")
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    ids = tokenizer.encode("ab. ca.", add_special_tokens=False)
    assert stop_prefix(ids, decode, ["."]) == 3
    assert stop_prefix(ids, decode, [" c"]) == 5  # spans two tokens
    assert stop_prefix(ids, decode, ["cc"]) is None
    assert stop_prefix(ids, decode, []) is None


def test_per_sample_requests_repeat_each_prompt_with_its_own_seeds_and_group_the_answers() -> None:
    batch = per_sample_requests([[1, 2], [3]], [5, 6], num_samples=3, max_new_tokens=2, max_len=8)
    assert batch.prompts == [[1, 2], [1, 2], [1, 2], [3], [3], [3]]
    assert batch.seeds == sample_seeds(5, 3) + sample_seeds(6, 3)
    assert batch.grouped(list("abcdef")) == [["a", "b", "c"], ["d", "e", "f"]]
    with pytest.raises(ValueError, match="exceeds"):
        per_sample_requests([[1, 2, 3]], [0], num_samples=2, max_new_tokens=6, max_len=8)


def test_check_prompts() -> None:
    check_prompts([[1, 2]], [0], max_new_tokens=3, max_len=5)
    with pytest.raises(ValueError, match="seeds"):
        check_prompts([[1]], [0, 1], 1, 5)
    with pytest.raises(ValueError, match="empty"):
        check_prompts([[]], [0], 1, 5)
    with pytest.raises(ValueError, match="maximum sequence length"):
        check_prompts([[1, 2, 3]], [0], max_new_tokens=3, max_len=5)
