"""`reinforce`: the command line. `reinforce run` runs a pipeline locally, `reinforce serve` the Tinker training API;
`reinforce status`, `reinforce samples` and `reinforce generate` answer questions about a run folder (how is it doing,
what did the model write, what does it say now); `reinforce operator` runs the Kubernetes operator; `reinforce
rollout` keeps generators on the latest weights where neither runs (docker compose); `reinforce shard-prompts` writes
pre-tokenized prompt shards for data.loader dali. Each command lives with its service; this only dispatches."""

from __future__ import annotations

import argparse
import importlib
import sys

from reinforce.core.spec import SpecError

# Each command and the function of its service's module that adds it: a command imports its own module only (the
# generator's and the operator's pull in transformers and kopf, seconds a `reinforce status` need not wait).
COMMANDS = {
    "run": "reinforce.supervisor.main:add_run_command",
    "serve": "reinforce.supervisor.serve:add_serve_command",
    "status": "reinforce.supervisor.status:add_status_command",
    "samples": "reinforce.supervisor.samples:add_samples_command",
    "generate": "reinforce.generator.answer:add_generate_command",
    "operator": "reinforce.operator.main:add_operator_command",
    "rollout": "reinforce.core.rollout:add_rollout_command",
    "shard-prompts": "reinforce.core.prompt_shards:add_shard_prompts_command",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command and its arguments (the docs' CLI reference is generated from this parser), or command `only`."""
    parser = argparse.ArgumentParser(prog="reinforce", description="Kubernetes-native REINFORCE RLHF pipeline.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, where in COMMANDS.items():
        if only in (None, name):
            module, function = where.split(":")
            getattr(importlib.import_module(module), function)(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # the command is the first argument (`reinforce --help`, a typo: every command, for the full usage)
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    if (check := getattr(args, "check", None)) and (problem := check(args)):
        parser.error(problem)
    try:
        sys.exit(args.handler(args))
    except SpecError as err:  # a bad spec, prompt file or configuration: nothing was started
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
