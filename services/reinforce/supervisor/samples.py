"""`reinforce samples RUN_DIR [--step N]`: a step's training samples (core/samples.py), by default the last step's;
and the end of `reinforce run`'s output: the first and the last step's best and worst sample."""

from __future__ import annotations

import argparse
from pathlib import Path

from reinforce.core.run_dir import RunPaths
from reinforce.core.samples import format_sample, read_samples, sample_steps
from reinforce.core.spec import SpecError

SUMMARY_CHARS = 200  # the run's summary cuts prompts and responses to this many characters


def samples_command(args: argparse.Namespace) -> int:
    paths = RunPaths(Path(args.run_dir))
    steps = sample_steps(paths)
    if not steps:
        raise SpecError(f"{paths.samples}: no samples (a run writes them every logging.samples_every steps)")
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise SpecError(f"{paths.samples}: no samples of step {step}; steps with samples: {_ranges(steps)}")
    print("\n".join(format_sample(row) for row in read_samples(paths, step)))
    return 0


def print_samples_summary(paths: RunPaths) -> None:
    """The first and the last step's best and worst sample: what training changed in what the model writes."""
    steps = sample_steps(paths)
    if not steps:
        return
    print(f"samples of the first and the last step (a step's every one: reinforce samples {paths.root} --step N)")
    for step in dict.fromkeys((steps[0], steps[-1])):
        for row in read_samples(paths, step):
            if row["pick"] in ("best", "worst"):
                print("  " + format_sample(row, SUMMARY_CHARS).replace("\n", "\n  "))


def _ranges(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]} ({len(steps)} files)" if len(steps) > 3 else ", ".join(map(str, steps))


def add_samples_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("samples", help="print a step's training samples from a run folder")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder")
    parser.add_argument("--step", type=int, help="the step (default: the last one with samples)")
    parser.set_defaults(handler=samples_command)
