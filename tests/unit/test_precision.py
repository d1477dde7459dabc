"""training.precision bf16: forward and backward on a bfloat16 copy of the float32 master weights, whose gradients
accumulate in float32 on the master weights; AdamW state float32; a bfloat16 reference; buffers float32 everywhere;
float32 log-probs within a stated tolerance of float32's."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from reinforce.core.spec import TrainingSpec
from reinforce.trainer.backends import torch_backend
from reinforce.trainer.backends.torch_backend import TorchBackend
from reinforce.trainer.distributed import Ranks

# bfloat16 keeps 8 significant bits (relative error 2^-9 per rounding): a log-prob of this small model moves by a few
# thousandths. On SmolLM2-135M (logits ~20), 96 sampled tokens after each of three prompts, measured once: mean 0.042,
# max 0.27 nats (autocast, the bf16 of earlier versions: mean 0.032, max 0.22).
MEAN_TOLERANCE, MAX_TOLERANCE = 0.02, 0.1
PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 2, 3, 4, 5, 6]]
RESPONSES = [[20, 21, 22], [30, 31, 32, 33, 34], [40]]


def _backends(tmp_path) -> tuple[TorchBackend, TorchBackend]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "policy")
    return tuple(
        TorchBackend(TrainingSpec(lr=1e-3, precision=p), tmp_path / "policy", Ranks()) for p in ("fp32", "bf16")
    )


def test_bf16_logprobs_stay_close_to_fp32_and_are_float32(tmp_path):
    fp32, bf16 = _backends(tmp_path)
    exact, mask = fp32.policy_logprobs(PROMPTS, RESPONSES, 1.0)
    pairs = {
        "policy": (exact, bf16.policy_logprobs(PROMPTS, RESPONSES, 1.0)[0]),
        "reference": (
            fp32.reference_logprobs(PROMPTS, RESPONSES, 1.0),
            bf16.reference_logprobs(PROMPTS, RESPONSES, 1.0),
        ),
    }
    for name, (want, got) in pairs.items():
        gap = (want - got).abs()[mask.bool()]
        assert got.dtype == torch.float32
        assert gap.mean() < MEAN_TOLERANCE and gap.max() < MAX_TOLERANCE, (name, gap)
        assert gap.max() > 0, name  # bfloat16 really ran
    assert next(bf16.reference.parameters()).dtype == torch.bfloat16


def test_bf16_computes_on_a_bfloat16_copy_whose_buffers_stay_float32(tmp_path):
    _, bf16 = _backends(tmp_path)
    assert bf16.compute is not bf16.policy
    assert (
        {p.dtype for p in bf16.compute.parameters()}
        == {p.dtype for p in bf16.reference.parameters()}
        == {torch.bfloat16}
    )
    assert {p.dtype for p in bf16.policy.parameters()} == {torch.float32}
    for model in (bf16.policy, bf16.compute, bf16.reference):
        assert {b.dtype for b in model.buffers()} == {torch.float32}  # the rotary frequencies
    # tied: the output layer's weight is the embedding's in the copy too
    assert bf16.compute.get_output_embeddings().weight is bf16.compute.get_input_embeddings().weight


def test_bf16_gradients_add_up_in_float32_and_each_step_refreshes_the_copy(tmp_path):
    """Each micro-batch's gradients arrive in bfloat16 and are added in float32 into the master weights' gradients,
    the copy keeping none; after the step the copy holds the new master weights, rounded to bfloat16."""
    _, bf16 = _backends(tmp_path)
    parts = [(PROMPTS[:2], RESPONSES[:2]), (PROMPTS[2:], RESPONSES[2:])]

    def backward(prompts: list[list[int]], responses: list[list[int]]) -> None:
        logprobs, mask = bf16.policy_logprobs(prompts, responses, 1.0)
        (-(logprobs * mask).sum()).backward()
        assert all(p.grad is None for p in bf16.compute.parameters())

    alone = []
    for part in parts:
        bf16.zero_grad()
        backward(*part)
        alone.append([p.grad.clone() for p in bf16.trainable_parameters()])
    bf16.zero_grad()
    for part in parts:
        backward(*part)
    for first, second, total in zip(*alone, [p.grad for p in bf16.trainable_parameters()], strict=True):
        assert total.dtype == torch.float32
        assert torch.equal(first, first.to(torch.bfloat16).float())  # computed in bfloat16
        assert torch.equal(total, first + second)
    before = [p.detach().clone() for p in bf16.compute.parameters()]
    bf16.optimizer_step()
    for computed, master in zip(bf16.compute.parameters(), bf16.policy.parameters(), strict=True):
        assert torch.equal(computed, master.detach().to(torch.bfloat16))
    assert not all(torch.equal(c, b) for c, b in zip(bf16.compute.parameters(), before, strict=True))


def test_bf16_keeps_float32_master_weights_and_optimizer_state(tmp_path):
    _, bf16 = _backends(tmp_path)
    before = {n: p.detach().clone() for n, p in bf16.policy.named_parameters()}
    bf16.zero_grad()
    logprobs, mask = bf16.policy_logprobs(PROMPTS, RESPONSES, 1.0)
    (-(logprobs * mask).sum() / mask.sum()).backward()
    assert all(p.grad.dtype == torch.float32 for p in bf16.trainable_parameters())
    bf16.optimizer_step()
    assert all(p.dtype == torch.float32 for p in bf16.policy.parameters())
    for state in bf16.optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # updates smaller than a bfloat16 step survive in the float32 master weights
    assert any(not torch.equal(before[n], p) for n, p in bf16.policy.named_parameters())


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_on_the_torch_backend_where_the_cpu_has_bfloat16_and_fp32_elsewhere(tmp_path, monkeypatch, native):
    """The default, auto: the torch backend trains in bfloat16 (its reference held in bfloat16) where the CPU
    multiplies bfloat16 in hardware, else in float32; megatron in float32; an explicit precision is kept."""
    assert TrainingSpec().precision == "auto"
    assert TrainingSpec().resolved_precision(native) == ("bf16" if native else "fp32")
    assert TrainingSpec(backend="megatron").resolved_precision(native) == "fp32"
    assert TrainingSpec(precision="fp32").resolved_precision(native) == "fp32"
    assert TrainingSpec(backend="megatron", precision="bf16").resolved_precision(native) == "bf16"
    _backends(tmp_path)  # writes the policy
    monkeypatch.setattr(torch_backend, "bfloat16_is_native", lambda device: native and device == "cpu")
    default = TorchBackend(TrainingSpec(), tmp_path / "policy", Ranks())
    dtype = torch.bfloat16 if native else torch.float32
    assert default.compute_dtype == dtype
    assert next(default.reference.parameters()).dtype == dtype
    assert (default.compute is default.policy) is not native
