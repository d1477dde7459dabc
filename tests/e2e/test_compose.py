"""docker-compose.yml: a valid file for Debian's docker-compose 1.29, whose services run the project's entry points.

The file's commands, environment and health checks, as `docker-compose config` resolves them, are run here as local
processes (service names -> 127.0.0.1, each fixed port -> one free port, volumes -> folders; otherwise the same
argv) in the file's start order, each started once its dependencies' health checks pass, with a real redis-server:
they train the tiny example for a few steps. `make compose-smoke` runs the same file with docker (images built on
the machine), and the last test here runs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import free_port
from prometheus_client.parser import text_string_to_metric_families
from promserver import COMPONENTS as PPO_COMPONENTS
from promserver import PROMETHEUS, PrometheusAPI, assert_every_dashboard_query_answers, wait_until_scraped

from reinforce.core import launch
from reinforce.core.environment_api import RUN_PATH
from reinforce.core.launch_flags import EnvironmentFlags, RewardFlags
from reinforce.core.metrics import read_metrics
from reinforce.core.names import COMPONENTS as ALL_COMPONENTS
from reinforce.core.names import (
    CONTROL_TOKEN_ENV,
    CRITIC_TOKEN_ENV,
    ENVIRONMENT_TOKEN_ENV,
    METRICS_PATH,
    READY_PATH,
    REDIS_URL_ENV,
    REWARD_READY_PATH,
    WEIGHTS_TOKEN_ENV,
)
from reinforce.core.run_dir import RunPaths
from reinforce.core.samples import read_samples, sample_steps
from reinforce.core.spec import CODE_TESTS_REWARD, EnvironmentSpec
from reinforce.operator import children
from reinforce.reward.rewards import final_code
from tests.integration.test_code_reward_server import (
    OUTPUT_LIMIT,
    SOLUTIONS,
    TIME_LIMIT_S,
    assert_scores_the_solutions,
)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
TOOLS_OVERRIDE = ROOT / "compose" / "tools.yml"  # the profile `tools` wired to the generators
CODE_TESTS_OVERRIDE = ROOT / "compose" / "code-tests.yml"  # and to the reward server, for reward.function code_tests
RELAY = "environment-metrics"  # compose/tools.yml's relay of the environment's /metrics (profile monitoring)
SOCKET_DIR = "/run/reinforce-environment"  # the volume environment-socket in each container that mounts it
PROMETHEUS_CONFIG = ROOT / "compose" / "prometheus.yml"  # the `prometheus` service's, @RUN@ -> $REINFORCE_RUN
EXAMPLES = ROOT / "examples"
SPEC_IN_CONTAINER = "/etc/reinforce/spec.yaml"
IMAGE_EXAMPLES = "/opt/reinforce/examples"  # where services/reinforce/core/Dockerfile puts examples/
DOCKER_COMPOSE = shutil.which("docker-compose")
# compose service -> its component (core/launch.py) and image folder (services/reinforce/COMPONENT/Dockerfile)
COMPONENTS = {"reward": "reward", "generator-0": "generator", "trainer": "trainer", "critic": "critic"}
needs_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None, reason="Debian's docker-compose is not installed (`make install` installs it)"
)


def compose_config(*overrides: Path, **env: str) -> dict:
    """The file (and overrides) as docker-compose resolves it: variables substituted, anchors expanded, paths made
    absolute."""
    files = [arg for path in (COMPOSE, *overrides) for arg in ("-f", str(path))]
    result = subprocess.run(
        [DOCKER_COMPOSE, *files, "config"], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@needs_compose
def test_compose_file_is_valid():
    result = subprocess.run([DOCKER_COMPOSE, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("compose_spec", "example"), [("compose", "tiny"), ("compose-ppo", "tiny-ppo"), ("compose-tools", "tiny-tools")]
)
def test_compose_spec_is_the_tiny_example(compose_spec, example):
    """examples/compose.yaml is tiny.yaml (compose-ppo.yaml tiny-ppo.yaml, compose-tools.yaml tiny-tools.yaml) with
    container paths and weights over HTTP, nothing else."""
    compose = yaml.safe_load((EXAMPLES / f"{compose_spec}.yaml").read_text())
    tiny = yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text())
    assert compose.pop("run_dir") == "/data/run"
    assert compose.pop("weights") == {"transport": "http"}
    assert compose["data"].pop("prompts") == f"{IMAGE_EXAMPLES}/{tiny['data'].pop('prompts')}"
    assert compose == tiny


def dockerfile_cmd(service: str) -> list[str]:
    text = (ROOT / "services" / "reinforce" / service / "Dockerfile").read_text().replace("\\\n", "")
    [cmd] = re.findall(r"^CMD (\[.*\])$", text, flags=re.MULTILINE)
    return json.loads(cmd)


def test_compose_commands_and_probes_are_the_services_launch(monkeypatch: pytest.MonkeyPatch):
    """Each service's command in docker-compose.yml is `python -m MODULE --spec SPEC` and flags its service's parser
    reads (core/launch_flags.py), which core/launch.py writes back as the same flags; its health check probes the
    launch's readiness path."""
    monkeypatch.setenv(REDIS_URL_ENV, "redis://redis:6379/0")  # as the file gives the generator and the trainer
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, component in COMPONENTS.items():
        command, service = services[name]["command"], launch.SERVICES[component]
        assert command[:3] == ["python", "-m", service.module], name
        parsed = service.flags.parse(service.parser(name), command[3:])
        assert parsed[0] == SPEC_IN_CONTAINER, name
        again = service.command("python", SPEC_IN_CONTAINER, parsed[1])
        assert service.flags.parse(service.parser(name), again[3:]) == parsed, name
        if service.ready_path:
            assert service.ready_path in " ".join(services[name]["healthcheck"]["test"]), name


