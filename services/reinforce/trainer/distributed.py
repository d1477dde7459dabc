"""Data parallelism for the trainer with torch.distributed (gloo on CPU, NCCL on GPU), launched by torchrun.

Each data-parallel rank reads its own share of a step's rollout groups from the stream (one consumer per rank,
so no rank sees another's data), computes gradients of the global loss on it, and the gradients are summed
across ranks before the optimizer step, which every rank then takes identically.

With model parallelism (the Megatron backend's tensor_parallel) one data-parallel rank is several processes
holding slices of one model replica. Processes are laid out as Megatron lays them out: the model-parallel peers
of a replica are consecutive global ranks, global rank = data-parallel rank * model_parallel + model rank. The
first of them (model rank 0) is the replica's reader: it alone reads and acknowledges rollout groups, and it
hands the same groups to its peers (`share_with_model_peers`), so each group is still trained exactly once.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


@dataclass(frozen=True)
class Ranks:
    rank: int = 0  # data-parallel rank
    world: int = 1  # data-parallel ranks
    model_rank: int = 0  # rank within the replica's model-parallel (tensor x pipeline) group
    model_world: int = 1
    group: Any = None  # the data-parallel process group (None: every process, when model_world is 1)
    model_group: Any = None  # this replica's model-parallel process group

    @classmethod
    def from_environment(cls, model_parallel: int = 1) -> Ranks:
        """The process group torchrun describes in the environment; a single rank without torchrun.

        `model_parallel` processes form one data-parallel rank (training.tensor_parallel x pipeline_parallel).
        """
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        if processes % model_parallel:
            raise ValueError(f"{processes} trainer processes do not form model-parallel groups of {model_parallel}")
        if processes == 1:
            return cls()
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank = dist.get_rank()
        if model_parallel == 1:
            return cls(rank, processes)
        replicas = processes // model_parallel
        # Every process must create every group, in the same order (torch.distributed's rule for new_group).
        data_groups = [dist.new_group(list(range(m, processes, model_parallel))) for m in range(model_parallel)]
        model_groups = [
            dist.new_group(list(range(r * model_parallel, (r + 1) * model_parallel))) for r in range(replicas)
        ]
        replica, model_rank = divmod(rank, model_parallel)
        return cls(replica, replicas, model_rank, model_parallel, data_groups[model_rank], model_groups[replica])

    @property
    def is_main(self) -> bool:
        """The first process of all: it feeds prompts, publishes weights, checkpoints and writes the metrics."""
        return self.rank == 0 and self.model_rank == 0

    @property
    def is_reader(self) -> bool:
        """The process of its data-parallel rank that reads (and acknowledges) that rank's rollout groups."""
        return self.model_rank == 0

    def barrier(self) -> None:
        """Every process (of every data-parallel rank)."""
        if self.world * self.model_world > 1:
            dist.barrier()

    def share_with_model_peers(self, payloads: list[bytes]) -> list[bytes]:
        """The reader's `payloads` on every process of its model-parallel group (serialised records: bytes, never
        pickled objects); the reader's own list where there is no model parallelism."""
        if self.model_world == 1:
            return payloads
        source = dist.get_global_rank(self.model_group, 0)
        lengths = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
        count = torch.tensor([len(payloads)], dtype=torch.int64)
        dist.broadcast(count, source, group=self.model_group)
        if not self.is_reader:
            lengths = torch.empty(int(count.item()), dtype=torch.int64)
        dist.broadcast(lengths, source, group=self.model_group)
        if self.is_reader:
            flat = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
        else:
            flat = torch.empty(int(lengths.sum().item()), dtype=torch.uint8)
        dist.broadcast(flat, source, group=self.model_group)
        data = flat.numpy().tobytes()
        offsets = [0, *torch.cumsum(lengths, 0).tolist()]
        return [data[a:b] for a, b in itertools.pairwise(offsets)]

    def broadcast_from_main(self, tensor: torch.Tensor) -> torch.Tensor:
        """The main process's `tensor` on every process, of every data-parallel rank and its model peers (filled in
        place on the others, which pass a tensor of the same shape and dtype)."""
        if self.world * self.model_world > 1:
            dist.broadcast(tensor, 0)
        return tensor

    def sum(self, value: int) -> int:
        if self.world == 1:
            return value
        total = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(total, group=self.group)
        return int(total.item())

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of `tensor` over ranks (a new tensor; the tensor itself with one rank)."""
        if self.world == 1:
            return tensor
        total = tensor.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total

    def sum_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Sum every gradient across ranks in one collective.

        Done by hand rather than by DistributedDataParallel: DDP's hooks need its own forward, and the
        trainer runs the model body and the LM head separately (no full-vocabulary logits over prompts).
        A rank may have had nothing to train (PPO: no sample of its share in a minibatch): its missing gradients
        count as zeros, and a parameter keeps no gradient only where no rank had one (AdamW then skips it, as it
        would with one rank).
        """
        if self.world == 1:
            return
        parameters = list(parameters)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in parameters]
        present = torch.tensor([p.grad is not None for p in parameters], dtype=grads[0].dtype, device=grads[0].device)
        flat = _flatten_dense_tensors([*grads, present])
        dist.all_reduce(flat, group=self.group)
        *reduced, anywhere = _unflatten_dense_tensors(flat, [*grads, present])
        for p, grad, total, had in zip(parameters, grads, reduced, anywhere.tolist(), strict=True):
            if p.grad is not None:
                grad.copy_(total)
            elif had:
                p.grad = total.clone()

    def gather_ints(self, values: list[int], per_rank: int) -> list[int]:
        """Every rank's `per_rank` ints, in rank order (tensors, not pickled objects)."""
        if self.world == 1:
            return values
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = [torch.empty(per_rank, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(everyone, mine, group=self.group)
        return torch.cat(everyone).tolist()

    def gather_lists(self, lists: list[list[int]]) -> list[list[int]]:
        """Every rank's int lists (each rank the same number of them, of any lengths), in rank order."""
        if self.world == 1:
            return lists
        lengths = self.gather_ints([len(x) for x in lists], len(lists))
        ranks_totals = [sum(lengths[r * len(lists) : (r + 1) * len(lists)]) for r in range(self.world)]
        width = max(ranks_totals)
        flat = [value for x in lists for value in x]
        everyone = self.gather_ints(flat + [0] * (width - len(flat)), width)
        out, offsets = [], [r * width for r in range(self.world)]
        for i, n in enumerate(lengths):
            rank = i // len(lists)
            out.append(everyone[offsets[rank] : offsets[rank] + n])
            offsets[rank] += n
        return out

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (the same shape on each), concatenated along the first dimension in rank order."""
        if self.world == 1:
            return tensor
        everyone = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(everyone, tensor.contiguous(), group=self.group)
        return torch.cat(everyone)

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
        dist.all_reduce(plain, group=self.group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
        return {
            n: peak[i].item() if n in maxed else plain[i].item() / (1 if n in summed else self.world)
            for i, n in enumerate(names)
        }
