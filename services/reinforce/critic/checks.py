"""What the critic refuses before a request reaches the model: rows and tokens past its caps (413), and token ids past
the vocabulary (422)."""

from __future__ import annotations

from reinforce.core.critic_api import ValuesRequest
from reinforce.critic.config import CriticConfig

# What each request cap is made of (CriticConfig.from_spec), named when a request is refused
ROWS_CAP = "training.prompts_per_step x algorithm.num_rollouts_per_prompt x algorithm.ppo_epochs"
ROW_TOKENS_CAP = "data.max_prompt_tokens + generation.max_new_tokens"


class RequestTooLarge(ValueError):
    """A request past the critic's caps (rows, tokens per row): answered 413."""


def check_caps(config: CriticConfig, requests: list[ValuesRequest]) -> None:
    """Refuse (RequestTooLarge) what the run's trainer never sends, before the lock: one request of 1.5M one-token
    rows held it for minutes."""
    rows = sum(len(r.prompt_token_ids) for r in requests)
    if config.max_rows is not None and rows > config.max_rows:
        raise RequestTooLarge(f"{rows} rows, more than the cap of {config.max_rows} per request ({ROWS_CAP})")
    if config.max_row_tokens is not None:
        for request in requests:
            _check_row_tokens(request, config.max_row_tokens)


def _check_row_tokens(request: ValuesRequest, cap: int) -> None:
    for i, (prompt, response) in enumerate(zip(request.prompt_token_ids, request.response_token_ids, strict=True)):
        if len(prompt) + len(response) > cap:
            tokens = len(prompt) + len(response)
            raise RequestTooLarge(f"row {i} has {tokens} tokens, more than the cap of {cap} per row ({ROW_TOKENS_CAP})")


def check_ids(request: ValuesRequest, vocab_size: int) -> None:
    """An id past the embedding table would fail deep inside the forward pass (a 500): say which row instead
    (ValueError, answered 422)."""
    for name in ("prompt_token_ids", "response_token_ids"):
        for i, row in enumerate(getattr(request, name)):
            if row and max(row) >= vocab_size:
                raise ValueError(f"{name}[{i}] holds id {max(row)}, past the vocabulary ({vocab_size})")
