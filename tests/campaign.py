"""A fault campaign: faults of every kind thrown at one `reinforce run` from a seeded schedule.

`benchmarks/fault_campaign.py` throws a hundred and writes the table to BENCHMARKS.md;
tests/integration/test_fault_campaign.py throws about twenty in CI. What must hold afterwards:

- **process faults** (kill -9 of a component, which the supervisor restarts; SIGSTOP stalls past the generators'
  reclaim time; kill -9 of the supervisor and everything under it, then `reinforce run --resume`): the final
  weights equal an undisturbed run's of the same spec, bit for bit;
- **data faults** (undecodable and copied records pushed into the run's streams, a copied group with NaN
  log-probs): each undecodable entry is dead-lettered, and copies are dropped or refused, so that every step still
  trains once on its own prompts (the audit trail) and the weights stay the undisturbed run's.

A fault strikes once the trainer has finished its step; after a process fault the campaign waits until a later
step is trained (the time that took, beyond a median step, is the fault's cost) before it throws the next.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import redis
import yaml
from runs import redis_pid, run_queue, service_pids

from reinforce.core.metrics import read_metrics
from reinforce.core.queue import DATA_FIELD, RolloutQueue
from reinforce.core.records_pb2 import RolloutGroup
from reinforce.core.run_dir import RunPaths

# Restarts the campaign's runs allow: every kill is one restart of its component, quickly.
RESTARTS = {"max_restarts": 1000, "backoff_s": 0.2, "max_backoff_s": 1.0}
RECLAIM_IDLE_S = 2.0  # generation.reclaim_idle_s of the campaign's runs: a stall outlasts it by STALL_BEYOND_S
STALL_BEYOND_S = 1.0
RECOVERY_TIMEOUT_S = 300.0  # a fault the run has not recovered from by then fails the campaign
GARBAGE = b"\xff\xfe not a protobuf record"


@dataclass
class Campaign:
    """The run under attack: its folder, the supervisor's process (replaced on --resume) and its output files."""

    run_dir: Path
    output: Path
    proc: subprocess.Popen | None = None
    rng: random.Random = field(default_factory=random.Random)
    resumes: int = 0

    def start(self, *args: str) -> None:
        with (
            (self.output / f"stdout-{self.resumes}.txt").open("w") as out,
            (self.output / f"stderr-{self.resumes}.txt").open("w") as err,
        ):  # files, not pipes: nobody reads a pipe during a long run, and a full one blocks it
            self.proc = subprocess.Popen([sys.executable, "-m", "reinforce", *args], stdout=out, stderr=err)

    def stderr(self) -> str:
        return "".join(p.read_text() for p in sorted(self.output.glob("stderr-*.txt")))

    def last_step(self) -> int:
        rows = read_metrics(RunPaths(self.run_dir).metrics)
        return int(rows[-1]["step"]) if rows else 0

    def wait_for_step(self, step: int, since: float = 0.0, timeout_s: float = RECOVERY_TIMEOUT_S) -> None:
        """Until step `step` (or a later one) is the last trained, at a time after `since` (a step that ended while
        a fault struck does not show that the run recovered from it); fails if the run ends first."""
        deadline = time.monotonic() + timeout_s
        while not ((rows := read_metrics(RunPaths(self.run_dir).metrics)) and rows[-1]["step"] >= step > 0 and (
            rows[-1]["time"] > since
        )):  # fmt: skip
            assert self.proc.poll() is None, f"the run ended at step {self.last_step()}:\n{self.stderr()[-3000:]}"
            assert time.monotonic() < deadline, f"step {step} not trained in {timeout_s} s"
            time.sleep(0.1)

    def with_queue(self, action: Callable[[redis.Redis, RolloutQueue], None]) -> None:
        """`action` on the run's Redis, through an outage (a restart, a resumed run's new Redis): a data fault may
        strike while a process fault's restart is still under way."""
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while True:
            client, queue = run_queue(self.run_dir)
            try:
                with client:
                    return action(client, queue)
            except (redis.ConnectionError, redis.TimeoutError):
                assert time.monotonic() < deadline, f"the run's Redis unreachable for {RECOVERY_TIMEOUT_S} s"
                time.sleep(0.5)


