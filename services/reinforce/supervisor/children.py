"""The child processes of a local run, as a Kubernetes run has them as pods: redis-server, the Triton reward server,
the environment service, the critic (algorithm.name ppo), N generators and the trainer, each started with its
launch flags, its share of the CPU threads and only its own credentials, and listed for Prometheus."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import sys
from dataclasses import dataclass

import redis

from reinforce.core import launch
from reinforce.core.durable import write_text_atomically
from reinforce.core.launch_flags import (
    CriticFlags,
    EnvironmentFlags,
    GeneratorFlags,
    LaunchFlags,
    RewardFlags,
    TrainerFlags,
)
from reinforce.core.metrics import file_sd_target
from reinforce.core.names import (
    COMPONENT_CRITIC,
    COMPONENT_ENVIRONMENT,
    COMPONENT_GENERATOR,
    COMPONENT_REWARD,
    COMPONENT_TRAINER,
    CONTROL_TOKEN_ENV,
    CRITIC_TOKEN_ENV,
    ENVIRONMENT_TOKEN_ENV,
    LOCAL_HOST,
    REDIS_URL_ENV,
    WEIGHTS_TOKEN_ENV,
)
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import RunSpec
from reinforce.core.threads import OPENMP_ENVIRONMENT, thread_count
from reinforce.supervisor.component import Component, http_ok, redis_pings
from reinforce.supervisor.ports import free_port

log = logging.getLogger("reinforce")
CREDENTIALS = (REDIS_URL_ENV, CONTROL_TOKEN_ENV, WEIGHTS_TOKEN_ENV, CRITIC_TOKEN_ENV, ENVIRONMENT_TOKEN_ENV)
# In the run folder: every component's metrics address, in Prometheus' file-service-discovery format.
PROMETHEUS_TARGETS = "prometheus_targets.json"


@dataclass(frozen=True)
class ThreadShares:
    """CPU threads of each kind of process (per process: each generator, each trainer rank)."""

    trainer: int
    generator: int
    reward: int
    critic: int


def thread_shares(spec: RunSpec, cpus: int) -> ThreadShares:
    """Share `cpus` between the processes that are busy at the same time, so that together they run one thread per
    core: oversubscribed OpenMP threads spin waiting for each other and a step takes many times longer.

    On-policy (max_policy_lag 0) generation, reward and training take turns: each gets every core, the generators
    (which sample at the same time) sharing them. Asynchronous, generators sample while the trainer trains: the
    trainer gets half the cores, the generators the other half. Trainer ranks train at the same time, and PPO's
    critic trains beside the actor: they share the trainer's cores.
    """
    on_policy = spec.algorithm.max_policy_lag == 0
    trainer_cores = cpus if on_policy else max(cpus // 2, 1)
    generator_cores = cpus if on_policy else max(cpus - trainer_cores, 1)
    trainers = spec.training.num_ranks + (spec.algorithm.name == "ppo")
    return ThreadShares(
        trainer=max(trainer_cores // trainers, 1),
        generator=max(generator_cores // spec.generation.num_generators, 1),
        reward=cpus,
        critic=max(trainer_cores // trainers, 1),
    )


def processes_take_turns(spec: RunSpec) -> bool:
    """Whether the run's processes compute one at a time: on-policy, one generator, one trainer rank, no critic
    training beside it, no reward model scoring beside the generator and no tool sandbox. (An evaluation's scoring,
    data.validation_prompts, overlaps the next step's sampling for the length of a forward pass: not counted.)"""
    return (
        spec.algorithm.max_policy_lag == 0
        and spec.generation.num_generators == 1
        and spec.training.num_ranks == 1
        and spec.algorithm.name != "ppo"
        and spec.reward.type != "hf_classifier"
        and not spec.environment.enabled
    )


def openmp_environment(spec: RunSpec) -> dict[str, str]:
    """How the children's OpenMP threads wait. Where the run's processes take turns, as libgomp does by default:
    spinning a few milliseconds before sleeping, so the next parallel region starts at once. Anywhere else
    OPENMP_ENVIRONMENT's PASSIVE: a thread spinning on a core another busy process needs slows both many times
    (docs/concepts.md has both measurements)."""
    return {} if processes_take_turns(spec) else OPENMP_ENVIRONMENT


class Children:
    """Starts a run's child processes, remembers them (`components`, in start order) and stops them."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.paths = RunPaths(spec.resolved_run_dir())
        self.components: list[Component] = []
        self.env = {**openmp_environment(spec), **os.environ, "PYTHONUNBUFFERED": "1"}  # a user's own OMP settings win
        # Secrets reach only the services that use them (launch.Service.credentials), never every child; one random
        # token per capability, so a generator cannot drive the critic. The Redis URL is added once Redis runs.
        for name in CREDENTIALS:
            self.env.pop(name, None)
        self.credentials = {name: secrets.token_urlsafe(24) for name in (CONTROL_TOKEN_ENV, WEIGHTS_TOKEN_ENV)}
        if spec.algorithm.name == "ppo":
            self.credentials[CRITIC_TOKEN_ENV] = secrets.token_urlsafe(24)
        if spec.environment.enabled:
            self.credentials[ENVIRONMENT_TOKEN_ENV] = secrets.token_urlsafe(24)
        self.scrape_targets: list[dict] = []
        # weights.transport http: the trainer's weight endpoint, known before generators start (their --weights-url)
        self.weights_port = free_port() if spec.weights.transport == "http" else None
        self.threads = thread_shares(spec, thread_count())
        self.environment_url: str | None = None
        self.starting: list[tuple[Component, str]] = []  # started, not yet waited for: each with its readiness URL

    def component(
        self, name: str, argv: list[str], threads: int | None = None, service: launch.Service | None = None
    ) -> Component:
        c = Component(name, argv, self.paths.logs / f"{name}.log", threads)
        if service is not None:
            c.credentials = {k: v for k, v in self.credentials.items() if launch.holds(service, k, self.spec)}
        c.start(self.env)
        self.components.append(c)
        return c

    def service_argv(self, service: launch.Service, flags: LaunchFlags) -> list[str]:
        return service.command(sys.executable, str(self.paths.spec), flags)

    def start_redis(self) -> None:
        port = free_port()
        password = secrets.token_urlsafe(24)
        self.paths.redis.mkdir(parents=True, exist_ok=True)
        # The password goes in a private config file, not on a command line that `ps` shows.
        config = self.paths.redis / "redis.conf"
        config.touch(mode=0o600)
        config.write_text(
            f"port {port}\nbind {LOCAL_HOST}\ndir {self.paths.redis}\nrequirepass {password}\n"
            # Append-only file, fsync on every write: a Redis crash or restart loses nothing acknowledged.
            'appendonly yes\nappendfsync always\nsave ""\n'
        )
        c = self.component("redis", [shutil.which("redis-server") or "redis-server", str(config)])
        url = f"redis://:{password}@{LOCAL_HOST}:{port}/0"
        self.credentials[REDIS_URL_ENV] = url
        client = redis.Redis.from_url(url)
        c.wait_until(lambda: redis_pings(client))

    def start_environment(self) -> str:
        """The environment service (environment.enabled); its port also serves its metrics."""
        port = free_port()
        self.add_scrape_target(COMPONENT_ENVIRONMENT, COMPONENT_ENVIRONMENT, port)
        argv = self.service_argv(launch.ENVIRONMENT, EnvironmentFlags(port=port))
        c = self.component(COMPONENT_ENVIRONMENT, argv, service=launch.ENVIRONMENT)
        self.environment_url = f"http://{LOCAL_HOST}:{port}"
        self.starting.append((c, self.environment_url + launch.ENVIRONMENT.ready_path))
        return self.environment_url

    def start_reward(self) -> str:
        http, grpc, metrics = free_port(), free_port(), free_port()
        self.add_scrape_target(COMPONENT_REWARD, "reward", metrics)
        # reward.function code_tests runs the tests in the environment service (started before it)
        environment_url = self.environment_url if self.spec.reward.uses_environment else None
        flags = RewardFlags(http_port=http, grpc_port=grpc, metrics_port=metrics, environment_url=environment_url)
        c = self.component("reward", self.service_argv(launch.REWARD, flags), self.threads.reward, launch.REWARD)
        url = f"http://{LOCAL_HOST}:{http}"
        self.starting.append((c, url + launch.REWARD.ready_path))
        return url

    def start_critic(self) -> str:
        """PPO's critic service; its port also serves its metrics."""
        port = free_port()
        self.add_scrape_target(COMPONENT_CRITIC, "critic", port)
        argv = self.service_argv(launch.CRITIC, CriticFlags(port=port))
        c = self.component(COMPONENT_CRITIC, argv, self.threads.critic, launch.CRITIC)
        url = f"http://{LOCAL_HOST}:{port}"
        self.starting.append((c, url + launch.CRITIC.ready_path))
        return url

    def start_generators(self, reward_url: str) -> dict[str, str]:
        """Every generator: their names -> control-plane URLs."""
        urls = {}
        for i in range(self.spec.generation.num_generators):
            name, port = f"generator-{i}", free_port()
            self.add_scrape_target(COMPONENT_GENERATOR, name, port)
            weights_url = launch.weights_url(LOCAL_HOST, self.weights_port) if self.weights_port else None
            flags = GeneratorFlags(
                reward_url=reward_url, port=port, id=name, weights_url=weights_url, environment_url=self.environment_url
            )
            argv = self.service_argv(launch.GENERATOR, flags)
            c = self.component(name, argv, self.threads.generator, launch.GENERATOR)
            urls[name] = f"http://{LOCAL_HOST}:{port}"
            self.starting.append((c, urls[name] + launch.GENERATOR.ready_path))
        return urls

    def wait_until_ready(self) -> None:
        """Until every component started since the last call answers its readiness probe: they start side by side
        (one's start-up, mostly imports and loading a model, need not wait for another's), and a RunFailed names
        the first that exits or is not ready in time."""
        for c, ready_url in self.starting:
            c.wait_until(lambda url=ready_url: http_ok(url))
        self.starting.clear()

    def start_trainer(self, critic_url: str | None) -> Component:
        return self.component("trainer", self.trainer_argv(critic_url), self.threads.trainer, launch.TRAINER)

    def trainer_argv(self, critic_url: str | None) -> list[str]:
        metrics_port = free_port()
        self.add_scrape_target(COMPONENT_TRAINER, "trainer", metrics_port)
        flags = TrainerFlags(metrics_port=metrics_port, weights_port=self.weights_port or 0, critic_url=critic_url)
        argv = self.service_argv(launch.TRAINER, flags)
        ranks = self.spec.training.num_ranks
        if ranks == 1:
            return argv
        # torchrun starts one process per rank and stops them all if one dies (then the restart policy acts)
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
        return [*launcher, f"--master-addr={LOCAL_HOST}", f"--master-port={free_port()}", *argv[1:]]

    def add_scrape_target(self, component: str, instance: str, port: int) -> None:
        """List a metrics endpoint in RUN_DIR/prometheus_targets.json, for a Prometheus `file_sd_configs`."""
        self.scrape_targets.append(file_sd_target(self.spec.name, component, instance, f"{LOCAL_HOST}:{port}"))
        self.write_scrape_targets()

    def write_scrape_targets(self) -> None:
        """Rewritten whole, by rename: Prometheus watches the file and must never read half of it."""
        write_text_atomically(self.paths.root / PROMETHEUS_TARGETS, json.dumps(self.scrape_targets, indent=2) + "\n")

    def stop(self) -> None:
        # trainer first (it checkpoints), then generators, the critic, reward server, Redis last; one that cannot
        # be stopped cleanly must not keep the others running
        for c in reversed(self.components):
            try:
                c.stop()
            except Exception:
                log.exception("stopping component %s failed; stopping the others", c.name)
        # A stopped run has nothing to scrape (and no alert should report its processes as down).
        self.scrape_targets.clear()
        try:
            self.write_scrape_targets()
        except OSError as err:  # a full disk: no file lists no targets either, and deleting frees space
            log.warning("rewriting %s failed (%s): deleting it", PROMETHEUS_TARGETS, err)
            (self.paths.root / PROMETHEUS_TARGETS).unlink(missing_ok=True)
