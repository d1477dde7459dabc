"""A hundred faults on one run, nothing lost: the fault campaign of tests/campaign.py at full size.

    python benchmarks/fault_campaign.py [--faults 100] [--ppo-faults 30] [--seed 1] [--only tiny-tools|tiny-ppo]
                                        [--render]

Two campaigns, each beside an undisturbed run of the same spec in the same invocation: examples/tiny-tools.yaml
(multi-turn, the environment service, two generators) and examples/tiny-ppo.yaml (the critic). Every kind of fault
that applies is thrown about equally often from the seed's schedule. Per kind: how many were thrown and survived,
the time each cost (from the strike to the next trained step, less the undisturbed run's median step); per run: the
largest difference between its final weights and the undisturbed run's, and the audit (every step trained once on
its own prompts). Each campaign's result is saved to benchmarks/results/fault_campaign.json as it ends (`--only`
reruns one, keeping the other's), then BENCHMARKS.md's section "Fault campaign" is written.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
import yaml
from campaign import PROCESS_FAULTS, campaign_overrides, kinds_for, median_step_s, run_campaign, schedule
from runs import EXAMPLES, assert_each_step_trained_once, max_weight_difference, reinforce, write_spec
from sections import add_render_flag, machine, render_saved, save_and_write

RESULTS = Path(__file__).parent / "results" / "fault_campaign.json"
GENERATORS = 2  # a stalled or killed generator's prompts are reclaimed by the other
EXAMPLES_RUN = ["tiny-tools", "tiny-ppo"]


def steps_for(faults: int, kinds: list[str]) -> int:
    """Enough steps for the schedule: each process fault waits for a step to be trained after it."""
    process = faults * sum(kind in PROCESS_FAULTS for kind in kinds) / len(kinds)
    return int(process * 1.25) + 10


def measure(example: str, faults: int, seed: int) -> dict:
    kinds = kinds_for(yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text()))
    steps = steps_for(faults, kinds)
    with tempfile.TemporaryDirectory(prefix="fault-campaign-") as tmp:
        folder = Path(tmp)
        undisturbed = write_spec(folder / "undisturbed", example, **campaign_overrides(steps, GENERATORS))
        started = time.monotonic()
        result = reinforce("run", str(undisturbed), timeout=3600)
        assert result.returncode == 0, result.stderr[-3000:]
        undisturbed_s = time.monotonic() - started
        step_s = median_step_s(folder / "undisturbed" / "run")
        attacked = write_spec(folder / "attacked", example, **campaign_overrides(steps, GENERATORS))
        plan = schedule(seed, faults, steps, kinds)
        started = time.monotonic()
        campaign, struck = run_campaign(attacked, folder / "attacked", plan, seed)
        attacked_s = time.monotonic() - started
        assert_each_step_trained_once(campaign.run_dir, steps)  # raises: the audit is not clean
        difference = max_weight_difference(folder / "undisturbed" / "run", campaign.run_dir)
    by_kind: dict[str, list[float]] = defaultdict(list)
    for s in struck:
        by_kind[s.kind].append(max(s.recovered_s - step_s, 0.0) if s.kind in PROCESS_FAULTS else 0.0)
    return {
        "example": example, "steps": steps, "faults": len(struck), "seed": seed, "median_step_s": step_s,
        "undisturbed_s": undisturbed_s, "attacked_s": attacked_s, "max_weight_difference": difference,
        "audit": "every step trained once on its own prompts", "resumes": campaign.resumes,
        "kinds": {kind: {"thrown": len(lost), "survived": len(lost), "lost_s_mean": statistics.fmean(lost),
                         "lost_s_max": max(lost)} for kind, lost in by_kind.items()},
    }  # fmt: skip


def render(results: dict) -> str:
    lines = [
        "## Fault campaign",
        "",
        f"Written by `python benchmarks/fault_campaign.py` from `benchmarks/results/fault_campaign.json` (measured "
        f"{results['date']}). Each campaign is one run with faults thrown from a seeded schedule (tests/campaign.py), "
        "beside an undisturbed run of the same spec; a process fault's cost is the time from the strike to the next "
        "trained step, less the undisturbed run's median step. A data fault costs no wait. CI throws 20 faults at "
        "examples/tiny.yaml (tests/integration/test_fault_campaign.py).",
        "",
    ]
    for run in results["runs"]:
        lines += [
            f"**examples/{run['example']}.yaml**, {run['steps']} steps, {GENERATORS} generators, seed {run['seed']}: "
            f"{run['faults']} faults, {run['resumes']} of them resumes ({run['machine']['cpus']} CPUs, Python "
            f"{run['machine']['python']}, 1-minute load average {run['machine']['load_average']:.1f} at the start); "
            f"{run['undisturbed_s']:.0f} s undisturbed, "
            f"{run['attacked_s']:.0f} s attacked (median step {run['median_step_s']:.2f} s). Final weights' largest "
            f"difference from the undisturbed run's: **{run['max_weight_difference']:g}**. Audit: {run['audit']}.",
            "",
            "| fault | thrown | survived | time lost per fault, mean s | max s |",
            "| --- | --- | --- | --- | --- |",
        ]
        for kind, row in run["kinds"].items():
            lines.append(
                f"| {kind} | {row['thrown']} | {row['survived']} | {row['lost_s_mean']:.1f} | {row['lost_s_max']:.1f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=100, help="faults thrown at the tiny-tools run")
    parser.add_argument("--ppo-faults", type=int, default=30, help="faults thrown at the tiny-ppo run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", choices=EXAMPLES_RUN, help="run this campaign only; keep the other's saved result")
    add_render_flag(parser)
    args = parser.parse_args()
    if args.render:
        return render_saved(RESULTS, render)
    faults = {"tiny-tools": args.faults, "tiny-ppo": args.ppo_faults}
    for example in [args.only] if args.only else EXAMPLES_RUN:
        load_average = os.getloadavg()[0]
        run = {**measure(example, faults[example], args.seed), "machine": machine(load_average)}
        saved = json.loads(RESULTS.read_text())["runs"] if RESULTS.is_file() else []
        runs = {r["example"]: r for r in saved} | {example: run}
        runs = [runs[name] for name in EXAMPLES_RUN if name in runs]
        save_and_write(RESULTS, {"date": time.strftime("%Y-%m-%d"), "runs": runs}, render)


if __name__ == "__main__":
    main()