def newest_pid(campaign: Campaign, module: str, name: str = "", timeout_s: float = 60) -> int:
    """The newest process of a component (a restarted one may take a moment to be back)."""
    deadline = time.monotonic() + timeout_s
    while not (pids := service_pids(campaign.run_dir, module, name)):
        assert time.monotonic() < deadline, f"no {module} {name} process in {timeout_s} s"
        time.sleep(0.1)
    return max(pids)


def generator_pid(campaign: Campaign) -> int:
    spec = yaml.safe_load((campaign.run_dir / "spec.yaml").read_text())
    count = spec.get("generation", {}).get("num_generators", 1)
    return newest_pid(campaign, "reinforce.generator", f"--id generator-{campaign.rng.randrange(count)}( |$)")


def kill(pid_of: Callable[[Campaign], int]) -> Callable[[Campaign], None]:
    return lambda campaign: os.kill(pid_of(campaign), signal.SIGKILL)


def stall(pid_of: Callable[[Campaign], int]) -> Callable[[Campaign], None]:
    """SIGSTOP past the reclaim time (another generator takes the stalled one's prompts over), then SIGCONT."""

    def strike(campaign: Campaign) -> None:
        pid = pid_of(campaign)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(RECLAIM_IDLE_S + STALL_BEYOND_S)
        os.kill(pid, signal.SIGCONT)

    return strike


def component(module: str) -> Callable[[Campaign], int]:
    return lambda campaign: newest_pid(campaign, module)


def kill_everything(campaign: Campaign) -> None:
    """kill -9 of the supervisor, then of every process group under it (each component runs in its own; Triton
    is a grandchild of the reward server's) and Redis; then `reinforce run --resume`."""
    campaign.proc.kill()
    campaign.proc.wait(60)
    pids = service_pids(campaign.run_dir)
    with contextlib.suppress(ValueError, AssertionError):  # Redis may be between a kill and its restart
        pids.append(redis_pid(campaign.run_dir))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    campaign.resumes += 1
    campaign.start("run", "--resume", str(campaign.run_dir))


def push_garbage(stream: str) -> Callable[[Campaign], None]:
    """An undecodable entry in the run's prompts or rollouts stream: its reader must dead-letter it."""

    def strike(client: redis.Redis, queue: RolloutQueue) -> None:
        key = getattr(queue, f"{stream}_key")
        entry_id = client.xadd(key, {DATA_FIELD: GARBAGE})
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while not any(fields[b"entry_id"] == entry_id for _, fields in client.xrange(queue.deadletter_key)):
            assert time.monotonic() < deadline, f"garbage entry {entry_id!r} in {key} never dead-lettered"
            time.sleep(0.1)

    return lambda campaign: campaign.with_queue(strike)


def push_copy(stream: str, forge: Callable[[bytes], bytes] = lambda data: data) -> Callable[[Campaign], None]:
    """A copy (through `forge`) of an entry waiting in a stream: a prompt sampled twice, a group delivered twice."""

    def strike(client: redis.Redis, queue: RolloutQueue) -> None:
        key = getattr(queue, f"{stream}_key")
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while not (entries := client.xrange(key, count=1)):
            assert time.monotonic() < deadline, f"{key} stayed empty"
            time.sleep(0.05)
        [(_, fields)] = entries
        client.xadd(key, {DATA_FIELD: forge(fields[DATA_FIELD])})

    return lambda campaign: campaign.with_queue(strike)


def nan_logprobs(data: bytes) -> bytes:
    group = RolloutGroup.FromString(data)
    for sample in group.samples:
        sample.logprobs[:] = [math.nan] * len(sample.logprobs)
    return group.SerializeToString()


