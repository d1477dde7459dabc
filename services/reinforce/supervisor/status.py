"""`reinforce status RUN_DIR`: how a local run is doing, from its folder and, while it runs, from its processes.

The folder tells the phase (running: a live supervisor holds its lock; finished; stopped: interrupted by Ctrl-C or
SIGTERM; failed; not started), the step, the latest reward, KL and throughput (metrics.jsonl), the last checkpoint
and the samples. A live run's components are asked too: the run's Redis (the published weight version, what is
queued) and every metrics endpoint the supervisor lists in prometheus_targets.json (up or not; the trainer's step,
each generator's loaded weight version).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import redis

from reinforce.core.metrics import GENERATOR_WEIGHT_VERSION, TRAINER_STEP, read_metrics, scrape, shown
from reinforce.core.names import LOCAL_HOST
from reinforce.core.queue import RolloutQueue, UnreadableRecord
from reinforce.core.run_dir import RunPaths
from reinforce.core.samples import sample_steps
from reinforce.core.spec import RunSpec, SpecError, load_spec
from reinforce.supervisor.children import PROMETHEUS_TARGETS
from reinforce.supervisor.lock import live_holder
from reinforce.supervisor.outcome import read_outcome

TIMEOUT_S = 2.0  # per component asked: a hung one must not hang the command


@dataclass(frozen=True)
class Phase:
    name: str  # running, finished, stopped, failed, not started
    detail: str


def phase_of(paths: RunPaths, spec: RunSpec, last_step: int) -> Phase:
    if (pid := live_holder(paths.lock)) is not None:
        return Phase("running", f"supervisor PID {pid}")
    if last_step >= spec.training.steps and paths.final_model.exists():
        return Phase("finished", "")
    outcome = read_outcome(paths)
    resume = f"`reinforce run --resume {paths.root}` continues it"
    if outcome is not None and outcome.exit_code != 0:
        # a component's failure: "... giving up. Log PATH, last lines:" and then those lines
        first_line = next(iter(outcome.message.splitlines()), "").removesuffix(", last lines:")
        reason = first_line or f"exit code {outcome.exit_code}"
        return Phase("stopped" if outcome.exit_code == 130 else "failed", f"{reason}; {resume}")
    if last_step == 0 and not paths.checkpoints.exists():
        return Phase("not started", "")
    return Phase("failed", f"the supervisor ended without recording why (killed?); {resume}")


def status_lines(paths: RunPaths) -> list[str]:
    if not paths.spec.exists():
        raise SpecError(f"{paths.root}: no spec.yaml, so not a run folder (`reinforce run` writes it)")
    spec = load_spec(paths.spec)
    rows = [r for r in read_metrics(paths.metrics) if "train_rollouts/rewards" in r]
    last = rows[-1] if rows else {}
    phase = phase_of(paths, spec, last.get("step", 0))
    detail = f" ({phase.detail})" if phase.detail else ""
    lines = [f"run {spec.name}: {phase.name}{detail}", f"  folder      {paths.root}"]
    lines.append(f"  step        {last.get('step', 0)} / {spec.training.steps}")
    if rows:
        first = f"step {rows[0]['step']}: {shown(rows[0].get('train_rollouts/rewards'), '.4f')}"
        lines += [
            f"  reward      {shown(last.get('train_rollouts/rewards'), '.4f')} ({first})",
            f"  KL          {shown(last.get('train_rollouts/init_policy_kl'), '.4f')}",
            f"  throughput  {shown(last.get('throughput/generated_tokens_per_second'), '.0f')} generated tokens/s, "
            f"{shown(last.get('timers/step_time'), '.2f')} s/step",
        ]
    checkpoints = sorted(p.name for p in paths.checkpoints.glob("step-*") if p.is_dir())
    lines.append(f"  checkpoint  {checkpoints[-1] if checkpoints else '-'}")
    if steps := sample_steps(paths):
        lines.append(f"  samples     steps {steps[0]}..{steps[-1]}: reinforce samples {paths.root} [--step N]")
    if paths.final_model.exists():
        lines.append(f"  final model {paths.final_model}: reinforce generate {paths.root} PROMPT")
    if phase.name == "running":
        lines += ["  components", *(f"    {line}" for line in component_lines(paths, spec))]
    return lines


def component_lines(paths: RunPaths, spec: RunSpec) -> list[str]:
    """One line per live component: Redis, then every metrics endpoint of prometheus_targets.json."""
    lines = [f"{'redis':<12} {_redis_state(paths, spec)}"]
    targets_file = paths.root / PROMETHEUS_TARGETS
    targets = json.loads(targets_file.read_text()) if targets_file.exists() else []
    for target in targets:
        name, address = target["labels"]["instance"], target["targets"][0]
        found = scrape(f"http://{address}/metrics", TIMEOUT_S)
        state = "down (its metrics endpoint does not answer)" if found is None else "up"
        if found and TRAINER_STEP in found:
            state += f": step {found[TRAINER_STEP]:.0f}"
        if found and GENERATOR_WEIGHT_VERSION in found:
            state += f": weight version {found[GENERATOR_WEIGHT_VERSION]:.0f}"
        lines.append(f"{name:<12} {state}")
    return lines


def _redis_state(paths: RunPaths, spec: RunSpec) -> str:
    """The run's Redis (its address and password are in the supervisor's private config file)."""
    try:
        lines = (paths.redis / "redis.conf").read_text().splitlines()
        config = dict(line.split(" ", 1) for line in lines if " " in line)
    except OSError as err:
        return f"unknown ({err})"
    url = f"redis://:{config['requirepass']}@{LOCAL_HOST}:{config['port']}/0"
    client = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
    try:
        queue = RolloutQueue(client, spec.name)
        weights = queue.latest_weights()
        depths = queue.depths()
    except (redis.RedisError, UnreadableRecord) as err:
        return f"down ({err})"
    finally:
        client.close()
    version = "none yet" if weights is None else str(weights.version)
    queued = f"{depths['prompts']} prompts and {depths['rollouts']} rollout groups queued"
    return f"up: published weight version {version}, {queued}"


def status_command(args: argparse.Namespace) -> int:
    print("\n".join(status_lines(RunPaths(Path(args.run_dir)))))
    return 0


def add_status_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("status", help="how a local run is doing: phase, step, reward, components")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder")
    parser.set_defaults(handler=status_command)
