"""A policy head's log-probs and entropies over chunks of response positions, forward and backward, so that no
[N, V] logits tensor is ever held: the torch trainer's lm_head (:func:`head_logprobs`) and any other head given as
a function of a chunk's states and targets (:func:`chunked_outputs`: the Megatron backend's vocabulary-parallel
output layer)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch.autograd.function import FunctionCtx

# (a chunk's states [n, H], its targets [n]) -> (log-prob of each target [n], each row's entropy [n] or None).
Outputs = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def temperature_scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in float32; at temperature 1 no division, which would be one more pass over [N, V]
    (200 MB at 1024 tokens of a 49k vocabulary)."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def head_logprobs(
    head: torch.nn.Module,
    states: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool = False,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(head(states) / temperature) at each target [N], and each row's entropy [N] if `entropy`: the
    values and gradients of :func:`head_outputs` on all N rows at once, holding the [rows, V] logits of at most
    `chunk_rows` rows (default :func:`head_chunk_rows`) at a time, forward and backward.

    Those logits, in float32 with their log_softmax and autograd's copies, were most of a micro-batch's memory
    and grew with its response tokens. Only the states are kept for backward, which recomputes each chunk's logits
    and runs autograd on that chunk alone (one more head matmul per step, as Liger's fused linear cross-entropy
    pays). A plain Linear head (every policy's but a LoRA-adapted lm_head) goes through
    :class:`_ChunkedLinearHead`, which casts its weight once per pass; any other through :class:`_ChunkedHead`.
    """
    rows = chunk_rows or head_chunk_rows(head_vocab_size(head))
    if type(head) is torch.nn.Linear:  # exactly: a subclass (a quantised layer, say) may compute otherwise
        present = _ChunkedLinearHead.apply(states, targets, temperature, entropy, rows, head.weight, head.bias)
        return _outputs_in(present)
    params = [p for p in head.parameters() if p.requires_grad]
    return chunked_outputs(_outputs_of(head, temperature, entropy), states, targets, params, rows)


