"""The vLLM engine: vLLM's continuous-batching sampler, with each sampled token's log-prob, refitted in place.

What it keeps of the torch engine's guarantees (torch_engine.py), and how:

- Log-probs are float32 log_softmax(logits / temperature) of the unfiltered distribution, what the trainer
  recomputes. vLLM's engine option `logprobs_mode="processed_logprobs"` (0.32) gives log_softmax after temperature
  but also after top-k/top-p masking (the filtered, renormalised distribution); its default, "raw_logprobs",
  ignores the temperature. `VLLMWorkerExtension.record_unfiltered_logprobs` makes the processed log-probs those of
  the temperature-scaled logits before the top-k/top-p mask, so all settings record what the torch engine records.
- A prompt's samples depend only on (weights, prompt, seed): each sample is one request, seeded from the prompt's
  seed and the sample's index by `sample_seeds`. Prefix caching is off, because a cached prompt is prefilled with a
  shorter query and its bf16 logits round differently; chunked prefill is off, because where a prompt is cut
  would depend on what else is in the batch. Decoding rows of a batch do not interact on this CPU backend (the
  tests check that a prompt samples the same tokens alone and in a batch).
- A response ends after (and includes) a stop string or an EOS token: `include_stop_str_in_output`, and the
  stop token ids are the EOS ids the torch engine uses. `is_end` is vLLM's finish reason "stop" ("length" when
  max_new_tokens cut it). The text is decoded from the token ids with the policy's Hugging Face tokenizer, as the
  torch engine does, not taken from vLLM (which cuts it inside a token that runs past the stop string).

The weights are in generation.dtype (auto: bfloat16 on bfloat16 hardware, about twice float32's speed there, and
float32 elsewhere: core/hardware.py; the log-prob mismatch to the trainer's float32 recomputation is reported by the
tests and benchmarks/engines.py), in eager mode (torch.compile costs minutes to start and gained nothing here).
vLLM's CPU attention supports head sizes 32, 64, 80, 96, 112, 128, ... only, so a tiny test model needs hidden_size
/ num_heads >= 32 (e.g. hidden 32, one head).

Refit: the worker's `reload_weights` with the file's tensors (vLLM 0.32's in-place reload; its plain `load_weights`
fails after the first load). On CPU that reload leaves a tied LM head multiplying with a stale packed copy of the
old embedding, so `reload_safetensors` packs the head again (the tests compare refits with fresh engines).

LoRA (training.lora): a weight version holds only the adapters (core/lora.py). The engine then starts with vLLM's LoRA
support on (one adapter slot, max_lora_rank the smallest vLLM allows at or above training.lora.rank) and never
changes its base weights: each version is written beside the file as a PEFT adapter folder, loaded as a new
`LoRARequest` (a new adapter id each load), and the previous adapter is removed, so one adapter is held at a time.
Every request carries the current adapter; version 0 is the base alone. vLLM applies B @ A beside each adapted layer
(nothing is merged), in the engine's dtype.

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): no engine-core subprocess, nothing serialised, and
`collective_rpc` calls the worker directly. Keep one live engine per process: releasing one tears down vLLM's
process-wide distributed state, which any other live engine uses.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase

from reinforce.core.hardware import bfloat16_is_native
from reinforce.core.lora import LORA_FORMAT, adapted_modules, adapter_rank, peft_config, read_lora_version
from reinforce.core.policy import load_tokenizer
from reinforce.core.spec import GenerationSpec, LoraSpec
from reinforce.generator.engines.base import GenerationEngine, SampledSequence
from reinforce.generator.engines.common import (
    check_fits,
    checkpoint_shapes,
    eos_token_ids,
    per_sample_requests,
    policy_files,
    read_checkpoint,
)

if TYPE_CHECKING:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput

# Prompt tokens per sequence assumed when sizing the KV cache (DataSpec.max_prompt_tokens' default); longer
# prompts still run, vLLM then preempts and recomputes sequences when the cache is full.
KV_PROMPT_TOKENS = 128
# vLLM holds one KV block back (its null block); blocks are 128 tokens on CPU.
KV_BLOCK_TOKENS = 128
_DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
# The values vLLM 0.32 accepts for max_lora_rank (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VLLMEngine(GenerationEngine):
    """The policy served by an in-process vLLM `LLM`, in generation.dtype, eager."""

    name: ClassVar[str] = "vllm"

    def __init__(
        self,
        policy_dir: Path,
        generation: GenerationSpec,
        num_samples: int,
        *,
        threads: int | None = None,
        kv_cache_bytes: int | None = None,
        max_model_len: int | None = None,
        lora: LoraSpec | None = None,
    ) -> None:
        """`threads`: OpenMP threads (default: OMP_NUM_THREADS if set, else the CPUs this process may run on).

        `kv_cache_bytes` (default: room for batch_prompts x num_samples sequences of KV_PROMPT_TOKENS +
        max_new_tokens, and at least one of max_model_len) is overridden by vLLM's own VLLM_CPU_KVCACHE_SPACE (GiB)
        when that is set. `max_model_len` defaults to the model's max_position_embeddings. `lora`: the run's
        training.lora; the engine then loads LoRA weight versions as adapters (and only those).
        """
        super().__init__(Path(policy_dir), generation, num_samples)
        self.threads = _configure_threads(threads)
        dtype = generation.resolved_dtype(bfloat16_is_native())
        config = AutoConfig.from_pretrained(self.policy_dir, local_files_only=True)
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(self.policy_dir)
        self.eos_token_ids = eos_token_ids(self.policy_dir, config, self.tokenizer)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.max_model_len = max_model_len or config.max_position_embeddings
        self._shapes = checkpoint_shapes(policy_files(self.policy_dir), self.tie_word_embeddings)
        if kv_cache_bytes is None:
            sequences = generation.batch_prompts * num_samples
            tokens = max(self.max_model_len, sequences * (KV_PROMPT_TOKENS + generation.max_new_tokens))
            tokens += KV_BLOCK_TOKENS
            kv_cache_bytes = tokens * _kv_bytes_per_token(config, dtype)
        self.max_lora_rank = None if lora is None else max_lora_rank(lora.rank)
        self.lora_targets = () if lora is None else tuple(lora.target_modules)
        self._lora: LoRARequest | None = None  # the adapter every request carries; None: the base weights
        self._lora_loads = 0  # adapter ids: one per load, so that vLLM never mistakes a new version for a cached one
        with _dropping(ExpectedLoadWarnings(narrowed_to=getattr(torch, dtype))):
            self._llm = _start_llm(
                self.policy_dir, dtype, self.max_model_len, kv_cache_bytes, config, self.max_lora_rank
            )
        self._llm.collective_rpc("record_unfiltered_logprobs")

    def _sample(
        self, prompts: list[list[int]], seeds: list[int], k: int, generation: GenerationSpec, limits: list[int]
    ) -> list[list[SampledSequence]]:
        from vllm.inputs import TokensPrompt

        batch = per_sample_requests(prompts, seeds, k, limits, self.max_model_len)
        requests = [TokensPrompt(prompt_token_ids=p) for p in batch.prompts]
        params = [self._sampling_params(s, generation, n) for s, n in zip(batch.seeds, batch.limits, strict=True)]
        outputs = self._llm.generate(requests, params, use_tqdm=False, lora_request=self._lora)
        return batch.grouped([self._sequence(out.outputs[0]) for out in outputs])

    def load_weights(self, path: Path) -> None:
        """Refit in place: a whole-policy file into the weights, a LoRA version as the adapter. The file is checked
        against the policy's names and shapes first: a file that does not fit is refused before anything changes, so
        the previous version keeps serving."""
        path = Path(path)
        with safe_open(str(path), framework="pt") as f:
            is_lora = (f.metadata() or {}).get("format") == LORA_FORMAT
        if (self.max_lora_rank is not None) != is_lora:
            kind = "a LoRA" if is_lora else "a whole-policy"
            started = "with LoRA (training.lora)" if self.max_lora_rank is not None else "without LoRA"
            raise ValueError(f"{path}: {kind} weight version, but the engine started {started}")
        if is_lora:
            self._load_adapter(path)
            return
        check_fits(path, self._shapes, self.tie_word_embeddings)
        self._llm.collective_rpc("reload_safetensors", args=(str(path), self.tie_word_embeddings))

    def _load_adapter(self, path: Path) -> None:
        """Load a LoRA version as a new adapter, then remove the previous one."""
        from vllm.lora.request import LoRARequest

        shapes, scaling = self._check_adapter(path)
        self._lora_loads += 1
        # vLLM reads an adapter from a PEFT folder, and reads it whole when it is added: the folder lives only
        # until then. The tensors are linked, not copied (the file's own names are ones vLLM parses).
        folder = Path(tempfile.mkdtemp(prefix=f"lora-{self._lora_loads}-"))
        try:
            (folder / "adapter_config.json").write_text(json.dumps(peft_config(shapes, scaling)))
            (folder / "adapter_model.safetensors").symlink_to(path.resolve())
            request = LoRARequest(f"{path.name}#{self._lora_loads}", self._lora_loads, str(folder))
            if not self._llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not add the adapter of {path}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        previous, self._lora = self._lora, request
        if previous is not None:
            self._llm.llm_engine.remove_lora(previous.lora_int_id)

    def _check_adapter(self, path: Path) -> tuple[dict[str, tuple[int, ...]], float]:
        """(tensor name -> shape, scaling) of a LoRA version that fits the policy: each adapted module is a weight of
        the policy, A is [r, in] and B [out, r] of it, and r is at most the engine's max_lora_rank."""
        # its numbers and modules first: finite, no update past float32, only the modules the run adapts
        adapters, scaling = read_lora_version(path, self.lora_targets)
        shapes = {name: tuple(tensor.shape) for name, tensor in adapters.items()}
        rank = adapter_rank(shapes)
        if rank > (self.max_lora_rank or 0):
            raise ValueError(f"{path}: LoRA rank {rank} above the engine's max_lora_rank {self.max_lora_rank}")
        modules = adapted_modules(shapes)
        if not modules or len(shapes) != 2 * len(modules):
            raise ValueError(f"{path}: a LoRA version holds lora_A and lora_B of each adapted module, and only those")
        for module in modules:
            weight = self._shapes.get(f"{module}.weight")
            a, b = shapes.get(f"{module}.lora_A.weight"), shapes.get(f"{module}.lora_B.weight")
            if weight is None or len(weight) != 2 or a != (rank, weight[1]) or b != (weight[0], rank):
                raise ValueError(
                    f"{path} does not fit the policy: adapter of {module!r}, A {a}, B {b}, weight {weight}"
                )
        return shapes, scaling

    def _sampling_params(self, seed: int, gen: GenerationSpec, max_tokens: int) -> SamplingParams:
        from vllm import SamplingParams

        return SamplingParams(
            seed=seed,
            temperature=gen.temperature,  # 0: greedy
            top_p=gen.top_p,
            top_k=gen.top_k,  # 0: off, as in GenerationSpec
            max_tokens=max_tokens,
            stop=list(gen.stop_strings) or None,
            include_stop_str_in_output=True,
            stop_token_ids=sorted(self.eos_token_ids),
            logprobs=0,  # only the sampled token's
            flat_logprobs=True,  # a few flat lists per sequence instead of a dict per token
        )

    def _sequence(self, completion: CompletionOutput) -> SampledSequence:
        ids = list(completion.token_ids)
        flat = completion.logprobs
        if flat is None or len(flat.start_indices) != len(ids):
            raise RuntimeError(f"vLLM returned log-probs for {0 if flat is None else len(flat)} of {len(ids)} tokens")
        # With logprobs=0 each position holds exactly the sampled token's entry.
        return SampledSequence(
            token_ids=ids,
            logprobs=[flat.logprobs[start] for start in flat.start_indices],
            is_end=completion.finish_reason == "stop",
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
        )


