"""How each service is launched: its module, its flags (core/launch_flags.py) and its readiness probe, defined once.

The local supervisor, the operator's pods, the container images' CMD and docker-compose.yml all start the
services this way (tests/e2e/test_compose.py checks the compose file against it; tests/unit/test_launch_flags.py
that the compose files' and the Dockerfiles' flags parse).

Every service listens on 127.0.0.1 unless given `--host` (names.LOCAL_HOST): a local run is reachable from this
machine only. Pods and containers pass `--host 0.0.0.0` (names.ANY_HOST), as their Services need.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from reinforce.core import names
from reinforce.core.launch_flags import (
    CriticFlags,
    EnvironmentFlags,
    GeneratorFlags,
    LaunchFlags,
    RewardFlags,
    TrainerFlags,
    TrainingApiFlags,
)
from reinforce.core.spec import RunSpec


@dataclass(frozen=True)
class Service:
    module: str  # python -m MODULE
    flags: type[LaunchFlags]  # its command line's flags (core/launch_flags.py)
    ready_path: str | None  # HTTP readiness probe on the port named by `probe_port_flag` (None: a TCP probe)
    probe_port_flag: str
    # The environment variables of secrets it may hold, and no others: a service that is taken over (a reward
    # function's dependency, a generator's engine) gives away only these.
    credentials: tuple[str, ...] = ()

    def command(self, python: str, spec_file: str, flags: LaunchFlags) -> list[str]:
        """`python -m MODULE --spec SPEC --flag value ...` (LaunchFlags.to_argv)."""
        if not isinstance(flags, self.flags):
            raise TypeError(f"{self.module} takes {self.flags.__name__}, not {type(flags).__name__}")
        return [python, "-m", self.module, "--spec", spec_file, *flags.to_argv()]

    def parser(self, description: str) -> argparse.ArgumentParser:
        """The parser of its `main`: --spec and its flags."""
        return self.flags.parser(f"python -m {self.module}", description)


# The environment token only when the reward runs code there (reward.function code_tests: RewardSpec.uses_environment).
REWARD = Service(
    "reinforce.reward", RewardFlags, names.REWARD_READY_PATH, probe_port_flag="http_port",
    credentials=(names.ENVIRONMENT_TOKEN_ENV,),
)  # fmt: skip
GENERATOR = Service(
    "reinforce.generator", GeneratorFlags, names.READY_PATH, probe_port_flag="port",
    credentials=(names.REDIS_URL_ENV, names.CONTROL_TOKEN_ENV, names.WEIGHTS_TOKEN_ENV, names.ENVIRONMENT_TOKEN_ENV),
)  # fmt: skip
TRAINER = Service(
    "reinforce.trainer", TrainerFlags, None, probe_port_flag="metrics_port",
    credentials=(names.REDIS_URL_ENV, names.WEIGHTS_TOKEN_ENV, names.CRITIC_TOKEN_ENV),
)  # fmt: skip
CRITIC = Service(
    "reinforce.critic", CriticFlags, names.READY_PATH, probe_port_flag="port", credentials=(names.CRITIC_TOKEN_ENV,)
)
ENVIRONMENT = Service(
    "reinforce.environment", EnvironmentFlags, names.READY_PATH, probe_port_flag="port",
    credentials=(names.ENVIRONMENT_TOKEN_ENV,),
)  # fmt: skip
# `reinforce serve`'s API (services/reinforce/training_api/), not a part of a run
TRAINING_API = Service(
    "reinforce.training_api", TrainingApiFlags, names.READY_PATH, probe_port_flag="port",
    credentials=(names.REDIS_URL_ENV, names.TRAINING_API_KEY_ENV),
)  # fmt: skip


def opened(credential: str, spec: RunSpec) -> bool:
    """Whether a run of `spec` has the service a credential opens: a critic (ppo), an environment service."""
    if credential == names.CRITIC_TOKEN_ENV:
        return spec.algorithm.name == "ppo"
    if credential == names.ENVIRONMENT_TOKEN_ENV:
        return spec.environment.enabled
    return True


def holds(service: Service, credential: str, spec: RunSpec) -> bool:
    """Whether `service` gets `credential` in a run of `spec`: one of its credentials, of a service the run has."""
    if credential not in service.credentials or not opened(credential, spec):
        return False
    # the reward server runs code in the environment service only for reward.function code_tests
    return service is not REWARD or credential != names.ENVIRONMENT_TOKEN_ENV or spec.reward.uses_environment


# `reinforce rollout` (the weight reconciler of docker compose; the supervisor and the operator run it in-process)
ROLLOUT_CREDENTIALS = (names.REDIS_URL_ENV, names.CONTROL_TOKEN_ENV)


def redis_shell_command(port: int, data_dir: str, config_dir: str, password_env: str) -> str:
    """`sh -c` text that starts redis-server with its password from a config file, never on its command line.

    printf is a shell builtin (no process whose argv `ps` could show); the file is private to the user. Append-only
    file fsynced on every write: a Redis restart loses nothing acknowledged.
    """
    config = f"{config_dir}/redis.conf"
    return (
        f'umask 077 && printf \'requirepass "%s"\\n\' "${password_env}" > {config} && '
        f"exec redis-server {config} --port {port} --dir {data_dir} --appendonly yes --appendfsync always --save ''"
    )


def weights_url(host: str, port: int) -> str:
    """The trainer's weight endpoint as generators reach it (their --weights-url; the trainer's --advertise-host)."""
    return f"http://{host}:{port}"


SERVICES = {
    names.COMPONENT_REWARD: REWARD,
    names.COMPONENT_GENERATOR: GENERATOR,
    names.COMPONENT_TRAINER: TRAINER,
    names.COMPONENT_CRITIC: CRITIC,
    names.COMPONENT_ENVIRONMENT: ENVIRONMENT,
}
