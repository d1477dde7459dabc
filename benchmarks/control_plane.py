"""Many generators, one trainer: what the control plane costs per step as generators are added.

    python benchmarks/control_plane.py [--generators 1 2 4 8] [--lags 0 1] [--steps 10] [--render]

examples/tiny.yaml (16 prompts a step, 2 per generator batch, so up to 8 generators share a step) run by
`reinforce run` with N generators and max_policy_lag 0 or 1. Beside each run a monitor reads the run's Redis without
joining its consumer groups (plain XREAD, GET, INFO): each prompt's enqueue and its group's push are stream entry
times, so the queue latency is enqueue to group on the rollouts stream (the trainer, blocked on that stream, takes it
at once); the weight record's changes give each version's publish time, and the generators' logs ("loaded weight
version V") the time the last of them loaded it (the supervisor's weight reconciler: publish to all-loaded). Redis
CPU is INFO's used_cpu_user + used_cpu_sys over the run. Trainer idle fraction: the steps' timers/rollout_time over
their timers/step_time (the first step, which waits for the generators to start, left out).
Writes benchmarks/results/control_plane.json and the section "Control plane: many generators, one trainer" of
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import redis
from runs import start, write_spec
from sections import write_section

from reinforce.core.metrics import read_metrics
from reinforce.core.queue import DATA_FIELD
from reinforce.core.records_pb2 import Prompt, RolloutGroup, WeightVersion
from reinforce.core.run_dir import RunPaths

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "control_plane.json"
HEADING = "## Control plane: many generators, one trainer"
LOADED = re.compile(r"^(\S+ \S+) \S+ INFO loaded weight version (\d+) ")


class Monitor:
    """Reads the run's streams and weight record from outside its consumer groups, until stopped."""

    def __init__(self, run_dir: Path, run_name: str) -> None:
        self.run_dir, self.prefix = run_dir, f"reinforce:{run_name}:"
        self.enqueued: dict[str, float] = {}  # prompt id -> enqueue time (its entry's)
        self.pushed: dict[str, float] = {}  # prompt id -> its group's push time
        self.published: dict[int, float] = {}  # version -> when the record appeared
        self.cpu = (0.0, 0.0)  # Redis CPU seconds at start and at stop
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def connect(self) -> redis.Redis:
        config = self.run_dir / "redis" / "redis.conf"
        while not config.exists():
            time.sleep(0.05)
        text = config.read_text()
        port = re.search(r"^port (\d+)", text, re.M).group(1)
        password = re.search(r"^requirepass (\S+)", text, re.M).group(1).strip('"')
        client = redis.Redis(port=int(port), password=password)
        while True:
            try:
                client.ping()
                return client
            except redis.RedisError:
                time.sleep(0.05)

    def run(self) -> None:
        client = self.connect()
        self.cpu = (_redis_cpu(client), 0.0)
        last = {self.prefix + "prompts": "0-0", self.prefix + "rollouts": "0-0"}
        while not self.stop.is_set():
            try:
                reply = client.xread(last, block=50)
                self._weights(client)
            except redis.RedisError:  # the run ended and its Redis with it
                break
            for key, entries in reply:
                key = key.decode()
                for entry_id, fields in entries:
                    last[key] = entry_id.decode()
                    at = int(entry_id.decode().split("-")[0]) / 1000
                    if key.endswith("prompts"):
                        self.enqueued.setdefault(Prompt.FromString(fields[DATA_FIELD]).id, at)
                    else:
                        self.pushed.setdefault(RolloutGroup.FromString(fields[DATA_FIELD]).prompt_id, at)
            self.cpu = (self.cpu[0], _redis_cpu(client))

    def _weights(self, client: redis.Redis) -> None:
        record = client.get(self.prefix + "weights")
        if record:
            weights = WeightVersion.FromString(record)
            self.published.setdefault(weights.version, weights.published_at)


