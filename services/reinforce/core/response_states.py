"""Prompt and response token ids as the tensors a log-prob or value pass takes: one row per response, right-padded,
the [B, T] mask of its trained tokens, and the transformer body's state at each position that predicts one.

The policy's head on those states gives the trainer its log-probs (trainer/logprobs.py), the critic's value head
its values: the same positions for both.
"""

from __future__ import annotations

import torch


def check_sequences(prompt_ids: list[list[int]], response_ids: list[list[int]]) -> None:
    """What a log-prob or value pass accepts: one response per prompt, no empty prompt (its last token's state
    predicts the response's first token)."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token to predict the response's first token")


def response_states(
    body: torch.nn.Module, prompt_ids: list[list[int]], response_ids: list[list[int]], pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The transformer body's last hidden state at each position that predicts a response token ([N, H], N = real
    response tokens, row-major), those tokens [N], and the [B, T] response mask. The policy's head on these states
    gives the response's log-probs, the critic's its values: the same positions for both.

    A run of rows with the same prompt (a prompt's k samples sit next to each other) runs that prompt through the
    body once; its samples then run only their responses, attending to the prompt's keys and values. No prompt token
    attends to a response, so this is the same computation as one pass over every row's prompt and response, on
    about half the tokens at the benchmarks' shapes (k = 4, 42-token prompts, 32-token responses), gradients
    included: they flow back through the shared keys and values.
    """
    check_sequences(prompt_ids, response_ids)
    device = next(body.parameters()).device
    prompts, prompt_of_row = distinct_runs(prompt_ids)
    prompt_of_row = torch.tensor(prompt_of_row, dtype=torch.long, device=device)
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)

    input_ids, attention = (t.to(device) for t in right_padded(prompts, [[] for _ in prompts], pad))
    # each sample's response but its last token (which predicts nothing)
    continuations = [r[:-1] for r in response_ids]
    width = max(len(c) for c in continuations)
    ids, response_attention = (t.to(device) for t in right_padded([[] for _ in continuations], continuations, pad))
    # Both passes' tokens through the embedding at once: its backward makes one dense [V, H] gradient, not two.
    embeds = body.get_input_embeddings()(torch.cat([input_ids.flatten(), ids.flatten()]))
    prompt_embeds = embeds[: input_ids.numel()].view(*input_ids.shape, embeds.shape[-1])
    response_embeds = embeds[input_ids.numel() :].view(*ids.shape, embeds.shape[-1])

    # 1. each distinct prompt once, right-padded; its last token's state predicts every sample's first token
    positions = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
    out = body(inputs_embeds=prompt_embeds, attention_mask=attention, position_ids=positions, use_cache=True)
    first = out.last_hidden_state[torch.arange(len(prompts), device=device), prompt_lengths - 1][prompt_of_row]
    states = first.unsqueeze(1)  # [B, 1 + width, H]: column t predicts response token t

    # 2. the continuations after their prompt's keys and values: the cache holds each prompt's padded slots too,
    # masked out by the joined attention mask
    if width > 0:
        cache = out.past_key_values
        cache.batch_select_indices(prompt_of_row)
        hidden = body(
            inputs_embeds=response_embeds,
            attention_mask=torch.cat([attention[prompt_of_row], response_attention], dim=1),
            position_ids=prompt_lengths[prompt_of_row].unsqueeze(1) + torch.arange(width, device=device),
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        states = torch.cat([states, hidden], dim=1)
    _, _, targets, mask = response_positions(prompt_ids, response_ids, device)
    return states[:, : mask.shape[1]][mask.bool()], targets, mask


def distinct_runs(prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The prompts with each run of equal neighbours once, and the index of each row's prompt among them."""
    prompts: list[list[int]] = []
    prompt_of_row = []
    for prompt in prompt_ids:
        if not prompts or prompts[-1] != prompt:
            prompts.append(prompt)
        prompt_of_row.append(len(prompts) - 1)
    return prompts, prompt_of_row


def padded_like(mask: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """Per-token values [N] in row-major order of the real tokens -> right-padded [B, T], 0 on padding."""
    out = torch.zeros(mask.shape, dtype=picked.dtype, device=mask.device)
    out[mask.bool()] = picked  # row-major order matches response_positions
    return out


def right_padded(
    prompt_ids: list[list[int]], response_ids: list[list[int]], pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [p + r for p, r in zip(prompt_ids, response_ids, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention[i, : len(row)] = 1
    return ids, attention


class ResponseIds(list):
    """A response's token ids (a list of ints wherever one is expected) that also says which of them the policy
    sampled: `trained[t]` is false on the tools' output inside a multi-turn episode (the RolloutGroup's loss_mask).

    The one place that mask takes effect is `response_positions`: such tokens are left out of the [B, T] mask that
    every log-prob pass returns, so they get no log-prob (0), no gradient, and no loss, KL, advantage or metric,
    whatever the algorithm. They still condition the tokens after them (they are in the model's input).
    """

    def __init__(self, ids: list[int], trained: list[bool]) -> None:
        super().__init__(ids)
        if len(trained) != len(ids):
            raise ValueError(f"a loss mask of {len(trained)} entries for {len(ids)} tokens")
        self.trained = list(trained)


def response_positions(
    prompt_ids: list[list[int]], response_ids: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, column) of the hidden state predicting each trained response token, the tokens, and the [B, T] mask
    (1.0 on them; every token but a ResponseIds' untrained ones)."""
    width = max((len(r) for r in response_ids), default=0)
    mask = torch.zeros((len(response_ids), width), dtype=torch.float32)
    rows, cols, targets = [], [], []
    for i, (prompt, response) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        trained = response.trained if isinstance(response, ResponseIds) else [True] * len(response)
        kept = [t for t, keep in enumerate(trained) if keep]
        mask[i, kept] = 1.0
        rows.extend([i] * len(kept))
        # Token t of the response sits at len(prompt) + t and is predicted by the state one to its left.
        cols.extend(len(prompt) - 1 + t for t in kept)
        targets.extend(response[t] for t in kept)
    as_long = [torch.tensor(x, dtype=torch.long, device=device) for x in (rows, cols, targets)]
    return as_long[0], as_long[1], as_long[2], mask.to(device)
