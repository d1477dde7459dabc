"""The critic's state and what changes it: the value model, its AdamW and step counters, and the lock that serialises
every use of them (values, train steps, checkpoint and restore). The HTTP side is server.py."""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path

import torch

from reinforce.core.checkpoints import checkpoint_folder, checkpoint_step, list_checkpoints
from reinforce.core.critic_api import (
    CheckpointResponse,
    Minibatch,
    MinibatchResult,
    ReadyResponse,
    TrainRequest,
    TrainResponse,
    ValuesRequest,
    ValuesResponse,
)
from reinforce.core.metrics import CriticMetrics
from reinforce.core.optim import adamw
from reinforce.core.packing import MicroBatch, pack
from reinforce.critic.checkpoint import load_checkpoint, save_checkpoint, set_aside
from reinforce.critic.checks import check_caps, check_ids
from reinforce.critic.config import CriticConfig
from reinforce.critic.value_model import critic_loss, load_value_model, response_values

log = logging.getLogger("reinforce.critic")


class RestoreRefused(ValueError):
    """A restore that would take the critic behind the trainer's newest checkpoint: answered 409."""


def _padded(rows: list[list[float]], like: torch.Tensor) -> torch.Tensor:
    """Right-pad per-token floats to `like`'s [B, T]."""
    out = torch.zeros_like(like)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=like.dtype)
    return out


