"""The local supervisor's run: start Redis, then the other children side by side, then until the trainer ends restart
any that exit, rotate their logs, roll weight versions out with the reconciler the operator uses, and show progress."""

from __future__ import annotations

import time

from reinforce.core.names import CONTROL_TOKEN_ENV, REDIS_URL_ENV
from reinforce.core.queue import RolloutQueue, connect
from reinforce.core.rollout import WeightReconciler, relay_fanout
from reinforce.core.spec import RunSpec
from reinforce.supervisor.children import Children
from reinforce.supervisor.component import Component
from reinforce.supervisor.progress import Progress


class Supervisor:
    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.children = Children(spec)
        self.max_log_bytes = int(spec.logging.max_component_log_mb * 2**20)

    def run(self) -> None:
        children = self.children
        children.start_redis()  # the generators and the trainer connect to it as they start
        # The others start side by side, as a run's pods do: each waits for what it calls (a generator for the
        # reward server, the trainer for the critic and for rollouts), so none need be ready before another starts.
        # The generators' multi-turn rollouts run their episodes in the environment (and code_tests its tests).
        if self.spec.environment.enabled:
            children.start_environment()
        reward_url = children.start_reward()
        critic_url = children.start_critic() if self.spec.algorithm.name == "ppo" else None
        generator_urls = children.start_generators(reward_url)
        trainer = children.start_trainer(critic_url)
        children.wait_until_ready()
        # A short outage budget: the reconciler is level-triggered (a failed pass is retried by the next), and
        # the supervisor's loop must not stall while it restarts Redis itself.
        queue = RolloutQueue(connect(children.credentials[REDIS_URL_ENV], max_outage_s=1.0), self.spec.name)
        fanout = relay_fanout(self.spec.weights)
        token = children.credentials[CONTROL_TOKEN_ENV]
        reconciler = WeightReconciler(queue, generator_urls, token, relay_fanout=fanout)
        try:
            self.watch(trainer, reconciler)
        finally:
            reconciler.close()

    def watch(self, trainer: Component, reconciler: WeightReconciler) -> None:
        progress = Progress(self.children.paths, self.spec.training.steps)
        try:
            while trainer.exit_code() != 0:
                self.supervise_once()
                reconciler.reconcile_once()
                progress.update()
                time.sleep(0.05)
            progress.update()
        finally:
            progress.close()

    def supervise_once(self) -> None:
        """Restart every child that exited (or give up on it: a RunFailed), and rotate the logs grown too large."""
        for c in self.children.components:
            c.supervise(self.spec.restart, self.children.env)
            c.rotate_log(self.max_log_bytes)

    def stop(self) -> None:
        self.children.stop()
