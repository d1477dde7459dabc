"""Trainer pods of a run with more than one model replica (issue #26, item 4): only pod 0, the main rank, serves
metrics and weights, so the others cannot be judged ready by its metrics port; on the node's network two pods on
one node cannot both declare the trainer's ports. The readiness probe is run here as the kubelet would run it.
tests/e2e/test_cluster_e2e.py trains such a run in pods."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from test_pod_security import run_of

from reinforce.operator.children import data_volume, trainer_command, trainer_stateful_set

TWO_RANKS = {"training.numRanks": 2}


def trainer_container(profile: str, changes: dict) -> dict:
    return trainer_stateful_set(run_of(profile, changes=changes))["spec"]["template"]["spec"]["containers"][0]


def probe_passes(probe: dict, pod_name: str) -> bool:
    env = {**os.environ, "POD_NAME": pod_name}
    return subprocess.run(probe["exec"]["command"], env=env, capture_output=True, timeout=30).returncode == 0


def test_one_trainer_pod_is_ready_when_its_metrics_port_listens() -> None:
    container = trainer_container("standard", {})
    metrics_port = run_of().config.ports.trainer_metrics
    assert container["readinessProbe"]["tcpSocket"] == {"port": metrics_port}
    assert {p["name"] for p in container["ports"]} == {"metrics", "weights", "rendezvous"}


@pytest.mark.parametrize("profile", ["standard", "host-network"])
def test_pod_0_is_ready_once_it_serves_metrics_and_the_others_while_they_run(profile: str) -> None:
    container = trainer_container(profile, TWO_RANKS)
    probe = container["readinessProbe"]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        # the probe as rendered, on a port of the test's own: the image's `python` is this interpreter here
        command = [sys.executable, *probe["exec"]["command"][1:]]
        command[-1] = command[-1].replace(str(run_of(profile).config.ports.trainer_metrics), str(port))
        assert command[-1] != probe["exec"]["command"][-1]
        listening = {"exec": {"command": command}}
        assert probe_passes(listening, "tiny-trainer-0")
        assert probe_passes(listening, "tiny-trainer-1")
    assert not probe_passes(listening, "tiny-trainer-0")  # nothing listens any more
    assert probe_passes(listening, "tiny-trainer-1")
    # host ports on the node's network: two trainer pods on one node must not both declare them
    assert bool(container.get("ports")) == (profile == "standard")


def test_several_trainer_pods_claim_the_data_volume_read_write_many() -> None:
    """They may land on several nodes, and each mounts the run's checkpoints."""
    assert data_volume(run_of())["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert data_volume(run_of(changes=TWO_RANKS))["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize("profile", ["standard", "host-network"])
def test_pod_0_hosts_the_rendezvous_and_no_torchrun_restarts_its_ranks_itself(profile: str) -> None:
    """The kubelet restarts every pod's container after a rank dies: torchrun must not (--max-restarts=0)."""
    script = trainer_command(run_of(profile, changes=TWO_RANKS))[2]
    assert " --max-restarts=0 " in script
    # the launcher as the container's shell expands it, printed instead of run
    printed = script.replace("exec python -m torch.distributed.run", "echo", 1).split(" -m reinforce.trainer")[0]
    for pod, is_host in (("tiny-trainer-0", "is_host=1"), ("tiny-trainer-1", "is_host=0")):
        shell = subprocess.run(["sh", "-c", printed], env={"POD_NAME": pod}, capture_output=True, text=True)
        assert f"--rdzv-conf={is_host}" in shell.stdout.split(), shell
        # rank order follows these addresses: pod 0's sorts first; on the node's network each pod has its own
        address = f"{pod}.tiny-trainer.ns.svc" if profile == "standard" else f"127.0.0.{1 + int(pod[-1])}"
        assert f"--local-addr={address}" in shell.stdout.split(), shell
