"""training.gradient_checkpointing on the Megatron backend (Megatron's full recompute, on CPU through the shim): the
transformer layers run again in the backward, and one step's loss and gradients are those without it (float32)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_tiny import (
    PROMPTS,
    RESPONSES,
    TEMPERATURE,
    megatron_parallel_state,
    policy_loss,
    tiny_config,
    tiny_hf_model,
)

from reinforce.core.spec import TrainingSpec
from reinforce.trainer.backends.megatron.backend import MegatronBackend
from reinforce.trainer.distributed import Ranks

LAYERS = tiny_config().num_hidden_layers


@pytest.fixture(scope="module", autouse=True)
def parallel_tp1() -> Iterator[None]:
    with megatron_parallel_state(1):
        yield


@pytest.fixture
def policy_dir(tmp_path: Path) -> Path:
    tiny_hf_model(tiny_config()).save_pretrained(tmp_path / "policy")
    return tmp_path / "policy"


def _backend(policy_dir: Path, checkpointing: bool) -> MegatronBackend:
    training = TrainingSpec(backend="megatron", precision="fp32", gradient_checkpointing=checkpointing)
    return MegatronBackend(training, policy_dir, Ranks())


def test_checkpointing_gives_the_same_loss_and_gradients(policy_dir: Path) -> None:
    results = []
    for checkpointing in (False, True):
        backend = _backend(policy_dir, checkpointing)
        with torch.no_grad():  # the old log-probs' pass, in train mode too
            logprobs = backend.policy_logprobs(PROMPTS, RESPONSES, TEMPERATURE)[0]
        loss = policy_loss(backend.policy)
        loss.backward()
        grads = {n: p.grad for n, p in backend.policy.named_parameters()}
        results.append((logprobs, loss.detach(), grads))
    (logprobs, loss, grads), (logprobs_ckpt, loss_ckpt, grads_ckpt) = results
    torch.testing.assert_close(logprobs_ckpt, logprobs, rtol=0, atol=0)
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=0)
    assert grads_ckpt.keys() == grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_layers_run_again_in_the_backward_only_when_on(policy_dir: Path, checkpointing: bool) -> None:
    backend = _backend(policy_dir, checkpointing)
    calls: list[int] = []
    for layer in backend.policy.decoder.layers:
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    loss = policy_loss(backend.policy)
    assert len(calls) == LAYERS
    loss.backward()
    assert len(calls) == (2 * LAYERS if checkpointing else LAYERS)
    assert not backend.reference.config.recompute_granularity  # the reference never trains
