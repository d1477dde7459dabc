"""`reinforce run SPEC.yaml`: a whole pipeline on this machine, as a Kubernetes run has it.

The local supervisor starts the same services as child processes (children.py), drives weight rollout with the
reconciler the operator uses and shows progress (run_loop.py), and stops every child when the run ends, fails, or
on Ctrl-C. This module is the command: the spec and data checked before anything starts, the run folder, signals,
the exit code.
"""

from __future__ import annotations

import argparse
import errno
import logging
import re
import signal
import sys
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig
from transformers.utils import logging as transformers_logging

from reinforce.core.data import DataError, read_prompt_file
from reinforce.core.hardware import bfloat16_is_native
from reinforce.core.optional import MissingPackage, require_backend, require_engine
from reinforce.core.policy import materialize_policy
from reinforce.core.prompt_shards import read_shard_index
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import RunSpec, SpecError, check_fits_policy, dump_spec, load_spec
from reinforce.core.trackers import check_trackers
from reinforce.supervisor.component import RunFailed
from reinforce.supervisor.engine_choice import choose_engine
from reinforce.supervisor.outcome import record_outcome
from reinforce.supervisor.progress import print_summary
from reinforce.supervisor.run_folder import prepare_run_dir
from reinforce.supervisor.run_loop import Supervisor


def resolve_spec(spec: RunSpec, spec_file: Path) -> RunSpec:
    """Absolute paths, so every process reads the same files whatever its working directory."""

    def local(path: str) -> str:
        p = Path(path)
        return str(p if p.is_absolute() else (spec_file.parent / p).resolve())

    policy = spec.policy
    if policy.path and not policy.path.startswith("package:"):
        policy = policy.model_copy(update={"path": local(policy.path)})
    reward = spec.reward
    if reward.path:
        reward = reward.model_copy(update={"path": local(reward.path)})
    critic = spec.critic
    if critic.reward_model_path:
        critic = critic.model_copy(update={"reward_model_path": local(critic.reward_model_path)})
    return spec.model_copy(
        update={
            "run_dir": str(spec.resolved_run_dir().resolve()),
            "policy": policy,
            "reward": reward,
            "critic": critic,
            "data": spec.data.model_copy(
                update={
                    "prompts": local(spec.data.prompts),
                    "validation_prompts": spec.data.validation_prompts and local(spec.data.validation_prompts),
                }
            ),
        }
    )


def run_command(args: argparse.Namespace) -> int:
    """`reinforce run`: the exit code (0 done, 1 a component failed, 2 a bad spec or prompt file, 130 Ctrl-C)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    transformers_logging.disable_progress_bar()  # the policy's loading and writing: one line says so instead
    try:
        return _run(args)
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: the disk is full: {err}; free space, then `reinforce run --resume`", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    spec, spec_file = _spec(args)
    _check_data(spec, spec_file)
    _check_packages(spec, spec_file)
    paths, _lock = prepare_run_dir(spec, resume=bool(args.resume), overwrite=args.overwrite)  # held until exit
    paths.spec.write_text(dump_spec(spec))
    print(f"run folder {paths.root}; preparing the initial policy ...", flush=True)
    materialize_policy(spec.policy, paths.initial_policy, spec.seed)
    policy_config = AutoConfig.from_pretrained(paths.initial_policy)
    _check_fits_policy(spec, spec_file, policy_config)
    spec, why = choose_engine(spec, policy_config)
    paths.spec.write_text(dump_spec(spec))  # the engine chosen, for every service and a resume
    print(choices_line(spec, why), flush=True)
    code = _supervise(spec, paths)
    if code == 0:
        print_summary(paths)
    return code


# What choices_line prints, read back by `resolved_choices` (benchmarks/vs_trl.py records each run's).
CHOICES_LINE = re.compile(
    r"^generation engine (?P<engine>\w+) \((?P<generation_dtype>\w+); .*\); "
    r"training precision (?P<precision>\w+) \(",
    re.MULTILINE,
)


def choices_line(spec: RunSpec, why: str) -> str:
    """The line `reinforce run` prints at start: the generation engine and dtype, and the training precision, as
    auto resolved them on this machine (`why`: how the engine was chosen)."""
    generation = spec.generation
    return (
        f"generation engine {generation.resolved_engine()} ({generation.resolved_dtype(bfloat16_is_native())}; {why}); "
        f"training precision {spec.training.resolved_precision(bfloat16_is_native('cpu'))} "
        f"(training.precision {spec.training.precision})"
    )


def resolved_choices(output: str) -> dict[str, str]:
    """{"engine", "generation_dtype", "precision"} from the choices_line in a run's output."""
    found = CHOICES_LINE.search(output)
    if found is None:
        raise ValueError("the output has no 'generation engine ... training precision ...' line (choices_line)")
    return found.groupdict()


