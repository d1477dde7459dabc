"""A hundred faults on one run, nothing lost: the fault campaign of tests/campaign.py at full size.

    python benchmarks/fault_campaign.py [--faults 100] [--ppo-faults 30] [--reward-faults 30] [--seed 1]
                                        [--only tiny-tools|tiny-ppo|tiny-rewards ...] [--render]

Three campaigns, each beside an undisturbed run of the same spec in the same invocation: examples/tiny-tools.yaml
(multi-turn, the environment service, two generators), examples/tiny-ppo.yaml (the critic), and examples/tiny.yaml
with tests/campaign_reward.py's reward, which adds the reward faults (a raising reward, NaN rewards) to the others.
Every kind of fault that applies is thrown about equally often from the seed's schedule; as root, the full disk
during a checkpoint is one of them. Per kind: how many were thrown and survived, the time each cost (from the
strike to the next trained step, less the undisturbed run's median step); per run: the largest difference between
its final weights and the undisturbed run's (0 unless reward faults left samples out), and the audit (every step
trained once on its own prompts; every sample left out named under its prompt). Each campaign's result is saved to
benchmarks/results/fault_campaign.json as it ends (`--only` reruns some, keeping the others'), then
BENCHMARKS.md's section "Fault campaign" is written.
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
from campaign import (
    PROCESS_FAULTS,
    campaign_env,
    campaign_overrides,
    faulty_reward,
    kinds_for,
    median_step_s,
    run_campaign,
    schedule,
)
from runs import (
    EXAMPLES,
    assert_each_step_trained_once,
    assert_lost_samples_audited,
    max_weight_difference,
    reinforce,
    write_spec,
)
from sections import add_render_flag, machine, render_saved, save_and_write

RESULTS = Path(__file__).parent / "results" / "fault_campaign.json"
GENERATORS = 2  # a stalled or killed generator's prompts are reclaimed by the other
# campaign: its example, and whether its reward is tests/campaign_reward.py's (which adds the reward faults)
CAMPAIGNS = {"tiny-tools": ("tiny-tools", False), "tiny-ppo": ("tiny-ppo", False), "tiny-rewards": ("tiny", True)}


def steps_for(faults: int, kinds: list[str]) -> int:
    """Enough steps for the schedule: each process fault waits for a step to be trained after it."""
    process = faults * sum(kind in PROCESS_FAULTS for kind in kinds) / len(kinds)
    return int(process * 1.25) + 10


def measure(name: str, faults: int, seed: int) -> dict:
    example, reward_faults = CAMPAIGNS[name]
    spec = yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text())
    kinds = kinds_for({**spec, "reward": faulty_reward(Path("reward-faults.json"))} if reward_faults else spec)
    steps = steps_for(faults, kinds)
    with tempfile.TemporaryDirectory(prefix="fault-campaign-") as tmp:
        folder = Path(tmp)

        def spec_in(role: str) -> Path:
            reward = {"reward": faulty_reward(folder / role / "reward-faults.json")} if reward_faults else {}
            return write_spec(folder / role, example, **campaign_overrides(steps, GENERATORS, **reward))

        undisturbed = spec_in("undisturbed")
        started = time.monotonic()
        result = reinforce("run", str(undisturbed), timeout=3600, env=campaign_env())
        assert result.returncode == 0, result.stderr[-3000:]
        undisturbed_s = time.monotonic() - started
        step_s = median_step_s(folder / "undisturbed" / "run")
        plan = schedule(seed, faults, steps, kinds)
        started = time.monotonic()
        campaign, struck = run_campaign(spec_in("attacked"), folder / "attacked", plan, seed)
        attacked_s = time.monotonic() - started
        assert_each_step_trained_once(campaign.run_dir, steps)  # raises: the audit is not clean
        lost = assert_lost_samples_audited(campaign.run_dir)
        difference = max_weight_difference(folder / "undisturbed" / "run", campaign.run_dir)
    by_kind: dict[str, list[float]] = defaultdict(list)
    for s in struck:
        by_kind[s.kind].append(max(s.recovered_s - step_s, 0.0) if s.kind in PROCESS_FAULTS else 0.0)
    return {
        "example": example, "steps": steps, "faults": len(struck), "seed": seed, "median_step_s": step_s,
        "undisturbed_s": undisturbed_s, "attacked_s": attacked_s, "max_weight_difference": difference,
        "audit": "every step trained once on its own prompts" + (
            f"; {lost} samples left out for a failed or NaN reward, each counted under its prompt" if lost else ""
        ), "resumes": campaign.resumes, "reward_faults": reward_faults,
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
            f"**examples/{run['example']}.yaml**"
            + (" with tests/campaign_reward.py's reward" if run.get("reward_faults") else "")
            + f", {run['steps']} steps, {GENERATORS} generators, seed {run['seed']}: "
            f"{run['faults']} faults, {run['resumes']} of them resumes ({run['machine']['cpus']} CPUs, Python "
            f"{run['machine']['python']}, 1-minute load average {run['machine']['load_average']:.1f} at the start); "
            f"{run['undisturbed_s']:.0f} s undisturbed, "
            f"{run['attacked_s']:.0f} s attacked (median step {run['median_step_s']:.2f} s). Final weights' largest "
            f"difference from the undisturbed run's: **{run['max_weight_difference']:g}**"
            + (" (reward faults leave samples out: a different run by design)" if run.get("reward_faults") else "")
            + f". Audit: {run['audit']}.",
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
    parser.add_argument("--reward-faults", type=int, default=30, help="faults thrown at the tiny-rewards run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", nargs="+", choices=CAMPAIGNS, help="run these campaigns; keep the others' results")
    add_render_flag(parser)
    args = parser.parse_args()
    if args.render:
        return render_saved(RESULTS, render)
    faults = {"tiny-tools": args.faults, "tiny-ppo": args.ppo_faults, "tiny-rewards": args.reward_faults}
    for name in args.only or CAMPAIGNS:
        load_average = os.getloadavg()[0]
        run = {**measure(name, faults[name], args.seed), "campaign": name, "machine": machine(load_average)}
        saved = json.loads(RESULTS.read_text())["runs"] if RESULTS.is_file() else []
        runs = {r.get("campaign", r["example"]): r for r in saved} | {name: run}
        runs = [runs[n] for n in CAMPAIGNS if n in runs]
        save_and_write(RESULTS, {"date": time.strftime("%Y-%m-%d"), "runs": runs}, render)


if __name__ == "__main__":
    main()