def chunked_outputs(
    outputs: Outputs, states: torch.Tensor, targets: torch.Tensor, params: Sequence[torch.Tensor], rows: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`outputs` of all N rows [N] (each row's entropy, or None where `outputs` gives none), computed `rows` rows at
    a time: its values and, through :class:`_ChunkedHead`, its gradients to the states and to `params`, the
    tensors that `outputs` uses and that should get gradients (summed over the chunks). Backward calls `outputs`
    again on each chunk in order, so a head whose outputs run collectives (a vocabulary-parallel one) runs them in
    the same order on every rank, as long as every rank calls this with the same row count and `rows`."""
    if torch.is_grad_enabled() and (states.requires_grad or any(p.requires_grad for p in params)):
        return _outputs_in(_ChunkedHead.apply(states, targets, outputs, rows, *params))
    return _chunked(outputs, states, targets, rows)


# At most this many logits (rows x vocabulary) at once in a log-prob pass: 32 MiB in float32, 170 rows of a 49k
# vocabulary. Small enough that a chunk's copies stay far below the body's activations, large enough for full-speed
# matmuls.
HEAD_CHUNK_LOGITS = 2**23


def head_chunk_rows(vocab: int) -> int:
    return max(1, HEAD_CHUNK_LOGITS // vocab)


def head_vocab_size(head: torch.nn.Module) -> int:
    """The output width of a policy's lm_head (a Linear, or PEFT's wrapper of one, which has no out_features of its
    own on every version: its base layer's)."""
    layer = head.get_base_layer() if hasattr(head, "get_base_layer") else head
    return layer.out_features


def head_outputs(
    head: Callable[[torch.Tensor], torch.Tensor],
    states: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unchunked formula: log_softmax of the logits / temperature at each target [n], entropy [n] if asked."""
    log_softmax = torch.log_softmax(temperature_scaled(head(states), temperature), dim=-1)
    picked = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
    return picked, token_entropy(log_softmax) if entropy else None


def _outputs_of(head: Callable[[torch.Tensor], torch.Tensor], temperature: float, entropy: bool) -> Outputs:
    """:func:`head_outputs` of `head` as a function of (states, targets)."""
    return partial(head_outputs, head, temperature=temperature, entropy=entropy)


def _chunked(
    outputs: Outputs, states: torch.Tensor, targets: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # No rows still make one (empty) chunk: split gives it, and with it the outputs' dtype and whether there is entropy.
    chunks = [outputs(s, t) for s, t in zip(states.split(rows), targets.split(rows), strict=True)]
    entropies = [c[1] for c in chunks]
    return torch.cat([c[0] for c in chunks]), None if entropies[0] is None else torch.cat(entropies)


def _present(logprobs: torch.Tensor, entropies: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The outputs a Function returns: autograd takes tensors only, so no entropy is no second output."""
    return (logprobs,) if entropies is None else (logprobs, entropies)


def _outputs_in(present: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs, entropies or None) from a Function's :func:`_present` outputs."""
    return present[0], present[1] if len(present) > 1 else None


class _ChunkedHead(torch.autograd.Function):
    """:func:`chunked_outputs`: `outputs` over row chunks. Backward recomputes each chunk under the forward's autocast
    and RNG state (so a LoRA head's dropout draws the same masks) and backpropagates through it alone; gradients go
    to the states and to the params (those that `outputs` uses)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        states: torch.Tensor,
        targets: torch.Tensor,
        outputs: Outputs,
        rows: int,
        *params: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.outputs, ctx.rows = outputs, rows
        ctx.autocast = _autocast_state(states.device.type)
        ctx.rng = _rng_state(states.device)
        ctx.save_for_backward(states, targets, *params)
        return _present(*_chunked(outputs, states, targets, rows))

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor) -> tuple:
        states, targets, *params = ctx.saved_tensors
        with torch.autocast(**ctx.autocast), _restored_rng(states.device, ctx.rng):
            grad_states, grad_params = _recomputed_gradients(
                ctx, ctx.outputs, states, targets, params, ctx.needs_input_grad[4:], grads
            )
        return grad_states, None, None, None, *grad_params


class _ChunkedLinearHead(torch.autograd.Function):
    """:func:`head_outputs` of a Linear head over row chunks, as autocast runs it (states, weight and bias cast to
    its dtype) but with the weight cast once per pass: autocast casts it again at every call made without grad,
    a copy of the whole [V, H] weight per chunk. Backward as :class:`_ChunkedHead`'s, the gradients of the cast
    weight and bias summed over the chunks in at least float32 and returned in the parameters' dtype."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        states: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        entropy: bool,
        rows: int,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        device_type = states.device.type
        ctx.dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        ctx.temperature, ctx.entropy, ctx.rows = temperature, entropy, rows
        ctx.save_for_backward(states, targets, weight, bias)
        with torch.autocast(device_type, enabled=False):
            head = _CastLinear(weight, bias, ctx.dtype)
            return _present(*_chunked(_outputs_of(head, temperature, entropy), states, targets, rows))

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor) -> tuple:
        states, targets, weight, bias = ctx.saved_tensors
        wanted = ctx.needs_input_grad[5:7]
        head = _CastLinear(weight, bias, ctx.dtype, wanted)
        outputs = _outputs_of(head, ctx.temperature, ctx.entropy)
        with torch.autocast(states.device.type, enabled=False):
            grad_states, (grad_weight, grad_bias) = _recomputed_gradients(
                ctx, outputs, states, targets, head.leaves, wanted, grads
            )
        return (
            grad_states,
            None,
            None,
            None,
            None,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
        )


class _CastLinear:
    """x -> linear(x, weight, bias) with all three in `dtype`, as autocast computes a Linear; the cast weight and
    bias are made once, as leaves (`leaves`) that require grad where `wanted` says, for backward to differentiate."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, wanted: tuple[bool, ...] = ()
    ) -> None:
        want_weight, want_bias = (*wanted, False, False)[:2]
        self.dtype = dtype
        self.weight = weight.detach().to(dtype).requires_grad_(want_weight)
        self.bias = None if bias is None else bias.detach().to(dtype).requires_grad_(want_bias)
        self.leaves = [self.weight, self.bias]

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(states.to(self.dtype), self.weight, self.bias)


def _recomputed_gradients(
    ctx: FunctionCtx,
    outputs: Outputs,
    states: torch.Tensor,
    targets: torch.Tensor,
    leaves: Sequence[torch.Tensor | None],
    wanted: Iterable[bool],
    grads: Sequence[torch.Tensor],
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """(d loss / d states, d loss / d each wanted leaf, summed over chunks) of the chunked `outputs`, given the
    loss's gradients of the log-probs and (where `outputs` gives them) the entropies: each chunk's logits recomputed
    and differentiated by autograd alone, one chunk's [rows, V] tensors alive at a time."""
    want_states, wanted = ctx.needs_input_grad[0], list(wanted)
    grad_states = torch.empty_like(states) if want_states else None
    totals: list[torch.Tensor | None] = [None] * len(leaves)
    inputs_wanted = [leaf for leaf, want in zip(leaves, wanted, strict=True) if want]
    with torch.enable_grad():
        for start in range(0, states.shape[0], ctx.rows):
            chunk = slice(start, start + ctx.rows)
            chunk_states = states[chunk].detach().requires_grad_(want_states)
            values = _present(*outputs(chunk_states, targets[chunk]))
            chunk_grads = [grad[chunk] for grad in grads]
            got = list(torch.autograd.grad(values, [chunk_states] * want_states + inputs_wanted, chunk_grads))
            if want_states:
                grad_states[chunk] = got.pop(0)
            _accumulate(totals, wanted, got)
    return grad_states, totals


def _accumulate(totals: list[torch.Tensor | None], wanted: Iterable[bool], grads: list[torch.Tensor]) -> None:
    """Add one chunk's gradients (one per wanted leaf) into `totals`, kept in at least float32: a bfloat16 leaf's
    chunks sum more exactly than one matmul over every row would round them."""
    chunk_grads = iter(grads)
    for i, want in enumerate(wanted):
        if want:
            grad = next(chunk_grads)
            # The first chunk's in float32 (no copy when it is); the next add into it without a float32 copy.
            first = totals[i] is None
            totals[i] = grad.to(torch.promote_types(grad.dtype, torch.float32)) if first else totals[i].add_(grad)


def _autocast_state(device_type: str) -> dict:
    return {
        "device_type": device_type,
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": torch.get_autocast_dtype(device_type),
    }


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextmanager
def _restored_rng(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> Iterator[None]:
    """The RNG as the forward found it, and as it was again afterwards (backward draws nothing of its own)."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def token_entropy(log_softmax: torch.Tensor) -> torch.Tensor:
    """H = - sum_v p_v log p_v of distributions given as log-probabilities [..., V] -> [...]."""
    return -(log_softmax.exp() * log_softmax).sum(-1)