def _spec(args: argparse.Namespace) -> tuple[RunSpec, Path]:
    """The run's spec and its file: the run folder's for --resume, else SPEC's with its paths made absolute."""
    if args.resume:
        spec_file = RunPaths(Path(args.resume)).spec
        return load_spec(spec_file), spec_file
    spec_file = Path(args.spec)
    spec = load_spec(spec_file)
    if args.run_dir:  # the command line's run folder wins over the spec's
        spec = spec.model_copy(update={"run_dir": args.run_dir})
    return resolve_spec(spec, spec_file), spec_file


def _check_data(spec: RunSpec, spec_file: Path) -> None:
    """A bad prompt file (or shard folder) fails now, naming file:line, not in the trainer later."""
    for name in ("prompts", "validation_prompts"):
        if getattr(spec.data, name):
            try:
                if name == "prompts" and spec.data.loader == "dali":
                    read_shard_index(Path(spec.data.prompts), spec.data)
                else:
                    read_prompt_file(getattr(spec.data, name), spec.data.on_bad_line, spec.data.prompt_field)
            except DataError as err:
                raise SpecError(f"{spec_file}: data.{name}: {err}") from None


def _check_packages(spec: RunSpec, spec_file: Path) -> None:
    """A tracker, engine or backend whose optional package is not installed fails now."""
    try:
        check_trackers(spec.logging.trackers)
        require_engine(spec.generation.resolved_engine())
        require_backend(spec.training.backend)
    except MissingPackage as err:
        raise SpecError(f"{spec_file}: {err}") from None


def _supervise(spec: RunSpec, paths: RunPaths) -> int:
    """Run the pipeline to its end, recording the outcome; every child is stopped whatever happens."""
    supervisor = Supervisor(spec)
    signals = StopSignals()
    try:
        supervisor.run()
    except KeyboardInterrupt:
        print("interrupted: stopping every component", file=sys.stderr)
        record_outcome(paths, 130, "interrupted (Ctrl-C or SIGTERM)")
        return 130
    except RunFailed as err:
        record_outcome(paths, 1, str(err))
        raise
    finally:
        signals.stopping = True  # from here on a signal cannot interrupt the shutdown, however many come
        supervisor.stop()
        paths.remove_partial_files()  # a component that died mid-write (a full disk) left them
    record_outcome(paths, 0, "")
    return 0


def _check_fits_policy(spec: RunSpec, spec_file: Path, policy_config: PretrainedConfig) -> None:
    """Prompt + response must fit the policy's positions: said now, naming the fields, not by a generator later."""
    limit = getattr(policy_config, "max_position_embeddings", None)
    if limit is None:  # a model family without absolute positions has no such limit
        return
    try:
        check_fits_policy(spec, limit)
    except ValueError as err:
        raise SpecError(f"{spec_file}: {err}") from None


class StopSignals:
    """SIGINT and SIGTERM: the first interrupts the run; once the shutdown has begun, they only say so.

    A KeyboardInterrupt raised inside supervisor.stop() would leave every component not yet stopped running,
    in its own session, forever.
    """

    def __init__(self) -> None:
        self.stopping = False
        # Explicitly, also for SIGINT: a shell starts background jobs with SIGINT ignored, and Python keeps it so.
        signal.signal(signal.SIGTERM, self.handle)
        signal.signal(signal.SIGINT, self.handle)

    def handle(self, _signum: int, _frame: object) -> None:
        if self.stopping:
            print("already stopping every component; please wait", file=sys.stderr)
            return
        self.stopping = True
        raise KeyboardInterrupt


def add_run_command(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser("run", help="run a whole pipeline locally")
    run.add_argument("spec", nargs="?", help="run spec YAML (see examples/)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    run.add_argument("--overwrite", action="store_true", help="delete an earlier run in the same run folder")
    run.add_argument("--run-dir", metavar="DIR", help="the run folder (instead of the spec's run_dir)")
    run.set_defaults(handler=run_command, check=_check_run_arguments)


def _check_run_arguments(args: argparse.Namespace) -> str | None:
    if bool(args.spec) == bool(args.resume):
        return "run takes a SPEC file or --resume RUN_DIR"
    return "--run-dir goes with a SPEC file (--resume names its run folder)" if args.resume and args.run_dir else None
