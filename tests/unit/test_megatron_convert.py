"""HF Llama <-> Megatron GPTModel conversion: layouts, tensor-parallel shards, bit-exact round trips (no model
is built here: see tests/integration/test_megatron_model.py)."""

from __future__ import annotations

import pytest
import torch
from megatron_tiny import tiny_config, tiny_hf_model
from transformers import LlamaConfig

from reinforce.trainer.backends.megatron import convert


def _hf_state(config: LlamaConfig) -> dict[str, torch.Tensor]:
    state = tiny_hf_model(config).state_dict()
    if config.tie_word_embeddings:
        del state["lm_head.weight"]  # what save_pretrained writes; megatron_to_hf gives it back the same way
    return state


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("layer_spec", ["local", "te"])
@pytest.mark.parametrize(("kv_heads", "tp"), [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (4, 4)])
def test_hf_megatron_hf_round_trip_is_bit_exact(tied: bool, kv_heads: int, layer_spec: str, tp: int) -> None:
    config = tiny_config(tied=tied, kv_heads=kv_heads)
    layout = convert.layout_from_hf(config, tp, layer_spec=layer_spec)  # type: ignore[arg-type]
    hf = _hf_state(config)
    shards = [convert.hf_to_megatron_shard(hf, layout, r, tp) for r in range(tp)]
    back = convert.megatron_shards_to_hf(shards, layout)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    full = convert.hf_to_megatron(hf, layout)
    assert convert.merge_state_dicts(shards).keys() == full.keys()
    assert all(torch.equal(convert.merge_state_dicts(shards)[k], v) for k, v in full.items())


def test_norm_keys_follow_the_layer_spec() -> None:
    config = tiny_config()
    hf = _hf_state(config)
    local = convert.hf_to_megatron(hf, convert.layout_from_hf(config))
    te = convert.hf_to_megatron(hf, convert.layout_from_hf(config, layer_spec="te"))
    assert torch.equal(local["decoder.layers.1.input_layernorm.weight"], hf["model.layers.1.input_layernorm.weight"])
    assert torch.equal(
        local["decoder.layers.1.pre_mlp_layernorm.weight"], hf["model.layers.1.post_attention_layernorm.weight"]
    )
    # Transformer Engine's spec fuses each pre-norm into the linear that follows it.
    assert torch.equal(
        te["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"], hf["model.layers.1.input_layernorm.weight"]
    )
    assert torch.equal(
        te["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"], hf["model.layers.1.post_attention_layernorm.weight"]
    )
    assert "decoder.layers.1.input_layernorm.weight" not in te
    assert torch.equal(te["decoder.final_layernorm.weight"], hf["model.norm.weight"])


def _labelled(rows: int, label: float) -> torch.Tensor:
    """A [rows, 64] weight whose row r holds label + r / 1000, so every row names where it came from."""
    return (label + torch.arange(rows, dtype=torch.float32) / 1000)[:, None].expand(rows, 64).clone()


def test_qkv_rows_are_grouped_q_heads_then_k_then_v() -> None:
    config = tiny_config(kv_heads=2)  # 4 query heads of 16 dims over 2 groups: 2 q heads per group
    layout = convert.layout_from_hf(config)
    hf = _hf_state(config)
    hf["model.layers.0.self_attn.q_proj.weight"] = _labelled(64, 100.0)
    hf["model.layers.0.self_attn.k_proj.weight"] = _labelled(32, 200.0)
    hf["model.layers.0.self_attn.v_proj.weight"] = _labelled(32, 300.0)
    qkv = convert.hf_to_megatron(hf, layout)["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0]
    d = 16
    expected = torch.cat(
        [
            _labelled(64, 100.0)[: 2 * d, 0],
            _labelled(32, 200.0)[:d, 0],
            _labelled(32, 300.0)[:d, 0],  # group 0
            _labelled(64, 100.0)[2 * d :, 0],
            _labelled(32, 200.0)[d:, 0],
            _labelled(32, 300.0)[d:, 0],  # group 1
        ]
    )
    assert torch.equal(qkv, expected)
    # TP=2: rank r holds query group r whole (its q heads, its k, its v).
    shards = [
        convert.shard_tensor("decoder.layers.0.self_attention.linear_qkv.weight", qkv[:, None], r, 2) for r in range(2)
    ]
    assert torch.equal(shards[1][:, 0], expected[4 * d :])


def test_fc1_is_gate_then_up_and_each_rank_gets_its_slice_of_both() -> None:
    config = tiny_config()
    layout = convert.layout_from_hf(config, 2)
    hf = _hf_state(config)
    gate, up = _labelled(96, 1.0), _labelled(96, 2.0)
    hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"] = gate, up
    fc1 = convert.hf_to_megatron(hf, layout)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate, up]))
    for rank in range(2):
        shard = convert.hf_to_megatron_shard(hf, layout, rank, 2)["decoder.layers.0.mlp.linear_fc1.weight"]
        half = slice(48 * rank, 48 * (rank + 1))
        assert torch.equal(shard, torch.cat([gate[half], up[half]]))  # SwiGLU's chunk(2) on the rank


def test_row_and_column_parallel_shards() -> None:
    config = tiny_config(tied=False)
    layout = convert.layout_from_hf(config, 2)
    hf = _hf_state(config)
    shard = convert.hf_to_megatron_shard(hf, layout, 1, 2)
    assert torch.equal(
        shard["decoder.layers.0.self_attention.linear_proj.weight"],
        hf["model.layers.0.self_attn.o_proj.weight"][:, 32:],
    )
    assert torch.equal(
        shard["decoder.layers.0.mlp.linear_fc2.weight"], hf["model.layers.0.mlp.down_proj.weight"][:, 48:]
    )
    assert torch.equal(shard["decoder.final_layernorm.weight"], hf["model.norm.weight"])  # replicated
    # vocab 41 over 2 ranks: padded to 42, rank 1 holds rows 21..40 and the zero padding row.
    assert torch.equal(shard["output_layer.weight"][:20], hf["lm_head.weight"][21:])
    assert torch.equal(shard["output_layer.weight"][20], torch.zeros(64))
    assert torch.equal(shard["embedding.word_embeddings.weight"][:20], hf["model.embed_tokens.weight"][21:])


def test_vocabulary_padding() -> None:
    config = tiny_config(vocab=41)
    assert convert.layout_from_hf(config, 1).padded_vocab_size == 41
    assert convert.layout_from_hf(config, 2).padded_vocab_size == 42
    assert convert.layout_from_hf(config, 2, vocab_multiple=128).padded_vocab_size == 256


def test_adam_step_scalars_are_replicated() -> None:
    step = torch.tensor(3.0)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert torch.equal(convert.shard_tensor(name, step, 1, 2), step)
    assert torch.equal(convert.merge_tensor(name, [step, step]), step)


def test_unsupported_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="divisible"):
        convert.layout_from_hf(tiny_config(kv_heads=1), 2)  # one query group cannot be split whole
    biased = tiny_config()
    biased.attention_bias = True
    with pytest.raises(ValueError, match="bias"):
        convert.layout_from_hf(biased)
    scaled = tiny_config()
    scaled.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="RoPE"):
        convert.layout_from_hf(scaled)
