"""training.gradient_checkpointing on the torch backend: the decoder layers run again in the backward, and one
step's loss and gradients are those without it (float32), for a full and a LoRA policy. The prompts come in runs of
equal neighbours, so the layers' recompute goes through response_states' shared KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from reinforce.core.spec import LoraSpec, TrainingSpec
from reinforce.trainer.backends.torch_backend import TorchBackend
from reinforce.trainer.distributed import Ranks

PROMPTS = [[1, 5, 9, 13], [1, 5, 9, 13], [1, 7], [1, 7], [1, 2, 3, 4, 5, 6]]
RESPONSES = [[20, 21, 22], [23, 24], [30, 31, 32, 33, 34], [35], [40, 41]]
LAYERS = 2
LORA = pytest.param(LoraSpec(rank=4, target_modules=["q_proj", "v_proj", "down_proj"]), id="lora")


@pytest.fixture
def policy_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "policy")
    return tmp_path / "policy"


def _backend(policy_dir: Path, lora: LoraSpec | None, checkpointing: bool, precision: str = "fp32") -> TorchBackend:
    training = TrainingSpec(precision=precision, lora=lora, gradient_checkpointing=checkpointing)
    torch.manual_seed(1)  # PEFT's random A
    backend = TorchBackend(training, policy_dir, Ranks())
    if lora is not None:  # PEFT starts B at zero, where A's gradient is zero too: give both something to show
        for name, parameter in backend.policy.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(parameter.data, std=0.1)
    return backend


def _loss(backend: TorchBackend) -> torch.Tensor:
    logprobs, entropy, mask = backend.policy_logprobs_and_entropy(PROMPTS, RESPONSES, 0.7)
    return -((logprobs + 0.1 * entropy) * mask).sum() / mask.sum()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("lora", [None, LORA])
def test_checkpointing_gives_the_same_loss_and_gradients(
    policy_dir: Path, lora: LoraSpec | None, precision: str
) -> None:
    """Bit for bit, in float32 and in bf16 (a bfloat16 copy of the policy, or LoRA under autocast)."""
    results = []
    for checkpointing in (False, True):
        backend = _backend(policy_dir, lora, checkpointing, precision)
        loss = _loss(backend)
        loss.backward()
        grads = {n: p.grad for n, p in backend.policy.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads, backend.reference_logprobs(PROMPTS, RESPONSES, 0.7)))
    (loss, grads, reference), (loss_ckpt, grads_ckpt, reference_ckpt) = results
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=0)
    assert grads_ckpt.keys() == grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(reference_ckpt, reference, rtol=0, atol=0)


@pytest.mark.parametrize("lora", [None, LORA])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_layers_run_again_in_the_backward_only_when_on(
    policy_dir: Path, lora: LoraSpec | None, checkpointing: bool
) -> None:
    backend = _backend(policy_dir, lora, checkpointing)
    calls: list[bool] = []
    for layer in backend.compute.base_model.layers:
        layer.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    loss = _loss(backend)
    forward = len(calls)
    assert forward == 2 * LAYERS  # the prompts' pass, then the responses' pass after their cache
    loss.backward()
    assert len(calls) - forward == (forward if checkpointing else 0)
