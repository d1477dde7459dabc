"""A prompt's token ids, as the trainer feeds it and the generator's `reinforce generate` answers it."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from reinforce.core.spec import DataSpec

# A prompt's text -> (token ids, or None to skip it; whether it was over-long): encode_prompt_checked with its
# tokenizer and data settings bound.
Encoder = Callable[[str], tuple[list[int] | None, bool]]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, data: DataSpec) -> list[int] | None:
    """Token ids of one prompt, chat-templated if `data.chat_template`, at most `data.max_prompt_tokens`.

    A longer prompt is truncated from the left (`on_long_prompt: truncate`), or not used: None
    (`on_long_prompt: skip`; the caller takes another prompt). :func:`encode_prompt_checked` also says
    whether the prompt was too long.
    """
    return encode_prompt_checked(tokenizer, text, data)[0]


def encode_prompt_checked(
    tokenizer: PreTrainedTokenizerBase, text: str, data: DataSpec
) -> tuple[list[int] | None, bool]:
    """(:func:`encode_prompt`'s result, whether the prompt was longer than `data.max_prompt_tokens`).

    Too long with ids: truncated; too long with None: skipped. One tokenisation serves both answers.
    """
    if data.chat_template:
        # A chat-format prompt brings its own messages (and perhaps its own system message).
        messages = list(getattr(text, "messages", None) or [{"role": "user", "content": str(text)}])
        if data.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": data.system_prompt})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        ids = list(ids)
    else:
        ids = tokenizer.encode(str(text), add_special_tokens=False)
        bos = tokenizer.bos_token_id
        # Keep the tokenizer's own BOS convention (does it prepend one?) but never add EOS to a prompt.
        if bos is not None and tokenizer.encode("", add_special_tokens=True)[:1] == [bos]:
            ids = [bos, *ids]
    too_long = len(ids) > data.max_prompt_tokens
    if too_long and data.on_long_prompt == "skip":
        return None, True
    return truncate_left(ids, data.max_prompt_tokens, tokenizer.bos_token_id), too_long


def truncate_left(ids: list[int], max_tokens: int, bos: int | None) -> list[int]:
    """Keep the last `max_tokens` ids; a leading BOS survives (models behave badly without it)."""
    if len(ids) <= max_tokens:
        return ids
    if bos is not None and ids[0] == bos and max_tokens > 1:
        return [bos, *ids[len(ids) - max_tokens + 1 :]]
    return ids[len(ids) - max_tokens :]
