"""The environment service under the confinement its pod gets (issue #24), emulated on this machine: the settings are
read from the Deployment the operator renders (operator/children.py), then applied to a real environment service
process the way a container runtime applies them: a read-only root file system (a private mount namespace whose root
is remounted read-only), a PID namespace of its own (the service is PID 1, as a container's command is), a tmpfs of
the scratch emptyDir's size at its mount path, the pod's non-root user, every capability dropped, no privilege
escalation (no_new_privs), and only the container's environment. In such a pod
`unshare` is refused (the restricted seccomp profile), so the sandbox runs without namespaces (`none`); here `unshare`
is left off the service's PATH for the same result.

What it shows: the service starts, is ready, and runs both tools; model-written code writes to its scratch folder but
nowhere else. Needs root (mount namespaces, setpriv); tests/integration/test_operator.py shows the API server keeps
these settings, and no kubelet runs here outside the cluster e2e."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from k8s import example_run

import reinforce
from reinforce.core.environment_api import EPISODES_PATH, step_path
from reinforce.core.names import ENVIRONMENT_TOKEN_ENV, READY_PATH
from reinforce.operator.children import OperatorConfig, Run, environment_deployment
from reinforce.operator.resource import ReinforceRunSpec
from reinforce.supervisor.ports import free_port

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")),
    reason="needs root, unshare and setpriv (util-linux) to emulate the pod's confinement",
)
TOOLS = ["python", "calculator"]
SCRATCH_SIZE = "64Mi"
# Code a model could send: writes outside its working folder (refused), then in it (its scratch, under /tmp).
PROBE = """```python
import os, tempfile
for path in ("/etc/reinforce-probe", "/usr/reinforce-probe", "/var/tmp/reinforce-probe"):
    try:
        open(path, "w")
        print("wrote", path)
    except OSError as err:
        print("refused", path, err.strerror)
open("scratch.txt", "w").write("kept")
print("scratch", os.getcwd().startswith(tempfile.gettempdir() + "/"), open("scratch.txt").read())
```"""


def pod_container() -> tuple[dict, dict]:
    """The environment pod's spec and container, as the operator renders them for a tools run."""
    body = example_run(**{"environment.enabled": True, "environment.tools": TOOLS,
                          "kubernetes.environment_scratch_size": SCRATCH_SIZE})  # fmt: skip
    spec = ReinforceRunSpec.model_validate({**body["spec"], "name": "tiny"})
    pod = environment_deployment(Run("tiny", "ns", "uid-1", spec, OperatorConfig()))["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


@pytest.fixture
def confined_service(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    pod, container = pod_container()
    context, user = container["securityContext"], pod["securityContext"]["runAsUser"]
    # what is emulated below: any of these changing makes this test stale
    assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"]
    assert context["capabilities"] == {"drop": ["ALL"]} and pod["automountServiceAccountToken"] is False
    [scratch] = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "scratch"]
    size = next(v["emptyDir"]["sizeLimit"] for v in pod["volumes"] if v["name"] == "scratch")
    assert size == SCRATCH_SIZE
    # the tmpfs over the scratch path would hide this checkout and its venv too (e.g. a clone under /tmp)
    hidden = [p for p in (Path(sys.prefix), Path(reinforce.__file__)) if p.resolve().is_relative_to(scratch)]
    if hidden:
        pytest.skip(f"{hidden[0]} lies under the pod's scratch mount {scratch}, which the confinement covers")
    # the spec the ConfigMap would mount, readable by the pod's user and outside the scratch mount (/tmp), which
    # hides what was there; the run folder does not exist in the pod
    config_map = Path(tempfile.mkdtemp(prefix="reinforce-confinement-", dir="/var/tmp"))
    config_map.chmod(0o755)
    spec_file = config_map / "spec.yaml"
    body = example_run(**{"environment.enabled": True, "environment.tools": TOOLS})["spec"]
    spec_file.write_text(yaml.safe_dump({**body, "name": "tiny", "run_dir": "/nonexistent/run"}))
    port, token = free_port(), secrets.token_urlsafe(24)
    # the container's command (python -m reinforce.environment --spec), with this venv's Python, on loopback
    command = [sys.executable, *container["command"][1:4], str(spec_file), "--host", "127.0.0.1", "--port", str(port)]
    # only the container's own variables: the token, and a PATH without unshare (seccomp refuses it in the pod)
    env = ["env", "-i", "PATH=/nonexistent", f"{ENVIRONMENT_TOKEN_ENV}={token}", "PYTHONUNBUFFERED=1"]
    drop = [shutil.which("setpriv"), f"--reuid={user}", f"--regid={user}", "--clear-groups", "--no-new-privs",
            "--inh-caps=-all", "--bounding-set=-all"]  # fmt: skip
    mounts = f"mount -o remount,bind,ro / && mount -t tmpfs -o size={SCRATCH_SIZE.removesuffix('i')},mode=1777 tmpfs"
    shell = f"{mounts} {scratch} && exec " + " ".join([*env, *drop, *command])
    log = (tmp_path / "environment.log").open("wb")
    # sh is PID 1 of the new PID namespace and execs the service, which stays PID 1 (unconfined_refusal lets isolation
    # none run there only); unshare ignores SIGTERM while it waits, so the stop signal goes to the session
    unshare = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc", "--kill-child"]
    process = subprocess.Popen(
        [*unshare, "sh", "-c", shell], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _ready(url):
            assert process.poll() is None, (tmp_path / "environment.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready in 60 s"
            time.sleep(0.2)
        yield url, token, tmp_path / "environment.log"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
        log.close()
        shutil.rmtree(config_map)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + READY_PATH, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_service_runs_its_tools_in_the_pods_confinement(confined_service: tuple[str, str, Path]) -> None:
    url, token, log = confined_service
    ready = httpx.get(url + READY_PATH).json()
    assert ready["ready"] and ready["isolation"] == "none" and ready["tools"] == TOOLS
    headers = {"Authorization": f"Bearer {token}"}
    episode = httpx.post(url + EPISODES_PATH, json={"prompt": "2+3?"}, headers=headers).json()["episode_id"]
    answer = httpx.post(url + step_path(episode), json={"action": PROBE}, headers=headers, timeout=30).json()
    observation = answer["observation"]
    assert observation["exit_code"] == 0 and not observation["error"], (observation, log.read_text()[-3000:])
    lines = observation["text"].splitlines()
    assert "refused /etc/reinforce-probe Read-only file system" in lines
    assert "refused /usr/reinforce-probe Read-only file system" in lines
    assert not any(line.startswith("wrote") for line in lines)
    assert "scratch True kept" in lines  # its working folder is on the scratch volume
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    answer = httpx.post(url + step_path(episode), json={"action": call}, headers=headers, timeout=30).json()
    assert answer["observation"]["text"] == "42"
    assert httpx.post(url + EPISODES_PATH, json={"prompt": "x"}).status_code == 401  # the token is still asked
