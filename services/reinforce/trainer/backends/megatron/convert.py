"""Hugging Face Llama <-> Megatron-core GPTModel: configs and state dicts, unsharded and per tensor-parallel rank.

Name and layout map (layer i; "full" means the unsharded TP=1 form):

    HF LlamaForCausalLM                       Megatron-core GPTModel
    model.embed_tokens.weight [V, h]          embedding.word_embeddings.weight [Vp, h]   vocab rows, padded to Vp
    model.layers.i.input_layernorm.weight     decoder.layers.i.input_layernorm.weight                    (local spec)
                                              decoder.layers.i.self_attention.linear_qkv.layer_norm_weight  (TE spec)
    q_proj [n*d, h], k_proj, v_proj [g*d, h]  decoder.layers.i.self_attention.linear_qkv.weight [g*(n/g+2)*d, h]
                                              rows per query group j: [q heads of group j..., k_j, v_j]
    o_proj [h, n*d]                           decoder.layers.i.self_attention.linear_proj.weight
    post_attention_layernorm.weight           decoder.layers.i.pre_mlp_layernorm.weight                  (local spec)
                                              decoder.layers.i.mlp.linear_fc1.layer_norm_weight          (TE spec)
    gate_proj, up_proj [f, h]                 decoder.layers.i.mlp.linear_fc1.weight [2f, h] = [gate; up]
    down_proj [h, f]                          decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                         decoder.final_layernorm.weight
    lm_head.weight (absent when tied)         output_layer.weight [Vp, h] (absent when tied: the embedding is used)

Tensor-parallel shards (rank r of t): the embedding, output layer and linear_qkv are split along rows (the
grouped QKV layout makes each rank hold whole query groups: its q heads with their k and v); linear_fc1 gives
each rank its slice of gate *and* its slice of up, [gate_r; up_r] (what SwiGLU's chunk(2) on that rank needs;
this is Megatron's stride-2 partition); linear_proj and linear_fc2 are split along columns; norms are replicated.
The same functions shard anything shaped like the parameters, Adam's moments included.

Every conversion only slices, views and concatenates, so a round trip is bit-exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import LlamaConfig

StateDict = dict[str, Tensor]
LayerSpec = Literal["local", "te"]

# Megatron's fused kernels need CUDA (and Apex or Transformer Engine); these settings use the plain torch paths,
# which give the same results. The local spec also refuses persist_layer_norm (torch.nn.RMSNorm has none).
CPU_SAFE_CONFIG: dict[str, bool] = {
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "gradient_accumulation_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
}

# training.gradient_checkpointing: Megatron's full recompute of every transformer layer, one at a time: only each
# layer's input is kept through the forward (Megatron's checkpoint replays the RNG tracker, on CPU through the shim).
FULL_RECOMPUTE: dict[str, str | int] = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}


@dataclass(frozen=True)
class LlamaLayout:
    """The shapes that decide how tensors are split, merged and renamed."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int  # the tokenizer's / HF model's
    padded_vocab_size: int  # Megatron's embedding rows: a multiple of tensor_parallel_size * vocab_multiple
    tied_embeddings: bool
    layer_spec: LayerSpec = "local"  # "te" fuses each pre-norm into the following linear's module

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups

    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        """Raise unless every split tensor divides evenly over `tensor_parallel_size` ranks."""
        t = tensor_parallel_size
        problems = [
            f"{name} {value} is not divisible by tensor_parallel_size {t}"
            for name, value in (
                ("num_attention_heads", self.num_heads),
                # Megatron can split a query group over ranks (t > groups), but then a rank holds parts of k/v
                # it shares with another; we keep whole groups per rank, which covers the usual configs.
                ("num_key_value_heads", self.num_query_groups),
                ("intermediate_size", self.ffn_hidden_size),
                ("padded vocabulary", self.padded_vocab_size),
            )
            if value % t
        ]
        if problems:
            raise ValueError("; ".join(problems))


def _rope_theta(config: LlamaConfig) -> float:
    # transformers 5 keeps RoPE settings in rope_parameters; 4.x had rope_theta and rope_scaling attributes.
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    legacy_scaling = getattr(config, "rope_scaling", None)
    if rope_type != "default" or (legacy_scaling and legacy_scaling.get("rope_type", "default") != "default"):
        # Megatron's rope_scaling is Llama-3.1's with fixed factors; mapping HF's variants is not done yet.
        raise ValueError(f"only the default RoPE is supported, not {rope_type!r} / {legacy_scaling!r}")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the config names no rope_theta")
    return float(theta)


