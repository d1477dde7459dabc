"""`reinforce`: the command line. `reinforce run` runs a pipeline locally; `reinforce status`, `reinforce samples`
and `reinforce generate` answer questions about a run folder (how is it doing, what did the model write, what does
it say now); `reinforce operator` runs the Kubernetes operator; `reinforce rollout` keeps generators on the latest
weights where neither runs (docker compose); `reinforce shard-prompts` writes pre-tokenized prompt shards for
data.loader dali. Each command lives with its service; this only dispatches."""

from __future__ import annotations

import argparse
import sys

from reinforce.core.spec import SpecError


def build_parser() -> argparse.ArgumentParser:
    """Every command and its arguments (the docs' CLI reference is generated from this parser)."""
    from reinforce.core.prompt_shards import add_shard_prompts_command
    from reinforce.core.rollout import add_rollout_command
    from reinforce.generator.answer import add_generate_command
    from reinforce.operator.main import add_operator_command
    from reinforce.supervisor.main import add_run_command
    from reinforce.supervisor.samples import add_samples_command
    from reinforce.supervisor.status import add_status_command

    parser = argparse.ArgumentParser(prog="reinforce", description="Kubernetes-native REINFORCE RLHF pipeline.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_run_command(commands)
    add_status_command(commands)
    add_samples_command(commands)
    add_generate_command(commands)
    add_operator_command(commands)
    add_rollout_command(commands)
    add_shard_prompts_command(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (check := getattr(args, "check", None)) and (problem := check(args)):
        parser.error(problem)
    try:
        sys.exit(args.handler(args))
    except SpecError as err:  # a bad spec, prompt file or configuration: nothing was started
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
