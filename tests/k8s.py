"""A real Kubernetes control plane for the tests: etcd, kube-apiserver and kube-controller-manager on loopback.

Test modules use the session fixture with ``from k8s import kube_apiserver  # noqa: F401``. The binaries come
from ``tests/integration/k8s-test-cluster.sh``, which builds them from Debian's ``kubernetes`` source package the first
time on a machine (about 6 to 11 minutes on 2 cores; later sessions reuse the cache in ~/.cache/reinforce-k8s)
and installs etcd-server. The API server runs with RBAC (``--authorization-mode=Node,RBAC``), an admin token in
group system:masters, client certificates for any user and groups, and ServiceAccount tokens; the
controller-manager runs every default controller, so ownerReference garbage collection works. There is no
kubelet: pods stay Pending unless a test patches their status.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner
from kubernetes import client, config

from generate import crd
from reinforce.core.spec import respell
from reinforce.operator.resource import ReinforceRunSpec
from reinforce.supervisor.ports import free_port

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "tests" / "integration" / "k8s-test-cluster.sh"
SINGLE_NODE_SCRIPT = REPO / "tests" / "e2e" / "k8s-single-node.sh"
BIN = Path(sys.executable).parent  # scripts/install_system.py puts helm and kubectl beside python
HELM = shutil.which("helm", path=str(BIN)) or "helm"
KUBECTL = shutil.which("kubectl", path=str(BIN)) or "kubectl"
ETCD = shutil.which("etcd") or "/usr/bin/etcd"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMIN_USER = "reinforce-test-admin"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
START_ATTEMPTS = 3
WORKDIR_PREFIX = "reinforce-k8s-"


class ClusterError(RuntimeError):
    """The control plane did not start; the message holds the tail of the failing component's log."""


def k8s_binaries() -> Path:
    """The folder with kube-apiserver and kube-controller-manager, built by the script on first use."""
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=None, text=True, check=False)
    if result.returncode != 0:
        raise ClusterError(f"{BUILD_SCRIPT} failed with exit code {result.returncode} (its output is above)")
    return Path(result.stdout.strip().splitlines()[-1])


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


class CertificateAuthority:
    """A throwaway CA (openssl) that signs the API server's serving certificate and client certificates."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.cert = folder / "ca.crt"
        self.key = folder / "ca.key"
        _openssl(
            *("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
            *("-keyout", "ca.key", "-out", "ca.crt", "-days", "3650", "-subj", "/CN=reinforce-test-ca"),
            *("-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"),
            cwd=folder,
        )

    def issue(self, name: str, subject: str, extensions: str) -> tuple[Path, Path]:
        """A certificate and its key, files ``name.crt`` and ``name.key``."""
        (self.folder / f"{name}.ext").write_text(extensions)
        _openssl(
            *("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
            *("-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject),
            cwd=self.folder,
        )
        _openssl(
            *("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial"),
            *("-days", "365", "-out", f"{name}.crt", "-extfile", f"{name}.ext"),
            cwd=self.folder,
        )
        return self.folder / f"{name}.crt", self.folder / f"{name}.key"

    def client(self, user: str, groups: Sequence[str] = ()) -> tuple[Path, Path]:
        # The API server reads the user from CN and the groups from the O entries of a client certificate.
        subject = "/CN=" + user + "".join(f"/O={group}" for group in groups)
        name = "client-" + "".join(c if c.isalnum() else "-" for c in user) + "-" + secrets.token_hex(3)
        return self.issue(name, subject, "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n")


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


@dataclass
class KubeCluster:
    """A running control plane. Kubeconfigs embed their credentials, so they work from any folder."""

    server: str
    ca: CertificateAuthority
    admin_token: str
    workdir: Path
    admin_kubeconfig: Path = field(init=False)

    def __post_init__(self) -> None:
        self.admin_kubeconfig = self.kubeconfig_for_token(self.admin_token, "admin")

    @property
    def ca_file(self) -> Path:
        return self.ca.cert

    def kubeconfig_for_token(self, token: str, name: str = "token-user") -> Path:
        """A kubeconfig that authenticates with a bearer token (a ServiceAccount's, or the admin's)."""
        return self._write_kubeconfig(name, {"token": token})

    def kubeconfig_for_user(self, user: str, groups: Sequence[str] = ()) -> Path:
        """A kubeconfig for any user name and groups (a client certificate; RBAC decides what it may do)."""
        cert, key = self.ca.client(user, groups)
        return self._write_kubeconfig(cert.stem, {"client-certificate-data": _b64(cert), "client-key-data": _b64(key)})

    def kubeconfig_for_service_account(self, namespace: str, name: str, expiration_s: int = 86400) -> Path:
        """A kubeconfig holding a fresh token of ServiceAccount namespace/name (created if missing)."""
        with self.api_client() as api:
            core = client.CoreV1Api(api)
            try:
                core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
            except client.ApiException as err:
                if err.status != 409:  # 409: it exists already
                    raise
            request = {"spec": {"expirationSeconds": expiration_s}}
            token = core.create_namespaced_service_account_token(name, namespace, request).status.token
        return self.kubeconfig_for_token(token, f"sa-{namespace}-{name}")

    def api_client(self, kubeconfig: Path | None = None) -> client.ApiClient:
        """A client of the ``kubernetes`` package; the admin's unless another kubeconfig is given."""
        return config.new_client_from_config(config_file=str(kubeconfig or self.admin_kubeconfig))

    def _write_kubeconfig(self, name: str, credentials: dict[str, str]) -> Path:
        # a new file each time: a kubeconfig handed out earlier keeps its credentials
        path = self.workdir / "kubeconfigs" / f"{name}-{secrets.token_hex(3)}.yaml"
        path.parent.mkdir(exist_ok=True)
        cluster = {"server": self.server, "certificate-authority-data": _b64(self.ca.cert)}
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": cluster}],
            "users": [{"name": name, "user": credentials}],
            "contexts": [{"name": name, "context": {"cluster": "test", "user": name, "namespace": "default"}}],
            "current-context": name,
        }
        path.write_text(yaml.safe_dump(kubeconfig, sort_keys=False))
        path.chmod(0o600)
        return path


