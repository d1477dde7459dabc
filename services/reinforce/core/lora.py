"""LoRA weight versions: what crosses from the trainer (PEFT) to the generators (plain models).

A LoRA weight version holds only the adapters, named as in the plain model: `<module>.lora_A.weight` [r, in] and
`<module>.lora_B.weight` [out, r] for each adapted Linear `<module>`, with safetensors metadata `format: lora` and
`lora_scaling` (alpha / r). A generator keeps the base weights it started with and loads a version as
W = W_base + scaling * B @ A for each adapted module: the same function of (base, adapters) every time, so a
version loaded twice gives the same weights.
"""

from __future__ import annotations

import torch

LORA_FORMAT = "lora"
_PARTS = (".lora_A.", ".lora_B.")


def lora_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters of a PEFT-injected model (adapter `default`), named `<module>.lora_{A,B}.weight` as in the plain
    model (PEFT's wrapping `base_model.model.` prefix and adapter name dropped)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            name = name.removeprefix("base_model.model.").replace(".default.", ".")
            out[name] = tensor.detach().clone()
    return out


def adapted_modules(adapters: dict[str, torch.Tensor]) -> list[str]:
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
