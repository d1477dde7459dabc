"""Worker of test_megatron_tensor_parallel.py, run by torchrun with --nproc_per_node equal to --tp (gloo, CPU).

Writes into --out (rank 0 only): initial log-probs, the HF-form weights gathered after training, and the
results of a sharded-checkpoint resume and of the chunked output layer against the unchunked one; with
--load-checkpoint, the HF form of a checkpoint written at another TP size (resharded on load) and its Adam moments.

`head_outputs_and_grads` also serves test_megatron_model.py (TP=1 in the test's own process).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from megatron_tiny import PROMPTS, RESPONSES, TEMPERATURE, megatron_from_hf, policy_loss, tiny_config, tiny_hf_model
from safetensors.torch import save_file

from reinforce.core.response_states import padded_like
from reinforce.trainer import chunked_head
from reinforce.trainer.backends.megatron import convert
from reinforce.trainer.backends.megatron.checkpoint import (
    load_sharded_checkpoint,
    optimizer_state_by_name,
    save_sharded_checkpoint,
)
from reinforce.trainer.backends.megatron.model import (
    _mask_padded_vocab,
    _response_states,
    _vocab_parallel_entropy,
    clip_grad_norm_,
    gather_hf_state_dict,
    gather_tensor_parallel_shards,
    initialize_parallel,
    megatron_state_dict,
    response_logprobs_and_entropy,
)
from reinforce.trainer.chunked_head import temperature_scaled

STEPS_BEFORE_CHECKPOINT = 2
STEPS_AFTER_CHECKPOINT = 2


# Adam divides each gradient element by its own RMS, so float noise in an element whose gradient is near eps
# (after clipping) moves its update by a fraction of lr: TP=1 and TP=2 weights differ by about 1.2e-2 * lr
# (measured: 1.2e-4 at lr 1e-2, 1.2e-5 at 1e-3, 1.3e-6 at 1e-4). 5e-4 keeps that under 1e-5 while every
# weight still moves by ~lr per step, far more than the tolerance.
LEARNING_RATE = 5e-4


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.01)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    norms = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        policy_loss(model).backward()
        norms.append(clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
    return norms


def head_outputs_and_grads(model: torch.nn.Module, chunk_rows: int | None) -> dict[str, torch.Tensor]:
    """log-probs and entropies [B, T] of the shared batch and this rank's gradient of every parameter for a loss
    weighting both: through response_logprobs_and_entropy, its output layer in chunks of `chunk_rows` rows, or (None)
    through the unchunked formula, every response token's logits at once (what the module computed before it
    chunked: the output layer, temperature, padded columns masked, the entropy, then vocab_parallel_cross_entropy)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    model.zero_grad(set_to_none=True)
    weight = model.shared_embedding_or_output_weight()
    if chunk_rows is None:
        states, targets, mask = _response_states(model, PROMPTS, RESPONSES)
        given = weight if model.share_embeddings_and_output_weights else None
        logits = model.output_layer(states.unsqueeze(1), weight=given)[0].squeeze(1)
        logits = _mask_padded_vocab(temperature_scaled(logits, TEMPERATURE), model.unpadded_vocab_size)
        entropy = padded_like(mask, _vocab_parallel_entropy(logits))
        logprobs = padded_like(mask, -vocab_parallel_cross_entropy(logits, targets))
    else:
        with mock.patch.object(chunked_head, "HEAD_CHUNK_LOGITS", chunk_rows * weight.shape[0]):
            logprobs, entropy, mask = response_logprobs_and_entropy(model, PROMPTS, RESPONSES, TEMPERATURE)
    weights = torch.linspace(-1.0, 2.0, mask.numel()).view_as(mask) * mask
    ((logprobs * weights).sum() + (entropy * weights.flip(1)).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return {"logprobs": logprobs.detach(), "entropy": entropy.detach(), **grads}


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each tensor's largest difference relative to its largest value: float32's rounding, summed in other orders
    (chunk by chunk), is about 1e-7 of it."""
    return {name: ((got[name] - value).abs().max() / value.abs().max()).item() for name, value in want.items()}


def chunked_head_difference(model: torch.nn.Module) -> float:
    """The largest of :func:`differences`, over every rank, between the chunked head's (3 rows a chunk: 5 chunks of
    the 13 response tokens) log-probs, entropies and parameter gradients and the unchunked formula's."""
    found = differences(head_outputs_and_grads(model, 3), head_outputs_and_grads(model, None))
    largest = torch.tensor(max(found.values()))
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--load-checkpoint", type=Path, help="a checkpoint written at another TP size")
    args = parser.parse_args()
    initialize_parallel(tensor_parallel_size=args.tp, seed=1234)
    torch.manual_seed(0)
    hf_model = tiny_hf_model(tiny_config(), seed=0)
    model, layout = megatron_from_hf(hf_model, args.tp)
    model.train()
    results: dict = {}

    with torch.no_grad():
        logprobs, entropy, mask = response_logprobs_and_entropy(model, PROMPTS, RESPONSES, TEMPERATURE)
    gathered = gather_hf_state_dict(model, layout)  # on rank 0 only (None elsewhere)
    if gathered is not None:
        # Gathering right after loading must give back the HF weights bit for bit.
        original = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
        results["gather_roundtrip_exact"] = gathered.keys() == original.keys() and all(
            torch.equal(gathered[k], original[k]) for k in original
        )
        save_file({"logprobs": logprobs, "entropy": entropy, "mask": mask}, args.out / "logprobs.safetensors")

    results["chunked_head_max_difference"] = chunked_head_difference(model)
    optimizer = make_optimizer(model)
    results["grad_norms"] = train(model, optimizer, STEPS_BEFORE_CHECKPOINT)
    checkpoint = args.out / "checkpoint"
    checkpoint.mkdir(exist_ok=True)
    save_sharded_checkpoint(checkpoint, model, optimizer, layout)
    dist.barrier()  # every shard written before any rank reads
    at_checkpoint = gather_hf_state_dict(model, layout)
    if at_checkpoint is not None:
        save_file({k: v.contiguous() for k, v in at_checkpoint.items()}, args.out / "hf_at_checkpoint.safetensors")
    results["grad_norms"] += train(model, optimizer, STEPS_AFTER_CHECKPOINT)
    continued = megatron_state_dict(model)

    # Resume: a fresh model and optimizer (other initial weights), loaded from the checkpoint, same steps.
    fresh = tiny_hf_model(tiny_config(), seed=99)
    resumed, _ = megatron_from_hf(fresh, args.tp)
    resumed.train()
    resumed_optimizer = make_optimizer(resumed)
    load_sharded_checkpoint(checkpoint, resumed, resumed_optimizer, layout)
    train(resumed, resumed_optimizer, STEPS_AFTER_CHECKPOINT)
    identical = all(torch.equal(v, megatron_state_dict(resumed)[k]) for k, v in continued.items())
    flags = torch.tensor([int(identical)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    results["resume_bit_identical"] = bool(flags.item())

    final = gather_hf_state_dict(model, layout)
    if final is not None and gathered is not None:
        results["max_weight_change"] = max((final[k] - gathered[k]).abs().max().item() for k in final)
        save_file({k: v.contiguous() for k, v in final.items()}, args.out / "hf_after_training.safetensors")
        (args.out / "results.json").write_text(json.dumps(results))
    if args.load_checkpoint is not None:
        load_other_checkpoint(args.load_checkpoint, args.out, args.tp)


def load_other_checkpoint(checkpoint: Path, out: Path, tp: int) -> None:
    """Load a checkpoint written at another TP size into a fresh model; write its HF form and Adam moments."""
    model, layout = megatron_from_hf(tiny_hf_model(tiny_config(), seed=5), tp)
    optimizer = make_optimizer(model)
    load_sharded_checkpoint(checkpoint, model, optimizer, layout)
    hf = gather_hf_state_dict(model, layout)
    moments, _ = optimizer_state_by_name(model, optimizer)
    # Adam's first moments are shaped like the parameters: merged and renamed by the same conversion.
    shards = gather_tensor_parallel_shards(
        {k.removesuffix("/exp_avg"): v for k, v in moments.items() if k.endswith("/exp_avg")}
    )
    if hf is not None and shards is not None:
        save_file({k: v.contiguous() for k, v in hf.items()}, out / "loaded_hf.safetensors")
        merged = convert.megatron_shards_to_hf(shards, layout)
        save_file({k: v.contiguous() for k, v in merged.items()}, out / "loaded_exp_avg_hf.safetensors")


if __name__ == "__main__":
    main()
    dist.barrier()
    dist.destroy_process_group()
