"""What tests/e2e/k8s-single-node.sh must do besides running the pipeline's pods (tests/e2e/test_cluster_e2e.py
checks it on the cluster that test module brings up, once its runs are done): a real pod runs with host networking,
and `down` leaves the machine as it found it."""

from __future__ import annotations

import os
import secrets
import subprocess
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from k8s import cgroup_hierarchies, single_node
from kubernetes import client, config

DOWN_TIMEOUT_S = 300
# What the script records and restores (kept in step with SYSCTLS, FIXED_PATHS and SHARED_DIRS there).
SYSCTLS = [
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
    "net.ipv4.ip_forward",
]
KUBELET_PATHS = [
    "/var/lib/kubelet",
    "/var/log/pods",
    "/var/log/containers",
    "/var/lib/dockershim",
    "/var/run/dockershim.sock",
    "/usr/libexec/kubernetes",
]
# Folders another container runtime on the machine may create while the test runs: one that appeared must not be ours,
# so it must hold something (the script removes those it created once they are empty).
SHARED_DIRS = ["/run/containerd/s", "/opt/containerd", "/run/docker/plugins", "/run/mount"]
# A real program for the pod: it proves host networking by connecting to the API server's port on 127.0.0.1.
HELLO_C = r"""
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

int main(int argc, char **argv) {
    struct sockaddr_in api = {0};
    api.sin_family = AF_INET;
    api.sin_port = htons(atoi(argv[1]));
    api.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    int ok = connect(fd, (struct sockaddr *)&api, sizeof api) == 0;
    printf("hello from pid %d: API server on 127.0.0.1:%s %s\n", getpid(), argv[1], ok ? "reachable" : "unreachable");
    return ok ? 0 : 1;
}
"""
HELLO_IMAGE = "reinforce-test/hello:1"


@dataclass
class Machine:
    """What `down` must give back, read before `up`."""

    sysctls: dict[str, str]
    kubelet_paths: set[str]
    shared_dirs: set[str]

    @classmethod
    def read(cls) -> Machine:
        sysctls = {}
        for name in SYSCTLS:
            path = Path("/proc/sys") / name.replace(".", "/")
            if path.exists():
                sysctls[name] = path.read_text().strip()
        kubelet_paths = {p for p in KUBELET_PATHS if os.path.lexists(p)}
        return cls(sysctls, kubelet_paths, {d for d in SHARED_DIRS if os.path.lexists(d)})


def wait_for(check: Callable[[], object], timeout_s: float, what: str) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat; None once the process is gone (or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]


def processes_naming(folder: Path) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"{folder}/" in args and int(cmdline.parent.name) != os.getpid():
            found.append(f"{cmdline.parent.name}: {args[:200]}")
    return found


def mounts_under(*folders: Path) -> list[str]:
    targets = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    return [t for t in targets for f in folders if t == str(f) or t.startswith(f"{f}/")]


def hello_image(state: Path, workdir: Path) -> None:
    """A one-file image: a static C program, `docker import`ed into the cluster's own dockerd."""
    source = workdir / "hello.c"
    source.write_text(HELLO_C)
    subprocess.run(["gcc", "-Os", "-static", "-o", str(workdir / "hello"), str(source)], check=True)
    with tarfile.open(workdir / "rootfs.tar", "w") as tar:
        tar.add(workdir / "hello", arcname="hello")
    docker = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
    with open(workdir / "rootfs.tar", "rb") as rootfs:
        subprocess.run(
            [docker, "-H", f"unix://{state}/docker.sock", "import", "-c", 'ENTRYPOINT ["/hello"]', "-", HELLO_IMAGE],
            stdin=rootfs,
            check=True,
            capture_output=True,
        )


def exercise_cluster(state: Path, workdir: Path) -> None:
    status = single_node("status", state, 60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "node: 127.0.0.1 Ready" in status.stdout
    kubeconfig = state / "admin.kubeconfig"
    assert f"kubeconfig: {kubeconfig}" in status.stdout and kubeconfig.is_file()

    api = config.new_client_from_config(config_file=str(kubeconfig))
    core = client.CoreV1Api(api)
    node = core.read_node("127.0.0.1")
    assert {(a.type, a.address) for a in node.status.addresses} >= {("InternalIP", "127.0.0.1")}
    api_port = api.configuration.host.rsplit(":", 1)[1]

    hello_image(state, workdir)
    name = f"hello-{secrets.token_hex(3)}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "hostNetwork": True,
            "restartPolicy": "Never",
            "containers": [
                {"name": "hello", "image": HELLO_IMAGE, "imagePullPolicy": "Never", "args": [api_port]},
            ],
        },
    }
    core.create_namespaced_pod("default", pod)

    def finished() -> str | None:
        phase = core.read_namespaced_pod(name, "default").status.phase
        return phase if phase in ("Succeeded", "Failed") else None

    phase = wait_for(finished, 120, f"pod {name} finished")
    # The log goes API server -> kubelet (InternalIP 127.0.0.1, both sides' certificates checked) -> dockershim.
    log = core.read_namespaced_pod_log(name, "default")
    assert phase == "Succeeded", log
    assert f"API server on 127.0.0.1:{api_port} reachable" in log
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)

    # A pod left running for `down`: its container, its cgroups and its volume mounts (a memory-backed emptyDir and
    # the ServiceAccount token, both tmpfs) must all go.
    running = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "left-running"},
        "spec": {
            "hostNetwork": True,
            "containers": [
                {
                    "name": "pause",
                    "image": "k8s.gcr.io/pause:3.2",
                    "imagePullPolicy": "Never",
                    "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                }
            ],
            "volumes": [{"name": "scratch", "emptyDir": {"medium": "Memory"}}],
        },
    }
    core.create_namespaced_pod("default", running)
    wait_for(lambda: core.read_namespaced_pod("left-running", "default").status.phase == "Running", 120, "running")
    uid = core.read_namespaced_pod("left-running", "default").metadata.uid
    assert [m for m in mounts_under(state) if uid in m and m.endswith("/scratch")]
    api.close()


def read_pids(state: Path) -> dict[str, tuple[int, str]]:
    """The processes `up` recorded: name -> (pid, start time)."""
    pids = {}
    for pid_file in (state / "pids").glob("*"):
        pid, start = pid_file.read_text().split()
        pids[pid_file.name] = (int(pid), start)
    return pids


def assert_down_leaves_the_machine_as_before(state: Path, before: Machine, pids: dict[str, tuple[int, str]]) -> None:
    """`down`, then: no process it recorded, nothing naming its folder, the sysctls, kubelet paths, shared folders,
    cgroups and mounts as before `up`; and a second `down` succeeds (it is idempotent)."""
    down = single_node("down", state, DOWN_TIMEOUT_S)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not state.exists()
    still_running = [name for name, (pid, start) in pids.items() if start_time(pid) == start]
    assert not still_running, f"processes `down` left running: {still_running}"
    assert not processes_naming(state)
    after = Machine.read()
    assert after.sysctls == before.sysctls
    assert after.kubelet_paths == before.kubelet_paths
    appeared = after.shared_dirs - before.shared_dirs
    assert not [d for d in appeared if not any(Path(d).iterdir())], f"empty folders left behind: {appeared}"
    assert not [h for h in cgroup_hierarchies() if (h / "kubepods").exists()]
    assert not mounts_under(state, Path("/var/lib/kubelet"))
    down_again = single_node("down", state, DOWN_TIMEOUT_S)
    assert down_again.returncode == 0, down_again.stderr
