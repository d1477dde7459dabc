"""training.attention: eager and sdpa compute the same log-probs and gradients; auto picks by the padded length."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from reinforce.core.spec import TrainingSpec
from reinforce.trainer.backends.torch_backend import EAGER_ATTENTION_MAX_TOKENS, TorchBackend
from reinforce.trainer.distributed import Ranks

PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 2, 3, 4, 5, 6]]
RESPONSES = [[20, 21, 22], [30, 31, 32, 33, 34], [40]]


@pytest.fixture
def policy_dir(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "policy")
    return tmp_path / "policy"


def logprobs_and_gradient(backend: TorchBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logprobs, mask = backend.policy_logprobs(PROMPTS, RESPONSES, 0.7)
    (logprobs * mask).sum().backward()
    grad = torch.cat([p.grad.flatten() for p in backend.trainable_parameters()])
    return logprobs.detach(), backend.reference_logprobs(PROMPTS, RESPONSES, 0.7), grad


def test_eager_and_sdpa_agree(policy_dir):
    # float32: the two kernels agree to float32 noise; bfloat16 would round each differently
    specs = (TrainingSpec(attention=a, precision="fp32") for a in ("eager", "sdpa"))
    eager, sdpa = (TorchBackend(spec, policy_dir, Ranks()) for spec in specs)
    for want, got in zip(logprobs_and_gradient(sdpa), logprobs_and_gradient(eager), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert eager.policy.config._attn_implementation == "eager"
    assert sdpa.reference.config._attn_implementation == "sdpa"


def test_auto_uses_eager_for_short_sequences_and_sdpa_for_long_ones_on_cpu(policy_dir):
    backend = TorchBackend(TrainingSpec(), policy_dir, Ranks())
    short = backend.policy_logprobs(PROMPTS, RESPONSES, 1.0)[0]
    assert backend.compute.config._attn_implementation == "eager"
    assert backend.reference.config._attn_implementation == "eager"

    long_response = [7] * EAGER_ATTENTION_MAX_TOKENS
    backend.reference_logprobs([[1]], [long_response], 1.0)
    assert backend.compute.config._attn_implementation == "sdpa"
    assert backend.reference.config._attn_implementation == "sdpa"
    # switching back and forth changes nothing computed
    torch.testing.assert_close(backend.policy_logprobs(PROMPTS, RESPONSES, 1.0)[0], short, rtol=1e-5, atol=1e-5)
    assert backend.compute.config._attn_implementation == "eager"