def test_each_compose_service_holds_only_its_launch_credentials():
    """Issue #30, R3-7: each container gets the secrets its service uses (core/launch.py), no other."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    held = {name: set(service.get("environment", {})) for name, service in services.items()}
    # the environment's token only where it runs: compose/tools.yml gives it to the generators (as the operator
    # gives it only to runs that have an environment service)
    assert held["generator-0"] == set(launch.GENERATOR.credentials) - {ENVIRONMENT_TOKEN_ENV}
    assert held["environment"] == set(launch.ENVIRONMENT.credentials)
    tools = yaml.safe_load(TOOLS_OVERRIDE.read_text())["services"]
    assert set(tools) == {"generator-0", RELAY} and set(tools["generator-0"]["environment"]) == {ENVIRONMENT_TOKEN_ENV}
    assert "environment" not in tools[RELAY]  # it relays /metrics, open on the service too
    # and to the reward server only for reward.function code_tests, in a file of its own (launch.holds)
    code_tests = yaml.safe_load(CODE_TESTS_OVERRIDE.read_text())["services"]
    assert set(code_tests) == {"reward"} and set(code_tests["reward"]["environment"]) == {ENVIRONMENT_TOKEN_ENV}
    assert held["trainer"] == set(launch.TRAINER.credentials)
    assert held["critic"] == set(launch.CRITIC.credentials)
    assert held["rollout"] == set(launch.ROLLOUT_CREDENTIALS)
    assert held["reward"] == set()
    tokens = {services["generator-0"]["environment"][name] for name in (CONTROL_TOKEN_ENV, WEIGHTS_TOKEN_ENV)}
    tokens.add(services["critic"]["environment"][CRITIC_TOKEN_ENV])
    assert len(tokens) == 3, "the default control, weights and critic tokens must differ"


def environment_socket(service: dict) -> str:
    """The environment service's --uds in its compose command."""
    _, flags = EnvironmentFlags.parse(launch.ENVIRONMENT.parser("environment"), service["command"][3:])
    assert flags.uds is not None
    return flags.uds