class Critic:
    """The value model, its AdamW, the step counters and the lock that serialises every use of them."""

    def __init__(self, config: CriticConfig, metrics: CriticMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or CriticMetrics()
        self.lock = threading.Lock()
        self._initialise()
        self.vocab_size = int(self.model.config.vocab_size)
        checkpoints = list_checkpoints(config.checkpoints)
        if checkpoints:
            self._load(checkpoint_step(checkpoints[-1]), checkpoints[-1])
            log.info("resumed from %s (%d optimizer steps)", checkpoints[-1], self.train_steps)

    def _initialise(self) -> None:
        """The value model, AdamW and counters as a fresh critic has them (the same bytes every time)."""
        c, optim = self.config, self.config.critic
        torch.manual_seed(c.seed)
        self.model = load_value_model(c.model, optim.init).to(c.device)
        self.optimizer = adamw(self.model.parameters(), optim.lr, optim.adam_betas, optim.weight_decay)
        self.train_steps = 0
        self.checkpoint_step: int | None = None
        self.metrics.train_steps.set(0)

    def values(self, request: ValuesRequest) -> ValuesResponse:
        check_caps(self.config, [request])
        check_ids(request, self.vocab_size)
        prompts, responses = request.prompt_token_ids, request.response_token_ids
        out: list[list[float]] = [[] for _ in prompts]
        with self.lock, torch.no_grad():
            for part in self._micro_batches(prompts, responses):
                values, _ = response_values(self.model, part.prompt_ids, part.response_ids)
                for row, v, r in zip(part.rows.tolist(), values.cpu(), part.response_ids, strict=True):
                    out[row] = v[: len(r)].tolist()
        return ValuesResponse(values=out)

    def _micro_batches(self, prompts: list[list[int]], responses: list[list[int]]) -> list[MicroBatch]:
        c = self.config.critic
        return pack(prompts, responses, c.micro_batch_tokens, c.micro_batch_size)

    def train(self, request: TrainRequest) -> TrainResponse:
        check_caps(self.config, list(request.minibatches))
        for minibatch in request.minibatches:
            check_ids(minibatch, self.vocab_size)
        results: list[MinibatchResult] = []
        with self.lock:
            self.model.train()
            try:
                for minibatch in request.minibatches:
                    results.append(self._step(minibatch))
            except RuntimeError as err:
                raise RuntimeError(f"minibatch {len(results)}: {err} (the minibatches before it were applied)") from err
            finally:
                self.model.eval()
        return TrainResponse(
            critic_loss=sum(r.critic_loss for r in results) / len(results),
            grad_norm=sum(r.grad_norm for r in results) / len(results),
            minibatches=results,
            train_steps=self.train_steps,
        )

    def _step(self, minibatch: Minibatch) -> MinibatchResult:
        """One AdamW step on a minibatch, micro-batched; the loss is the minibatch's token mean."""
        c = self.config.critic
        prompts, responses = minibatch.prompt_token_ids, minibatch.response_token_ids
        num_tokens = sum(len(r) for r in responses)
        self.optimizer.zero_grad(set_to_none=True)
        loss, clipped_tokens = 0.0, 0.0
        for part in self._micro_batches(prompts, responses):
            values, mask = response_values(self.model, part.prompt_ids, part.response_ids)
            rows = part.rows.tolist()
            returns = _padded([minibatch.returns[i] for i in rows], values)
            old_values = _padded([minibatch.old_values[i] for i in rows], values)
            out = critic_loss(values, old_values, returns, mask, c.value_clip, num_tokens)
            out.loss.backward()
            loss += out.loss.item()
            clipped_tokens += out.clip_fraction.item() * float(mask.sum())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.max_grad_norm))
        if not math.isfinite(grad_norm):
            # stepping would write nan into every weight the optimizer touches, and into its moments
            self.optimizer.zero_grad(set_to_none=True)
            raise RuntimeError(f"non-finite critic gradient (norm {grad_norm}); its step was not applied")
        self.optimizer.step()
        self.train_steps += 1
        result = MinibatchResult(
            critic_loss=loss, grad_norm=grad_norm, value_clip_fraction=clipped_tokens / num_tokens, tokens=num_tokens
        )
        self._note_step(result)
        return result

    def _note_step(self, result: MinibatchResult) -> None:
        self.metrics.train_steps.set(self.train_steps)
        self.metrics.train_tokens.inc(result.tokens)
        self.metrics.loss.set(result.critic_loss)
        self.metrics.grad_norm.set(result.grad_norm)
        self.metrics.value_clip_fraction.set(result.value_clip_fraction)

    def save(self, step: int) -> CheckpointResponse:
        start = time.perf_counter()
        with self.lock:
            c = self.config
            path = save_checkpoint(
                c.checkpoints, step, self.model, self.optimizer, self.train_steps, c.keep_checkpoints
            )
            self.checkpoint_step = step
        self.metrics.checkpoint_step.set(step)
        self.metrics.checkpoint_seconds.set(time.perf_counter() - start)
        log.info("checkpoint %s", path)
        return CheckpointResponse(step=step, path=str(path), train_steps=self.train_steps)

    def restore(self, step: int) -> CheckpointResponse:
        """Load checkpoint `step` and move newer ones aside (never deleted): they belong to a history the trainer
        has abandoned, and a later restart must not resume from them. Step 0 without a checkpoint is the fresh critic
        (a trainer that starts over before its first checkpoint). Refused (RestoreRefused) when `step` is behind the
        trainer's newest checkpoint, which is where the trainer resumes from."""
        self._check_not_behind_trainer(step)
        root = self.config.checkpoints
        with self.lock:
            path = checkpoint_folder(root, step)
            if path.is_dir():
                self._load(step, path)
            elif step == 0:
                self._initialise()
            else:
                raise FileNotFoundError(f"no critic checkpoint for step {step} in {root}")
            for newer in list_checkpoints(root):
                if checkpoint_step(newer) > step:
                    log.warning("restored step %d: checkpoint %s moved aside to %s", step, newer, set_aside(newer))
        log.info("restored step %d", step)
        return CheckpointResponse(step=step, path=str(path), train_steps=self.train_steps)

    def _check_not_behind_trainer(self, step: int) -> None:
        folder = self.config.trainer_checkpoints
        trainer = list_checkpoints(folder) if folder is not None else []
        if trainer and step < checkpoint_step(trainer[-1]):
            raise RestoreRefused(
                f"step {step} is behind the trainer's newest checkpoint ({trainer[-1]}), where a resumed trainer "
                "starts: the critic stays where it is"
            )

    def _load(self, step: int, path: Path) -> None:
        state = load_checkpoint(path, self.model, self.optimizer)
        self.train_steps = int(state["train_steps"])
        self.checkpoint_step = step
        self.metrics.train_steps.set(self.train_steps)
        self.metrics.checkpoint_step.set(step)

    def ready(self) -> ReadyResponse:
        return ReadyResponse(ready=True, train_steps=self.train_steps, checkpoint_step=self.checkpoint_step)