def _redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def all_loaded_seconds(run_dir: Path, generators: int, published: dict[int, float]) -> list[float]:
    """Per version after 0: from its publish to the last generator's "loaded weight version" log line."""
    loaded: dict[int, list[float]] = {}
    for i in range(generators):
        for line in (RunPaths(run_dir).logs / f"generator-{i}.log").read_text().splitlines():
            if match := LOADED.match(line):
                at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                loaded.setdefault(int(match.group(2)), []).append(at)
    return [max(times) - published[v] for v, times in loaded.items() if len(times) == generators and v in published]


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def measure(generators: int, lag: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="control-plane-") as tmp:
        spec = write_spec(
            Path(tmp), generation={"num_generators": generators, "batch_prompts": 2}, algorithm={"max_policy_lag": lag},
            training={"steps": steps, "prompts_per_step": 16, "checkpoint_every": steps},
        )  # fmt: skip
        run_dir = Path(tmp) / "run"
        proc = start("run", str(spec))
        monitor = Monitor(run_dir, "tiny")
        monitor.thread.start()
        started = time.monotonic()
        _, stderr = proc.communicate(timeout=1800)
        wall = time.monotonic() - started
        monitor.stop.set()
        monitor.thread.join(10)
        if proc.returncode != 0:
            raise RuntimeError(f"run with {generators} generators, lag {lag} failed:\n{stderr[-3000:]}")
        rows = read_metrics(RunPaths(run_dir).metrics)[1:]  # the first step waits for the generators to start
        latencies = [monitor.pushed[p] - t for p, t in monitor.enqueued.items() if p in monitor.pushed]
        loads = all_loaded_seconds(run_dir, generators, monitor.published)
        return {
            "generators": generators, "lag": lag, "steps": steps, "wall_s": wall,
            "step_s": statistics.mean(r["timers/step_time"] for r in rows),
            "trainer_idle": sum(r["timers/rollout_time"] for r in rows) / sum(r["timers/step_time"] for r in rows),
            "queue_p50_s": percentile(latencies, 50), "queue_p99_s": percentile(latencies, 99),
            "all_loaded_p50_s": percentile(loads, 50), "all_loaded_max_s": max(loads),
            "redis_cpu_s_per_step": (monitor.cpu[1] - monitor.cpu[0]) / steps,
        }  # fmt: skip


def render(results: dict) -> str:
    lines = [
        HEADING,
        "",
        f"Generated by `python benchmarks/control_plane.py` from `benchmarks/results/control_plane.json`: "
        f"examples/tiny.yaml, {results['runs'][0]['steps']} steps of 16 prompts (2 per generator batch), every "
        "process on one machine. Trainer idle: share of a step spent waiting for rollout groups. Queue: a prompt's "
        "enqueue to its group on the rollouts stream (p50 / p99). All-loaded: a version's publish to the last "
        "generator's load (the supervisor's weight reconciler; p50 / max). Redis: its CPU seconds per step. "
        f"{results['machine']}, {results['date']}.",
        "",
        "| generators | max_policy_lag | s/step | trainer idle | queue p50 / p99 (s) | all-loaded p50 / max (s) | "
        "Redis CPU ms/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results["runs"], key=lambda r: (r["lag"], r["generators"])):
        lines.append(
            f"| {r['generators']} | {r['lag']} | {r['step_s']:.2f} | {r['trainer_idle']:.0%} | "
            f"{r['queue_p50_s']:.2f} / {r['queue_p99_s']:.2f} | {r['all_loaded_p50_s']:.2f} / "
            f"{r['all_loaded_max_s']:.2f} | {1000 * r['redis_cpu_s_per_step']:.1f} |"
        )
    return "\n".join(lines) + "\n" + results.get("extrapolation", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generators", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--lags", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--render", action="store_true", help="only re-render BENCHMARKS.md from the saved JSON")
    args = parser.parse_args()
    if not args.render:
        saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        runs = []
        for lag in args.lags:
            for n in args.generators:
                runs.append(measure(n, lag, args.steps))
                print(json.dumps(runs[-1]), flush=True)
        saved.update(
            machine=f"{platform.machine()}, {os.cpu_count()} CPUs shared with other jobs",
            date=datetime.now().date().isoformat(),
            runs=runs,
        )
        RESULTS.write_text(json.dumps(saved, indent=1) + "\n")
    write_section(render(json.loads(RESULTS.read_text())))


if __name__ == "__main__":
    main()
