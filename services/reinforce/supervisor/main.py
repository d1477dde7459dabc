"""`reinforce`: the command line. `reinforce run SPEC.yaml` runs a whole pipeline on this machine.

The local supervisor starts the same services a Kubernetes run has, as child processes: redis-server, the
Triton reward server, the critic (algorithm.name ppo), N generators and the trainer. It drives weight rollout
with the same reconciler the operator uses, shows progress, and stops every child when the run ends, fails, or
on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from tqdm import tqdm
from transformers import AutoConfig

from reinforce.core import launch
from reinforce.core.checkpoints import ForeignCheckpoint, refuse_foreign_checkpoints
from reinforce.core.data import DataError, read_prompt_file
from reinforce.core.durable import write_text_atomically
from reinforce.core.launch_flags import (
    CriticFlags,
    EnvironmentFlags,
    GeneratorFlags,
    LaunchFlags,
    RewardFlags,
    TrainerFlags,
)
from reinforce.core.metrics import file_sd_target, read_metrics, shown
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
from reinforce.core.optional import MissingPackage, require_backend, require_engine
from reinforce.core.policy import materialize_policy
from reinforce.core.prompt_shards import read_shard_index
from reinforce.core.queue import RolloutQueue, connect
from reinforce.core.rollout import WeightReconciler, relay_fanout
from reinforce.core.run_dir import RunPaths, ensure_run_id
from reinforce.core.spec import RunSpec, SpecError, check_fits_policy, dump_spec, load_spec
from reinforce.core.threads import OPENMP_ENVIRONMENT, THREADS_ENV, thread_count
from reinforce.core.trackers import check_trackers
from reinforce.supervisor.lock import RunFolderBusy, RunLock
from reinforce.supervisor.outcome import record_outcome
from reinforce.supervisor.ports import free_port
from reinforce.supervisor.samples import print_samples_summary

log = logging.getLogger("reinforce")
READY_TIMEOUT_S = 300
CREDENTIALS = (REDIS_URL_ENV, CONTROL_TOKEN_ENV, WEIGHTS_TOKEN_ENV, CRITIC_TOKEN_ENV, ENVIRONMENT_TOKEN_ENV)
# In the run folder: every component's metrics address, in Prometheus' file-service-discovery format.
PROMETHEUS_TARGETS = "prometheus_targets.json"


class RunFailed(RuntimeError):
    """A component died or never became ready; the message names it."""


@dataclass
class Component:
    name: str
    argv: list[str]
    log_path: Path
    threads: int | None = None  # its CPU threads ($REINFORCE_NUM_THREADS; None: the service decides)
    process: subprocess.Popen | None = None
    restarts: int = 0
    restart_at: float | None = None  # monotonic time of a scheduled restart
    started_at: float = 0.0  # monotonic time of the last (re)start
    credentials: dict[str, str] = field(default_factory=dict)  # its secrets' environment variables, no one else's

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**env, **self.credentials}
        if self.threads is not None:
            env = {**env, THREADS_ENV: str(self.threads)}
        # O_APPEND: every write lands at the end, also after rotate_log truncated the file under the process
        with self.log_path.open("ab") as out:
            # own process group: Ctrl-C reaches the supervisor only, which then stops children in order
            self.process = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.started_at = time.monotonic()

    def rotate_log(self, max_bytes: int) -> None:
        """Past `max_bytes`, the log is copied to NAME.log.1 (replacing the older copy) and emptied: the process
        keeps its descriptor, so the file is truncated in place (logrotate's copytruncate; output written during
        the copy can be lost)."""
        try:
            if self.log_path.stat().st_size <= max_bytes:
                return
            shutil.copyfile(self.log_path, self.log_path.with_name(self.log_path.name + ".1"))
            os.truncate(self.log_path, 0)
        except OSError as err:  # a full disk: the run goes on, its log unrotated
            log.warning("rotating %s failed: %s", self.log_path, err)

    def exit_code(self) -> int | None:
        return self.process.poll() if self.process else None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then after `grace_s` SIGKILL to the whole process group (Triton runs as a grandchild).

        Idempotent: a stopped component has no process (and no process group) left to signal.
        """
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def failure(self, code: int) -> RunFailed:
        restarted = f" after {self.restarts} restarts" if self.restarts else ""
        return RunFailed(
            f"component {self.name} exited with code {code}{restarted}; giving up. "
            f"Log {self.log_path}, last lines:\n{self.log_tail()}"
        )


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


