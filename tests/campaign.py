"""A fault campaign: faults of every kind thrown at one `reinforce run` from a seeded schedule.

`benchmarks/fault_campaign.py` throws a hundred and writes the table to BENCHMARKS.md;
tests/integration/test_fault_campaign.py throws about twenty in CI. What must hold afterwards:

- **process faults** (kill -9 of a component, which the supervisor restarts; SIGSTOP stalls past the generators'
  reclaim time; kill -9 of the supervisor and everything under it, then `reinforce run --resume`): the final
  weights equal an undisturbed run's of the same spec, bit for bit;
- **data faults** (undecodable and copied records pushed into the run's streams, a copied group with NaN
  log-probs): each undecodable entry is dead-lettered, and copies are dropped or refused, so that every step still
  trains once on its own prompts (the audit trail) and the weights stay the undisturbed run's;
- **a weight file damaged in transit** (emulated: a byte of the next published version's file flipped as it
  appears, so that what a generator reads does not match the published sha256, and set back once one refused it):
  timed and judged as the process faults, bit for bit: no generator samples with bytes it did not check;
- **a full disk during a checkpoint** (the checkpoints folder a small tmpfs, filled until the trainer's next
  checkpoint fails, then freed; root only): a process fault, the trainer exits and its restart resumes;
- **reward faults** (the reward function raises, or answers NaN, for its next few calls; a spec whose reward is
  tests/campaign_reward.py's): the samples scored then are left out of their step, so the weights are not the
  undisturbed run's; the audit names each prompt that lost samples, and how many, as the step's metrics count them.

A fault strikes once the trainer has finished its step; after a process fault the campaign waits until a later
step is trained (the time that took, beyond a median step, is the fault's cost) before it throws the next.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import random
import shutil
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
from campaign_reward import write_counts
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
CHECKPOINT_DISK = "32m"  # the checkpoints' tmpfs: a few of the tiny examples' checkpoints and the filler
FILLER = ".campaign-filler"  # not step-*: never a checkpoint to list, resume or rotate
REWARD_FAULT_CALLS = 2  # the reward function's calls a reward fault spoils: a window of a step or two
CAMPAIGN_REWARD = "campaign_reward:char_fraction_with_faults"  # tests/campaign_reward.py
TRAINER_FAILED = "component trainer exited with code 1; restart"  # the supervisor's line for a trainer that raised
WEIGHTS_REFUSED = "refusing weights:"  # a generator's log line for a version it did not load


@dataclass
class Campaign:
    """The run under attack: its folder, the supervisor's process (replaced on --resume) and its output files."""

    run_dir: Path
    output: Path
    proc: subprocess.Popen | None = None
    rng: random.Random = field(default_factory=random.Random)
    resumes: int = 0

    def start(self, *args: str) -> None:
        env = campaign_env()
        with (
            (self.output / f"stdout-{self.resumes}.txt").open("w") as out,
            (self.output / f"stderr-{self.resumes}.txt").open("w") as err,
        ):  # files, not pipes: nobody reads a pipe during a long run, and a full one blocks it
            self.proc = subprocess.Popen([sys.executable, "-m", "reinforce", *args], stdout=out, stderr=err, env=env)

    def stderr(self) -> str:
        return "".join(p.read_text() for p in sorted(self.output.glob("stderr-*.txt")))

    def last_step(self) -> int:
        rows = read_metrics(RunPaths(self.run_dir).metrics)
        return int(rows[-1]["step"]) if rows else 0

    def wait_for_step(self, step: int, since: float = 0.0) -> None:
        """Until step `step` (or a later one) is the last trained, at a time after `since` (a step that ended while
        a fault struck does not show that the run recovered from it)."""

        def trained() -> bool:
            rows = read_metrics(RunPaths(self.run_dir).metrics)
            return bool(rows) and rows[-1]["step"] >= step > 0 and rows[-1]["time"] > since

        self.wait_for(trained, f"step {step} trained")

    def wait_for(
        self, condition: Callable[[], bool], what: str, timeout_s: float = RECOVERY_TIMEOUT_S, poll_s: float = 0.1
    ) -> None:
        """Until `condition()`, asked every `poll_s`; fails if the run ends first, or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert self.proc.poll() is None, f"the run ended at step {self.last_step()}:\n{self.stderr()[-3000:]}"
            assert time.monotonic() < deadline, f"not {what} in {timeout_s} s"
            time.sleep(poll_s)

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


def campaign_env() -> dict[str, str]:
    """This process's environment with tests/ on the path: the reward server imports campaign_reward where the spec
    names it (CAMPAIGN_REWARD)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}


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


def damage_weights_in_transit(campaign: Campaign) -> None:
    """Flip a byte of each weight version published from now on, the moment its file appears, until a generator
    refuses one (a generator that read a version before the flip loaded it whole); then set it back, and the
    reconciler's next push is read whole."""
    paths = RunPaths(campaign.run_dir)
    refused = refusals(paths)
    seen = set(paths.weights.glob("v*.safetensors"))
    while refusals(paths) == refused:
        # a version is read once the reconciler's next pass (every 50-100 ms) pushes it: look every 5 ms
        campaign.wait_for(lambda: bool(set(paths.weights.glob("v*.safetensors")) - seen), "a new version", poll_s=0.005)
        [path] = set(paths.weights.glob("v*.safetensors")) - seen
        seen.add(path)
        with contextlib.suppress(FileNotFoundError), path.open("r+b") as weights:  # rotation may remove an old one
            offset = path.stat().st_size // 2
            weights.seek(offset)
            byte = weights.read(1)
            weights.seek(offset)
            weights.write(bytes([byte[0] ^ 0xFF]))
            weights.flush()
            with contextlib.suppress(AssertionError):
                campaign.wait_for(lambda: refusals(paths) > refused, "a generator refused the damaged version", 5.0)
            weights.seek(offset)
            weights.write(byte)


