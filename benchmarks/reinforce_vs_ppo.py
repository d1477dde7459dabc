"""REINFORCE (RLOO) against PPO with the critic service on the same task, side by side.

    python benchmarks/reinforce_vs_ppo.py [--examples tiny quickstart] [--steps N]

For each example (tiny by default; quickstart, SmolLM2 on CPU, takes tens of minutes) the REINFORCE run
(examples/EXAMPLE.yaml) and the PPO run (examples/EXAMPLE-ppo.yaml: the same model, prompts, reward, seed, k and
steps, with PPO's own learning rates) train one after the other through `reinforce run`, so neither competes with
the other for the cores. Printed per algorithm: the mean reward of the first and last 3 steps, the reward gained
per 1000 trained samples and per wall second (steps' wall time, from the end of the first step to the end of the
last, so start-up is left out), samples/s, the KL to the reference at the end, and the whole run's wall time.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from runs import reinforce, write_spec

from reinforce.core.metrics import read_metrics
from reinforce.core.run_dir import RunPaths

ALGORITHMS = {"reinforce": "{example}", "ppo": "{example}-ppo"}


def run(folder: Path, example: str, steps: int | None) -> dict[str, float]:
    training = {"steps": steps, "checkpoint_every": steps} if steps else {}
    spec = write_spec(folder, example=example, training=training)
    start = time.perf_counter()
    result = reinforce("run", str(spec), timeout=24 * 3600)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{example}: reinforce run failed:\n{result.stderr[-3000:]}")
    rows = read_metrics(RunPaths(folder / "run").metrics)
    settings = yaml.safe_load(spec.read_text())
    per_step = settings["training"]["prompts_per_step"] * settings["algorithm"]["num_rollouts_per_prompt"]
    first, last = statistics.mean(_rewards(rows[:3])), statistics.mean(_rewards(rows[-3:]))
    samples = (len(rows) - 1) * per_step  # trained after the first step ended
    seconds = rows[-1]["time"] - rows[0]["time"]
    return {
        "steps": len(rows),
        "reward_start": first,
        "reward_end": last,
        "gain_per_1k_samples": (last - first) / samples * 1000,
        "gain_per_s": (last - first) / seconds,
        "samples_per_s": samples / seconds,
        "kl_end": rows[-1]["train_rollouts/init_policy_kl"],
        "wall_s": wall,
    }


def _rewards(rows: list[dict]) -> list[float]:
    return [r["train_rollouts/rewards"] for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=["tiny"], choices=["tiny", "quickstart"])
    parser.add_argument("--steps", type=int, help="training steps of every run (default: the examples')")
    args = parser.parse_args()
    header = (
        "algorithm  steps  reward@start  reward@end  gain/1k samples  gain/s  samples/s  KL@end  wall s (with start-up)"
    )
    for example in args.examples:
        print(f"\n{example}\n{header}", flush=True)
        for algorithm, name in ALGORITHMS.items():
            with tempfile.TemporaryDirectory() as tmp:
                r = run(Path(tmp), name.format(example=example), args.steps)
            print(
                f"{algorithm:<9} {r['steps']:>6} {r['reward_start']:>13.3f} {r['reward_end']:>11.3f} "
                f"{r['gain_per_1k_samples']:>16.3f} {r['gain_per_s']:>7.4f} {r['samples_per_s']:>10.1f} "
                f"{r['kl_end']:>7.3f} {r['wall_s']:>23.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
