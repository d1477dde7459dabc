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

Only the main process talks to the critic, and it sends what one rank would send: the step's whole batch. With
several data-parallel ranks each reads its own share of the groups, so the ranks first gather every rank's token ids
(the whole batch in prompt order, as one rank holds it); the main process has them valued and hands the values to
every process (data-parallel ranks and tensor peers); after GAE it gathers the returns and sends the minibatches of
step 3, drawn over the whole batch, in one request. Each rank's actor trains its own samples of each minibatch
(gradients summed over ranks, the minibatch's token count too), so two ranks take the updates one rank takes.
Why not a critic client per rank: the critic is one process with one optimizer, so per-rank requests would have to
be joined back into one AdamW step per minibatch inside it (waiting for every rank, per request); gathering is a few
kilobytes of token ids and floats per step, keeps the critic's API and its request caps as they are, and keeps the
critic's updates bit-identical to one rank's.

Asynchronous mode (max_policy_lag > 0): each clipped term is weighted by min(pi_old / mu, importance_weight_cap), mu
the generator's log-probs (ppo.py).

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
from reinforce.core.packing import MicroBatch, packing_metrics
from reinforce.core.spec import RunSpec
from reinforce.trainer.algorithms.aggregation import step_normalizer
from reinforce.trainer.algorithms.base import Algorithm, SampleValues
from reinforce.trainer.algorithms.dapo import shaped_rewards
from reinforce.trainer.algorithms.ppo import generalized_advantages, ppo_policy_loss, token_rewards
from reinforce.trainer.algorithms.reinforce import (
    BehaviourStats,
    earlier_versions_mismatched,
    truncated_importance_weights,
)
from reinforce.trainer.algorithms.tensors import kl_per_token, masked_mean, masked_whiten
from reinforce.trainer.backends.base import TrainerBackend
from reinforce.trainer.batch import (
    StepBatch,
    in_order,
    micro_batches,
    prompt_index,
    token_lists,
)
from reinforce.trainer.critic_client import CriticClient, CriticError
from reinforce.trainer.distributed import Ranks


@dataclass(frozen=True)
class WholeBatch:
    """The step's batch of every data-parallel rank in prompt order (the batch one rank would hold): what the critic
    is sent. Row p of it is row order[p] of the ranks' batches concatenated in rank order; this rank's sample i is its
    row positions[i]. With one data-parallel rank it is that rank's batch (both identities)."""

    order: Tensor  # [B_whole] long
    positions: Tensor  # [B] long
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]

    def rows(self, rows: Tensor) -> Tensor:
        """This rank's samples among rows of the whole batch (sorted, as indices into this rank's batch)."""
        return torch.nonzero(torch.isin(self.positions, rows)).flatten()