def resolve_spec(spec: RunSpec, spec_file: Path) -> RunSpec:
    """Absolute paths, so every process reads the same files whatever its working directory."""

    def local(path: str) -> str:
        p = Path(path)
        return str(p if p.is_absolute() else (spec_file.parent / p).resolve())

    policy = spec.policy
    if policy.path and not policy.path.startswith("package:"):
        policy = policy.model_copy(update={"path": local(policy.path)})
    reward = spec.reward
    if reward.path:
        reward = reward.model_copy(update={"path": local(reward.path)})
    critic = spec.critic
    if critic.reward_model_path:
        critic = critic.model_copy(update={"reward_model_path": local(critic.reward_model_path)})
    return spec.model_copy(
        update={
            "run_dir": str(spec.resolved_run_dir().resolve()),
            "policy": policy,
            "reward": reward,
            "critic": critic,
            "data": spec.data.model_copy(
                update={
                    "prompts": local(spec.data.prompts),
                    "validation_prompts": spec.data.validation_prompts and local(spec.data.validation_prompts),
                }
            ),
        }
    )


class Supervisor:
    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.paths = RunPaths(spec.resolved_run_dir())
        self.components: list[Component] = []
        self.env = {**OPENMP_ENVIRONMENT, **os.environ, "PYTHONUNBUFFERED": "1"}  # a user's own OMP settings win
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
        self.max_log_bytes = int(spec.logging.max_component_log_mb * 2**20)

    def component(
        self, name: str, argv: list[str], threads: int | None = None, service: launch.Service | None = None
    ) -> Component:
        c = Component(name, argv, self.paths.logs / f"{name}.log", threads)
        if service is not None:
            c.credentials = {k: v for k, v in self.credentials.items() if launch.holds(service, k, self.spec)}
        c.start(self.env)
        self.components.append(c)
        return c

    def wait_until(self, what: Component, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready():
            code = what.exit_code()
            if code is not None:
                raise what.failure(code)
            if time.monotonic() > deadline:
                raise RunFailed(f"component {what.name} not ready after {READY_TIMEOUT_S}s; log {what.log_path}")
            time.sleep(0.2)

    def service_argv(self, service: launch.Service, flags: LaunchFlags) -> list[str]:
        return service.command(sys.executable, str(self.paths.spec), flags)

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
        self.wait_until(c, lambda: _redis_pings(client))

    def start_reward(self) -> str:
        http, grpc, metrics = free_port(), free_port(), free_port()
        self.add_scrape_target(COMPONENT_REWARD, "reward", metrics)
        # reward.function code_tests runs the tests in the environment service (started before it)
        environment_url = self.environment_url if self.spec.reward.uses_environment else None
        flags = RewardFlags(http_port=http, grpc_port=grpc, metrics_port=metrics, environment_url=environment_url)
        c = self.component(
            "reward",
            self.service_argv(launch.REWARD, flags),
            self.threads.reward,
            launch.REWARD,
        )
        url = f"http://{LOCAL_HOST}:{http}"
        self.wait_until(c, lambda: _http_ok(url + launch.REWARD.ready_path))
        return url

    def start_critic(self) -> str:
        """PPO's critic service; its port also serves its metrics."""
        port = free_port()
        self.add_scrape_target(COMPONENT_CRITIC, "critic", port)
        argv = self.service_argv(launch.CRITIC, CriticFlags(port=port))
        c = self.component(COMPONENT_CRITIC, argv, self.threads.critic, launch.CRITIC)
        url = f"http://{LOCAL_HOST}:{port}"
        self.wait_until(c, lambda: _http_ok(url + launch.CRITIC.ready_path))
        return url

    def start_environment(self) -> str:
        """The environment service (environment.enabled); its port also serves its metrics."""
        port = free_port()
        self.add_scrape_target(COMPONENT_ENVIRONMENT, COMPONENT_ENVIRONMENT, port)
        argv = self.service_argv(launch.ENVIRONMENT, EnvironmentFlags(port=port))
        c = self.component(COMPONENT_ENVIRONMENT, argv, service=launch.ENVIRONMENT)
        url = f"http://{LOCAL_HOST}:{port}"
        self.wait_until(c, lambda: _http_ok(url + launch.ENVIRONMENT.ready_path))
        return url

    def start_generators(self, reward_url: str) -> dict[str, str]:
        urls = {}
        for i in range(self.spec.generation.num_generators):
            name, port = f"generator-{i}", free_port()
            self.add_scrape_target(COMPONENT_GENERATOR, name, port)
            weights_url = launch.weights_url(LOCAL_HOST, self.weights_port) if self.weights_port else None
            flags = GeneratorFlags(
                reward_url=reward_url, port=port, id=name, weights_url=weights_url, environment_url=self.environment_url
            )
            argv = self.service_argv(launch.GENERATOR, flags)
            self.component(name, argv, self.threads.generator, launch.GENERATOR)
            urls[name] = f"http://{LOCAL_HOST}:{port}"
        for c, url in zip(self.components[-len(urls) :], urls.values(), strict=True):
            self.wait_until(c, lambda url=url: _http_ok(url + launch.GENERATOR.ready_path))
        return urls

    def add_scrape_target(self, component: str, instance: str, port: int) -> None:
        """List a metrics endpoint in RUN_DIR/prometheus_targets.json, for a Prometheus `file_sd_configs`."""
        self.scrape_targets.append(file_sd_target(self.spec.name, component, instance, f"{LOCAL_HOST}:{port}"))
        self.write_scrape_targets()

    def write_scrape_targets(self) -> None:
        """Rewritten whole, by rename: Prometheus watches the file and must never read half of it."""
        write_text_atomically(self.paths.root / PROMETHEUS_TARGETS, json.dumps(self.scrape_targets, indent=2) + "\n")

    def run(self) -> None:
        self.start_redis()
        # the generators' multi-turn rollouts run their episodes here (and reward.function code_tests its tests)
        self.environment_url = self.start_environment() if self.spec.environment.enabled else None
        reward_url = self.start_reward()
        critic_url = self.start_critic() if self.spec.algorithm.name == "ppo" else None
        generator_urls = self.start_generators(reward_url)
        trainer = self.component("trainer", self.trainer_argv(critic_url), self.threads.trainer, launch.TRAINER)
        # A short outage budget: the reconciler is level-triggered (a failed pass is retried by the next), and
        # the supervisor's loop must not stall while it restarts Redis itself.
        queue = RolloutQueue(connect(self.credentials[REDIS_URL_ENV], max_outage_s=1.0), self.spec.name)
        fanout = relay_fanout(self.spec.weights)
        reconciler = WeightReconciler(queue, generator_urls, self.credentials[CONTROL_TOKEN_ENV], relay_fanout=fanout)
        try:
            self.watch(trainer, reconciler)
        finally:
            reconciler.close()

    def watch(self, trainer: Component, reconciler: WeightReconciler) -> None:
        progress = Progress(self.paths, self.spec.training.steps)
        try:
            while trainer.exit_code() != 0:
                for c in self.components:
                    self.supervise(c)
                    c.rotate_log(self.max_log_bytes)
                reconciler.reconcile_once()
                progress.update()
                time.sleep(0.05)
            progress.update()
        finally:
            progress.close()

    def supervise(self, c: Component) -> None:
        """Restart a component that exited, with exponential back-off, like a pod's restart policy."""
        if c.restart_at is not None:
            if time.monotonic() >= c.restart_at:
                c.restart_at = None
                c.start(self.env)
            return
        code = c.exit_code()
        if code is None:
            return
        policy = self.spec.restart
        if c.restarts and time.monotonic() - c.started_at >= policy.reset_after_s:
            # like the kubelet's back-off reset: faults hours apart do not add up to a crash loop
            tqdm.write(
                f"component {c.name} ran {time.monotonic() - c.started_at:.0f}s since its last restart: "
                f"its restart count ({c.restarts}) is reset",
                file=sys.stderr,
            )
            c.restarts = 0
        if c.restarts >= policy.max_restarts:
            raise c.failure(code)
        c.stop()  # reap what is left of its process group (Triton runs as a grandchild and holds the ports)
        delay = min(policy.backoff_s * 2**c.restarts, policy.max_backoff_s)
        c.restarts += 1
        c.restart_at = time.monotonic() + delay
        tqdm.write(
            f"component {c.name} exited with code {code}; restart {c.restarts} of {policy.max_restarts} "
            f"in {delay:.1f}s (log {c.log_path})",
            file=sys.stderr,
        )

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


def _redis_pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


class Progress:
    """The progress bar, fed from metrics.jsonl (re-read only when the trainer has appended to it)."""

    def __init__(self, paths: RunPaths, total_steps: int) -> None:
        self.paths = paths
        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
        self._size = 0

    def update(self) -> None:
        size = self.paths.metrics.stat().st_size if self.paths.metrics.exists() else 0
        if size == self._size:
            return
        self._size = size
        rows = read_metrics(self.paths.metrics)
        if not rows:  # a restarted trainer dropped the rows of the steps it redoes
            self.bar.reset()
            return
        rows = [r for r in rows if "train_rollouts/rewards" in r]  # not the start's validation-only row
        if not rows:
            return
        last = rows[-1]
        self.bar.update(last["step"] - self.bar.n)
        self.bar.set_postfix(
            reward=shown(last.get("train_rollouts/rewards"), ".3f"),
            kl=shown(last.get("train_rollouts/init_policy_kl"), ".4f"),
            tok_s=shown(last.get("throughput/generated_tokens_per_second"), ".0f"),
        )

    def close(self) -> None:
        self.bar.close()


def prepare_run_dir(spec: RunSpec, resume: bool, overwrite: bool) -> tuple[RunPaths, RunLock]:
    """The run folder, locked for this supervisor before anything in it is read, deleted or written."""
    paths = RunPaths(spec.resolved_run_dir())
    try:
        lock = RunLock(paths.lock)
    except RunFolderBusy as err:
        raise RunFailed(str(err)) from None
    started = paths.metrics.exists() or paths.checkpoints.exists()
    if started and overwrite:
        _empty_folder(paths.root, keep=paths.lock)
    elif started and not resume:
        lock.release()
        raise RunFailed(
            f"run folder {paths.root} already holds a run: pass --resume to continue it or --overwrite to start over"
        )
    if not resume:
        shutil.rmtree(paths.redis, ignore_errors=True)  # a fresh run starts from an empty queue
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.remove_partial_files()  # what an earlier life's crash or full disk left half-written
    try:
        refuse_foreign_checkpoints(paths.checkpoints, ensure_run_id(paths))
    except ForeignCheckpoint as err:
        lock.release()
        raise RunFailed(str(err)) from None
    return paths, lock


def _empty_folder(folder: Path, keep: Path) -> None:
    """Delete what `folder` holds except `keep` (the held lock: deleting it would let another supervisor in)."""
    for entry in folder.iterdir():
        if entry == keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def run_command(args: argparse.Namespace) -> int:
    """`reinforce run`: the exit code (0 done, 1 a component failed, 2 a bad spec or prompt file, 130 Ctrl-C)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return _run(args)
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: the disk is full: {err}; free space, then `reinforce run --resume`", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.resume:
        spec_file = RunPaths(Path(args.resume)).spec
        spec = load_spec(spec_file)
    else:
        spec_file = Path(args.spec)
        spec = load_spec(spec_file)
        if args.run_dir:  # the command line's run folder wins over the spec's
            spec = spec.model_copy(update={"run_dir": args.run_dir})
        spec = resolve_spec(spec, spec_file)
    # A bad prompt file (or shard folder) fails now, naming file:line; so does a tracker whose extra is not installed.
    for name in ("prompts", "validation_prompts"):
        if getattr(spec.data, name):
            try:
                if name == "prompts" and spec.data.loader == "dali":
                    read_shard_index(Path(spec.data.prompts), spec.data)
                else:
                    read_prompt_file(getattr(spec.data, name), spec.data.on_bad_line, spec.data.prompt_field)
            except DataError as err:
                raise SpecError(f"{spec_file}: data.{name}: {err}") from None
    try:
        check_trackers(spec.logging.trackers)
        require_engine(spec.generation.engine)
        require_backend(spec.training.backend)
    except MissingPackage as err:
        raise SpecError(f"{spec_file}: {err}") from None
    paths, _lock = prepare_run_dir(spec, resume=bool(args.resume), overwrite=args.overwrite)  # held until exit
    paths.spec.write_text(dump_spec(spec))
    generation = spec.generation
    print(
        f"run folder {paths.root}; generation engine {generation.engine} ({generation.resolved_dtype()}); "
        f"training precision {spec.training.resolved_precision()} (training.precision {spec.training.precision})",
        flush=True,
    )
    print("preparing the initial policy ...", flush=True)
    materialize_policy(spec.policy, paths.initial_policy, spec.seed)
    _check_fits_policy(spec, spec_file, paths.initial_policy)
    supervisor = Supervisor(spec)
    signals = _Signals()
    try:
        supervisor.run()
    except KeyboardInterrupt:
        print("interrupted: stopping every component", file=sys.stderr)
        record_outcome(paths, 130, "interrupted (Ctrl-C or SIGTERM)")
        return 130
    except RunFailed as err:
        record_outcome(paths, 1, str(err))
        raise
    finally:
        signals.stopping = True  # from here on a signal cannot interrupt the shutdown, however many come
        supervisor.stop()
        paths.remove_partial_files()  # a component that died mid-write (a full disk) left them
    record_outcome(paths, 0, "")
    _print_summary(paths)
    return 0


def _check_fits_policy(spec: RunSpec, spec_file: Path, policy_dir: Path) -> None:
    """Prompt + response must fit the policy's positions: said now, naming the fields, not by a generator later."""
    limit = getattr(AutoConfig.from_pretrained(policy_dir), "max_position_embeddings", None)
    if limit is None:  # a model family without absolute positions has no such limit
        return
    try:
        check_fits_policy(spec, limit)
    except ValueError as err:
        raise SpecError(f"{spec_file}: {err}") from None


class _Signals:
    """SIGINT and SIGTERM: the first interrupts the run; once the shutdown has begun, they only say so.

    A KeyboardInterrupt raised inside supervisor.stop() would leave every component not yet stopped running,
    in its own session, forever.
    """

    def __init__(self) -> None:
        self.stopping = False
        # Explicitly, also for SIGINT: a shell starts background jobs with SIGINT ignored, and Python keeps it so.
        signal.signal(signal.SIGTERM, self.handle)
        signal.signal(signal.SIGINT, self.handle)

    def handle(self, _signum: int, _frame: object) -> None:
        if self.stopping:
            print("already stopping every component; please wait", file=sys.stderr)
            return
        self.stopping = True
        raise KeyboardInterrupt


def _print_summary(paths: RunPaths) -> None:
    rows = [r for r in read_metrics(paths.metrics) if "train_rollouts/rewards" in r]
    if not rows:
        return
    first, last = rows[0], rows[-1]
    print(
        f"done: {last['step']} steps; reward {shown(first.get('train_rollouts/rewards'), '.3f')} -> "
        f"{shown(last.get('train_rollouts/rewards'), '.3f')}; "
        f"KL {shown(last.get('train_rollouts/init_policy_kl'), '.4f')}\n"
        f"  metrics {paths.metrics}\n  plot    {paths.plot}\n  model   {paths.final_model}"
    )
    print_samples_summary(paths)


def add_run_command(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser("run", help="run a whole pipeline locally")
    run.add_argument("spec", nargs="?", help="run spec YAML (see examples/)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    run.add_argument("--overwrite", action="store_true", help="delete an earlier run in the same run folder")
    run.add_argument("--run-dir", metavar="DIR", help="the run folder (instead of the spec's run_dir)")
    run.set_defaults(handler=run_command, check=_check_run_arguments)


def _check_run_arguments(args: argparse.Namespace) -> str | None:
    if bool(args.spec) == bool(args.resume):
        return "run takes a SPEC file or --resume RUN_DIR"
    return "--run-dir goes with a SPEC file (--resume names its run folder)" if args.resume and args.run_dir else None