def layout_from_hf(
    config: LlamaConfig,
    tensor_parallel_size: int = 1,
    *,
    vocab_multiple: int = 1,
    layer_spec: LayerSpec = "local",
) -> LlamaLayout:
    """The layout of `config` on `tensor_parallel_size` ranks; raises on features the converter does not map.

    The vocabulary is padded to a multiple of `tensor_parallel_size * vocab_multiple` (Megatron-LM pads to
    128 * t for fast GEMMs; 1 keeps the padding, and the log-softmax masking it needs, minimal).
    """
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("Llama configs with attention_bias or mlp_bias are not supported (Megatron: add_bias_linear)")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r}: only SwiGLU (silu) is mapped")
    _rope_theta(config)  # validates the RoPE variant
    heads = config.num_attention_heads
    groups = config.num_key_value_heads or heads
    if heads % groups:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    multiple = tensor_parallel_size * vocab_multiple
    layout = LlamaLayout(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        padded_vocab_size=math.ceil(config.vocab_size / multiple) * multiple,
        tied_embeddings=bool(config.tie_word_embeddings),
        layer_spec=layer_spec,
    )
    layout.check_tensor_parallel(tensor_parallel_size)
    return layout


# ---- configs and models ----------------------------------------------------------------------------------


def transformer_config_from_hf(
    config: LlamaConfig,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool | None = None,
    perform_initialization: bool = False,
    **overrides: Any,
) -> Any:
    """A megatron.core TransformerConfig equal in architecture to the HF Llama `config`.

    `perform_initialization=False` by default: the weights are about to be loaded from the HF model, and the
    random init of a 100M+ model costs seconds. `use_cpu_initialization` defaults to "no CUDA here".
    `overrides` are passed to TransformerConfig as they are (recompute, sequence_parallel, fusions on GPU...).
    """
    from megatron.core.transformer import TransformerConfig

    layout = layout_from_hf(config, tensor_parallel_size)
    on_cpu = not torch.cuda.is_available()
    kwargs: dict[str, Any] = {
        "num_layers": layout.num_layers,
        "hidden_size": layout.hidden_size,
        "ffn_hidden_size": layout.ffn_hidden_size,
        "num_attention_heads": layout.num_heads,
        "num_query_groups": layout.num_query_groups,
        "kv_channels": layout.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(config.rms_norm_eps),
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        # HF Llama's attention_dropout is 0 in every released config; the residual path has none at all.
        "hidden_dropout": 0.0,
        "attention_dropout": float(getattr(config, "attention_dropout", 0.0) or 0.0),
        "init_method_std": float(config.initializer_range),
        "tensor_model_parallel_size": tensor_parallel_size,
        "pipeline_model_parallel_size": pipeline_parallel_size,
        "params_dtype": params_dtype,
        # The dtype of activations sent between pipeline stages; Megatron requires it once PP > 1.
        "pipeline_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
        "fp16": params_dtype == torch.float16,
        "use_cpu_initialization": on_cpu if use_cpu_initialization is None else use_cpu_initialization,
        "perform_initialization": perform_initialization,
        **(CPU_SAFE_CONFIG if on_cpu else {}),
    }
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(
    config: LlamaConfig,
    transformer_config: Any,
    *,
    layout: LlamaLayout | None = None,
    pre_process: bool = True,
    post_process: bool = True,
) -> Any:
    """A GPTModel (this rank's shard) shaped like `config`; megatron's parallel state must be initialised.

    The returned model carries `unpadded_vocab_size` (the HF vocabulary): log-probs must ignore the padded rows;
    and `padding_idx` (the HF config's pad_token_id).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    layout = layout or layout_from_hf(config, transformer_config.tensor_model_parallel_size)
    if layout.layer_spec == "te":
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(
        config=transformer_config,
        transformer_layer_spec=spec,
        vocab_size=layout.padded_vocab_size,
        max_sequence_length=config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,  # vocab-parallel logits stay sharded; the log-prob code reduces across ranks
        share_embeddings_and_output_weights=layout.tied_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=_rope_theta(config),  # type: ignore[arg-type]  # annotated int; used as a float base
    )
    model.unpadded_vocab_size = layout.vocab_size
    model.padding_idx = config.pad_token_id  # HF's embedding passes no gradient through lookups of it
    _mark_tensor_parallel(model)
    return model


def _mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Give every split parameter Megatron's tensor-parallel attributes, which its layers skip setting when
    perform_initialization is False (megatron-core 0.16.1). Without them a grad-norm or optimizer that asks
    `param_is_not_tensor_parallel_duplicate` counts split weights on TP rank 0 only.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        kind = partition_of(name)
        if kind == "replicated" or getattr(param, "tensor_model_parallel", False):
            continue
        for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(param, attribute):  # defaults (not parallel) some layers set; replace them
                delattr(param, attribute)
        set_tensor_model_parallel_attributes(
            param, is_parallel=True, dim=1 if kind == "columns" else 0, stride=2 if kind == "gated_rows" else 1
        )


# ---- HF <-> Megatron (full, unsharded) --------------------------------------------------------------------


def _norm_keys(layout: LlamaLayout, i: int) -> tuple[str, str]:
    prefix = f"decoder.layers.{i}."
    if layout.layer_spec == "te":
        return prefix + "self_attention.linear_qkv.layer_norm_weight", prefix + "mlp.linear_fc1.layer_norm_weight"
    return prefix + "input_layernorm.weight", prefix + "pre_mlp_layernorm.weight"


def _pad_rows(weight: Tensor, rows: int) -> Tensor:
    if weight.shape[0] == rows:
        return weight.clone()
    out = weight.new_zeros((rows, *weight.shape[1:]))
    out[: weight.shape[0]] = weight
    return out


def hf_to_megatron(hf: Mapping[str, Tensor], layout: LlamaLayout) -> StateDict:
    """An HF Llama state dict -> the full (TP=1) Megatron GPTModel state dict (tensors only)."""
    g, rep, d, h = layout.num_query_groups, layout.heads_per_group, layout.head_dim, layout.hidden_size
    embedding = _pad_rows(hf["model.embed_tokens.weight"], layout.padded_vocab_size)
    out: StateDict = {"embedding.word_embeddings.weight": embedding}
    for i in range(layout.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf[src + "self_attn.q_proj.weight"].reshape(g, rep * d, h)
        k = hf[src + "self_attn.k_proj.weight"].reshape(g, d, h)
        v = hf[src + "self_attn.v_proj.weight"].reshape(g, d, h)
        out[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(g * (rep + 2) * d, h)
        out[dst + "self_attention.linear_proj.weight"] = hf[src + "self_attn.o_proj.weight"].clone()
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]], dim=0
        )
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"].clone()
        attn_norm, mlp_norm = _norm_keys(layout, i)
        out[attn_norm] = hf[src + "input_layernorm.weight"].clone()
        out[mlp_norm] = hf[src + "post_attention_layernorm.weight"].clone()
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    if not layout.tied_embeddings:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], layout.padded_vocab_size)
    return out


def megatron_to_hf(mg: Mapping[str, Tensor], layout: LlamaLayout, *, include_tied_lm_head: bool = False) -> StateDict:
    """The full Megatron state dict -> an HF Llama state dict.

    With tied embeddings lm_head.weight is left out (as save_pretrained writes it) unless
    `include_tied_lm_head`, which adds it as the same tensor as the embedding (for a strict load_state_dict).
    """
    g, rep, d, h = layout.num_query_groups, layout.heads_per_group, layout.head_dim, layout.hidden_size
    f, vocab = layout.ffn_hidden_size, layout.vocab_size
    out: StateDict = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"][:vocab].clone()}
    for i in range(layout.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = mg[src + "self_attention.linear_qkv.weight"].reshape(g, (rep + 2) * d, h)
        q, k, v = torch.split(qkv, [rep * d, d, d], dim=1)
        out[dst + "self_attn.q_proj.weight"] = q.reshape(g * rep * d, h).clone()
        out[dst + "self_attn.k_proj.weight"] = k.reshape(g * d, h).clone()
        out[dst + "self_attn.v_proj.weight"] = v.reshape(g * d, h).clone()
        out[dst + "self_attn.o_proj.weight"] = mg[src + "self_attention.linear_proj.weight"].clone()
        gate, up = torch.split(mg[src + "mlp.linear_fc1.weight"], [f, f], dim=0)
        out[dst + "mlp.gate_proj.weight"] = gate.clone()
        out[dst + "mlp.up_proj.weight"] = up.clone()
        out[dst + "mlp.down_proj.weight"] = mg[src + "mlp.linear_fc2.weight"].clone()
        attn_norm, mlp_norm = _norm_keys(layout, i)
        out[dst + "input_layernorm.weight"] = mg[attn_norm].clone()
        out[dst + "post_attention_layernorm.weight"] = mg[mlp_norm].clone()
    out["model.norm.weight"] = mg["decoder.final_layernorm.weight"].clone()
    if not layout.tied_embeddings:
        out["lm_head.weight"] = mg["output_layer.weight"][:vocab].clone()
    elif include_tied_lm_head:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# ---- tensor-parallel sharding -----------------------------------------------------------------------------

_ROW_SPLIT = ("embedding.word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight")
_COLUMN_SPLIT = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_GATED = "mlp.linear_fc1.weight"


def partition_of(name: str) -> Literal["rows", "columns", "gated_rows", "replicated"]:
    """How tensor `name` of the GPTModel is split over tensor-parallel ranks."""
    if name.endswith(_GATED):
        return "gated_rows"
    if name.endswith(_ROW_SPLIT):
        return "rows"
    if name.endswith(_COLUMN_SPLIT):
        return "columns"
    return "replicated"  # norms (incl. TE's fused layer_norm_weight) and scalars such as Adam's step


def shard_tensor(name: str, full: Tensor, rank: int, world: int) -> Tensor:
    """Rank `rank`'s shard of the full tensor `name` (a new tensor, contiguous)."""
    kind = partition_of(name) if full.dim() else "replicated"  # 0-d: a per-parameter scalar (Adam's step)
    if kind == "rows":
        return full.chunk(world, dim=0)[rank].clone()
    if kind == "columns":
        return full.chunk(world, dim=1)[rank].clone()
    if kind == "gated_rows":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(world, dim=0)[rank], up.chunk(world, dim=0)[rank]], dim=0)
    return full.clone()


