"""Each service's command-line flags as one typed object, written once.

Whoever starts a service (the local supervisor, the operator, the tests) builds its flags object, and
`core/launch.py`'s `Service.command` writes it as the command line (`to_argv`); the service's own `main` parses that
command line back into the same object with the parser derived from its fields, as TRL derives its CLI from its
config dataclasses. A misspelt flag is a TypeError where the object is built, and a mistyped value one too
(`__post_init__` checks each field against its annotation), not an argparse error in a child process.

A field is a flag: `metrics_port` is `--metrics-port`, its annotation the option's type (bool: a bare flag), its
default the option's default (no default: a required option), `flag(help=...)` its help line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, Self

from reinforce.core.names import (
    CRITIC_PORT,
    ENVIRONMENT_PORT,
    ENVIRONMENT_TOKEN_ENV,
    LOCAL_HOST,
    REDIS_URL_ENV,
    TRAINING_API_PORT,
    TRAINING_API_SESSION_TIMEOUT_S,
)


class ShellText(str):
    """A flag's value as shell text that the container's `sh -c` expands before the service parses it (the
    host-network generator's ports, computed from its pod ordinal); accepted only where a field's type names it."""


def flag(text: str, default: Any = dataclasses.MISSING, env: str | None = None) -> Any:
    """A field of a flags object, `text` its help line. `env`: when the flag is absent the service reads this
    variable (a secret kept off the command line, where `ps` would show it); required only if that is unset too."""
    return dataclasses.field(default=default, metadata={"help": text, "env": env})


def _options(annotation: Any) -> tuple[type, ...]:
    """The types a field accepts: `int | None` -> (int, NoneType)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _accepts(options: tuple[type, ...], value: object) -> bool:
    if isinstance(value, bool):  # a bool is an int to isinstance; a port is not a bool
        return bool in options
    return isinstance(value, options)


def _add_option(parser: argparse.ArgumentParser, field: dataclasses.Field, options: tuple[type, ...]) -> None:
    option, help_text = f"--{field.name.replace('_', '-')}", field.metadata["help"]
    if bool in options:
        parser.add_argument(option, action="store_true", help=help_text)
        return
    [value_type] = [t for t in options if t not in (types.NoneType, ShellText)]
    env = field.metadata["env"]
    if env is not None:
        default, required = os.environ.get(env), env not in os.environ
    else:
        default, required = (None, True) if field.default is dataclasses.MISSING else (field.default, False)
    parser.add_argument(option, type=value_type, default=default, required=required, help=help_text)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchFlags:
    """The flags of one service (a subclass per service); `--spec` is not one: every service takes it."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not _accepts(_options(hints[field.name]), value):
                raise TypeError(f"{type(self).__name__}.{field.name}: {value!r} is not {hints[field.name]}")

    def to_argv(self) -> list[str]:
        """The flags that differ from their defaults, in field order: a bare flag for True, `--name value` else."""
        argv: list[str] = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None or value is False or value == field.default:
                continue
            option = f"--{field.name.replace('_', '-')}"
            argv += [option] if value is True else [option, str(value)]
        return argv

    @classmethod
    def parser(cls, prog: str, description: str) -> argparse.ArgumentParser:
        """`--spec` and one option per field."""
        parser = argparse.ArgumentParser(prog=prog, description=description)
        parser.add_argument("--spec", required=True, help="resolved run spec (RUN_DIR/spec.yaml)")
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            _add_option(parser, field, _options(hints[field.name]))
        return parser

    @classmethod
    def parse(cls, parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> tuple[str, Self]:
        """(the spec file, the flags) from `argv` (None: sys.argv), by `parser` (from `cls.parser`)."""
        args = parser.parse_args(argv)
        return args.spec, cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardFlags(LaunchFlags):
    http_port: int = flag("Triton HTTP port.", 8000)
    grpc_port: int = flag("Triton gRPC port.", 8001)
    metrics_port: int = flag("Triton Prometheus metrics port.", 8002)
    host: str = flag(f"Address Triton binds HTTP, gRPC and metrics to (default {LOCAL_HOST}).", LOCAL_HOST)
    environment_url: str | None = flag(
        "The environment service, where reward.function code_tests runs the tests.", None
    )
    log_level: str = flag("Python log level.", "INFO")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GeneratorFlags(LaunchFlags):
    redis_url: str | None = flag(f"redis://[:PASSWORD@]HOST:PORT/DB (default: ${REDIS_URL_ENV})", None, REDIS_URL_ENV)
    reward_url: str = flag("Triton HTTP address of the reward server")
    port: int | ShellText = flag("control plane port")
    metrics_port: int | ShellText = flag("Prometheus metrics on a port of their own (0: on --port only)", 0)
    host: str = flag(f"control plane address (default {LOCAL_HOST})", LOCAL_HOST)
    weights_url: str | None = flag("the run's trainer weight endpoint, http://HOST:PORT (weights.transport http)", None)
    id: str = flag("consumer name in the prompts stream's group")
    environment_url: str | None = flag(
        f"the environment service, http://HOST:PORT or unix:/SOCKET (its token: ${ENVIRONMENT_TOKEN_ENV})", None
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerFlags(LaunchFlags):
    redis_url: str | None = flag(f"redis://[:PASSWORD@]HOST:PORT/DB (default: ${REDIS_URL_ENV})", None, REDIS_URL_ENV)
    metrics_port: int = flag("Prometheus port (0: none)", 0)
    host: str = flag(f"address of the metrics and weight endpoints (default {LOCAL_HOST})", LOCAL_HOST)
    weights_port: int = flag("weights.transport http: port (0: any free)", 0)
    advertise_host: str = flag("host generators use to reach the weight endpoint", LOCAL_HOST)
    critic_url: str | None = flag("algorithm.name ppo: base URL of the critic service", None)
    stay_up: bool = flag(
        "after the last step keep serving metrics and weights until SIGTERM (on Kubernetes, where a container "
        "that exits is restarted, and generators still fetch the final weights from this one)",
        False,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriticFlags(LaunchFlags):
    host: str = flag(f"Bind address (default {LOCAL_HOST}: loopback only).", LOCAL_HOST)
    port: int = flag(f"Port of the critic's API (default {CRITIC_PORT}).", CRITIC_PORT)
    metrics_port: int = flag("Prometheus metrics on a port of their own (0: on --port only)", 0)
    device: str = flag("torch device of the value model (cpu, cuda, ...).", "cpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvironmentFlags(LaunchFlags):
    host: str = flag(f"Bind address (default {LOCAL_HOST}).", LOCAL_HOST)
    port: int = flag(f"Port of the environment's API (default {ENVIRONMENT_PORT}).", ENVIRONMENT_PORT)
    metrics_port: int = flag("Prometheus metrics on a port of their own (0: on --port only)", 0)
    uds: str | None = flag(
        "serve on this Unix socket instead of --host/--port (docker-compose: a container without network)", None
    )
    run_as: str | None = flag(
        "UID:GID to run as once --uds is bound, for a service started as root: the socket then lies in root's "
        "folder, where the tools' code, run as UID, cannot replace it (docker-compose)",
        None,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingApiFlags(LaunchFlags):
    host: str = flag(f"Bind address (default {LOCAL_HOST}).", LOCAL_HOST)
    port: int = flag(f"Port of the API (default {TRAINING_API_PORT}).", TRAINING_API_PORT)
    redis_url: str | None = flag(f"redis://[:PASSWORD@]HOST:PORT/DB (default: ${REDIS_URL_ENV})", None, REDIS_URL_ENV)
    session_timeout_s: float = flag(
        f"seconds: a session with no heartbeat for this long expires, its models saved and unloaded (default "
        f"{TRAINING_API_SESSION_TIMEOUT_S:g})",
        TRAINING_API_SESSION_TIMEOUT_S,
    )
