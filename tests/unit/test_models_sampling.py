"""Model materialisation, prompt encoding, log-probs and the batched sampler, on a tiny random Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from reinforce.core.policy import MARKER, load_policy, load_tokenizer, materialize_policy
from reinforce.core.prompt_encoding import encode_prompt
from reinforce.core.spec import DataSpec, GenerationSpec, PolicySpec, RandomInit
from reinforce.generator.engines.torch_engine import _filter, sample
from reinforce.trainer.logprobs import response_logprobs

PLAIN = DataSpec(prompts="unused", chat_template=False, max_prompt_tokens=64)
TEXTS = ["hello there, friend", "ok", "what is the weather like today?"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = PolicySpec(random_init=RandomInit())
    return materialize_policy(spec, tmp_path_factory.mktemp("policy") / "init", seed=3)


@pytest.fixture(scope="module")
def model(folder: Path):
    torch.set_num_threads(1)  # the test machine's cores are shared
    return load_policy(folder)


@pytest.fixture(scope="module")
def tokenizer(folder: Path):
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [encode_prompt(tokenizer, t, PLAIN) for t in TEXTS]


def _max_diff(model, seqs, prompts, temperature: float) -> float:
    flat_prompts = [p for p, group in zip(prompts, seqs, strict=True) for _ in group]
    flat = [s for group in seqs for s in group]
    with torch.no_grad():
        lp, mask = response_logprobs(model, flat_prompts, [s.token_ids for s in flat], temperature)
    sampled = torch.zeros_like(lp)
    for i, s in enumerate(flat):
        sampled[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
        assert mask[i].sum().item() == len(s.token_ids)
    return ((lp - sampled) * mask).abs().max().item()


def test_materialize_is_idempotent_and_reloads(folder: Path, tmp_path: Path) -> None:
    marker = folder / MARKER
    before = marker.stat().st_mtime_ns
    spec = PolicySpec(random_init=RandomInit())
    assert materialize_policy(spec, folder, seed=3) == folder
    assert marker.stat().st_mtime_ns == before  # returned at once, nothing rewritten
    assert json.loads(marker.read_text())["seed"] == 3
    with pytest.raises(ValueError, match="materialised from"):
        materialize_policy(spec, folder, seed=4)  # another seed would be another model

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert model.config.vocab_size == len(tok) == len(RandomInit().vocab) + 4
    assert tok.decode(tok.encode("hi, you!"), skip_special_tokens=True) == "hi, you!"
    assert tok.encode("ab")[0] == tok.bos_token_id and tok.eos_token == "</s>"
    # Same seed, same weights: every process that materialises gets the same model.
    again = load_policy(materialize_policy(spec, tmp_path / "again", seed=3))
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


def test_encode_prompt_truncates_from_the_left(tokenizer) -> None:
    full = encode_prompt(tokenizer, "abcdefgh", PLAIN)
    assert full[0] == tokenizer.bos_token_id and tokenizer.decode(full[1:]) == "abcdefgh"
    short = encode_prompt(tokenizer, "abcdefgh", PLAIN.model_copy(update={"max_prompt_tokens": 5}))
    assert short == [tokenizer.bos_token_id, *full[-4:]]  # BOS kept, oldest text dropped
    assert tokenizer.decode(short[1:]) == "efgh"


def test_response_logprobs_matches_full_logits(model, prompts) -> None:
    responses = [[5, 6, 7], [8], [9, 10]]
    with torch.no_grad():
        lp, mask = response_logprobs(model, prompts, responses, temperature=0.7)
        assert lp.shape == mask.shape == (3, 3)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : -1] / 0.7
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
            assert torch.allclose(lp[i, : len(r)], want, atol=1e-5)
            assert mask[i].tolist() == [1.0] * len(r) + [0.0] * (3 - len(r))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_samples_sharing_a_prompt_get_the_logprobs_and_gradients_of_separate_passes(folder, prompts, attention) -> None:
    """response_states runs each run of equal prompts once and shares its keys and values: the log-probs and the
    gradient are those of one full forward per sample (prompts of three lengths, a run broken and resumed, an empty
    response and a one-token one)."""
    model = load_policy(folder).train()
    model.set_attn_implementation(attention)
    rows = [0, 0, 0, 1, 1, 2, 1]
    prompt_ids = [prompts[r] for r in rows]
    responses = [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14], [], [15, 16], [17, 18, 19]]

    def gradient(loss: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    shared, mask = response_logprobs(model, prompt_ids, responses, temperature=0.9)
    separate = torch.zeros_like(shared)
    for i, (p, r) in enumerate(zip(prompt_ids, responses, strict=True)):
        if r:
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : -1] / 0.9
            separate[i, : len(r)] = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
    assert mask.sum(1).tolist() == [len(r) for r in responses]
    torch.testing.assert_close(shared, separate, rtol=0, atol=1e-5)
    torch.testing.assert_close(gradient((shared * mask).sum()), gradient(separate.sum()), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_response_logprobs(model, tokenizer, prompts, temperature: float) -> None:
    gen = GenerationSpec(max_new_tokens=12, temperature=temperature)
    seqs = sample(model, tokenizer, prompts, 3, gen, seeds=[1, 2, 3])
    assert [len(g) for g in seqs] == [3, 3, 3]
    assert _max_diff(model, seqs, prompts, temperature) < 1e-4


def test_filtered_sampling_keeps_unfiltered_logprobs(model, tokenizer, prompts) -> None:
    gen = GenerationSpec(max_new_tokens=10, temperature=0.8, top_k=5, top_p=0.5)
    seqs = sample(model, tokenizer, prompts, 2, gen, seeds=[4, 5, 6])
    assert _max_diff(model, seqs, prompts, 0.8) < 1e-4


def test_filter_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(_filter(logits, 2, 1.0)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(_filter(logits, 0, 0.7)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(_filter(logits, 0, 0.5)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(_filter(logits, 0, 0.1)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(_filter(logits, 3, 0.99)).tolist() == [[True, True, True, False]]


def test_seeds_make_samples_reproducible(model, tokenizer, prompts) -> None:
    gen = GenerationSpec(max_new_tokens=8)
    first = sample(model, tokenizer, prompts, 2, gen, seeds=[7, 8, 9])
    same = sample(model, tokenizer, prompts, 2, gen, seeds=[7, 8, 9])
    other = sample(model, tokenizer, prompts, 2, gen, seeds=[17, 18, 19])
    tokens = lambda seqs: [[s.token_ids for s in g] for g in seqs]  # noqa: E731
    assert tokens(first) == tokens(same)
    assert tokens(first) != tokens(other)
    assert first[0][0].token_ids != first[0][1].token_ids  # a prompt's samples differ from each other


def test_top_k_1_is_greedy(model, tokenizer, prompts) -> None:
    gen = GenerationSpec(max_new_tokens=6, top_k=1)
    seqs = sample(model, tokenizer, prompts, 2, gen, seeds=[1, 2, 3])
    eos = tokenizer.eos_token_id
    for prompt, group in zip(prompts, seqs, strict=True):
        ids, greedy = list(prompt), []
        with torch.no_grad():
            while len(greedy) < 6 and (not greedy or greedy[-1] != eos):
                greedy.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
                ids.append(greedy[-1])
        assert group[0].token_ids == group[1].token_ids == greedy


def test_batch_padding_does_not_change_samples(model, tokenizer, prompts) -> None:
    gen = GenerationSpec(max_new_tokens=10)
    seeds = [11, 12, 13]
    together = sample(model, tokenizer, prompts, 2, gen, seeds=seeds)
    for prompt, seed, group in zip(prompts, seeds, together, strict=True):
        alone = sample(model, tokenizer, [prompt], 2, gen, seeds=[seed])[0]
        for a, b in zip(alone, group, strict=True):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_eos_ends_a_sequence(folder: Path, tokenizer, prompts) -> None:
    model = load_policy(folder)
    eos = tokenizer.eos_token_id
    # A bias toward EOS makes some rows end early and leaves others running to the limit.
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[eos] = 1.5
    model.lm_head = head
    gen = GenerationSpec(max_new_tokens=16)
    seqs = [s for g in sample(model, tokenizer, prompts, 4, gen, seeds=[1, 2, 3]) for s in g]
    for s in seqs:
        assert s.is_end == (s.token_ids[-1] == eos)
        assert eos not in s.token_ids[:-1]
        assert s.is_end or len(s.token_ids) == 16
        assert "</s>" not in s.text
    assert {s.is_end for s in seqs} == {True, False}
    flat_prompts = [p for p in prompts for _ in range(4)]
    with torch.no_grad():
        lp, _ = response_logprobs(model, flat_prompts, [s.token_ids for s in seqs], 1.0)
    for i, s in enumerate(seqs):
        assert torch.allclose(lp[i, : len(s.logprobs)], torch.tensor(s.logprobs), atol=1e-4)


def test_stop_strings_end_a_sequence(model, tokenizer, prompts) -> None:
    stops = ["e", "o"]
    gen = GenerationSpec(max_new_tokens=20, stop_strings=stops)
    seqs = [s for g in sample(model, tokenizer, prompts, 4, gen, seeds=[5, 6, 7]) for s in g]
    eos = tokenizer.eos_token_id
    for s in seqs:
        assert s.is_end == (any(x in s.text for x in stops) or s.token_ids[-1] == eos)
        before = tokenizer.decode(s.token_ids[:-1], skip_special_tokens=True)
        assert not any(x in before for x in stops)  # stopped on the token that completed it
        assert s.is_end or len(s.token_ids) == 20
    assert {s.is_end for s in seqs} == {True, False}
    assert any(s.token_ids[-1] != eos and s.is_end for s in seqs)  # some ended on a stop string


def test_response_logprobs_gradient_flows(model, prompts) -> None:
    model.zero_grad()
    lp, mask = response_logprobs(model, prompts, [[5, 6], [7], [8, 9, 10]], temperature=1.0)
    assert lp.requires_grad
    (-(lp * mask).sum() / mask.sum()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum().item() for g in grads) > 0
    model.zero_grad()


def test_too_long_prompt_is_refused(model, tokenizer) -> None:
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_position_embeddings"):
        sample(model, tokenizer, [[1] * (limit - 4)], 1, GenerationSpec(max_new_tokens=5), seeds=[0])
