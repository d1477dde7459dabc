"""LoRA weight versions: what crosses from the trainer (PEFT) to the generators (plain models).

A LoRA weight version holds only the adapters, named as in the plain model: `<module>.lora_A.weight` [r, in] and
`<module>.lora_B.weight` [out, r] for each adapted Linear `<module>`, with safetensors metadata `format: lora` and
`lora_scaling` (alpha / r). Every generator keeps the base weights it started with (weight version 0), so a version
is the same function of (base, adapters) however many versions came before it. The torch engine merges a version:
W = W_base + scaling * B @ A for each adapted module. The vLLM engine does not merge: it loads the adapters as a
vLLM LoRA adapter (`peft_config` describes them in PEFT's format) and applies them beside the base weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from reinforce.core.spec import LoraSpec

if TYPE_CHECKING:
    import peft

LORA_FORMAT = "lora"
_PARTS = (".lora_A.", ".lora_B.")
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def lora_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters of a PEFT-injected model (adapter `default`), named `<module>.lora_{A,B}.weight` as in the plain
    model (PEFT's wrapping `base_model.model.` prefix and adapter name dropped)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            name = name.removeprefix("base_model.model.").replace(".default.", ".")
            out[name] = tensor.detach().clone()
    return out


def lora_config(model: torch.nn.Module, lora: LoraSpec) -> peft.LoraConfig:
    """PEFT's configuration of `lora`'s adapters for `model` (a plain model, not a PEFT-wrapped one): the trainer's
    single adapter and each tenant's of the training API. ValueError where target_modules names an output layer
    tied to the input embeddings: the generators merge adapters into the weights, and a tied output layer's weight
    is the input embedding's."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    output = model.get_output_embeddings()
    output_names = {name for name, module in model.named_modules() if module is output}
    if tied and any(t in output_names or t.split(".")[-1] in output_names for t in lora.target_modules):
        raise ValueError(
            f"training.lora.target_modules names the output layer {sorted(output_names)}, whose weight is tied to the "
            "input embeddings: leave it out"
        )
    try:
        from peft import LoraConfig
    except ImportError:
        raise RuntimeError("LoRA needs PEFT: pip install 'reinforce-k8s[lora]'") from None
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def adapted_modules(adapters: Mapping[str, object]) -> list[str]:
    """The adapted modules of a LoRA weight version, from its tensor names."""
    return sorted({name.split(".lora_A.")[0] for name in adapters if ".lora_A." in name})


def merge_into(
    model: torch.nn.Module,
    adapters: dict[str, torch.Tensor],
    scaling: float,
    base: dict[str, torch.Tensor] | None = None,
) -> None:
    """Set each adapted module's weight of a plain model to base + scaling * B @ A (base: the model's own now)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for module in adapted_modules(adapters):
            weight = params[f"{module}.weight"]
            a, b = adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"]
            start = base[module] if base is not None else weight.detach().clone()
            weight.copy_(start + scaling * (b.to(weight.dtype) @ a.to(weight.dtype)))


def adapter_rank(shapes: dict[str, tuple[int, ...]]) -> int:
    """The one rank r of a LoRA weight version's adapters (names and shapes as `lora_tensors` gives them)."""
    ranks = {shape[0] for name, shape in shapes.items() if ".lora_A." in name}
    ranks |= {shape[1] for name, shape in shapes.items() if ".lora_B." in name}
    if len(ranks) != 1:
        raise ValueError(f"a LoRA weight version has one rank for all its adapters, this one has {sorted(ranks)}")
    return ranks.pop()


def peft_config(shapes: dict[str, tuple[int, ...]], scaling: float) -> dict[str, object]:
    """PEFT's adapter_config.json for a LoRA weight version, which engines that load PEFT adapters read: r from the
    tensors' shapes, lora_alpha = scaling * r (so that alpha / r is the version's scaling), and the adapted modules'
    names."""
    rank = adapter_rank(shapes)
    return {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": scaling * rank,
        "target_modules": sorted({module.rsplit(".", 1)[-1] for module in adapted_modules(shapes)}),
        "bias": "none",
    }


def read_lora_version(path: Path, target_modules: Sequence[str]) -> tuple[dict[str, torch.Tensor], float]:
    """The adapters and the scaling of a LoRA weight version file; ValueError naming the file where the scaling is
    not a finite positive number, a tensor holds a non-finite value, an update scaling * B @ A could overflow
    float32, or a module is none of the run's `target_modules` (training.lora)."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        adapters = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    try:
        scaling = float(metadata["lora_scaling"])
    except (KeyError, ValueError):
        raise ValueError(f"{path}: no lora_scaling number in its metadata") from None
    if not (math.isfinite(scaling) and scaling > 0):
        raise ValueError(f"{path}: lora_scaling {scaling!r} is not a finite positive number")
    for name, tensor in adapters.items():
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{path}: {name} holds non-finite values")
    for module in adapted_modules(adapters):
        if module.rsplit(".", 1)[-1] not in target_modules:
            raise ValueError(f"{path}: an adapter of {module!r}, none of training.lora.target_modules")
        a, b = adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"]
        largest = float(a.abs().max()) * float(b.abs().max()) * a.shape[0] * scaling  # bounds every |update|
        if not largest < FLOAT32_MAX:
            raise ValueError(f"{path}: the update of {module!r} could reach {largest:.3g}, past float32")
    return adapters, scaling
