"""The TensorRT-LLM engine's parts that need no TensorRT-LLM: refit buckets, casts, request parameters, results.

The engine itself has not run (TensorRT-LLM cannot be installed here; see tensorrt_llm_engine.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from reinforce.core.policy import build_char_tokenizer
from reinforce.core.spec import GenerationSpec
from reinforce.generator.engines.tensorrt_llm_engine import (
    TensorRTLLMEngine,
    bucket_by_bytes,
    cast_for_engine,
    sampled_logprobs,
    sampling_kwargs,
    to_sequence,
)


def test_buckets_keep_file_order_and_stay_under_the_limit() -> None:
    sizes = [("a", 4), ("b", 4), ("c", 3), ("d", 10), ("e", 0), ("f", 1)]
    assert bucket_by_bytes(sizes, 8) == [["a", "b"], ["c"], ["d"], ["e", "f"]]  # "d" alone exceeds the limit
    assert bucket_by_bytes([("z", 0), ("a", 4)], 4) == [["z", "a"]]
    assert bucket_by_bytes([], 8) == []
    assert [n for bucket in bucket_by_bytes(sizes, 1) for n in bucket] == [n for n, _ in sizes]
    with pytest.raises(ValueError):
        bucket_by_bytes(sizes, 0)


def test_floating_tensors_are_cast_to_the_engine_dtype_and_integers_kept() -> None:
    assert cast_for_engine(torch.ones(2), torch.bfloat16).dtype == torch.bfloat16
    assert cast_for_engine(torch.ones(2, dtype=torch.int64), torch.bfloat16).dtype == torch.int64


def test_sampling_kwargs() -> None:
    kwargs = sampling_kwargs(GenerationSpec(max_new_tokens=7), seed=3, eos_ids={2, 9}, pad_id=0)
    assert kwargs == {
        "n": 1,
        "seed": 3,
        "temperature": 1.0,
        "top_k": None,
        "top_p": None,
        "max_tokens": 7,
        "end_id": -1,
        "pad_id": 0,
        "stop_token_ids": [2, 9],
        "stop": None,
        "include_stop_str_in_output": True,
        "detokenize": False,
        "logprobs": 0,
        "processed_logprobs": False,  # temperature 1 and no filter: raw log-probs are the torch engine's
    }
    filtered = sampling_kwargs(GenerationSpec(temperature=0.7, top_k=5, top_p=0.9, stop_strings=["."]), 1, {2}, 0)
    assert filtered["processed_logprobs"] and filtered["top_k"] == 5 and filtered["top_p"] == 0.9
    assert filtered["stop"] == ["."]
    assert sampling_kwargs(GenerationSpec(temperature=0.7), 1, {2}, 0)["processed_logprobs"]


@dataclass
class _Logprob:  # the shape of tensorrt_llm.executor.result.Logprob
    logprob: float
    rank: int | None = None


def test_sampled_logprobs_read_both_result_shapes() -> None:
    assert sampled_logprobs([4, 5], [-0.5, -1.0]) == [-0.5, -1.0]
    assert sampled_logprobs([4, 5], [{4: _Logprob(-0.5)}, {7: _Logprob(-9.0), 5: _Logprob(-1.0)}]) == [-0.5, -1.0]
    with pytest.raises(RuntimeError, match="1 of 2"):
        sampled_logprobs([4, 5], [-0.5])


def test_a_response_ends_where_its_text_first_contains_a_stop_string() -> None:
    tokenizer = build_char_tokenizer("abc .")
    ids = tokenizer.encode("ab. ca", add_special_tokens=False)
    logprobs = [-float(i) for i in range(len(ids))]
    cut = to_sequence(ids, logprobs, "length", tokenizer, [" c"])
    assert cut.token_ids == ids[:5] and cut.logprobs == logprobs[:5] and cut.is_end and cut.text == "ab. c"
    whole = to_sequence(ids, logprobs, "length", tokenizer, [])
    assert whole.token_ids == ids and not whole.is_end
    eos = [*ids, tokenizer.eos_token_id]
    ended = to_sequence(eos, [*logprobs, -0.1], "stop", tokenizer, [])
    assert ended.is_end and ended.text == "ab. ca" and ended.token_ids[-1] == tokenizer.eos_token_id


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed")
def test_the_engine_imports_tensorrt_llm_only_when_it_starts(tiny_head32_policy: Path) -> None:
    with pytest.raises(ModuleNotFoundError, match="tensorrt_llm"):
        TensorRTLLMEngine(tiny_head32_policy, GenerationSpec(), num_samples=2)