@needs_compose
def test_compose_environment_is_confined_as_the_operators_pod():
    """The `environment` service (profile tools) runs model-written code: it gets the settings of the operator's
    environment pod (operator/children.py) that compose can say, and no network at all; compose/tools.yml gives the
    generators its socket (read-only) and the command of docker-compose.yml with --environment-url."""
    services = compose_config(TOOLS_OVERRIDE)["services"]
    env = services["environment"]
    assert env["profiles"] == ["tools"] and env["network_mode"] == "none"
    pod = children.ENVIRONMENT_SECURITY_CONTEXT
    assert env["read_only"] is pod["readOnlyRootFilesystem"] is True
    assert env["cap_drop"] == pod["capabilities"]["drop"] == ["ALL"]
    assert env["security_opt"] == ["no-new-privileges:true"] and pod["allowPrivilegeEscalation"] is False
    sysctls = {s["name"]: s["value"] for s in children.ENVIRONMENT_SYSCTLS}
    assert {name: str(value) for name, value in env["sysctls"].items()} == sysctls
    # it starts as root only to bind its socket where the tools' code cannot replace it, then runs as a uid of its own
    # (the base of the pod's: the other containers' uid would count their threads against its calls' max_processes)
    assert env["user"] == "0:0" and sorted(env["cap_add"]) == ["SETGID", "SETUID"]
    assert env["tmpfs"] == [f"{children.SCRATCH_DIR}:size=64m,mode=1777"] and env["pids_limit"] > 0
    spec = EnvironmentSpec()  # the memory the pod gets by default (operator/children.py _environment_resources)
    memory_mib = spec.max_concurrent_calls * spec.memory_limit_mb + children.ENVIRONMENT_SERVICE_MEMORY_MIB
    assert env["mem_limit"] == f"{memory_mib}m"
    uds = environment_socket(env)
    flags = EnvironmentFlags(uds=uds, run_as=f"{children.ENVIRONMENT_UID_BASE}:{children.RUN_AS_USER}")
    assert env["command"] == launch.ENVIRONMENT.command("python", SPEC_IN_CONTAINER, flags)
    assert uds == f"{SOCKET_DIR}/api.sock" and f"environment-socket:{SOCKET_DIR}:rw" in env["volumes"]
    assert uds in env["healthcheck"]["test"] and launch.ENVIRONMENT.ready_path in env["healthcheck"]["test"][-1]
    default = yaml.safe_load(COMPOSE.read_text())["services"]["generator-0"]
    generator = services["generator-0"]
    assert generator["command"] == [*default["command"], "--environment-url", f"unix:{uds}"]
    assert f"environment-socket:{SOCKET_DIR}:ro" in generator["volumes"]
    assert generator["depends_on"]["environment"] == {"condition": "service_healthy"}
    assert generator["environment"][ENVIRONMENT_TOKEN_ENV] == env["environment"][ENVIRONMENT_TOKEN_ENV]


@needs_compose
def test_compose_code_tests_wires_the_reward_server_to_the_environment():
    """compose/code-tests.yml gives the reward server what reward.function code_tests needs, and nothing else: the
    command of docker-compose.yml with --environment-url (the environment's socket), the socket's volume read-only and
    the environment's token; it starts once the environment is healthy."""
    services = compose_config(TOOLS_OVERRIDE, CODE_TESTS_OVERRIDE)["services"]
    env, reward = services["environment"], services["reward"]
    uds = environment_socket(env)
    default = yaml.safe_load(COMPOSE.read_text())["services"]["reward"]
    assert reward["command"] == [*default["command"], "--environment-url", f"unix:{uds}"]
    _, flags = RewardFlags.parse(launch.REWARD.parser("reward"), reward["command"][3:])
    assert flags.environment_url == f"unix:{uds}"
    assert f"environment-socket:{SOCKET_DIR}:ro" in reward["volumes"] and len(reward["volumes"]) == 2  # and the spec
    assert reward["environment"] == {ENVIRONMENT_TOKEN_ENV: env["environment"][ENVIRONMENT_TOKEN_ENV]}
    assert reward["depends_on"] == {"environment": {"condition": "service_healthy"}}
    assert "network_mode" not in reward  # the generators reach it over the network as before


@needs_compose
def test_compose_environment_metrics_relay_is_on_the_network_and_the_environment_is_not():
    """compose/tools.yml's relay (profile monitoring) reads the environment's socket and serves its /metrics on the
    network; the environment itself keeps no network, and the relay holds no secret and can write nothing."""
    services = compose_config(TOOLS_OVERRIDE)["services"]
    relay, env = services[RELAY], services["environment"]
    assert env["network_mode"] == "none" and "network_mode" not in relay
    assert relay["profiles"] == ["monitoring"] and "environment" not in relay
    assert relay["volumes"] == [f"environment-socket:{SOCKET_DIR}:ro"]
    assert relay["read_only"] is True and relay["cap_drop"] == ["ALL"] and "cap_add" not in relay
    assert relay["user"] == f"{children.RUN_AS_USER}:{children.RUN_AS_USER}"
    assert relay["security_opt"] == env["security_opt"]
    assert relay["command"][relay["command"].index("--uds") + 1] == environment_socket(env)
    assert relay["depends_on"] == {"environment": {"condition": "service_healthy"}}


@needs_compose
def test_compose_redis_takes_its_password_from_a_file_as_the_operators_pods_do():
    command = yaml.safe_load(COMPOSE.read_text())["services"]["redis"]["command"]
    assert command[:2] == ["sh", "-c"] and "--requirepass" not in command[2]
    assert command[2].replace("$$", "$") == launch.redis_shell_command(6379, "/data", "/tmp", "REDIS_PASSWORD")


def test_images_default_to_the_compose_commands():
    services = compose_config()["services"]
    for name, service in COMPONENTS.items():
        assert dockerfile_cmd(service) == services[name]["command"], service