PROCESS_FAULTS: dict[str, Callable[[Campaign], None]] = {
    "kill -9 trainer": kill(component("reinforce.trainer")),
    "kill -9 a generator": kill(generator_pid),
    "kill -9 reward server": kill(component("reinforce.reward")),
    "kill -9 redis-server": kill(lambda campaign: redis_pid(campaign.run_dir)),
    "kill -9 environment service": kill(component("reinforce.environment")),
    "kill -9 critic": kill(component("reinforce.critic")),
    "SIGSTOP a generator past the reclaim time": stall(generator_pid),
    "SIGSTOP trainer": stall(component("reinforce.trainer")),
    "kill -9 supervisor and all, then --resume": kill_everything,
}
DATA_FAULTS: dict[str, Callable[[Campaign], None]] = {
    "undecodable prompt entry": push_garbage("prompts"),
    "undecodable rollout entry": push_garbage("rollouts"),
    "duplicated prompt entry": push_copy("prompts"),
    "duplicated rollout entry": push_copy("rollouts"),
    "rollout copy with NaN log-probs": push_copy("rollouts", nan_logprobs),
}
FAULTS = {**PROCESS_FAULTS, **DATA_FAULTS}


def kinds_for(spec: dict) -> list[str]:
    """The fault kinds that apply to a spec: the environment service's and the critic's only where they run."""
    absent = set()
    if not spec.get("environment", {}).get("enabled"):
        absent.add("kill -9 environment service")
    if spec.get("algorithm", {}).get("name", "reinforce") != "ppo":
        absent.add("kill -9 critic")
    return [kind for kind in FAULTS if kind not in absent]


def schedule(seed: int, faults: int, steps: int, kinds: list[str]) -> list[tuple[int, str]]:
    """`faults` faults, every kind about equally often, in a seeded order; each strikes once the trainer has
    finished a step of 1..steps-2, the process faults each after a step of its own (the campaign waits for the
    step after it before the next: two on one step would push the last ones past the run's end)."""
    rng = random.Random(seed)
    chosen = [kinds[i % len(kinds)] for i in range(faults)]
    rng.shuffle(chosen)
    process = [kind for kind in chosen if kind in PROCESS_FAULTS]
    if len(process) > steps - 2:
        raise ValueError(f"{len(process)} process faults need more than {steps} steps (one each, and two to end)")
    at = iter(sorted(rng.sample(range(1, steps - 1), len(process))))
    return sorted((next(at) if kind in PROCESS_FAULTS else rng.randint(1, steps - 2), kind) for kind in chosen)


@dataclass(frozen=True)
class Struck:
    kind: str
    after_step: int  # the last trained step when it struck
    recovered_s: float  # process faults: from the strike to the next trained step (0 for data faults)


def run_campaign(spec: Path, output: Path, plan: list[tuple[int, str]], seed: int) -> tuple[Campaign, list[Struck]]:
    """Start `reinforce run SPEC`, throw the planned faults, wait for its end (a run that fails fails the
    campaign). The spec's run folder is kept for the caller's checks; the supervisor's output is in `output`."""
    run_dir = Path(yaml.safe_load(spec.read_text())["run_dir"])
    campaign = Campaign(run_dir, output, rng=random.Random(seed))
    campaign.start("run", str(spec))
    struck = []
    for step, kind in plan:
        campaign.wait_for_step(step)
        after, start, struck_at = campaign.last_step(), time.monotonic(), time.time()
        FAULTS[kind](campaign)
        if kind in PROCESS_FAULTS:
            campaign.wait_for_step(after + 1, since=struck_at)
        struck.append(Struck(kind, after, time.monotonic() - start if kind in PROCESS_FAULTS else 0.0))
    assert campaign.proc.wait(RECOVERY_TIMEOUT_S) == 0, campaign.stderr()[-3000:]
    return campaign, struck


def median_step_s(run_dir: Path) -> float:
    times = [row["time"] for row in read_metrics(RunPaths(run_dir).metrics)]
    return statistics.median(b - a for a, b in pairwise(times))


def campaign_overrides(steps: int, generators: int, **overrides: dict) -> dict[str, dict]:
    """write_spec's overrides for a campaign's run; its undisturbed twin runs the same spec (what the campaign adds,
    restarts and the reclaim time, changes no sample)."""
    generation = {"num_generators": generators, "reclaim_idle_s": RECLAIM_IDLE_S, **overrides.pop("generation", {})}
    training = {"steps": steps, **overrides.pop("training", {})}
    return {"training": training, "generation": generation, "restart": RESTARTS, **overrides}
