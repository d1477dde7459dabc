"""The policy head's log-probs and entropies computed over chunks of response positions (trainer/chunked_head.py,
head_logprobs): the values and gradients of the unchunked formula (head_outputs on all rows at once), in float32 to
rounding and in bfloat16 autocast to bfloat16's, whatever the chunk size, with a tied output layer and with a
LoRA-adapted one; and chunked_outputs, the same for a head given as a function (the Megatron backend's, tested on
the model in tests/integration/test_megatron_model.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reinforce.core.policy import load_policy, materialize_policy
from reinforce.core.response_states import response_states
from reinforce.core.spec import PolicySpec, RandomInit
from reinforce.trainer import chunked_head
from reinforce.trainer.chunked_head import chunked_outputs, head_chunk_rows, head_logprobs, head_outputs
from reinforce.trainer.logprobs import response_logprobs_and_entropy

PROMPTS = [[1, 5, 6], [1, 5, 6], [1, 7], [1, 8, 9, 10]]
RESPONSES = [[11, 12, 13, 14, 15], [16, 17], [18, 19, 20, 21, 22, 23, 24], [25, 26, 27]]  # N = 17 tokens
N = sum(len(r) for r in RESPONSES)
FLOAT32 = {"rtol": 1e-6, "atol": 1e-6}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize_policy(PolicySpec(random_init=RandomInit()), tmp_path_factory.mktemp("policy") / "p", seed=5)


@pytest.fixture
def model(folder: Path) -> torch.nn.Module:
    torch.set_num_threads(1)  # the test machine's cores are shared
    model = load_policy(folder).train()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one weight, two paths
    return model


def _outputs_and_grads(
    model: torch.nn.Module, chunk_rows: int | None, temperature: float, head: torch.nn.Module | None = None
) -> list[torch.Tensor]:
    """log-probs, entropies and every parameter's gradient of a loss weighting both, from the body's states through
    head_logprobs in chunks of `chunk_rows` (None: the unchunked formula, head_outputs) of `head` (model.lm_head)."""
    model.zero_grad()
    head = head or model.lm_head
    states, targets, _ = response_states(model.base_model, PROMPTS, RESPONSES, pad=0)
    if chunk_rows is None:
        logprobs, entropy = head_outputs(head, states, targets, temperature, entropy=True)
    else:
        logprobs, entropy = head_logprobs(head, states, targets, temperature, True, chunk_rows)
    weights = torch.linspace(-1.0, 2.0, N)
    ((logprobs * weights).sum() + (entropy * weights.flip(0)).sum()).backward()
    return [logprobs.detach(), entropy.detach(), *(p.grad.clone() for p in model.parameters())]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [1, 4, 5, N, 64])  # 4 and 5 do not divide 17; 64 is one chunk
def test_chunks_give_the_unchunked_values_and_gradients_in_float32(model, chunk_rows: int, temperature: float) -> None:
    want = _outputs_and_grads(model, None, temperature)
    got = _outputs_and_grads(model, chunk_rows, temperature)
    assert want[0].shape == (N,) and want[2].abs().sum() > 0  # the embedding's (tied head's) gradient is not zero
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **FLOAT32)


def test_any_other_head_goes_through_autograd_on_each_chunk(model) -> None:
    """A head that is not exactly a Linear (here one inside a Sequential) takes the generic recomputing Function."""
    wrapped = torch.nn.Sequential(model.lm_head)
    want = _outputs_and_grads(model, None, 0.7, wrapped)
    got = _outputs_and_grads(model, 5, 0.7, wrapped)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **FLOAT32)


def test_a_head_with_a_bias_gets_its_gradient() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True)
    states, targets = torch.randn(N, 16, requires_grad=True), torch.randint(0, 50, (N,))

    def grads(chunk_rows: int | None) -> list[torch.Tensor]:
        if chunk_rows is None:
            logprobs, entropy = head_outputs(head, states, targets, 0.7, entropy=True)
        else:
            logprobs, entropy = head_logprobs(head, states, targets, 0.7, True, chunk_rows)
        return list(torch.autograd.grad((logprobs - entropy).sum(), [states, head.weight, head.bias]))

    assert grads(None)[2].abs().sum() > 0
    for a, b in zip(grads(4), grads(None), strict=True):
        torch.testing.assert_close(a, b, **FLOAT32)


def test_a_head_given_as_a_function_gets_the_gradients_of_its_tensors() -> None:
    """chunked_outputs of a function of (states, targets) that gives no entropy, its weight a plain tensor: the
    function's values on all rows at once, None for the entropy, and the gradients of the states and the weight."""
    torch.manual_seed(0)
    weight = torch.randn(50, 16, requires_grad=True)
    states, targets = torch.randn(N, 16, requires_grad=True), torch.randint(0, 50, (N,))

    def outputs(chunk_states: torch.Tensor, chunk_targets: torch.Tensor) -> tuple[torch.Tensor, None]:
        return head_outputs(lambda x: x @ weight.t(), chunk_states, chunk_targets, 0.7, entropy=False)[0], None

    logprobs, entropy = chunked_outputs(outputs, states, targets, [weight], 4)
    want = outputs(states, targets)[0]
    assert entropy is None and logprobs.requires_grad
    weights = torch.linspace(-1.0, 2.0, N)
    got_grads, want_grads = (torch.autograd.grad((v * weights).sum(), [states, weight]) for v in (logprobs, want))
    for a, b in zip([logprobs, *got_grads], [want, *want_grads], strict=True):
        torch.testing.assert_close(a, b, **FLOAT32)