def refusals(paths: RunPaths) -> int:
    """The weight versions the generators refused (their logs' lines; a restart appends to the same file)."""
    return sum(log.read_text().count(WEIGHTS_REFUSED) for log in paths.logs.glob("generator-*.log"))


def fill_checkpoint_disk(campaign: Campaign) -> None:
    """Fill the checkpoints' tmpfs until the trainer's next checkpoint fails on it (the trainer exits, its restart
    resumes from the newest intact checkpoint), then free the space."""
    root = RunPaths(campaign.run_dir).checkpoints
    assert os.path.ismount(root), f"{root} is not the campaign's tmpfs (run_campaign mounts it)"
    exits = campaign.stderr().count(TRAINER_FAILED)
    with (root / FILLER).open("wb", buffering=0) as filler:
        try:
            while filler.write(b"\0" * 2**20):
                pass
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
    # the next checkpoint is at most checkpoint_every steps away
    campaign.wait_for(lambda: campaign.stderr().count(TRAINER_FAILED) > exits, "a checkpoint failed on the full disk")
    (root / FILLER).unlink()


def mounted_checkpoint_disk(campaign: Campaign) -> Path:
    """The run's checkpoints folder on a tmpfs of CHECKPOINT_DISK, mounted once the supervisor has prepared the
    run folder (a checkpoints folder before then would make it refuse the folder as another run's)."""
    paths = RunPaths(campaign.run_dir)
    campaign.wait_for(paths.root.joinpath("run_id").is_file, "the run folder prepared")
    paths.checkpoints.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={CHECKPOINT_DISK}", "tmpfs", str(paths.checkpoints)],
                   check=True)  # fmt: skip
    return paths.checkpoints


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


def reward_calls(name: str) -> Callable[[Campaign], None]:
    """The campaign reward's next REWARD_FAULT_CALLS calls raise (`raise`) or answer NaN (`nan`); it returns once
    they were made (tests/campaign_reward.py)."""

    def strike(campaign: Campaign) -> None:
        spec = yaml.safe_load((campaign.run_dir / "spec.yaml").read_text())
        path = Path(spec["reward"]["kwargs"]["faults_file"])
        write_counts(path, {name: REWARD_FAULT_CALLS})
        campaign.wait_for(lambda: json.loads(path.read_text())[name] == 0, f"{REWARD_FAULT_CALLS} reward calls made")

    return strike


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
    "disk full during a checkpoint": fill_checkpoint_disk,
    "weight file damaged in transit": damage_weights_in_transit,
}
DATA_FAULTS: dict[str, Callable[[Campaign], None]] = {
    "undecodable prompt entry": push_garbage("prompts"),
    "undecodable rollout entry": push_garbage("rollouts"),
    "duplicated prompt entry": push_copy("prompts"),
    "duplicated rollout entry": push_copy("rollouts"),
    "rollout copy with NaN log-probs": push_copy("rollouts", nan_logprobs),
}
REWARD_FAULTS: dict[str, Callable[[Campaign], None]] = {
    "reward raises for a window": reward_calls("raise"),
    "NaN rewards for a window": reward_calls("nan"),
}
FAULTS = {**PROCESS_FAULTS, **DATA_FAULTS, **REWARD_FAULTS}


def kinds_for(spec: dict) -> list[str]:
    """The fault kinds that apply to a spec: the environment service's and the critic's only where they run, the
    full disk where this process may mount a tmpfs, the reward faults where the spec's reward is CAMPAIGN_REWARD."""
    absent = set()
    if not spec.get("environment", {}).get("enabled"):
        absent.add("kill -9 environment service")
    if spec.get("algorithm", {}).get("name", "reinforce") != "ppo":
        absent.add("kill -9 critic")
    if not can_mount():
        absent.add("disk full during a checkpoint")
    if spec.get("reward", {}).get("function") != CAMPAIGN_REWARD:
        absent |= set(REWARD_FAULTS)
    return [kind for kind in FAULTS if kind not in absent]


def faulty_reward(faults_file: Path) -> dict:
    """The reward section of a campaign with reward faults: the tiny examples' reward, and its windows' file."""
    return {"function": CAMPAIGN_REWARD, "kwargs": {"char": "a", "faults_file": str(faults_file)}}


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
    disk = mounted_checkpoint_disk(campaign) if any(k == "disk full during a checkpoint" for _, k in plan) else None
    try:
        struck = []
        for step, kind in plan:
            campaign.wait_for_step(step)
            after, start, struck_at = campaign.last_step(), time.monotonic(), time.time()
            FAULTS[kind](campaign)
            if kind in PROCESS_FAULTS:
                campaign.wait_for_step(after + 1, since=struck_at)
            struck.append(Struck(kind, after, time.monotonic() - start if kind in PROCESS_FAULTS else 0.0))
        assert campaign.proc.wait(RECOVERY_TIMEOUT_S) == 0, campaign.stderr()[-3000:]
    finally:
        if disk is not None:  # lazily: a failed campaign's trainer may still hold files there
            subprocess.run(["umount", "--lazy", str(disk)], check=True)
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
