"""core/launch_flags.py: each service's flags object, written as a command line by core/launch.py and read back by
the parser its `main` uses; the spellings in docker-compose.yml, compose/tools.yml, compose/code-tests.yml and the
Dockerfiles' CMD parse."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from reinforce.core import launch
from reinforce.core.launch_flags import (
    CriticFlags,
    EnvironmentFlags,
    GeneratorFlags,
    LaunchFlags,
    RewardFlags,
    ShellText,
    TrainerFlags,
)
from reinforce.core.names import REDIS_URL_ENV

ROOT = Path(__file__).resolve().parents[2]
SPEC = "/etc/reinforce/spec.yaml"

# Every field away from its default: each one must appear on the command line and come back.
EVERY_FLAG: dict[str, LaunchFlags] = {
    "reward": RewardFlags(
        http_port=1, grpc_port=2, metrics_port=3, host="0.0.0.0", environment_url="http://env:5557", log_level="DEBUG"
    ),
    "generator": GeneratorFlags(
        redis_url="redis://:pw@redis:6379/0",
        reward_url="http://reward:8000",
        port=8080,
        metrics_port=8081,
        host="0.0.0.0",
        weights_url="http://trainer:9001",
        id="generator-0",
        environment_url="unix:/run/env.sock",
    ),
    "trainer": TrainerFlags(
        redis_url="redis://:pw@redis:6379/0",
        metrics_port=9000,
        host="0.0.0.0",
        weights_port=9001,
        advertise_host="trainer",
        critic_url="http://critic:5556",
        stay_up=True,
    ),
    "critic": CriticFlags(host="0.0.0.0", port=6000, metrics_port=6001, device="cuda"),
    "environment": EnvironmentFlags(host="0.0.0.0", port=7000, metrics_port=7001, uds="/run/env.sock"),
}


def parse(service: launch.Service, argv: list[str]) -> tuple[str, LaunchFlags]:
    """What the service's `main` parses from `python -m MODULE ARGV...` (argv past the module)."""
    return service.flags.parse(service.parser("test"), argv)


def test_every_service_has_a_flags_object_of_its_own():
    assert set(EVERY_FLAG) == set(launch.SERVICES)
    for name, service in launch.SERVICES.items():
        assert type(EVERY_FLAG[name]) is service.flags, name
        assert {f.name for f in dataclasses.fields(service.flags)} >= {"host", service.probe_port_flag}, name


