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
    """:func:`head_outputs` of a Linear head, as autocast runs it (states, weight and bias cast to its dtype) but
    with the weight cast once per pass: autocast casts it again at every call made without grad, a copy of the whole
    [V, H] weight per chunk.

    Forward goes over chunks of rows, the full vocabulary each (a row's log-softmax needs all of it), and keeps each
    row's log-sum-exp. Backward goes over chunks of the vocabulary, all rows each, with the gradient of the logits
    written out (:func:`_logit_gradients`): each chunk's d W = d logits^T @ states is then its own rows of the
    weight's gradient, computed once with every token in one product. Over chunks of rows, every chunk would make
    a whole [V, H] product, summed into the gradient: for SmolLM2's 49k x 576 head at a thousand response tokens,
    six products with 170 tokens each and six passes over the whole gradient, most of the step's head time."""

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
        ctx.temperature, ctx.logits_budget = temperature, rows * weight.shape[0]
        with torch.autocast(device_type, enabled=False):
            head = _CastLinear(weight, bias, ctx.dtype)
            chunks = [
                _linear_chunk_outputs(head, s, t, temperature, entropy)
                for s, t in zip(states.split(rows), targets.split(rows), strict=True)
            ]
        logprobs, entropies, log_sum_exp = (torch.cat(parts) for parts in zip(*chunks, strict=True))
        ctx.save_for_backward(states, targets, weight, bias, log_sum_exp, entropies if entropy else None)
        return _present(logprobs, entropies if entropy else None)

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor) -> tuple:
        states, targets, weight, bias, log_sum_exp, entropies = ctx.saved_tensors
        want_states, want_weight, want_bias = ctx.needs_input_grad[0], *ctx.needs_input_grad[5:7]
        grad_logprobs, grad_entropies = (*grads, None)[:2]
        head = _CastLinear(weight, bias, ctx.dtype)
        x = states.detach().to(ctx.dtype)
        grad_x = states.new_zeros(states.shape, dtype=torch.promote_types(ctx.dtype, torch.float32))
        grad_weight = weight.new_empty(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32))
        grad_bias = None if bias is None else bias.new_empty(bias.shape, dtype=grad_weight.dtype)
        columns = max(1, ctx.logits_budget // max(1, states.shape[0]))
        with torch.autocast(states.device.type, enabled=False):
            for start in range(0, weight.shape[0], columns):
                vocab = slice(start, start + columns)
                logits = torch.nn.functional.linear(x, head.weight[vocab], None if bias is None else head.bias[vocab])
                scaled = temperature_scaled(logits, ctx.temperature)
                grad_logits = _logit_gradients(
                    scaled, targets - start, log_sum_exp, entropies, grad_logprobs, grad_entropies, ctx.temperature
                )
                if grad_bias is not None:
                    grad_bias[vocab] = grad_logits.sum(0)
                grad_logits = grad_logits.to(ctx.dtype)
                if want_states:
                    grad_x += grad_logits @ head.weight[vocab]
                if want_weight:
                    grad_weight[vocab] = grad_logits.t() @ x
        return (
            grad_x.to(states.dtype) if want_states else None,
            None,
            None,
            None,
            None,
            grad_weight.to(weight.dtype) if want_weight else None,
            grad_bias.to(bias.dtype) if want_bias else None,
        )


def _linear_chunk_outputs(
    head: Callable[[torch.Tensor], torch.Tensor],
    states: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-prob of each target, entropy (zeros unless `entropy`), log-sum-exp of the scaled logits) of a chunk of
    rows. Without entropy no [rows, V] log-softmax is made: the log-sum-exp is computed in place in the scaled
    logits (this function's own copy), and a log-prob is its target's scaled logit less it."""
    scaled = temperature_scaled(head(states), temperature)
    target_logits = scaled.gather(-1, targets[:, None]).squeeze(-1)
    if entropy:
        log_softmax = torch.log_softmax(scaled, dim=-1)
        picked = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
        return picked, token_entropy(log_softmax), target_logits - picked
    largest = scaled.amax(-1, keepdim=True)
    log_sum_exp = (largest + scaled.sub_(largest).exp_().sum(-1, keepdim=True).log_()).squeeze(-1)
    return target_logits - log_sum_exp, torch.zeros_like(target_logits), log_sum_exp


def _logit_gradients(
    scaled: torch.Tensor,
    targets: torch.Tensor,
    log_sum_exp: torch.Tensor,
    entropies: torch.Tensor | None,
    grad_logprobs: torch.Tensor,
    grad_entropies: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """d loss / d logits [N, C] of one chunk of C vocabulary columns, given the scaled logits z = logits / T of those
    columns, each row's log-sum-exp over the whole vocabulary and the loss's gradients of the log-probs (g) and the
    entropies (h). With p = softmax(z) and log p = z - lse: d log p_t / d z_v = [v = t] - p_v and
    d H / d z_v = -p_v (log p_v + H), each divided by T. `targets` are counted from the chunk's first column."""
    log_p = scaled.sub_(log_sum_exp[:, None])  # in place, as the rest: each [N, C] tensor made is a page-faulted one
    if grad_entropies is None:
        grad = log_p.exp_().mul_(-grad_logprobs[:, None])
    else:
        p = log_p.exp()
        grad = p * -grad_logprobs[:, None]
        grad -= p.mul_(log_p.add_(entropies[:, None])).mul_(grad_entropies[:, None])
    inside = (targets >= 0) & (targets < grad.shape[1])
    rows = inside.nonzero().squeeze(-1)
    grad[rows, targets[rows]] += grad_logprobs[rows]
    return grad if temperature == 1.0 else grad.div_(temperature)


class _CastLinear:
    """x -> linear(x, weight, bias) with all three in `dtype`, as autocast computes a Linear; the cast weight and
    bias are made once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.weight = weight.detach().to(dtype)
        self.bias = None if bias is None else bias.detach().to(dtype)

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
