"""The sampling pieces of the training API that the integration test does not reach through the SDK: top_k and
top_p cut the distribution, a greedy draw takes the most likely token, stops read strings and token ids, an asample
the server cannot compute is refused by field name, and prompt log-probs before prompt_logprobs_last_n are NaN."""

from __future__ import annotations

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker", reason="the `api` extra (tinker==0.38.0) is not installed")
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as public_pb  # noqa: E402

from reinforce.training_api.sampling import (  # noqa: E402
    Sequence,
    Stops,
    check_sample,
    draw,
    encode_samples,
    stops_of,
)

LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def drawn(params: types.SamplingParams, draws: int = 400) -> set[int]:
    generator = torch.Generator().manual_seed(0)
    return {int(draw(LOGITS, params, generator)) for _ in range(draws)}


def test_top_k_and_top_p_cut_the_distribution_and_temperature_0_is_greedy():
    assert drawn(types.SamplingParams()) == {0, 1, 2, 3}
    assert drawn(types.SamplingParams(top_k=2)) == {0, 1}
    assert drawn(types.SamplingParams(top_p=0.7)) == {0, 1}  # 0.5 is short of 0.7; 0.5 + 0.3 reaches it
    assert drawn(types.SamplingParams(top_p=0.4)) == {0}
    assert drawn(types.SamplingParams(temperature=0.0), draws=3) == {0}


def test_a_seeded_generator_draws_the_same_tokens():
    rows = LOGITS.repeat(8, 1)
    first = draw(rows, types.SamplingParams(), torch.Generator().manual_seed(5))
    assert torch.equal(first, draw(rows, types.SamplingParams(), torch.Generator().manual_seed(5)))


class Tokenizer:
    eos_token_id = 2


def test_stops_of_strings_token_ids_none_and_nothing():
    assert stops_of(None, Tokenizer()) == Stops(frozenset({2}), ())
    assert stops_of([], Tokenizer()) == Stops(frozenset(), ())
    assert stops_of(".", Tokenizer()) == Stops(frozenset(), (".",))
    assert stops_of([7, 9], Tokenizer()) == Stops(frozenset({7, 9}), ())


def request(**fields) -> types.SampleRequest:
    return types.SampleRequest(
        prompt=types.ModelInput.from_ints([1, 2, 3]), sampling_params=types.SamplingParams(max_tokens=4), **fields
    )


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"topk_sample_logprobs": 2}, "topk_sample_logprobs"),
        ({"prompt_alt_tokens_k": 1}, "prompt_alt_tokens_k"),
        ({"num_samples": 0}, "num_samples"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 3}, "prompt_logprobs_last_n"),
        ({"sampling_params": types.SamplingParams(max_tokens=8)}, "exceed 10"),
    ],
)
def test_an_asample_the_server_cannot_compute_is_refused_by_field(fields: dict, named: str):
    sample = request(**fields) if "sampling_params" not in fields else request().model_copy(update=fields)
    with pytest.raises(ValueError, match=named):
        check_sample(sample, vocab_size=16, max_context_length=10)
    check_sample(request(), vocab_size=16, max_context_length=10)


def test_prompt_log_probs_before_the_last_n_are_nan():
    prompt = [1, 2, 3, 4]
    logprobs = torch.log_softmax(torch.randn(len(prompt), 8, generator=torch.Generator().manual_seed(0)), dim=-1)
    asked = request(prompt_logprobs=True, prompt_logprobs_last_n=2)
    message = public_pb.SampleResponse()
    message.ParseFromString(encode_samples([Sequence([5], [-1.0], "stop")], prompt, logprobs, asked))
    scores = np.frombuffer(message.prompt_logprobs, np.float32)
    assert np.isnan(scores[:2]).all()
    assert scores[2:].tolist() == pytest.approx([float(logprobs[1, 3]), float(logprobs[2, 4])])
    assert message.sequences[0].stop_reason == public_pb.STOP_REASON_STOP
