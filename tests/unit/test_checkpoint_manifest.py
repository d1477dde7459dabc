"""Issue #30, finding R3-13: a resume checks the newest checkpoint against its manifest (run id, sha256 per file);
a damaged one is set aside, named, and the one before is used; another run's checkpoint is refused."""

import json
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from reinforce.core.checkpoints import MANIFEST, ForeignCheckpoint, list_checkpoints
from reinforce.core.spec import TrainingSpec
from reinforce.trainer.backends.torch_backend import TorchBackend
from reinforce.trainer.checkpoint import TrainerState, load_checkpoint, newest_intact_checkpoint, save_checkpoint
from reinforce.trainer.distributed import Ranks

RUN = "run-a"


@pytest.fixture
def checkpoints(tmp_path):
    """checkpoints/step-000001 and step-000002 of run RUN (torch backend, a one-layer Llama)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "policy")
    backend = TorchBackend(TrainingSpec(lr=1e-3), tmp_path / "policy", Ranks())
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(root, TrainerState(step, {"epoch": 0, "index": step}, step), backend, keep=2, run_id=RUN)
    return root


def test_the_manifest_names_the_run_and_every_file(checkpoints):
    newest = list_checkpoints(checkpoints)[-1]
    manifest = json.loads((newest / MANIFEST).read_text())
    assert manifest["run_id"] == RUN
    assert set(manifest["files"]) == {p.name for p in newest.iterdir()} - {MANIFEST}
    assert newest_intact_checkpoint(checkpoints, RUN) == newest


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda folder: (folder / "model.safetensors").write_bytes(b"\0" * 100), "model.safetensors holds 100 bytes"),
        (lambda folder: _flip_last_byte(folder / "optimizer.pt"), "optimizer.pt does not match its sha256"),
        (lambda folder: (folder / "rng.pt").unlink(), "rng.pt is missing"),
        (lambda folder: (folder / MANIFEST).unlink(), "manifest.json is missing or unreadable"),
    ],
    ids=["truncated", "changed", "missing", "no-manifest"],
)
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_used(checkpoints, tmp_path, caplog, damage, named):
    newest = list_checkpoints(checkpoints)[-1]
    damage(newest)
    with caplog.at_level(logging.ERROR):
        chosen = newest_intact_checkpoint(checkpoints, RUN)
    assert chosen == checkpoints / "step-000001"
    assert not newest.exists() and (checkpoints / "damaged-step-000002").is_dir()  # kept for inspection
    assert named in caplog.text and "damaged-step-000002" in caplog.text
    backend = TorchBackend(TrainingSpec(lr=1e-3), tmp_path / "policy", Ranks())
    assert load_checkpoint(chosen, backend).step == 1


def test_another_runs_checkpoint_is_refused_naming_both_runs(checkpoints):
    with pytest.raises(ForeignCheckpoint, match=f"belongs to run {RUN}, not to this run \\(run-b\\)"):
        newest_intact_checkpoint(checkpoints, "run-b")
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step-000001", "step-000002"]  # nothing moved


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
