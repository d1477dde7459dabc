"""How each service is launched: its module, its flags and its readiness probe, defined once.

The local supervisor, the operator's pods, the container images' CMD and docker-compose.yml all start the
services this way (tests/integration/test_compose.py checks the compose file against it).
"""

from __future__ import annotations

from dataclasses import dataclass

from reinforce.core import names


@dataclass(frozen=True)
class Service:
    module: str  # python -m MODULE
    ready_path: str | None  # HTTP readiness probe on the port named by `probe_port_flag` (None: a TCP probe)
    probe_port_flag: str

    def command(self, python: str, spec_file: str, **flags: object) -> list[str]:
        """`python -m MODULE --spec SPEC --flag value ...`: flag_name becomes --flag-name; True is a bare flag."""
        argv = [python, "-m", self.module, "--spec", spec_file]
        for flag, value in flags.items():
            option = f"--{flag.replace('_', '-')}"
            argv += [option] if value is True else [option, str(value)]
        return argv


REWARD = Service("reinforce.reward", names.REWARD_READY_PATH, probe_port_flag="http_port")
GENERATOR = Service("reinforce.generator", names.READY_PATH, probe_port_flag="port")
TRAINER = Service("reinforce.trainer", None, probe_port_flag="metrics_port")
CRITIC = Service("reinforce.critic", names.READY_PATH, probe_port_flag="port")
SERVICES = {
    names.COMPONENT_REWARD: REWARD,
    names.COMPONENT_GENERATOR: GENERATOR,
    names.COMPONENT_TRAINER: TRAINER,
    names.COMPONENT_CRITIC: CRITIC,
}