def merge_tensor(name: str, shards: Sequence[Tensor]) -> Tensor:
    """The full tensor `name` from every rank's shard, in rank order (inverse of :func:`shard_tensor`)."""
    kind = partition_of(name) if shards[0].dim() else "replicated"
    if kind == "rows":
        return torch.cat(list(shards), dim=0)
    if kind == "columns":
        return torch.cat(list(shards), dim=1)
    if kind == "gated_rows":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return shards[0].clone()


def shard_state_dict(full: Mapping[str, Tensor], rank: int, world: int) -> StateDict:
    """One rank's Megatron state dict from the full one."""
    return {name: shard_tensor(name, tensor, rank, world) for name, tensor in full.items()}


def merge_state_dicts(shards: Sequence[Mapping[str, Tensor]]) -> StateDict:
    """The full Megatron state dict from every tensor-parallel rank's, in rank order."""
    return {name: merge_tensor(name, [s[name] for s in shards]) for name in shards[0]}


def hf_to_megatron_shard(hf: Mapping[str, Tensor], layout: LlamaLayout, rank: int, world: int) -> StateDict:
    """HF state dict -> tensor-parallel rank `rank`'s Megatron state dict."""
    layout.check_tensor_parallel(world)
    return shard_state_dict(hf_to_megatron(hf, layout), rank, world)


def megatron_shards_to_hf(shards: Sequence[Mapping[str, Tensor]], layout: LlamaLayout) -> StateDict:
    """Every tensor-parallel rank's Megatron state dict, in rank order -> one HF state dict."""
    return megatron_to_hf(merge_state_dicts(shards), layout)


def hf_parameter_count(layout: LlamaLayout) -> int:
    """Parameters of the HF model (tied weights once), for checking a built GPTModel against."""
    h, f, d = layout.hidden_size, layout.ffn_hidden_size, layout.head_dim
    attention = h * layout.num_heads * d * 2 + h * layout.num_query_groups * d * 2
    per_layer = attention + 3 * h * f + 2 * h
    heads = 1 if layout.tied_embeddings else 2
    return layout.num_layers * per_layer + heads * layout.vocab_size * h + h
