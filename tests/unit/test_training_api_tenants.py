"""The training API's tenants on a tiny random base model (services/reinforce/training_api/tenants.py): the modules a
client's LoRA flags adapt, and what get_info tells the SDK."""

from __future__ import annotations

from pathlib import Path

import pytest
from tinker import types

from reinforce.core.policy import materialize_policy
from reinforce.core.spec import PolicySpec, RandomInit
from reinforce.training_api.tenants import Tenants


@pytest.fixture
def tied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tenants:
    """Tenants of a random model whose output layer is tied to its embeddings, from a relative folder."""
    materialize_policy(PolicySpec(random_init=RandomInit(tie_word_embeddings=True)), tmp_path / "base", seed=0)
    monkeypatch.chdir(tmp_path)
    return Tenants(Path("base"), "random_init", 16.0, 0, tmp_path / "checkpoints", "run")


def test_train_unembed_is_refused_where_the_output_layer_is_tied(tied: Tenants):
    with pytest.raises(ValueError, match="train_unembed"):
        tied.create("s:train:0", types.LoraConfig(rank=2))
    tied.create("s:train:1", types.LoraConfig(rank=2, train_unembed=False))
    assert tied.info("s:train:1").lora_rank == 2


def test_get_info_names_the_tokenizer_folder_absolutely(tied: Tenants, tmp_path: Path):
    """The SDK loads it in the client's own working folder."""
    tied.create("s:train:0", types.LoraConfig(rank=2, train_mlp=False, train_unembed=False))
    info = tied.info("s:train:0")
    assert Path(info.model_data.tokenizer_id) == tmp_path / "base"
    assert ":" not in info.model_data.tokenizer_id  # the SDK cuts it at the first colon
