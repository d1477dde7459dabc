"""What the vLLM and TensorRT-LLM engines share to keep the torch engine's guarantees: the published weight file as
an engine loads it, per-sample seeds, the policy's EOS ids, and stop strings matched on decoded text.

The trainer publishes with safetensors' `save_model`, which keeps one name of each group of tied tensors. For a
policy with tied word embeddings (SmolLM2 and the tiny test model) that is `lm_head.weight`, while vLLM and
TensorRT-LLM load the embedding and tie the head to it: fed the file as it is, vLLM refuses it, and an engine that
does not check would keep its old embedding. `engine_names` puts the tensor back under the embedding's name.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from reinforce.generator.engines.base import SampledSequence

# Llama-family names (Llama, SmolLM2, Mistral, Qwen2): the families the project trains.
EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def engine_names(file_names: Collection[str], tie_word_embeddings: bool) -> dict[str, str]:
    """Map each tensor name of a weight file to the name the engine loads it under; unmapped names are skipped."""
    names = {name: name for name in file_names}
    if not tie_word_embeddings:
        return names
    if EMBEDDING not in names and LM_HEAD not in names:
        raise ValueError(f"a policy with tied word embeddings needs {EMBEDDING} or {LM_HEAD}; the file has neither")
    head = names.pop(LM_HEAD, None)
    if head is not None and EMBEDDING not in names:
        names[head] = EMBEDDING  # the file kept only the head's name for the shared tensor
    return names


def read_checkpoint(path: Path, tie_word_embeddings: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(engine name, tensor) for every tensor of a safetensors file, read lazily: one tensor in memory at a time."""
    with safe_open(str(path), framework="pt") as f:
        for file_name, name in engine_names(list(f.keys()), tie_word_embeddings).items():
            yield name, f.get_tensor(file_name)


def policy_files(policy_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face model folder (save_pretrained shards big models)."""
    index = policy_dir / "model.safetensors.index.json"
    if index.is_file():
        return [policy_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [policy_dir / "model.safetensors"]


def checkpoint_shapes(files: list[Path], tie_word_embeddings: bool) -> dict[str, tuple[int, ...]]:
    """Engine name -> shape of every tensor of the files, from their headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for file_name, name in engine_names(list(f.keys()), tie_word_embeddings).items():
                shapes[name] = tuple(f.get_slice(file_name).get_shape())
    return shapes


def check_fits(path: Path, expected: dict[str, tuple[int, ...]], tie_word_embeddings: bool) -> None:
    """Refuse a weight file whose names or shapes differ from the policy's, before any weight is touched."""
    found = checkpoint_shapes([path], tie_word_embeddings)
    if found == expected:
        return
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    reshaped = sorted(name for name in found.keys() & expected.keys() if found[name] != expected[name])
    raise ValueError(
        f"{path} does not fit the policy: missing {missing}, unexpected {unexpected}, other shapes {reshaped}"
    )


def sample_seeds(seed: int, num_samples: int) -> list[int]:
    """The seeds of a prompt's samples: a 56-bit hash of (seed, index).

    Engines seed sample i of an n-sample request with seed + i (vLLM) or leave it to the runtime; prompts whose
    seeds differ by less than k would then share draws. One request per sample with these seeds avoids both.
    """
    return [
        int.from_bytes(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=7).digest(), "big")
        for i in range(num_samples)
    ]


def eos_token_ids(policy_dir: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The EOS ids of a policy folder: the tokenizer's plus its generation config's."""
    if (policy_dir / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(policy_dir, local_files_only=True)
    else:
        generation = GenerationConfig.from_model_config(config)
    return merge_eos_ids(tokenizer, generation.eos_token_id)


def merge_eos_ids(tokenizer: PreTrainedTokenizerBase, configured: int | list[int] | None) -> set[int]:
    """The tokenizer's EOS plus any the generation config lists (chat models end turns with their own)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return ids


def stop_prefix(token_ids: list[int], decode: Callable[[list[int]], str], stop_strings: list[str]) -> int | None:
    """Length of the shortest prefix whose decoded text contains a stop string (the torch engine stops there)."""
    if not stop_strings:
        return None
    # Decode whole prefixes: a stop string may span tokens, and a byte-level token may complete a character only
    # together with the next one.
    return next(
        (n for n in range(1, len(token_ids) + 1) if any(s in decode(token_ids[:n]) for s in stop_strings)), None
    )


@dataclass(frozen=True)
class PerSampleRequests:
    """A batch as one request per sample, the samples of a prompt adjacent."""

    num_samples: int  # k
    prompts: list[list[int]]  # each prompt's token ids, k times
    seeds: list[int]  # each sample's own seed
    limits: list[int]  # each sample's max new tokens (its prompt's)

    def grouped(self, sequences: list[SampledSequence]) -> list[list[SampledSequence]]:
        """The engine's answers, one per request, as each prompt's k samples."""
        k = self.num_samples
        return [sequences[i : i + k] for i in range(0, len(sequences), k)]


def per_sample_requests(
    prompts: list[list[int]], seeds: list[int], num_samples: int, max_new_tokens: int | list[int], max_len: int
) -> PerSampleRequests:
    """Checked prompts (check_prompts) as one request per sample, each seeded by `sample_seeds`: an engine's n=k
    would seed sample i with seed + i, so prompts whose seeds differ by less than k would share draws.
    `max_new_tokens`: one limit for all, or each prompt's own."""
    limits = _limits(prompts, max_new_tokens)
    check_prompts(prompts, seeds, limits, max_len)
    return PerSampleRequests(
        num_samples,
        [list(p) for p in prompts for _ in range(num_samples)],
        [s for seed in seeds for s in sample_seeds(seed, num_samples)],
        [n for n in limits for _ in range(num_samples)],
    )


def check_prompts(prompts: list[list[int]], seeds: list[int], max_new_tokens: int | list[int], max_len: int) -> None:
    """What `sample` accepts: one seed per prompt, no empty prompt, prompt + response within the engine's length
    (`max_new_tokens`: one limit for all, or each prompt's own)."""
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("sample needs at least one prompt and no empty prompt")
    longest, new_tokens = max((len(p) + n, n) for p, n in zip(prompts, _limits(prompts, max_new_tokens), strict=True))
    if longest > max_len:
        raise ValueError(
            f"longest prompt ({longest - new_tokens} tokens) + max_new_tokens ({new_tokens}) exceeds the engine's "
            f"maximum sequence length ({max_len}); lower data.max_prompt_tokens or generation.max_new_tokens"
        )


def _limits(prompts: list[list[int]], max_new_tokens: int | list[int]) -> list[int]:
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * len(prompts)
    if len(max_new_tokens) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens limits")
    return list(max_new_tokens)