class VLLMWorkerExtension:
    """Methods vLLM mixes into its worker (`LLM(worker_extension_cls=...)`), called by name with `collective_rpc`.

    Only names and plain arguments (a path, a flag) cross the call, so this also works, unchanged and without
    pickling tensors, if the engine core ever runs in its own process.
    """

    model_runner: Any  # the worker's, set by vLLM
    reload_weights: Any  # the worker's method

    def record_unfiltered_logprobs(self) -> None:
        """Make processed log-probs log_softmax(logits / temperature) before top-k/top-p, like the torch engine."""
        from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

        sampler = self.model_runner.sampler
        topk_topp = getattr(sampler, "topk_topp_sampler", None)
        # Refuse rather than silently record filtered log-probs if vLLM's sampler is not the one this was written for.
        if not isinstance(topk_topp, TopKTopPSampler) or sampler.logprobs_mode != "processed_logprobs":
            raise RuntimeError("vLLM's sampler is not the TopKTopPSampler in processed_logprobs mode of vLLM 0.32")
        filtered = topk_topp.forward

        def forward(
            logits: torch.Tensor,
            generators: dict[int, torch.Generator],
            k: torch.Tensor | None,
            p: torch.Tensor | None,
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            if k is None and p is None:  # nothing is masked: vLLM's own log-probs are already the unfiltered ones
                return filtered(logits, generators, k, p)
            # Before the call: the top-k/top-p mask is applied to `logits` in place.
            unfiltered = logits.log_softmax(dim=-1, dtype=torch.float32)
            sampled, _ = filtered(logits, generators, k, p)
            return sampled, unfiltered

        topk_topp.forward = forward

    def reload_safetensors(self, path: str, tie_word_embeddings: bool) -> None:
        """Load a whole-policy safetensors file (Hugging Face names) into the running model, in place."""
        model = self.model_runner.get_model()
        dtypes = {name: param.dtype for name, param in model.named_parameters()}
        weightless = frozenset({"RotaryEmbedding", "ParallelLMHead"} if tie_word_embeddings else {"RotaryEmbedding"})
        with _dropping(ExpectedLoadWarnings(weightless=weightless)):
            self.reload_weights(weights_iterator=_cast(read_checkpoint(Path(path), tie_word_embeddings), dtypes))
        lm_head = getattr(model, "lm_head", None)
        if tie_word_embeddings and lm_head is not None:
            # On CPU the head multiplies with its own packed copy of the embedding, made after loading. vLLM's
            # reload refreshes the embedding but skips the tied head ("ParallelLMHead: Failed to load weights"), so
            # the logits would keep the old embedding: pack the head again.
            lm_head.quant_method.process_weights_after_loading(lm_head)


def _cast(
    weights: Iterator[tuple[str, torch.Tensor]], dtypes: dict[str, torch.dtype]
) -> Iterator[tuple[str, torch.Tensor]]:
    # Tensors that vLLM loads under their own name are cast to the parameter's dtype here, which vLLM would
    # otherwise do with a warning per tensor on every refit; fused ones (q/k/v, gate/up) are cast by their loader.
    for name, tensor in weights:
        dtype = dtypes.get(name)
        yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


# vLLM 0.32's loggers of the warnings ExpectedLoadWarnings drops.
WEIGHT_DTYPE_LOGGER = "vllm.model_executor.models.utils"
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class ExpectedLoadWarnings(logging.Filter):
    """Drops the warnings vLLM 0.32 logs for what this engine does on purpose, so that a generator's log shows only
    what needs reading:

    - at start, one per tensor, "Attempted to load weight ... with dtype torch.float32 into parameter with dtype
      torch.bfloat16" (`narrowed_to` bfloat16): the initial policy is float32 and the engine bfloat16
      (generation.dtype). vLLM rounds each weight to nearest even, as a published version's cast does;
    - at every refit, "RotaryEmbedding: Failed to load weights" and, for a tied head, "ParallelLMHead: Failed to load
      weights" (`weightless` layers): the rotary embedding has no weights in the file, and a tied head's weight is
      the embedding's, which reload_safetensors packs into the head again.

    Any other dtype or layer still warns.
    """

    def __init__(self, narrowed_to: torch.dtype | None = None, weightless: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.narrowed_to, self.weightless = narrowed_to, weightless

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg == "Attempted to load weight %s with dtype %s into parameter with dtype %s":
            return args[1:] != (torch.float32, self.narrowed_to)
        if record.msg == "%s: Failed to load weights":
            return args[:1] != () and args[0] not in self.weightless
        return True


@contextlib.contextmanager
def _dropping(expected: ExpectedLoadWarnings) -> Iterator[None]:
    """`expected` filters vLLM's loading loggers for the duration of one load."""
    loggers = [logging.getLogger(name) for name in (WEIGHT_DTYPE_LOGGER, RELOAD_LOGGER)]
    for logger in loggers:
        logger.addFilter(expected)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(expected)


def _configure_threads(threads: int | None) -> int:
    """Set the environment vLLM reads at start; returns the OpenMP thread count."""
    # In-process engine core: the worker extension is called directly and OMP_NUM_THREADS applies to it.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if threads is None:
        threads = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    # vLLM drops torch to one thread unless OMP_NUM_THREADS is set, and its CPU worker then disables
    # torch.set_num_threads for the whole process, so both are set before it starts.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return threads


def max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of rank `rank`."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"vLLM loads LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}, training.lora.rank is {rank}")
    return fitting[0]


def _start_llm(
    policy_dir: Path,
    dtype: str,
    max_model_len: int,
    kv_cache_bytes: int,
    config: PretrainedConfig,
    lora_rank: int | None,
) -> LLM:
    from vllm import LLM
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        supported = CPUAttentionBackend.get_supported_head_sizes()
        # vLLM only fails at the first forward pass, with "Unsupported CPU attention configuration".
        if head_dim not in supported:
            raise ValueError(f"vLLM's CPU attention supports head sizes {supported}, the policy has {head_dim}")
    kernels: dict[str, Any] = {}
    if current_platform.is_cpu():
        kernels = {"kernel_config": {"ir_op_priority": {op: [CPU_NORMS, "native"] for op in _cpu_norm_kernels()}}}
    lora: dict[str, Any] = {}
    if lora_rank is not None:
        # One adapter serves at a time; two fit in vLLM's cache, so that the previous one leaves when this engine
        # removes it, not when vLLM's LRU cache evicts it while the next is still being loaded.
        lora = {"enable_lora": True, "max_lora_rank": lora_rank, "max_loras": 1, "max_cpu_loras": 2}
    return LLM(
        model=str(policy_dir),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(max_model_len, 8192),  # without chunked prefill, a whole prompt must fit
        kv_cache_memory_bytes=kv_cache_bytes,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",  # sampling comes from GenerationSpec only, not the model card's defaults
        worker_extension_cls=f"{__name__}.VLLMWorkerExtension",
        disable_log_stats=True,
        **kernels,
        **lora,
    )


# The provider name under which _cpu_norm_kernels registers vLLM's compiled CPU RMSNorm.
CPU_NORMS = "reinforce_cpu_c"


def _cpu_norm_kernels() -> list[str]:
    """Registers vLLM's compiled CPU kernels (torch.ops._C.rms_norm, fused_add_rms_norm) as implementations of its IR
    ops rms_norm and fused_add_rms_norm; returns the ops' names. vLLM 0.32 registers them for GPUs only, and on CPU
    runs the ops as a chain of eager torch ops (a float32 copy, pow, mean, rsqrt, two multiplies) written for
    torch.compile to fuse, which eager mode never does. The kernels normalise in float32 and round once, closer to
    the trainer's float32 norm than the eager chain, which rounds before its weight multiply (benchmarks/engines.py
    reports the engines' log-prob mismatch). Contiguous 2-D inputs with the weight in their dtype only; anything else
    falls back to vLLM's own implementation."""
    from vllm import ir
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # loads torch.ops._C
    if CPU_NORMS not in ir.ops.rms_norm.impls:

        @ir.ops.rms_norm.register_impl(CPU_NORMS, supports_args=_kernel_takes)
        def rms_norm(
            x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
        ) -> torch.Tensor:
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x, weight, epsilon)
            return out

        @ir.ops.fused_add_rms_norm.register_impl(CPU_NORMS, supports_args=_fused_kernel_takes, inplace=True)
        def fused_add_rms_norm(
            x: torch.Tensor,
            x_residual: torch.Tensor,
            weight: torch.Tensor | None,
            epsilon: float,
            variance_size: int | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)  # x: the output, x_residual: the sum
            return x, x_residual

    return ["rms_norm", "fused_add_rms_norm"]


def _kernel_takes(
    x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
) -> bool:
    return variance_size is None and x.dim() == 2 and x.is_contiguous() and (weight is None or weight.dtype == x.dtype)


def _fused_kernel_takes(
    x: torch.Tensor,
    x_residual: torch.Tensor,
    weight: torch.Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> bool:
    return _kernel_takes(x, weight, epsilon, variance_size) and x_residual.is_contiguous()


def _kv_bytes_per_token(config: PretrainedConfig, dtype: str) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * _DTYPE_BYTES[dtype]  # 2: keys and values