@pytest.mark.parametrize("name", sorted(EVERY_FLAG))
def test_flags_round_trip_through_the_command_line(name: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    service, flags = launch.SERVICES[name], EVERY_FLAG[name]
    argv = service.command("python", SPEC, flags)
    assert argv[:5] == ["python", "-m", service.module, "--spec", SPEC]
    assert len(argv) - 5 >= len(dataclasses.fields(flags))  # every field written, none left at its default
    assert parse(service, argv[3:]) == (SPEC, flags)


@pytest.mark.parametrize("name", sorted(EVERY_FLAG))
def test_defaults_are_left_off_and_parse_back(name: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(REDIS_URL_ENV, "redis://from-env:6379/0")
    service = launch.SERVICES[name]
    required = {
        f.name: getattr(EVERY_FLAG[name], f.name)
        for f in dataclasses.fields(service.flags)
        if f.default is dataclasses.MISSING
    }
    flags = service.flags(**required)
    argv = service.command("python", SPEC, flags)
    assert len(argv) == 5 + 2 * len(required)
    # the generator's and the trainer's Redis URL: from $REINFORCE_REDIS_URL when the flag is absent
    has_redis = hasattr(flags, "redis_url")
    expected = dataclasses.replace(flags, redis_url="redis://from-env:6379/0") if has_redis else flags
    assert parse(service, argv[3:]) == (SPEC, expected)


def test_every_field_has_a_help_line():
    for service in launch.SERVICES.values():
        for field in dataclasses.fields(service.flags):
            assert field.metadata["help"].strip(), f"{service.flags.__name__}.{field.name}"


def test_a_misspelt_or_mistyped_flag_fails_where_it_is_built():
    with pytest.raises(TypeError, match="metric_port"):
        CriticFlags(metric_port=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"CriticFlags\.port: '5556'"):
        CriticFlags(port="5556")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"TrainerFlags\.metrics_port: True"):
        TrainerFlags(metrics_port=True)  # a bool is an int to isinstance, not a port
    with pytest.raises(TypeError, match="stay_up"):
        TrainerFlags(stay_up=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"reinforce\.critic takes CriticFlags, not EnvironmentFlags"):
        launch.CRITIC.command("python", SPEC, EnvironmentFlags())
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'id'"):
        GeneratorFlags(reward_url="http://reward:8000", port=8080)  # type: ignore[call-arg]


def test_shell_text_only_where_the_field_takes_it():
    """The host-network generator's ports are shell arithmetic on its pod ordinal (operator/children.py)."""
    port = ShellText("$((8080 + ${POD_NAME##*-}))")
    flags = GeneratorFlags(reward_url="http://reward:8000", port=port, id="$POD_NAME")
    assert launch.GENERATOR.command("python", SPEC, flags)[5:9] == [
        "--reward-url",
        "http://reward:8000",
        "--port",
        port,
    ]
    with pytest.raises(TypeError, match=r"CriticFlags\.port"):
        CriticFlags(port=port)  # type: ignore[arg-type]


def test_the_redis_url_comes_from_the_environment_or_is_required(monkeypatch: pytest.MonkeyPatch):
    argv = ["--spec", SPEC, "--metrics-port", "9000"]
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:secret@127.0.0.1:1/0")
    assert parse(launch.TRAINER, argv)[1].redis_url == "redis://:secret@127.0.0.1:1/0"
    monkeypatch.delenv(REDIS_URL_ENV)
    with pytest.raises(SystemExit):
        parse(launch.TRAINER, argv)


# compose/tools.yml's relay of the environment's /metrics: not a launch service (its own parser;
# tests/e2e/test_compose.py runs its command)
METRICS_RELAY = "reinforce.environment.metrics_relay"


def _compose_commands() -> list[list[str]]:
    commands = []
    for path in (ROOT / "docker-compose.yml", ROOT / "compose" / "tools.yml", ROOT / "compose" / "code-tests.yml"):
        for service in yaml.safe_load(path.read_text())["services"].values():
            if service.get("command", [None])[0] == "python" and service["command"][2] != METRICS_RELAY:
                commands.append(service["command"])
    return commands


def _dockerfile_commands() -> list[list[str]]:
    commands = []
    for component in launch.SERVICES:
        text = (ROOT / "services" / "reinforce" / component / "Dockerfile").read_text().replace("\\\n", "")
        [cmd] = re.findall(r"^CMD (\[.*\])$", text, flags=re.MULTILINE)
        commands.append(json.loads(cmd))
    return commands


def test_the_compose_files_and_dockerfiles_spellings_parse(monkeypatch: pytest.MonkeyPatch):
    """The command lines written by hand, before the flags were objects, still parse, and to_argv writes what they
    mean (tests/e2e/test_compose.py runs the compose file's commands as processes)."""
    monkeypatch.setenv(REDIS_URL_ENV, "redis://redis:6379/0")  # as compose gives it to the generator and trainer
    by_module = {service.module: service for service in launch.SERVICES.values()}
    commands = _compose_commands() + _dockerfile_commands()
    assert {command[2] for command in commands} == set(by_module)
    for command in commands:
        service = by_module[command[2]]
        spec_file, flags = parse(service, command[3:])
        assert spec_file == SPEC
        assert parse(service, service.command("python", spec_file, flags)[3:]) == (spec_file, flags)
        given = dict(zip(command[5::2], command[6::2], strict=True))
        for option, value in given.items():
            assert str(getattr(flags, option.removeprefix("--").replace("-", "_"))) == value, command
