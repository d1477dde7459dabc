"""Synchronous against asynchronous training, with one and two generators, side by side.

    python benchmarks/async_throughput.py [--examples tiny quickstart] [--seconds 40 300] [--transport file|http]

For each example (by default both, in one invocation, each with its own wall time), each configuration
(max_policy_lag 0, 1, 2 x 1, 2 generators) runs for a fixed wall time from its first finished step, then is
stopped. Printed per configuration: trained samples/s, the mean reward of the last 3 steps, the
train/inference log-prob mismatch, the generators' mean weight sync time per version and its MB/s, next to
the loopback copy bandwidth of the same weight file measured in the same run.
"""

import argparse
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from runs import start, wait_for_step, write_spec

from reinforce.core.metrics import read_metrics
from reinforce.core.run_dir import RunPaths

LOADED = re.compile(r"loaded weight version \d+ in ([\d.]+)s")


def run_for(folder: Path, example: str, seconds: float, transport: str, lag: int, generators: int) -> dict:
    spec = write_spec(
        folder,
        example=example,
        algorithm={"max_policy_lag": lag},
        generation={"num_generators": generators},
        training={"steps": 100_000, "checkpoint_every": 100_000},
        weights={"transport": transport},
    )
    proc = start("run", str(spec))
    run = RunPaths(folder / "run")
    wait_for_step(proc, run.root, 1, timeout_s=900)
    time.sleep(seconds)
    wait_for_step(proc, run.root, 3, timeout_s=900)  # a rate needs steps after the first, however slow they are
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    rows = read_metrics(run.metrics)
    first, last = rows[0], rows[-1]
    samples = (last["step"] - first["step"]) * len_of_step(spec)
    syncs = [float(s) for f in run.logs.glob("generator-*.log") for s in LOADED.findall(f.read_text())]
    weight_file = max(run.weights.glob("v*.safetensors"))
    return {
        "samples_per_s": samples / (last["time"] - first["time"]),
        "reward_end": statistics.mean(r["train_rollouts/rewards"] for r in rows[-3:]),
        "mismatch": statistics.mean(r["train_rollouts/logprob_mismatch"] for r in rows),
        "lag": statistics.mean(r["train_rollouts/policy_lag"] for r in rows),
        "sync_s": statistics.mean(syncs),
        "weight_mb": weight_file.stat().st_size / 1e6,
        "copy_mb_s": copy_bandwidth(weight_file),
        "steps": last["step"],
    }


def len_of_step(spec_path: Path) -> int:
    spec = yaml.safe_load(spec_path.read_text())
    return spec["training"]["prompts_per_step"] * spec["algorithm"].get("num_rollouts_per_prompt", 4)


def copy_bandwidth(path: Path) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start_time = time.perf_counter()
        shutil.copyfile(path, Path(tmp) / "copy")
        return path.stat().st_size / 1e6 / (time.perf_counter() - start_time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=["tiny", "quickstart"], choices=["tiny", "quickstart"])
    parser.add_argument("--seconds", nargs="+", type=float, default=[40.0, 300.0], help="wall time per example")
    parser.add_argument("--transport", default="file", choices=["file", "http"])
    args = parser.parse_args()
    for example, seconds in zip(args.examples, args.seconds, strict=True):
        benchmark(example, seconds, args.transport)


def benchmark(example: str, seconds: float, transport: str) -> None:
    header = "lag gens  samples/s  reward@end  mismatch  mean lag  sync s/version  sync MB/s  copy MB/s  sync/copy"
    print(f"\n{example}, {seconds:.0f} s per configuration, weights over {transport}\n{header}")
    for lag in (0, 1, 2):
        for generators in (1, 2):
            with tempfile.TemporaryDirectory() as tmp:
                r = run_for(Path(tmp), example, seconds, transport, lag, generators)
            sync_mb_s = r["weight_mb"] / r["sync_s"] if r["sync_s"] else float("inf")
            print(
                f"{lag:>3} {generators:>4} {r['samples_per_s']:>10.1f} {r['reward_end']:>11.3f} "
                f"{r['mismatch']:>9.2e} {r['lag']:>9.2f} {r['sync_s']:>15.3f} {sync_mb_s:>10.0f} "
                f"{r['copy_mb_s']:>10.0f} {sync_mb_s / r['copy_mb_s']:>10.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