@dataclass(frozen=True)
class CriticView:
    """What the critic trains on, over the whole batch ([B_whole] or [B_whole, T_whole], rows as WholeBatch's)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    keep: Tensor  # [B_whole] bool
    trained: Tensor  # [B_whole] bool: kept, with a response token in the mask
    values: Tensor  # V_old(s_t)
    returns: Tensor  # R_t


@dataclass(frozen=True)
class Rollout:
    """What this rank's share of the step's batch is trained against, each [B, T] (B samples, prompt-major)."""

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
    importance_weights: Tensor | None  # min(pi_old / mu, cap) (max_policy_lag > 0)
    whole: WholeBatch
    critic: CriticView


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
        rollout, timers, stats = self.rollout(batch, backend, version)
        minibatches = self.minibatches(len(rollout.whole.order), version)
        # a minibatch without a single kept response token gives the critic nothing to learn
        view = rollout.critic
        critic_batches = []
        if self.critic is not None:
            critic_batches = [self.critic_minibatch(view, rows) for rows in minibatches if view.trained[rows].any()]
        critic_update = self.pool.submit(self.train_critic, critic_batches)  # (nan, nan) off the main process
        actor = [self.actor_step(backend, rollout, rollout.whole.rows(rows)) for rows in minibatches]
        wait_start = time.perf_counter()
        # every rank reports the main process's critic metrics (the others would average a nan in)
        critic_metrics = self.ranks.broadcast_from_main(torch.tensor(critic_update.result(), dtype=torch.float64))
        critic_loss, critic_grad_norm = critic_metrics.tolist()
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
            **stats,
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
    ) -> tuple[Rollout, dict[str, float], dict[str, float]]:
        """Steps 1 and 2: log-probs and values of the batch, then rewards, GAE, returns and whitening; also the
        timers and the statistics of the behaviour log-probs: the mean train/inference gap, how many groups were
        refused for it (as REINFORCE refuses), and the importance weights."""
        alg, temperature = self.spec.algorithm, self.spec.generation.temperature
        prompt_ids, response_ids = token_lists(batch.groups)
        whole = self.whole_batch(batch, prompt_ids, response_ids)
        values_request = None
        if self.critic is not None:
            values_request = self.pool.submit(self.critic.values, whole.prompt_ids, whole.response_ids)
        k = alg.num_rollouts_per_prompt
        parts = micro_batches(
            prompt_ids, response_ids, self.spec.training, k, whole_groups=False, shares_prompts=backend.shares_prompts
        )
        old_logprobs, ref_logprobs, masks, timers = self.logprobs(parts, backend)
        limit = self.spec.training.max_logprob_mismatch
        behaviour_stats = BehaviourStats(k, limit, alg.importance_weight_cap)
        earlier_refused = earlier_versions_mismatched(batch.groups, backend, version, limit, temperature)
        behaviour, refused = behaviour_stats.compare(batch.groups, old_logprobs, masks, version, earlier_refused)
        keep = batch.keep.reshape(-1) & ~refused.repeat_interleave(k)
        mask = masks * keep.unsqueeze(-1)
        importance_weights = None
        if alg.max_policy_lag > 0:
            importance_weights = truncated_importance_weights(old_logprobs, behaviour, alg.importance_weight_cap)
            behaviour_stats.weights.add(importance_weights, mask)
        wait_start = time.perf_counter()
        whole_values = torch.zeros(len(whole.response_ids), max(len(r) for r in whole.response_ids))
        if values_request is not None:
            whole_values = _padded(values_request.result(), like=whole_values)
        whole_values = self.ranks.broadcast_from_main(whole_values)  # to every process but the main one
        values = _columns(whole_values[whole.positions], like=old_logprobs)
        timers["timers/critic_wait"] += time.perf_counter() - wait_start

        kl = kl_per_token(old_logprobs, ref_logprobs, alg.kl_estimator, alg.use_absolute_kl, alg.kl_clamp)
        scores = shaped_rewards(batch, self.spec).reshape(-1)
        rewards = token_rewards(scores, kl, mask, alg.initial_policy_kl_penalty)
        advantages, returns = generalized_advantages(values, rewards, mask, alg.discount_factor, alg.gae_lambda)
        whitened = masked_whiten(advantages, mask, all_reduce=self.ranks.sum_tensor)
        actor_samples = keep & batch.is_end.reshape(-1) if alg.ppo_loss_mask == "ended" else keep
        actor_mask = mask * actor_samples.unsqueeze(-1)
        critic = self.critic_view(whole, whole_values, keep, mask, returns)
        rollout = Rollout(
            prompt_ids, response_ids, keep, old_logprobs, mask, actor_samples, actor_mask, kl, values, advantages,
            returns, whitened, importance_weights, whole, critic,
        )  # fmt: skip
        return rollout, {**timers, **packing_metrics(parts)}, behaviour_stats.metrics()

    def logprobs(
        self, parts: list[MicroBatch], backend: TrainerBackend
    ) -> tuple[Tensor, Tensor, Tensor, dict[str, float]]:
        """The policy's and the reference's log-probs of the whole batch in prompt order, their mask, and timers."""
        temperature = self.spec.generation.temperature
        old, ref, masks = [], [], []
        timers = {"timers/init_logprobs": 0.0, "timers/logprobs": 0.0, "timers/critic_wait": 0.0}
        for part in parts:
            ref_start = time.perf_counter()
            ref.append(backend.reference_logprobs(part.prompt_ids, part.response_ids, temperature))
            old_start = time.perf_counter()
            logprobs, mask = backend.policy_logprobs(part.prompt_ids, part.response_ids, temperature)
            timers["timers/init_logprobs"] += old_start - ref_start
            timers["timers/logprobs"] += time.perf_counter() - old_start
            old.append(logprobs)
            masks.append(mask)
        return in_order(old, parts), in_order(ref, parts), in_order(masks, parts), timers

    def whole_batch(self, batch: StepBatch, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> WholeBatch:
        """Every data-parallel rank's token ids in prompt order (a collective of every rank)."""
        if self.ranks.world == 1:
            identity = torch.arange(len(prompt_ids))
            return WholeBatch(identity, identity, prompt_ids, response_ids)
        k = self.spec.algorithm.num_rollouts_per_prompt
        indices = torch.tensor(self.ranks.gather_ints([prompt_index(g) for g in batch.groups], len(batch.groups)))
        order = (torch.argsort(indices, stable=True).unsqueeze(-1) * k + torch.arange(k)).reshape(-1)
        mine = self.ranks.rank * len(prompt_ids)
        positions = torch.argsort(order)[mine : mine + len(prompt_ids)]
        prompts, responses = self.ranks.gather_lists(prompt_ids), self.ranks.gather_lists(response_ids)
        return WholeBatch(order, positions, [prompts[i] for i in order], [responses[i] for i in order])

    def critic_view(self, whole: WholeBatch, values: Tensor, keep: Tensor, mask: Tensor, returns: Tensor) -> CriticView:
        """The critic's rows of the whole batch: every rank's keep flags and returns gathered (a collective)."""
        flags = torch.stack([keep, mask.bool().any(-1)], -1).to(torch.int64)
        flags = self.ranks.gather_rows(flags)[whole.order].bool()
        wide = _columns(returns, like=torch.zeros(returns.shape[0], values.shape[1], dtype=returns.dtype))
        whole_returns = self.ranks.gather_rows(wide)[whole.order]
        trained = flags[:, 0] & flags[:, 1]
        return CriticView(whole.prompt_ids, whole.response_ids, flags[:, 0], trained, values, whole_returns)

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
        # the minibatch's counts over every rank (this rank holds `rows` of it, maybe none)
        counts = [rollout.actor_mask[rows].sum(), rollout.actor_samples[rows].sum(), rollout.mask[rows].sum()]
        num_tokens, num_samples, response_tokens = self.ranks.sum_tensor(torch.stack(counts).long()).tolist()
        normalizer = step_normalizer(self.spec, num_tokens, num_samples)
        sums = dict.fromkeys(("loss", "ppo_ratio", "ppo_ratio_clamped", "ppo_clip_fraction", "entropy"), 0.0)
        prompts = [rollout.prompt_ids[i] for i in rows]
        responses = [rollout.response_ids[i] for i in rows]
        for piece in micro_batches(
            prompts,
            responses,
            t,
            alg.num_rollouts_per_prompt,
            whole_groups=False,
            shares_prompts=backend.shares_prompts,
        ):
            part = rows[piece.rows]
            logprobs, entropy, mask = backend.policy_logprobs_and_entropy(
                piece.prompt_ids, piece.response_ids, temperature
            )
            columns = slice(0, mask.shape[1])
            weights = None if rollout.importance_weights is None else rollout.importance_weights[part, columns]
            out = ppo_policy_loss(
                logprobs, rollout.old_logprobs[part, columns], rollout.whitened[part, columns],
                rollout.actor_mask[part, columns], alg.clip_range(), normalizer, entropy, alg.entropy_bonus, weights,
                metric_mask=rollout.mask[part, columns],
            )  # fmt: skip
            out.loss.backward()
            share = float(rollout.actor_mask[part].sum()) / max(num_tokens, 1)  # this part's share of the token means
            response_share = float(rollout.mask[part].sum()) / max(response_tokens, 1)  # of the ratio's means
            sums["loss"] += out.loss.item()
            sums["ppo_ratio"] += out.ppo_ratio.item() * response_share
            sums["ppo_ratio_clamped"] += out.ppo_ratio_clamped.item() * response_share
            sums["ppo_clip_fraction"] += out.clip_fraction.item() * share
            sums["entropy"] += (out.entropy.item() if out.entropy is not None else 0.0) * share
        grad_norm, lr = backend.optimizer_step()
        # each rank holds its share of the minibatch's sums: their sum is the minibatch's
        summed = self.ranks.sum_tensor(torch.tensor(list(sums.values()), dtype=torch.float64))
        totals = dict(zip(sums, summed.tolist(), strict=True))
        return {
            "train_optim/actor_loss": totals["loss"],
            "train_optim/ppo_ratio": totals["ppo_ratio"],
            "train_optim/ppo_ratio_clamped": totals["ppo_ratio_clamped"],
            "train_optim/ppo_clip_fraction": totals["ppo_clip_fraction"],
            "train_optim/entropy": totals["entropy"],
            "train_optim/grad_norm": grad_norm,
            "train_optim/lr": lr,
        }

    @staticmethod
    def critic_minibatch(view: CriticView, rows: Tensor) -> Minibatch:
        """The critic's view of a minibatch: token ids, R_t and V_old(s_t) of its kept samples."""
        kept = [int(i) for i in rows if view.keep[i]]
        lengths = [len(view.response_ids[i]) for i in kept]
        return Minibatch(
            prompt_token_ids=[view.prompt_ids[i] for i in kept],
            response_token_ids=[view.response_ids[i] for i in kept],
            returns=[view.returns[i, :n].tolist() for i, n in zip(kept, lengths, strict=True)],
            old_values=[view.values[i, :n].tolist() for i, n in zip(kept, lengths, strict=True)],
        )


def _padded(rows: list[list[float]], like: Tensor) -> Tensor:
    """Per-token floats of each row, right-padded to `like`'s [B, T] with 0."""
    out = torch.zeros_like(like)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=like.dtype)
    return out


def _columns(rows: Tensor, like: Tensor) -> Tensor:
    """`rows` [B, T'] cut or right-padded with 0 to `like`'s [B, T]."""
    out = torch.zeros_like(like)
    width = min(rows.shape[1], like.shape[1])
    out[:, :width] = rows[:, :width]
    return out


def _mean_of(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the minibatch steps of the step."""
    return {name: sum(row[name] for row in rows) / len(rows) for name in rows[0]}
