"""PPO behind the algorithm seam: the passes of one step, with the critic service (NeMo-Aligner's PPOTrainer).

The formulas are ppo.py's. One step on the step's batch of B = prompts_per_step * k samples:

    1. no gradient, whole batch:  log pi_old(y_t) and log pi_ref(y_t) of every response token (micro-batched by
                                  token budget, sequence by sequence: nothing here needs whole groups),
                                  while the critic answers V_old(s_t) for the same tokens (/v1/values, in a thread)
    2. whole batch:               r_t = token_rewards(...), (A_t, R_t) = GAE(V_old, r), Â_t = masked_whiten(A)
    3. ppo_epochs x num_minibatches, a seeded permutation of the samples per epoch:
           actor:  one AdamW step on L_actor (clipped ratio, entropy bonus) per minibatch, micro-batched, over the
                   tokens of `ppo_loss_mask` (by default the properly-ended responses)
           critic: the same minibatches in one /v1/train request, one AdamW step each, running in a thread
                   beside the actor's steps (the critic computes in its own process)

With tensor parallelism only the main process talks to the critic: it hands the values of step 1 to its tensor
peers (the same batch on each) and alone sends the minibatches of step 3.

Exactness: the critic is checkpointed at the trainer's checkpoint steps (/v1/checkpoint, before the trainer's own
files) and restored with the trainer (/v1/restore), so a resumed run repeats the same updates bit for bit. The
trainer counts the critic's optimizer steps; a critic that restarted and resumed from an older checkpoint reports
fewer, and the trainer then stops with an error so that it too restarts from its checkpoint (the supervisor or
Kubernetes restarts it) rather than train on with a critic from another history.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from reinforce.core.critic_api import Minibatch
from reinforce.core.spec import RunSpec
from reinforce.trainer.algorithms.aggregation import step_normalizer
from reinforce.trainer.algorithms.base import Algorithm, SampleValues, TokenStats
from reinforce.trainer.algorithms.dapo import shaped_rewards
from reinforce.trainer.algorithms.ppo import generalized_advantages, masked_whiten, ppo_policy_loss, token_rewards
from reinforce.trainer.algorithms.reinforce import kl_per_token, masked_mean, mismatched_groups
from reinforce.trainer.backends.base import TrainerBackend
from reinforce.trainer.batch import StepBatch, generator_logprobs, in_order, micro_batches, packing_metrics, token_lists
from reinforce.trainer.critic_client import CriticClient, CriticError
from reinforce.trainer.distributed import Ranks


@dataclass(frozen=True)
class Rollout:
    """What the step's batch is trained against, each [B, T] over the whole batch (B samples, prompt-major)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    keep: Tensor  # [B] bool: samples trained on (a non-finite reward drops its sample)
    old_logprobs: Tensor  # log pi_old: the weights that sampled the batch
    mask: Tensor  # 1 on response tokens of kept samples
    actor_samples: Tensor  # [B] bool: samples whose tokens L_actor averages over (ppo_loss_mask)
    actor_mask: Tensor  # mask of the actor_samples
    kl: Tensor  # kl_t to the reference
    values: Tensor  # V_old(s_t), from the critic
    advantages: Tensor  # A_t (GAE)
    returns: Tensor  # R_t = A_t + V_old(s_t)
    whitened: Tensor  # Â_t