class Localize:
    """Rewrites a compose value for a local process as docker-compose would pass it ($$ -> $), with service names ->
    127.0.0.1, each fixed port -> one free port (the same in every service), a service's volume targets -> local
    folders; the environment's --run-as (a container's change of user) is dropped."""

    PORT_FLAG = r"--[\w-]*port|-p"

    def __init__(self, services: list[str], volumes: dict[str, str], ports: dict[str, int]) -> None:
        self.ports = ports
        self.hosts = "|".join(re.escape(name) for name in [*services, "127.0.0.1"])
        self.services = services
        self.volumes = volumes  # container path -> local path

    def __call__(self, value: str, previous: str = "") -> str:
        value = value.replace("$$", "$")  # compose's escape for a literal $, which `config` prints unresolved
        if re.fullmatch(self.PORT_FLAG, previous):
            return str(self.ports[value])
        if previous.endswith("-host") and value in self.services:
            return "127.0.0.1"
        value = re.sub(rf"\b({self.hosts}):(\d+)\b", lambda m: f"127.0.0.1:{self.ports[m[2]]}", value)
        value = re.sub(rf"({self.PORT_FLAG}) (\d+)\b", lambda m: f"{m[1]} {self.ports[m[2]]}", value)
        for target, local in self.volumes.items():
            value = value.replace(target, local)
        return value

    def argv(self, argv: list[str]) -> list[str]:
        if "--run-as" in argv:  # the container's change of user: a local process stays this test's (its folders)
            at = argv.index("--run-as")
            argv = argv[:at] + argv[at + 2 :]
        return [self(arg, previous) for previous, arg in zip(["", *argv], argv, strict=False)]


def start_order(services: dict) -> list[str]:
    order: list[str] = []
    while len(order) < len(services):
        ready = [s for s in services if s not in order and set(services[s].get("depends_on", {})) <= set(order)]
        assert ready, f"depends_on has a cycle among {set(services) - set(order)}"
        order += sorted(ready)
    return order


def volume_folders(service: dict, tmp_path: Path) -> dict[str, str]:
    """Container path -> local path: a bind mount's source, or a folder for a named volume."""
    folders = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if not source.startswith("/"):
            source = str(tmp_path / "volumes" / source)
            Path(source).mkdir(parents=True, exist_ok=True)
        folders[target] = source
    return folders


def health_argv(service: dict) -> list[str] | None:
    kind, *rest = service.get("healthcheck", {}).get("test", ["NONE"])
    if kind == "NONE":  # `disable: true`, as `docker-compose config` prints it
        return None
    return rest if kind == "CMD" else ["sh", "-c", *rest]


def log_tail(tmp_path: Path, name: str) -> str:
    return (tmp_path / "logs" / f"{name}.log").read_text()[-3000:]


