"""The generation-engine seam: what a generator needs from whatever samples its responses.

An engine samples k responses per prompt with each sampled token's log-prob, and loads weight versions in place.
Implementations, chosen by `generation.engine`: `torch` (torch_engine.py, the reference), `vllm` and
`tensorrt_llm`. Whatever the engine, a prompt's samples depend only on (weights, prompt, its seed), so a prompt
re-sampled after a crash repeats itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from reinforce.core.spec import GenerationSpec


@dataclass
class SampledSequence:
    token_ids: list[int]
    logprobs: list[float]  # log pi(y_t) of each sampled token under the engine's weights, temperature-scaled
    is_end: bool  # ended with EOS or a stop string (not cut by max_new_tokens)
    text: str  # decoded response, special tokens skipped


class GenerationEngine(ABC):
    """Samples k responses per prompt with per-token log-probs, and loads weight versions in place."""

    name: ClassVar[str]

    def __init__(self, policy_dir: Path, generation: GenerationSpec, num_samples: int) -> None:
        self.policy_dir = policy_dir
        self.generation = generation
        self.num_samples = num_samples

    def sample(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        num_samples: int | None = None,
        temperature: float | None = None,
        max_new_tokens: list[int] | None = None,
        stop_strings: Sequence[str] = (),
    ) -> list[list[SampledSequence]]:
        """For each prompt (token ids), `num_samples` (default: the engine's k) responses drawn under the prompt's
        seed at `temperature` (default: generation.temperature; 0: greedy, the likeliest token each time).

        Multi-turn episodes continue from a prompt's ids plus everything so far, one turn per call: `max_new_tokens`
        is each prompt's own limit (what is left of the episode's budget; default generation.max_new_tokens), and
        `stop_strings` end a response too, beside generation.stop_strings (a tool call's closing tag)."""
        k = self.num_samples if num_samples is None else num_samples
        limit = self.generation.max_new_tokens
        limits = [limit] * len(prompts) if max_new_tokens is None else list(max_new_tokens)
        if len(limits) != len(prompts) or not all(1 <= n <= limit for n in limits):
            raise ValueError(f"max_new_tokens: one limit per prompt, each 1 to generation.max_new_tokens ({limit})")
        generation = self.generation.model_copy(
            update={
                "temperature": self.generation.temperature if temperature is None else temperature,
                "stop_strings": [*self.generation.stop_strings, *stop_strings],
            }
        )
        return self._sample(prompts, seeds, k, generation, limits)

    @abstractmethod
    def _sample(
        self, prompts: list[list[int]], seeds: list[int], k: int, generation: GenerationSpec, limits: list[int]
    ) -> list[list[SampledSequence]]:
        """`sample` with its defaults resolved: `generation` carries the temperature and every stop string, `limits`
        each prompt's max new tokens."""

    @abstractmethod
    def load_weights(self, path: Path) -> None:
        """Load a verified safetensors file in place: the whole policy (Hugging Face parameter names), or with
        training.lora the adapters alone (core/lora.py), applied to the weights the engine started with."""
