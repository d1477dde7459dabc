"""Data parallelism for the trainer with torch.distributed (gloo on CPU, NCCL on GPU), launched by torchrun.

Each rank reads its own share of a step's rollout groups from the stream (one consumer per rank, so no rank
sees another's data), computes gradients of the global loss on it, and the gradients are summed across
ranks before the optimizer step, which every rank then takes identically.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @classmethod
    def from_environment(cls) -> Ranks:
        """The process group torchrun describes in the environment; a single rank without torchrun."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        return cls(dist.get_rank(), world)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum(self, value: int) -> int:
        if self.world == 1:
            return value
        total = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(total)
        return int(total.item())

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of `tensor` over ranks (a new tensor; the tensor itself with one rank)."""
        if self.world == 1:
            return tensor
        total = tensor.detach().clone()
        dist.all_reduce(total)
        return total

    def sum_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Sum every gradient across ranks in one collective.

        Done by hand rather than by DistributedDataParallel: DDP's hooks need its own forward, and the
        trainer runs the model body and the LM head separately (no full-vocabulary logits over prompts).
        """
        if self.world == 1:
            return
        grads = [p.grad for p in parameters if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(reduced)

    def gather_ints(self, values: list[int], per_rank: int) -> list[int]:
        """Every rank's `per_rank` ints, in rank order (tensors, not pickled objects)."""
        if self.world == 1:
            return values
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = [torch.empty(per_rank, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(everyone, mine)
        return torch.cat(everyone).tolist()

    def reduce_metrics(self, values: dict[str, float], summed: set[str], maxed: set[str]) -> dict[str, float]:
        """Sum the `summed` metrics, take the max of `maxed`, and average the rest over ranks.

        Every rank holds the same number of samples, so the average of rank means is the global mean of
        per-sample metrics (per-token ones are averaged per rank).
        """
        if self.world == 1:
            return values
        names = sorted(values)
        plain = torch.tensor([values[n] for n in names], dtype=torch.float64)
        peak = plain.clone()
        dist.all_reduce(plain)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return {
            n: peak[i].item() if n in maxed else plain[i].item() / (1 if n in summed else self.world)
            for i, n in enumerate(names)
        }