@contextlib.contextmanager
def compose_processes(services: dict, tmp_path: Path) -> Iterator[tuple[dict[str, subprocess.Popen], dict[str, int]]]:
    """The services as local processes (Localize), in the file's start order, each started once its dependencies'
    health checks pass; yields them by name and the ports (each fixed port of the file -> its local one). Every one
    still running is stopped on exit; their logs are in tmp_path/logs."""
    ports: dict[str, int] = defaultdict(free_port)
    env_path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # `python`, `reinforce`: this venv's
    (tmp_path / "logs").mkdir()
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in start_order(services):
            service = services[name]
            localize = Localize(list(services), volume_folders(service, tmp_path), ports)
            env = {**os.environ, "PATH": env_path}
            env.update({key: localize(str(value)) for key, value in service.get("environment", {}).items()})
            with (tmp_path / "logs" / f"{name}.log").open("w") as log:
                procs[name] = subprocess.Popen(
                    localize.argv(service["command"]), env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            if (check := health_argv(service)) is None:
                continue
            deadline = time.monotonic() + 180
            while subprocess.run(localize.argv(check), env=env, capture_output=True).returncode != 0:
                assert procs[name].poll() is None, f"{name} exited:\n{log_tail(tmp_path, name)}"
                assert time.monotonic() < deadline, f"{name} not healthy in 180 s:\n{log_tail(tmp_path, name)}"
                time.sleep(0.5)
        yield procs, ports
    finally:
        for proc in reversed(procs.values()):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            proc.wait(timeout=30)


@needs_compose
@pytest.mark.slow
@pytest.mark.parametrize(
    ("compose_spec", "profile"), [("compose", None), ("compose-ppo", "ppo"), ("compose-tools", "tools")]
)
def test_compose_commands_train_the_tiny_example(tmp_path, compose_spec, profile):
    """The services of the file's default profile, with profile ppo the critic too (examples/compose-ppo.yaml), with
    profile tools and compose/tools.yml the environment service, the generators its clients over its Unix socket
    (examples/compose-tools.yaml, multi-turn episodes with the calculator)."""
    if shutil.which("redis-server") is None or shutil.which("curl") is None:
        pytest.skip("needs redis-server and curl (make install installs them)")
    spec = yaml.safe_load((EXAMPLES / f"{compose_spec}.yaml").read_text())
    spec["run_dir"] = str(tmp_path / "run")
    spec["data"]["prompts"] = spec["data"]["prompts"].replace(IMAGE_EXAMPLES, str(EXAMPLES))
    spec["training"].update(steps=3, checkpoint_every=3)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    overrides = [TOOLS_OVERRIDE] if profile == "tools" else []
    services = compose_config(*overrides, REINFORCE_SPEC=str(spec_file), REINFORCE_RUN=spec["name"])["services"]
    # `docker-compose config` lists every profile's services; `up` starts those of no profile or of the chosen one
    services = {name: s for name, s in services.items() if profile in s.get("profiles", [profile])}
    with compose_processes(services, tmp_path) as (procs, _):
        code = procs["trainer"].wait(timeout=300)
        assert code == 0, log_tail(tmp_path, "trainer")
    paths = RunPaths(tmp_path / "run")
    assert [row["step"] for row in read_metrics(paths.metrics)] == [1, 2, 3]
    assert (paths.checkpoints / "step-000003").is_dir()
    assert (paths.critic_checkpoints / "step-000003").is_dir() == (profile == "ppo")
    assert (paths.final_model / "config.json").exists()
    samples = [row for step in sample_steps(paths) for row in read_samples(paths, step)]
    # with tools, the episodes ran in the environment service: some sample called the calculator
    assert samples and any(s.get("tool_calls", 0) > 0 for s in samples) == (profile == "tools")


@needs_compose
@pytest.mark.slow
@pytest.mark.docker
def test_compose_stack_in_containers_trains_the_tiny_example(tmp_path):
    """`make compose-smoke`: the images built from a debootstrapped Debian, the stack up in Debian's dockerd."""
    if os.geteuid() != 0:
        pytest.skip("needs root: scripts/build-images.sh runs debootstrap and dockerd")
    # Output to files, not pipes: a daemon the script leaves running (dockerd) that kept a copy of the script's
    # stdout or stderr would make a pipe reader wait for ever; here it is named instead.
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("w") as out, stderr.open("w") as err:
        result = subprocess.run(
            ["bash", str(ROOT / "scripts" / "compose-smoke.sh")], stdout=out, stderr=err, timeout=1800
        )
    assert result.returncode == 0, f"{stdout.read_text()[-3000:]}\n{stderr.read_text()[-5000:]}"
    assert processes_holding(stdout, stderr) == [], "processes left running hold the script's output open"
    steps = yaml.safe_load((EXAMPLES / "compose.yaml").read_text())["training"]["steps"]
    [summary] = [line for line in stdout.read_text().splitlines() if line.startswith("compose-smoke:")]
    print(summary)
    assert summary.startswith(f"compose-smoke: {steps} steps in "), summary


def build_images(tmp_path: Path) -> None:
    """scripts/build-images.sh (every image, or those out of date), its log in tmp_path/build.log."""
    if os.geteuid() != 0:
        pytest.skip("needs root: scripts/build-images.sh runs debootstrap and dockerd")
    with (tmp_path / "build.log").open("w") as log:
        built = subprocess.run(
            ["bash", str(ROOT / "scripts" / "build-images.sh")], stdout=log, stderr=log, timeout=1800
        )
    assert built.returncode == 0, (tmp_path / "build.log").read_text()[-3000:]


def compose_env(spec_file: Path, run: str, **extra: str) -> dict[str, str]:
    """docker-compose's environment for a run of `spec_file` named `run`."""
    env = {**os.environ, "REINFORCE_SPEC": str(spec_file), "REINFORCE_RUN": run, **extra}
    if subprocess.run(["docker", "image", "inspect", "redis:7.0"], capture_output=True).returncode != 0:
        env["REINFORCE_REDIS_IMAGE"] = "reinforce-redis:0.1.0"  # build-images.sh's, where none can be pulled
    return env


@needs_compose
@pytest.mark.slow
@pytest.mark.docker
def test_compose_tools_stack_in_containers_trains_the_tiny_tools_example(tmp_path):
    """Profile tools with compose/tools.yml, in containers, with the profile monitoring: examples/compose-tools.yaml
    trains to its end, the generator's episodes reaching the confined environment container over its Unix socket (the
    samples' tool calls can have come from nowhere else), and Prometheus scrapes the environment's metrics through
    the relay environment-metrics: it counted at least the calculator calls of the samples kept."""
    build_images(tmp_path)
    spec = yaml.safe_load((EXAMPLES / "compose-tools.yaml").read_text())
    run = spec["name"]
    port = free_port()
    env = compose_env(EXAMPLES / "compose-tools.yaml", run, REINFORCE_PROMETHEUS_PORT=str(port))
    project = "reinforce-tools-test"
    compose = [DOCKER_COMPOSE, "--project-name", project, "--file", str(COMPOSE), "--file", str(TOOLS_OVERRIDE),
               "--profile", "tools", "--profile", "monitoring"]  # fmt: skip
    subprocess.run([*compose, "down", "--volumes"], env=env, capture_output=True)  # what an interrupted run left
    try:
        up = subprocess.run([*compose, "up", "--detach"], env=env, capture_output=True, text=True, timeout=600)
        assert up.returncode == 0, up.stderr[-3000:]
        trainer = subprocess.run([*compose, "ps", "-q", "trainer"], env=env, capture_output=True, text=True,
                                 check=True).stdout.strip()  # fmt: skip
        exited = subprocess.run(["docker", "wait", trainer], capture_output=True, text=True, timeout=1200)
        if exited.stdout.strip() != "0":
            logs = subprocess.run([*compose, "logs", "--tail", "30"], env=env, capture_output=True, text=True)
            pytest.fail(f"the trainer exited {exited.stdout.strip()}:\n{logs.stdout[-5000:]}")
        time.sleep(5)  # two more of Prometheus' 2 s scrapes: the environment's count includes every call trained on
        prometheus = PrometheusAPI(f"http://127.0.0.1:{port}")
        at = time.time()
        calls = prometheus.query(f'reinforce_environment_tool_calls_total{{run="{run}",tool="calculator"}}', at)
        environment_up = prometheus.query(f'up{{run="{run}",component="environment"}}', at)
        volume = subprocess.run(["docker", "volume", "inspect", "--format", "{{.Mountpoint}}", f"{project}_run"],
                                capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        paths = RunPaths(Path(volume) / "run")
        steps = [row["step"] for row in read_metrics(paths.metrics)]
        samples = [row for step in sample_steps(paths) for row in read_samples(paths, step)]
    finally:
        subprocess.run([*compose, "down", "--volumes"], env=env, capture_output=True, timeout=300)
    assert steps == list(range(1, spec["training"]["steps"] + 1))
    called = [s for s in samples if s["tool_calls"] > 0]
    assert called and all(s["turns"] in (1, 2) for s in called)
    assert [(r["metric"]["instance"], r["value"][1]) for r in environment_up] == [(RELAY, "1")]
    [counted] = [float(r["value"][1]) for r in calls]
    assert counted >= sum(s["tool_calls"] for s in samples)
    print(f"compose tools: {len(steps)} steps, {len(called)} of {len(samples)} kept samples called the calculator, "
          f"the environment counted {counted:.0f} calls")  # fmt: skip


def code_tests_spec() -> dict:
    """examples/compose-tools.yaml scoring with reward.function code_tests, with the limits that
    tests/integration/test_code_reward_server.py's solutions are scored under."""
    spec = yaml.safe_load((EXAMPLES / "compose-tools.yaml").read_text())
    spec["reward"] = {"type": "python", "function": CODE_TESTS_REWARD, "max_batch_size": len(SOLUTIONS)}
    spec["environment"].update(time_limit_s=TIME_LIMIT_S, output_limit_chars=OUTPUT_LIMIT)
    return spec


def run_requests(metrics_text: str) -> float:
    """The environment's POST /v1/run requests in its /metrics text."""
    [family] = [f for f in text_string_to_metric_families(metrics_text) if f.name == "reinforce_environment_requests"]
    return sum(s.value for s in family.samples if s.name.endswith("_total") and s.labels["endpoint"] == RUN_PATH)


@needs_compose
@pytest.mark.slow
def test_compose_code_tests_reward_scores_in_the_environment_and_its_relay_counts_the_runs(tmp_path):
    """The environment, the reward server and the metrics relay of compose/tools.yml and code-tests.yml, as local
    processes: the reward server scores hand-written solutions (escapes included) by running them with their tests in
    the environment service over its socket; the relay's /metrics (the environment's) counts a POST /v1/run per
    solution with a code block; it answers nothing else, and 502 once the environment is gone."""
    if shutil.which("curl") is None:
        pytest.skip("needs curl, the services' health checks (make install installs it)")
    spec = code_tests_spec()
    spec["run_dir"] = str(tmp_path / "run")
    spec["data"]["prompts"] = spec["data"]["prompts"].replace(IMAGE_EXAMPLES, str(EXAMPLES))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    services = compose_config(TOOLS_OVERRIDE, CODE_TESTS_OVERRIDE, REINFORCE_SPEC=str(tmp_path / "spec.yaml"))
    services = {name: services["services"][name] for name in ("environment", "reward", RELAY)}
    with compose_processes(services, tmp_path) as (procs, ports):
        assert_scores_the_solutions(f"http://127.0.0.1:{ports['8000']}")
        relay = f"http://127.0.0.1:{ports['5559']}"
        metrics = httpx.get(relay + METRICS_PATH, timeout=10)
        assert metrics.status_code == 200 and run_requests(metrics.text) == sum(
            final_code(response) is not None for response, _ in SOLUTIONS.values()
        )
        assert httpx.get(relay + READY_PATH, timeout=10).status_code == 404
        os.killpg(procs["environment"].pid, signal.SIGTERM)
        procs["environment"].wait(timeout=30)
        assert httpx.get(relay + METRICS_PATH, timeout=10).status_code == 502


@needs_compose
@pytest.mark.slow
@pytest.mark.docker
def test_compose_code_tests_reward_scores_in_the_environment_container(tmp_path):
    """compose/code-tests.yml in containers: the reward container scores hand-written solutions (escapes included) by
    running them with their tests in the confined environment container, over its socket (its port published on a
    free host port for this test only)."""
    build_images(tmp_path)
    spec = code_tests_spec()
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    port = free_port()
    publish = tmp_path / "publish.yml"
    publish.write_text(
        yaml.safe_dump({"version": "2.4", "services": {"reward": {"ports": [f"127.0.0.1:{port}:8000"]}}})
    )
    env = compose_env(tmp_path / "spec.yaml", spec["name"])
    compose = [DOCKER_COMPOSE, "--project-name", "reinforce-code-tests-test", "--file", str(COMPOSE),
               "--file", str(TOOLS_OVERRIDE), "--file", str(CODE_TESTS_OVERRIDE), "--file", str(publish),
               "--profile", "tools"]  # fmt: skip
    subprocess.run([*compose, "down", "--volumes"], env=env, capture_output=True)  # what an interrupted run left
    try:
        up = subprocess.run([*compose, "up", "--detach", "reward"], env=env, capture_output=True, text=True,
                            timeout=600)  # fmt: skip
        assert up.returncode == 0, up.stderr[-3000:]
        deadline = time.monotonic() + 180
        while not reward_ready(f"http://127.0.0.1:{port}"):
            if time.monotonic() > deadline:
                logs = subprocess.run([*compose, "logs", "--tail", "30"], env=env, capture_output=True, text=True)
                pytest.fail(f"the reward container not ready in 180 s:\n{logs.stdout[-5000:]}")
            time.sleep(1)
        assert_scores_the_solutions(f"http://127.0.0.1:{port}")
    finally:
        subprocess.run([*compose, "down", "--volumes"], env=env, capture_output=True, timeout=300)


def reward_ready(url: str) -> bool:
    try:
        return httpx.get(url + REWARD_READY_PATH, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def metrics_ports(services: dict) -> dict[str, int]:
    """Compose service -> the port its command serves /metrics on (Triton's --metrics-port, the trainer's
    --metrics-port, else the service's one --port; the environment's relay's --port)."""
    ports = {}
    for name in [*COMPONENTS, RELAY]:
        command = services[name]["command"]
        flag = "--metrics-port" if "--metrics-port" in command else "--port"
        ports[name] = int(command[command.index(flag) + 1])
    return ports


def test_compose_prometheus_scrapes_every_service_at_its_metrics_port():
    """compose/prometheus.yml: one job per service that exports metrics, named as the service (its DNS name, its
    `instance` label, and before the first '-' its `component`), at the port the service's command serves; the
    environment (no network) through its relay in compose/tools.yml."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    services[RELAY] = yaml.safe_load(TOOLS_OVERRIDE.read_text())["services"][RELAY]
    jobs = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    found = {}
    for job in jobs:
        [sd] = job["dns_sd_configs"]
        assert sd["names"] == [job["job_name"]] and sd["type"] == "A", job
        found[job["job_name"]] = sd["port"]
    assert found == metrics_ports(services)
    assert {name.split("-")[0] for name in found} <= set(ALL_COMPONENTS)
    assert "@RUN@" in services["prometheus"]["command"][2] and "$$REINFORCE_RUN" in services["prometheus"]["command"][2]


def test_compose_prometheus_config_passes_promtool(tmp_path):
    """The config as the container writes it (run name substituted, the rules file at the path it is mounted on)."""
    rules = yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]["volumes"][1].split(":")
    text = PROMETHEUS_CONFIG.read_text().replace("@RUN@", "tiny").replace(rules[1], str(ROOT / rules[0]))
    (tmp_path / "prometheus.yml").write_text(text)
    promtool = Path(PROMETHEUS).with_name("promtool")
    result = subprocess.run([promtool, "check", "config", tmp_path / "prometheus.yml"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


@needs_compose
@pytest.mark.slow
@pytest.mark.docker
def test_compose_prometheus_answers_the_ppo_dashboard(tmp_path):
    """Issue #28, item 4: the stack with profiles ppo and monitoring, in containers, on a longer tiny-ppo: while it
    trains, its own Prometheus (published on a free host port) answers every panel query of every dashboard but the
    environment's, sees each service up, and has the chart's alert rules loaded and healthy."""
    build_images(tmp_path)
    spec = yaml.safe_load((EXAMPLES / "compose-ppo.yaml").read_text())
    spec["training"].update(steps=500, checkpoint_every=500)  # still training when checked; `down` ends it
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    port = free_port()
    env = compose_env(tmp_path / "spec.yaml", spec["name"], REINFORCE_PROMETHEUS_PORT=str(port))
    compose = [DOCKER_COMPOSE, "--project-name", "reinforce-prometheus-test", "--file", str(COMPOSE),
               "--profile", "ppo", "--profile", "monitoring"]  # fmt: skip
    subprocess.run([*compose, "down", "--volumes"], env=env, capture_output=True)  # what an interrupted run left
    try:
        up = subprocess.run([*compose, "up", "--detach"], env=env, capture_output=True, text=True, timeout=600)
        assert up.returncode == 0, up.stderr[-3000:]
        prometheus = PrometheusAPI(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 300
        while not prometheus.query(f'reinforce_trainer_step{{run="{spec["name"]}"}} >= 5', time.time()):
            if time.monotonic() > deadline:
                logs = subprocess.run([*compose, "logs", "--tail", "30"], env=env, capture_output=True, text=True)
                pytest.fail(f"the trainer did not reach step 5 in 300 s:\n{logs.stdout[-5000:]}")
            time.sleep(2)
        at = wait_until_scraped(prometheus, spec["name"], PPO_COMPONENTS)
        time.sleep(3)  # the scrapes up to `at` are stored
        up_series = prometheus.query(f'up{{run="{spec["name"]}"}}', at)
        names = assert_every_dashboard_query_answers(prometheus, spec["name"], at, skip=frozenset({"environment.json"}))
        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
    finally:
        subprocess.run([*compose, "down", "--volumes"], env=env, capture_output=True, timeout=300)
    instances = {("reward", "reward"), ("critic", "critic"), ("generator", "generator-0"), ("trainer", "trainer")}
    assert {(r["metric"]["component"], r["metric"]["instance"], r["value"][1]) for r in up_series} == {
        (*instance, "1") for instance in instances
    }
    assert rules and all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    print(f"compose Prometheus: {names} metric names of the PPO run checked")


def processes_holding(*files: Path) -> list[str]:
    """'PID COMMAND' of every process with one of these files open."""
    wanted = {(st.st_dev, st.st_ino) for st in map(os.stat, files)}
    holders = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            st = os.stat(fd)
            if (st.st_dev, st.st_ino) in wanted:
                pid = fd.parent.parent.name
                holders.add(f"{pid} {Path('/proc', pid, 'comm').read_text().strip()}")
        except OSError:  # the process or descriptor went away meanwhile
            continue
    return sorted(holders)


def test_rollout_exits_on_sigterm(redis_url):
    """`docker stop` sends SIGTERM to the command, PID 1 of its container, which ignores signals it has no handler
    for: `reinforce rollout` must handle it, or every `docker-compose down` waits out the grace period."""
    env = {**os.environ, "REINFORCE_REDIS_URL": redis_url, "REINFORCE_CONTROL_TOKEN": "t"}
    argv = [
        sys.executable,
        "-m",
        "reinforce",
        "rollout",
        "--run",
        "tiny",
        "--generator",
        f"g=http://127.0.0.1:{free_port()}",
    ]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_line = proc.stdout.readline()  # its first pass logged: in the reconcile loop (EOF if it exited)
    assert "g has loaded None" in first_line, first_line + proc.communicate()[0]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 0, proc.communicate()[0]
