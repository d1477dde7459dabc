"""core/lora.py's reading of a LoRA weight version, which both engines load through: the red team's R4-12 (its numbers
and modules were checked by shape only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from reinforce.core.lora import read_lora_version

MODULE = "model.layers.0.self_attn.q_proj"
TARGETS = ("q_proj", "v_proj")  # the run's training.lora.target_modules
FITTING = {f"{MODULE}.lora_A.weight": torch.full((4, 16), 0.01), f"{MODULE}.lora_B.weight": torch.ones(16, 4)}


def version(folder: Path, tensors: dict[str, torch.Tensor], scaling: str) -> Path:
    path = folder / f"v-{len(list(folder.iterdir()))}.safetensors"
    save_file(tensors, str(path), {"format": "lora", "lora_scaling": scaling})
    return path


def test_a_trained_adapter_is_read_with_its_scaling(tmp_path: Path) -> None:
    adapters, scaling = read_lora_version(version(tmp_path, FITTING, "2.0"), TARGETS)
    assert scaling == 2.0 and torch.equal(adapters[f"{MODULE}.lora_B.weight"], FITTING[f"{MODULE}.lora_B.weight"])


@pytest.mark.parametrize(
    ("tensors", "scaling", "refusal"),
    [
        (FITTING, "nan", "lora_scaling nan is not a finite positive number"),
        (FITTING, "-1", "lora_scaling -1.0 is not a finite positive number"),
        (FITTING, "inf", "lora_scaling inf is not a finite positive number"),
        (FITTING, "many", "no lora_scaling number in its metadata"),
        (FITTING, "1e308", rf"the update of '{MODULE}' could reach 4e\+306, past float32"),
        ({**FITTING, f"{MODULE}.lora_A.weight": torch.full((4, 16), float("nan"))}, "2.0",
         rf"{MODULE}.lora_A.weight holds non-finite values"),
        ({"lm_head.lora_A.weight": torch.zeros(4, 16), "lm_head.lora_B.weight": torch.zeros(32, 4)}, "2.0",
         "an adapter of 'lm_head', none of training.lora.target_modules"),
    ],
)  # fmt: skip
def test_numbers_no_trained_adapter_has_are_refused_naming_the_file(
    tmp_path: Path, tensors: dict[str, torch.Tensor], scaling: str, refusal: str
) -> None:
    path = version(tmp_path, tensors, scaling)
    with pytest.raises(ValueError, match=rf"^{path}: {refusal}"):
        read_lora_version(path, TARGETS)
