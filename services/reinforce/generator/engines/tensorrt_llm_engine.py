"""The TensorRT-LLM engine (GPU): TensorRT-LLM's LLM API on its PyTorch backend, refitted in place over CUDA IPC.

NOT RUN. This has never run on a GPU, nor against an installed TensorRT-LLM: every `tensorrt_llm` release on PyPI is
a stub that fetches from NVIDIA's index, which this project's build machines cannot reach. It is written against
the LLM API as read in NVIDIA/TensorRT-LLM's sources (tensorrt_llm/llmapi/rlhf_utils.py, sampling_params.py,
examples/ray_orchestrator/rl_perf_repro.py, tests/unittest/llmapi/test_llm_update_weights.py; releases 1.1-1.3).
The parts that need no TensorRT-LLM (names, buckets, casts, request parameters, reading results) are plain
functions below, unit-tested on CPU; `tensorrt_llm` is imported only when the engine starts.

How the torch engine's guarantees are kept, and where they are not:

- Refit: the stock worker extension, `tensorrt_llm.llmapi.rlhf_utils.WorkerExtension` (`orchestrator_type="ray"`),
  as NeMo-RL and verl use it. `load_weights` checks the verified file against the policy's names and shapes, reads
  it in buckets of at most `refit_bucket_bytes`, casts each bucket to the engine's dtype on the GPU and passes
  CUDA IPC handles (`torch.multiprocessing.reductions.reduce_tensor`) to `update_weights`; `update_weights(None)`
  then runs the post-load processing and resets the prefix cache. Only handles cross to the workers (Ray serialises
  them; this module pickles nothing). The workers must see the generator's GPU (one GPU, tensor_parallel_size 1).
- Log-probs: TensorRT-LLM's `LogprobMode.PROCESSED` is the log_softmax after temperature and after top-k/top-p
  masking; `RAW` ignores the temperature. With temperature alone (the default spec) PROCESSED equals what the torch
  engine records. With top-k or top-p on, the recorded log-probs are those of the filtered, renormalised
  distribution: higher than the torch engine's unfiltered ones by -log(kept mass) at each step. (The vLLM engine
  patches its sampler to avoid this; TensorRT-LLM offers no such seam in its public API.)
- Seeds: one request per sample, seeded by `sample_seeds`; KV block reuse off (a reused prefix is prefilled
  differently, which can change bf16 logits), as vLLM's prefix caching is off.
- Ends: EOS ids are stop token ids with `end_id=-1` and `include_stop_str_in_output=True`, so the EOS token and its
  log-prob stay in the response, as the torch engine keeps them (the RL setting of rl_perf_repro.py).
  TensorRT-LLM matches stop strings as token sequences (their own tokenisation), the torch engine on decoded text:
  each response is also cut where its decoded text first contains a stop string (`to_sequence`), which gives the
  torch engine's answer whenever TensorRT-LLM stopped at or after that point.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from safetensors import safe_open
from transformers import AutoConfig, PreTrainedTokenizerBase

from reinforce.core.hardware import bfloat16_is_native
from reinforce.core.policy import load_tokenizer
from reinforce.core.spec import GenerationSpec
from reinforce.generator.engines.base import GenerationEngine, SampledSequence
from reinforce.generator.engines.common import (
    check_fits,
    checkpoint_shapes,
    engine_names,
    eos_token_ids,
    per_sample_requests,
    policy_files,
    stop_prefix,
)

if TYPE_CHECKING:
    from tensorrt_llm import LLM

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
REFIT_BUCKET_BYTES = 512 << 20  # GPU memory a refit holds at once beyond the engine's own weights


class TensorRTLLMEngine(GenerationEngine):
    """The policy served by TensorRT-LLM's `LLM` (PyTorch backend) on one GPU. Not run yet: see the module docstring."""

    name: ClassVar[str] = "tensorrt_llm"

    def __init__(
        self,
        policy_dir: Path,
        generation: GenerationSpec,
        num_samples: int,
        *,
        kv_cache_memory_fraction: float = 0.5,
        refit_bucket_bytes: int = REFIT_BUCKET_BYTES,
        max_seq_len: int | None = None,
    ) -> None:
        super().__init__(Path(policy_dir), generation, num_samples)
        self.dtype = generation.resolved_dtype(bfloat16_is_native("cuda"))
        self.refit_bucket_bytes = refit_bucket_bytes
        config = AutoConfig.from_pretrained(self.policy_dir, local_files_only=True)
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(self.policy_dir)
        self.eos_token_ids = eos_token_ids(self.policy_dir, config, self.tokenizer)
        self.pad_token_id = self.tokenizer.pad_token_id
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.max_seq_len = max_seq_len or config.max_position_embeddings
        self._shapes = checkpoint_shapes(policy_files(self.policy_dir), self.tie_word_embeddings)
        self._llm = _start_llm(self.policy_dir, self.dtype, self.max_seq_len, kv_cache_memory_fraction)

    def _sample(
        self, prompts: list[list[int]], seeds: list[int], k: int, generation: GenerationSpec, limits: list[int]
    ) -> list[list[SampledSequence]]:
        from tensorrt_llm.sampling_params import LogprobMode, SamplingParams

        batch = per_sample_requests(prompts, seeds, k, limits, self.max_seq_len)
        requests = [{"prompt_token_ids": p} for p in batch.prompts]
        params = []
        for seed, limit in zip(batch.seeds, batch.limits, strict=True):
            kwargs = sampling_kwargs(generation, seed, self.eos_token_ids, self.pad_token_id, limit)
            mode = LogprobMode.PROCESSED if kwargs.pop("processed_logprobs") else LogprobMode.RAW
            params.append(SamplingParams(**kwargs, logprobs_mode=mode))
        outputs = self._llm.generate(requests, sampling_params=params, use_tqdm=False)
        sequences = [
            to_sequence(
                list(out.outputs[0].token_ids),
                out.outputs[0].logprobs,
                out.outputs[0].finish_reason,
                self.tokenizer,
                generation.stop_strings,
            )
            for out in outputs
        ]
        return batch.grouped(sequences)

    def load_weights(self, path: Path) -> None:
        from tensorrt_llm._torch.utils import get_device_uuid  # what the worker extension keys handles by
        from torch.multiprocessing.reductions import reduce_tensor

        path = Path(path)
        check_fits(path, self._shapes, self.tie_word_embeddings)
        device = torch.cuda.current_device()
        uuid = get_device_uuid(device)
        dtype = DTYPES[self.dtype]
        with safe_open(str(path), framework="pt") as f:
            names = engine_names(list(f.keys()), self.tie_word_embeddings)
            sizes = [(name, math.prod(f.get_slice(name).get_shape()) * dtype.itemsize) for name in names]
            for bucket in bucket_by_bytes(sizes, self.refit_bucket_bytes):
                # The tensors must outlive the call: the workers map their memory through the handles.
                tensors = [(names[name], cast_for_engine(f.get_tensor(name).to(device), dtype)) for name in bucket]
                handles = [(name, reduce_tensor(tensor)) for name, tensor in tensors]
                self._llm._collective_rpc("update_weights", ({uuid: handles},))
                del tensors, handles
        self._llm._collective_rpc("update_weights", (None,))  # finalise: post-load processing, prefix cache reset