class _ControlPlane:
    """Starts and stops the three processes; everything lives in one temporary folder."""

    def __init__(self, binaries: Path) -> None:
        self.binaries = binaries
        # etcd fsyncs every write: in memory (/dev/shm) that costs nothing; the data is thrown away anyway.
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
        _remove_stale_workdirs(base)
        self.workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir=base))
        (self.workdir / "owner.pid").write_text(str(os.getpid()))
        self.logs = self.workdir / "logs"
        self.logs.mkdir()
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self) -> KubeCluster:
        ca = CertificateAuthority(self.workdir)
        etcd_url = self._start_etcd()
        admin_token = secrets.token_hex(16)
        server = self._start_apiserver(ca, etcd_url, admin_token)
        cluster = KubeCluster(server=server, ca=ca, admin_token=admin_token, workdir=self.workdir)
        self._start_controller_manager(cluster)
        self._wait_for_controllers(cluster)
        return cluster

    def stop(self) -> None:
        for _, proc in reversed(self.procs):  # controller-manager, API server, then etcd
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
            )
        self.procs.append((name, proc))
        return proc

    def _fail(self, name: str, why: str) -> ClusterError:
        tail = (self.logs / f"{name}.log").read_text(errors="replace")[-4000:]
        return ClusterError(f"{name} {why}; the end of its log:\n{tail}")

    def _start_etcd(self) -> str:
        client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        cmd = [ETCD, "--name", "test", "--data-dir", str(self.workdir / "etcd")]
        cmd += ["--listen-client-urls", client, "--advertise-client-urls", client]
        cmd += ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer]
        cmd += ["--initial-cluster", f"test={peer}", "--logger", "zap", "--log-level", "warn"]
        proc = self._spawn("etcd", cmd)
        self._wait("etcd", proc, lambda: _http_ok(f"{client}/health"), timeout_s=30)
        return client

    def _start_apiserver(self, ca: CertificateAuthority, etcd_url: str, admin_token: str) -> str:
        port = free_port()
        serving = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
        cert, key = ca.issue("apiserver", "/CN=kube-apiserver", serving)
        (self.workdir / "tokens.csv").write_text(f'{admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        sa_key = self.workdir / "sa.key"
        _openssl("genrsa", "-out", str(sa_key), "2048", cwd=self.workdir)
        cmd = [str(self.binaries / "kube-apiserver"), f"--etcd-servers={etcd_url}"]
        cmd += ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={port}"]
        cmd += ["--insecure-port=0", f"--tls-cert-file={cert}", f"--tls-private-key-file={key}"]
        cmd += [f"--client-ca-file={ca.cert}", f"--token-auth-file={self.workdir / 'tokens.csv'}"]
        cmd += ["--authorization-mode=Node,RBAC", "--service-cluster-ip-range=10.96.0.0/24"]
        cmd += [f"--service-account-key-file={sa_key}", f"--service-account-signing-key-file={sa_key}"]
        cmd += [f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}", "--allow-privileged=true", "--profiling=false"]
        proc = self._spawn("kube-apiserver", cmd)
        server = f"https://127.0.0.1:{port}"
        context = ssl.create_default_context(cafile=str(ca.cert))
        ready = lambda: _http_ok(f"{server}/readyz", admin_token, context)  # noqa: E731
        self._wait("kube-apiserver", proc, ready, timeout_s=60)
        return server

    def _start_controller_manager(self, cluster: KubeCluster) -> None:
        # Its own identity, as kubeadm sets it up: each controller then acts as its own ServiceAccount with the
        # bootstrap RBAC roles, so garbage collection runs with the rights it has on a real cluster.
        kubeconfig = cluster.kubeconfig_for_user("system:kube-controller-manager")
        cmd = [str(self.binaries / "kube-controller-manager"), f"--kubeconfig={kubeconfig}"]
        cmd += ["--controllers=*", "--use-service-account-credentials=true", "--leader-elect=false"]
        cmd += ["--port=0", "--secure-port=0", f"--root-ca-file={cluster.ca.cert}"]
        cmd += [f"--service-account-private-key-file={self.workdir / 'sa.key'}"]
        cmd += [f"--cluster-signing-cert-file={cluster.ca.cert}", f"--cluster-signing-key-file={cluster.ca.key}"]
        self._spawn("kube-controller-manager", cmd)

    def _wait_for_controllers(self, cluster: KubeCluster) -> None:
        # The default ServiceAccount appears once the controllers run with their own credentials.
        def default_account() -> bool:
            with cluster.api_client() as api:
                try:
                    client.CoreV1Api(api).read_namespaced_service_account("default", "default")
                    return True
                except client.ApiException:
                    return False

        self._wait("kube-controller-manager", self.procs[-1][1], default_account, timeout_s=60)

    def _wait(self, name: str, proc: subprocess.Popen[bytes], ready, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise self._fail(name, f"exited with code {proc.returncode}")
            if ready():
                return
            time.sleep(0.1)
        raise self._fail(name, f"was not ready within {timeout_s:.0f} s")


def _die_with_parent() -> None:
    # A test process killed outright (SIGKILL, OOM) runs no teardown: the kernel then stops its servers.
    # SIGKILL, because kube-apiserver does not finish a graceful shutdown once etcd is gone.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _remove_stale_workdirs(base: Path) -> None:
    """Folders left by test processes that were killed outright (etcd's WAL alone is 64 MB of /dev/shm)."""
    for folder in base.glob(f"{WORKDIR_PREFIX}*"):
        try:
            os.kill(int((folder / "owner.pid").read_text()), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (OSError, ValueError):
            continue  # another user's, or being created right now


def _http_ok(url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> bool:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


# An unused control plane waits this long for the next module that uses it before it stops.
LINGER_S = 30.0


class _Shared:
    """One control plane for the modules that use it, one after another (issue 42's plan runs them on one worker,
    in a row): they count their users here, and the last one out leaves it LINGER_S for the next to come."""

    plane: _ControlPlane | None = None
    cluster: KubeCluster | None = None
    users = 0
    stopping: threading.Timer | None = None
    lock = threading.Lock()


def _start_control_plane() -> tuple[_ControlPlane, KubeCluster]:
    binaries = k8s_binaries()
    for attempt in range(1, START_ATTEMPTS + 1):
        plane = _ControlPlane(binaries)
        try:
            return plane, plane.start()
        except BaseException as err:
            plane.stop()
            # Another process can take a free port before our server binds it: then start over on new ports.
            if attempt == START_ATTEMPTS or "address already in use" not in str(err):
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def kube_apiserver() -> Iterator[KubeCluster]:
    """A running etcd + kube-apiserver (RBAC, token auth) + kube-controller-manager, shared by the modules that use
    it one after another (_Shared).

    The first use on a machine builds the Kubernetes binaries (~6-11 minutes on 2 cores; cached afterwards);
    starting the control plane takes a few seconds. LINGER_S after the last module using it ends, or at the
    process's exit, everything is stopped and deleted: idle, its controllers and etcd still use CPU, which the
    rest of the session would otherwise pay.
    """
    with _Shared.lock:
        if _Shared.stopping is not None:
            _Shared.stopping.cancel()
            _Shared.stopping = None
        if _Shared.cluster is None:
            _Shared.plane, _Shared.cluster = _start_control_plane()
            atexit.register(_Shared.plane.stop)  # stopping twice (after the linger's stop) does nothing more
        _Shared.users += 1
        cluster = _Shared.cluster
    try:
        yield cluster
    finally:
        with _Shared.lock:
            _Shared.users -= 1
            if _Shared.users == 0:
                _Shared.stopping = threading.Timer(LINGER_S, _stop_if_unused)
                _Shared.stopping.daemon = True
                _Shared.stopping.start()


def _stop_if_unused() -> None:
    with _Shared.lock:
        if _Shared.users == 0 and _Shared.plane is not None:
            _Shared.plane.stop()
            _Shared.plane = _Shared.cluster = None
        _Shared.stopping = None


# ---- ReinforceRuns --------------------------------------------------------------------------------------------
EXAMPLE = REPO / "examples" / "tiny.yaml"
API = (crd.GROUP, crd.VERSION)


def install_crd(api_client: client.ApiClient, body: dict[str, Any], timeout_s: float = 30) -> None:
    extensions = client.ApiextensionsV1Api(api_client)
    name = body["metadata"]["name"]
    try:
        extensions.create_custom_resource_definition(body)
    except client.ApiException as err:
        if err.status != 409:
            raise
        current = extensions.read_custom_resource_definition(name)
        body = {**body, "metadata": {**body["metadata"], "resourceVersion": current.metadata.resource_version}}
        extensions.replace_custom_resource_definition(name, body)
    wait_for(lambda: _condition(extensions.read_custom_resource_definition(name), "Established"), timeout_s)


def _condition(obj: Any, kind: str) -> bool:
    return any(c.type == kind and c.status == "True" for c in (obj.status.conditions or []))


def wait_for(check: Callable[[], Any], timeout_s: float, interval_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(interval_s)
    raise AssertionError(f"not true within {timeout_s} s: {check}")


def example_run(name: str = "tiny", **changes: Any) -> dict[str, Any]:
    """examples/tiny.yaml as a ReinforceRun, spelled in camelCase; ``changes`` maps dotted spec paths (either
    spelling: the spec is respelled after they are applied) to new values."""
    spec = yaml.safe_load(EXAMPLE.read_text())
    for excluded in crd.EXCLUDED_SPEC_FIELDS:
        spec.pop(excluded, None)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    spec = respell(spec, ReinforceRunSpec)  # a ReinforceRun spells its fields in camelCase
    return {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": name}, "spec": spec}


@contextlib.contextmanager
def operator(namespace: str) -> Iterator[KopfRunner]:
    """`reinforce operator` in-process, watching the test's namespace (others hold earlier tests' runs)."""
    args = ["run", "--standalone", "--namespace", namespace, "-m", "reinforce.operator.main"]
    with KopfRunner(args, timeout=60) as runner:
        yield runner
    assert runner.exit_code == 0, runner.output
    assert runner.exception is None, runner.output
    assert "forbidden" not in runner.output.lower(), runner.output  # the RBAC of OPERATOR_RULES sufficed


# --- a whole single-node cluster (tests/e2e/k8s-single-node.sh) ----------------------------------------------------


def cgroup_hierarchies() -> list[Path]:
    hierarchies = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, target, fstype, *_ = line.split()
        if fstype in ("cgroup", "cgroup2"):
            hierarchies.append(Path(target))
    return hierarchies


def single_node_skip_reason() -> str | None:
    """Why tests/e2e/k8s-single-node.sh cannot run here (None: it can)."""
    if sys.platform != "linux":
        return "needs Linux"
    if os.geteuid() != 0:
        return "needs root: the kubelet creates cgroups, mounts volumes and sets sysctls"
    hierarchies = cgroup_hierarchies()
    if not hierarchies:
        return "no cgroup file system is mounted"
    if any((h / "kubepods").exists() for h in hierarchies):
        return "a kubelet's cgroups (kubepods) exist already: another cluster runs on this machine"
    probe = hierarchies[0] / f"reinforce-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as err:
        return f"cannot create cgroups here ({err})"
    if not shutil.which("apt-get"):  # the scripts install golang-go, etcd-server, docker.io, gcc... with it
        missing = [tool for tool in ("dockerd", "go", "etcd", "gcc", "jq", "curl", "openssl") if not shutil.which(tool)]
        if missing:
            return f"missing {', '.join(missing)}, and no apt-get to install them"
    missing = [tool for tool in ("setsid", "flock", "findmnt") if not shutil.which(tool)]
    if missing:
        return f"missing {', '.join(missing)} (util-linux)"
    return None


def single_node(command: str, state: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """tests/e2e/k8s-single-node.sh COMMAND with its state in `state`, its output printed."""
    env = {**os.environ, "REINFORCE_K8S_STATE": str(state)}
    result = subprocess.run(
        ["bash", str(SINGLE_NODE_SCRIPT), command],
        env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip
    print(f"$ k8s-single-node.sh {command} (exit {result.returncode})\n{result.stdout}{result.stderr}")
    return result