def test_chunks_give_the_unchunked_values_and_gradients_in_bfloat16(model) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _outputs_and_grads(model, None, 0.7)
        got = _outputs_and_grads(model, 4, 0.7)
    # The body runs identically; the head's weight gradient sums bfloat16 matmuls per chunk in float32 where the
    # unchunked one rounds one matmul's sum to bfloat16: equal to bfloat16's precision (3 significant digits).
    for a, b in zip(got, want, strict=True):
        assert (a - b).norm() <= 1e-2 * b.norm() + 1e-6


def test_the_public_passes_give_the_unchunked_logprobs_and_entropy(model, monkeypatch) -> None:
    """response_logprobs_and_entropy, its chunks made 4 rows of this small vocabulary, against the formula."""
    monkeypatch.setattr(chunked_head, "HEAD_CHUNK_LOGITS", 4 * model.config.vocab_size)
    assert chunked_head.head_chunk_rows(model.config.vocab_size) == 4
    logprobs, entropy, mask = response_logprobs_and_entropy(model, PROMPTS, RESPONSES, 0.7)
    states, targets, _ = response_states(model.base_model, PROMPTS, RESPONSES, pad=0)
    want_logprobs, want_entropy = head_outputs(model.lm_head, states, targets, 0.7, entropy=True)
    torch.testing.assert_close(logprobs[mask.bool()], want_logprobs, **FLOAT32)
    torch.testing.assert_close(entropy[mask.bool()], want_entropy, **FLOAT32)
    assert logprobs.requires_grad and entropy.requires_grad


@pytest.mark.parametrize("chunk_rows", [3, 64])
def test_without_grad_the_chunks_give_the_values_and_hold_no_graph(model, chunk_rows: int) -> None:
    """The reference's and the generator's path: no graph kept, the same numbers."""
    with torch.no_grad():
        states, targets, _ = response_states(model.base_model, PROMPTS, RESPONSES, pad=0)
        want = head_outputs(model.lm_head, states, targets, 0.7, entropy=False)[0]
        logprobs, entropy = head_logprobs(model.lm_head, states, targets, 0.7, False, chunk_rows)
    assert entropy is None and logprobs.grad_fn is None
    torch.testing.assert_close(logprobs, want, **FLOAT32)


def test_a_lora_head_with_dropout_recomputes_the_forwards_masks(model) -> None:
    """A PEFT LoRA lm_head with dropout in train mode: backward recomputes each chunk under the forward's RNG
    state, so the gradients are those of keeping every chunk's graph (the same dropout masks), and the RNG moves
    on as the forward left it."""
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["lm_head"], lora_dropout=0.5)).train()
    head = lora.base_model.model.lm_head
    trainable = [p for p in head.parameters() if p.requires_grad]
    with torch.no_grad():
        trainable[1].normal_()  # lora_B starts at zero, which would leave lora_A's gradient zero
    states = torch.randn(N, model.config.hidden_size, requires_grad=True)
    targets = torch.randint(0, model.config.vocab_size, (N,))

    def grads(chunked: Callable[[], tuple[torch.Tensor, None]]) -> list[torch.Tensor]:
        torch.manual_seed(3)
        logprobs, _ = chunked()
        after_forward = torch.get_rng_state()
        grads = torch.autograd.grad(logprobs.sum(), [states, *trainable])
        assert torch.equal(torch.get_rng_state(), after_forward)
        return [logprobs.detach(), *grads]

    # Each chunk's graph kept (plain autograd over head_outputs per chunk) against the recomputing Function.
    kept = grads(lambda: _kept_chunks(head, states, targets, 5))
    recomputed = grads(lambda: head_logprobs(head, states, targets, 0.7, False, 5))
    assert all(g.abs().sum() > 0 for g in kept)
    for a, b in zip(recomputed, kept, strict=True):
        torch.testing.assert_close(a, b, **FLOAT32)


def _kept_chunks(
    head: torch.nn.Module, states: torch.Tensor, targets: torch.Tensor, rows: int
) -> tuple[torch.Tensor, None]:
    chunks = zip(states.split(rows), targets.split(rows), strict=True)
    return torch.cat([head_outputs(head, s, t, 0.7, entropy=False)[0] for s, t in chunks]), None


def test_no_response_tokens_give_empty_outputs_and_zero_gradients(model) -> None:
    states = torch.zeros(0, model.config.hidden_size, requires_grad=True)
    logprobs, entropy = head_logprobs(model.lm_head, states, torch.zeros(0, dtype=torch.long), 1.0, True, 4)
    (logprobs.sum() + entropy.sum()).backward()
    assert logprobs.shape == entropy.shape == (0,) and states.grad.shape == (0, model.config.hidden_size)


def test_chunk_rows_bound_the_logits_held_at_once() -> None:
    assert head_chunk_rows(49152) == 170  # SmolLM2's vocabulary: 170 x 49152 float32 logits = 32 MiB
    assert head_chunk_rows(2**30) == 1