def _start_llm(policy_dir: Path, dtype: str, max_seq_len: int, kv_cache_memory_fraction: float) -> LLM:
    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi import KvCacheConfig

    return LLM(
        model=str(policy_dir),
        backend="pytorch",
        dtype=dtype,
        max_seq_len=max_seq_len,
        tensor_parallel_size=1,
        kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=kv_cache_memory_fraction, enable_block_reuse=False),
        sampler_type="TorchSampler",  # per-request seeds and processed log-probs
        orchestrator_type="ray",  # required for ray_worker_extension_cls
        ray_worker_extension_cls="tensorrt_llm.llmapi.rlhf_utils.WorkerExtension",
    )


def bucket_by_bytes(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Consecutive groups of names whose sizes add up to at most max_bytes; a bigger tensor gets a group alone.

    File order is kept: a layer's tensors tend to be neighbours, and engines process a layer once all of its
    tensors have arrived, so keeping them together bounds the memory held for half-loaded layers.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    buckets: list[list[str]] = []
    used = 0
    for name, size in sizes:
        if not buckets or used + size > max_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(name)
        used += size
    return buckets


def cast_for_engine(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating-point tensors in the engine's dtype (the trainer publishes in generation.dtype already; a file written
    another way may differ); integer tensors as they are."""
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def sampling_kwargs(
    generation: GenerationSpec, seed: int, eos_ids: set[int], pad_id: int | None, max_tokens: int | None = None
) -> dict[str, Any]:
    """Keyword arguments of one sample's `tensorrt_llm.SamplingParams`, plus `processed_logprobs` (bool): whether
    to ask for `LogprobMode.PROCESSED` (temperature, top-k or top-p change the distribution) or `RAW`.
    `max_tokens`: this sample's limit (default generation.max_new_tokens)."""
    return {
        "n": 1,
        "seed": seed,
        "temperature": generation.temperature,
        "top_k": generation.top_k or None,  # None: off (0 is off in GenerationSpec)
        "top_p": generation.top_p if generation.top_p < 1.0 else None,
        "max_tokens": generation.max_new_tokens if max_tokens is None else max_tokens,
        "end_id": -1,  # EOS is a stop token instead, so that it stays in the response
        "pad_id": pad_id,
        "stop_token_ids": sorted(eos_ids),
        "stop": list(generation.stop_strings) or None,
        "include_stop_str_in_output": True,
        "detokenize": False,  # the text is decoded from the kept token ids, as the torch engine does
        "logprobs": 0,  # the sampled token's only
        "processed_logprobs": generation.temperature != 1.0 or generation.top_k > 0 or generation.top_p < 1.0,
    }


def sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The sampled tokens' log-probs from a CompletionOutput's `logprobs`: a list with, per token, a float or a
    {token id: Logprob} dict (both shapes exist across TensorRT-LLM versions)."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError(
            f"TensorRT-LLM returned log-probs for {0 if logprobs is None else len(logprobs)} of {len(token_ids)} tokens"
        )
    values = []
    for token, entry in zip(token_ids, logprobs, strict=True):
        values.append(float(entry) if isinstance(entry, int | float) else float(entry[token].logprob))
    return values


def to_sequence(
    token_ids: list[int],
    logprobs: Any,
    finish_reason: str | None,
    tokenizer: PreTrainedTokenizerBase,
    stop_strings: list[str],
) -> SampledSequence:
    """A SampledSequence, cut after the first token whose decoded response contains a stop string."""
    values = sampled_logprobs(token_ids, logprobs)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    cut = stop_prefix(token_ids, decode, stop_strings)
    if cut is not None:
        token_ids, values = token_ids[:cut], values[:cut]
    return SampledSequence(
        token_ids=token_ids, logprobs=values, is_end=cut is not None or finish_reason == "stop", text=decode(token_ids)
    )