class PPO(Algorithm):
    name = "ppo"

    def __init__(self, spec: RunSpec, ranks: Ranks, critic: CriticClient | None) -> None:
        """`critic`: None on the main process's tensor-parallel peers (one client per run)."""
        super().__init__(spec, ranks)
        self.critic = critic
        self.critic_steps = 0  # the critic's optimizer steps, as this trainer's history has them
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="critic")

    # ---- the critic's state follows the trainer's checkpoints -------------------------------------------------
    def restore(self, step: int) -> None:
        if self.critic is not None:
            self.critic.wait_ready()
            self.critic_steps = self.critic.restore(step).train_steps

    def save(self, step: int) -> None:
        if self.critic is not None:
            self.check_critic_steps(self.critic.checkpoint(step).train_steps)

    def close(self) -> None:
        self.pool.shutdown()
        if self.critic is not None:
            self.critic.close()

    def check_critic_steps(self, reported: int) -> None:
        if reported != self.critic_steps:
            raise CriticError(
                f"the critic reports {reported} optimizer steps where this trainer expects {self.critic_steps}: it "
                "restarted from an older checkpoint; stopping so that the trainer resumes from its own"
            )

    # ---- one step ---------------------------------------------------------------------------------------------
    def update(self, batch: StepBatch, backend: TrainerBackend, version: int) -> dict[str, float]:
        alg = self.spec.algorithm
        start = time.perf_counter()
        rollout, timers, mismatch, refused = self.rollout(batch, backend, version)
        minibatches = self.minibatches(len(rollout.response_ids), version)
        # a minibatch without a single kept response token gives the critic nothing to learn
        critic_batches = [self.critic_minibatch(rollout, rows) for rows in minibatches if rollout.mask[rows].any()]
        critic_update = self.pool.submit(self.train_critic, critic_batches)  # (nan, nan) on a tensor peer
        actor = [self.actor_step(backend, rollout, rows) for rows in minibatches]
        wait_start = time.perf_counter()
        critic_loss, critic_grad_norm = critic_update.result()
        timers["timers/critic_wait"] += time.perf_counter() - wait_start

        mask = rollout.mask.bool()
        self.sample_values = SampleValues(masked_mean(rollout.kl, mask), masked_mean(rollout.advantages, mask))
        sample_kl = self.sample_values.kl[batch.keep.reshape(-1)]
        rewards = batch.rewards.reshape(-1)[batch.keep.reshape(-1)]
        return {
            "train_rollouts/init_policy_kl": sample_kl.mean().item(),
            "train_rollouts/rewards_with_kl": (rewards - alg.initial_policy_kl_penalty * sample_kl).mean().item(),
            "train_rollouts/advantages": rollout.advantages[mask].mean().item(),
            "train_rollouts/returns": rollout.returns[mask].mean().item(),
            "train_rollouts/values": rollout.values[mask].mean().item(),
            "train_rollouts/logprob_mismatch": mismatch,
            "train_rollouts/refused_mismatched_groups": float(refused),
            **_mean_of(actor),
            "train_optim/critic_loss": critic_loss,
            "train_optim/critic_grad_norm": critic_grad_norm,
            **timers,
            "timers/train_time": time.perf_counter() - start - timers["timers/init_logprobs"],
        }

    def train_critic(self, minibatches: list[Minibatch]) -> tuple[float, float]:
        """The critic's steps on the minibatches (none when every sample was dropped): (loss, gradient norm)."""
        if not minibatches or self.critic is None:
            return math.nan, math.nan
        result = self.critic.train(minibatches)
        self.critic_steps += len(minibatches)
        self.check_critic_steps(result.train_steps)
        return result.critic_loss, result.grad_norm

    @torch.no_grad()
    def rollout(
        self, batch: StepBatch, backend: TrainerBackend, version: int
    ) -> tuple[Rollout, dict[str, float], float, int]:
        """Steps 1 and 2: log-probs and values of the whole batch, then rewards, GAE, returns and whitening; also
        the mean train/inference log-prob gap and how many groups were refused for it (as REINFORCE refuses)."""
        alg, temperature = self.spec.algorithm, self.spec.generation.temperature
        prompt_ids, response_ids = token_lists(batch.groups)
        values_request = None if self.critic is None else self.pool.submit(self.critic.values, prompt_ids, response_ids)
        old, ref, masks = [], [], []
        timers = {"timers/init_logprobs": 0.0, "timers/logprobs": 0.0, "timers/critic_wait": 0.0}
        k = alg.num_rollouts_per_prompt
        parts = micro_batches(prompt_ids, response_ids, self.spec.training, k, whole_groups=False)
        for part in parts:
            ref_start = time.perf_counter()
            ref.append(backend.reference_logprobs(part.prompt_ids, part.response_ids, temperature))
            old_start = time.perf_counter()
            logprobs, mask = backend.policy_logprobs(part.prompt_ids, part.response_ids, temperature)
            timers["timers/init_logprobs"] += old_start - ref_start
            timers["timers/logprobs"] += time.perf_counter() - old_start
            old.append(logprobs)
            masks.append(mask)
        old_logprobs, ref_logprobs, masks = in_order(old, parts), in_order(ref, parts), in_order(masks, parts)
        # on-policy: the generator sampled with these very weights, so its log-probs should be the trainer's
        behaviour = generator_logprobs(batch.groups, like=old_logprobs)
        mismatch = TokenStats()
        mismatch.add((behaviour - old_logprobs).abs(), masks)
        same_version = torch.tensor([g.policy_version == version for g in batch.groups for _ in g.samples])
        limit = self.spec.training.max_logprob_mismatch
        refused_samples = mismatched_groups(behaviour, old_logprobs, masks, same_version, k, limit).repeat_interleave(k)
        keep = batch.keep.reshape(-1) & ~refused_samples
        mask = masks * keep.unsqueeze(-1)
        wait_start = time.perf_counter()
        if values_request is None:  # a tensor peer: the main process's values arrive
            values = torch.empty_like(old_logprobs)
        else:
            values = _padded(values_request.result(), like=old_logprobs)
        values = self.ranks.share_tensor_with_model_peers(values)
        timers["timers/critic_wait"] += time.perf_counter() - wait_start

        kl = kl_per_token(old_logprobs, ref_logprobs, alg.kl_estimator, alg.use_absolute_kl, alg.kl_clamp)
        scores = shaped_rewards(batch, self.spec).reshape(-1)
        rewards = token_rewards(scores, kl, mask, alg.initial_policy_kl_penalty)
        advantages, returns = generalized_advantages(values, rewards, mask, alg.discount_factor, alg.gae_lambda)
        whitened = masked_whiten(advantages, mask, all_reduce=self.ranks.sum_tensor)
        actor_samples = keep & batch.is_end.reshape(-1) if alg.ppo_loss_mask == "ended" else keep
        actor_mask = mask * actor_samples.unsqueeze(-1)
        rollout = Rollout(
            prompt_ids, response_ids, keep, old_logprobs, mask, actor_samples, actor_mask, kl, values, advantages,
            returns, whitened,
        )  # fmt: skip
        num_refused = int(refused_samples.sum()) // alg.num_rollouts_per_prompt
        return rollout, {**timers, **packing_metrics(parts)}, mismatch.mean(), num_refused

    def minibatches(self, num_samples: int, version: int) -> list[Tensor]:
        """Sample indices of every minibatch of every epoch, in order: a permutation per epoch, seeded by the run's
        seed and the step, so a redone step draws the same ones."""
        alg = self.spec.algorithm
        generator = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + version)
        size = num_samples // alg.num_minibatches
        out = []
        for _ in range(alg.ppo_epochs):
            order = torch.randperm(num_samples, generator=generator)
            out += [order[i * size : (i + 1) * size].sort().values for i in range(alg.num_minibatches)]
        return out

    def actor_step(self, backend: TrainerBackend, rollout: Rollout, rows: Tensor) -> dict[str, float]:
        """One AdamW step of the policy on a minibatch's L_actor, micro-batched; the minibatch's metrics."""
        alg, t, temperature = self.spec.algorithm, self.spec.training, self.spec.generation.temperature
        backend.zero_grad()
        num_tokens = int(rollout.actor_mask[rows].sum())
        normalizer = step_normalizer(self.spec, num_tokens, int(rollout.actor_samples[rows].sum()))
        sums = dict.fromkeys(("loss", "ppo_ratio", "ppo_ratio_clamped", "ppo_clip_fraction", "entropy"), 0.0)
        prompts = [rollout.prompt_ids[i] for i in rows]
        responses = [rollout.response_ids[i] for i in rows]
        for piece in micro_batches(prompts, responses, t, alg.num_rollouts_per_prompt, whole_groups=False):
            part = rows[piece.rows]
            logprobs, entropy, mask = backend.policy_logprobs_and_entropy(
                piece.prompt_ids, piece.response_ids, temperature
            )
            columns = slice(0, mask.shape[1])
            out = ppo_policy_loss(
                logprobs, rollout.old_logprobs[part, columns], rollout.whitened[part, columns],
                rollout.actor_mask[part, columns], alg.clip_range(), normalizer, entropy, alg.entropy_bonus,
            )  # fmt: skip
            out.loss.backward()
            share = float(rollout.actor_mask[part].sum()) / max(num_tokens, 1)  # this part's share of the token means
            sums["loss"] += out.loss.item()
            sums["ppo_ratio"] += out.ppo_ratio.item() * share
            sums["ppo_ratio_clamped"] += out.ppo_ratio_clamped.item() * share
            sums["ppo_clip_fraction"] += out.clip_fraction.item() * share
            sums["entropy"] += (out.entropy.item() if out.entropy is not None else 0.0) * share
        grad_norm, lr = backend.optimizer_step()
        return {
            "train_optim/actor_loss": sums["loss"],
            "train_optim/ppo_ratio": sums["ppo_ratio"],
            "train_optim/ppo_ratio_clamped": sums["ppo_ratio_clamped"],
            "train_optim/ppo_clip_fraction": sums["ppo_clip_fraction"],
            "train_optim/entropy": sums["entropy"],
            "train_optim/grad_norm": grad_norm,
            "train_optim/lr": lr,
        }

    @staticmethod
    def critic_minibatch(rollout: Rollout, rows: Tensor) -> Minibatch:
        """The critic's view of a minibatch: token ids, R_t and V_old(s_t) of its kept samples."""
        kept = [int(i) for i in rows if rollout.keep[i]]
        lengths = [len(rollout.response_ids[i]) for i in kept]
        return Minibatch(
            prompt_token_ids=[rollout.prompt_ids[i] for i in kept],
            response_token_ids=[rollout.response_ids[i] for i in kept],
            returns=[rollout.returns[i, :n].tolist() for i, n in zip(kept, lengths, strict=True)],
            old_values=[rollout.values[i, :n].tolist() for i, n in zip(kept, lengths, strict=True)],
        )


def _padded(rows: list[list[float]], like: Tensor) -> Tensor:
    """Per-token floats of each row, right-padded to `like`'s [B, T] with 0."""
    out = torch.zeros_like(like)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=like.dtype)
    return out


def _mean_of(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the minibatch steps of the step."""
    return {name: sum(row[name] for row in rows) / len(rows) for name in rows[0]}
