"""The pipeline trains when Kubernetes runs it: `helm install`, `kubectl apply` a ReinforceRun, watch it in pods.

On a real single-node cluster (tests/e2e/k8s-single-node.sh: etcd, API server, controller-manager, scheduler, kubelet
and its own dockerd, all on loopback) with the project's images (scripts/build-images.sh, built in the machine's
dockerd, where docker-compose's tests use them too, and copied into the cluster's):
the chart is installed with Helm, so the operator runs as a pod under the chart's RBAC; runs are applied with
kubectl. The cluster has no kube-proxy and no DNS, so the chart is installed with the host-network profile
(docs/kubernetes/single-node.md), and no volume provisioner, so the test makes a hostPath PersistentVolume for each
claim. Last, the cluster itself: a real pod on the node's network, and `down` leaves the machine as it found it
(tests/e2e/single_node_checks.py).

Marked ``slow`` and ``cluster``: it needs root, and the first build of the cluster and the images takes minutes.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s import HELM, KUBECTL, REPO, example_run, single_node, single_node_skip_reason
from kubernetes import client, config
from promserver import Prometheus, assert_every_dashboard_query_answers, wait_until_scraped
from runs import (
    BASELINE_TRAINING,
    assert_each_step_trained_once,
    max_weight_difference,
)
from single_node_checks import Machine, assert_down_leaves_the_machine_as_before, exercise_cluster, read_pids

from generate import crd
from generate.chart_values import CHART
from reinforce.core.metrics import read_metrics, scrape
from reinforce.core.names import (
    COMPONENT_GENERATOR,
    COMPONENT_REWARD,
    COMPONENT_TRAINER,
    K8S_COMPONENT_LABEL,
    K8S_INSTANCE_LABEL,
)
from reinforce.core.spec import respell
from reinforce.operator.children import OperatorConfig
from reinforce.operator.resource import KubernetesSpec, ReinforceRunSpec

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

BUILD_IMAGES = REPO / "scripts" / "build-images.sh"
DOCKER = shutil.which("docker") or "/usr/bin/docker"  # the machine's dockerd by default
RUNS = "runs"  # the namespace of the test's ReinforceRuns
RELEASE, OPERATOR_NAMESPACE = "reinforce", "reinforce-system"
HEALTH_PORT = 8090  # the operator's liveness port on the node's network: not a run's port
PORTS = OperatorConfig().ports
STEPS = 30  # examples/tiny.yaml as it is
PROMPTS_IN_IMAGE = "/opt/reinforce/examples/data/tiny.txt"  # the image's copy of examples/data
RUN_TIMEOUT_S = 900
CLUSTER_PROCESSES = {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "dockerd", "kubelet"}
UP_TIMEOUT_S = 3600  # a cold build of kube-scheduler and kubelet is part of the first `up` on a machine
IMAGES_TIMEOUT_S = 3600  # and a cold build of the images
# Issue 25: the trainer and generators of the first run take a toleration, a node affinity and a priority class
# pasted from a Pod manifest (the node is labelled pool=gpu; the chart's tenancy allows them), which the scheduler
# and the API server's admission then act on
PRIORITY_CLASS = "reinforce-e2e-training"
PASTED = {
    "spec": {
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}]
                }
            }
        },
        "priorityClassName": PRIORITY_CLASS,
    }
}


@dataclass
class Cluster:
    state: Path
    kubeconfig: Path
    api_server: str  # https://127.0.0.1:PORT
    api: client.ApiClient
    volumes: Path  # hostPath PersistentVolumes live here
    timings: dict[str, float]
    before: Machine  # what `down` must give back
    pids: dict[str, tuple[int, str]]  # the processes `up` started

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [KUBECTL, "--kubeconfig", str(self.kubeconfig), *args], capture_output=True, text=True, timeout=300
        )
        if check:
            assert result.returncode == 0, f"kubectl {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return result

    def run_status(self, name: str) -> dict[str, Any]:
        run = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
            crd.GROUP, crd.VERSION, RUNS, crd.PLURAL, name
        )
        return run.get("status") or {}


def _timed(timings: dict[str, float], what: str, action: Callable[[], subprocess.CompletedProcess[str]]) -> None:
    start = time.monotonic()
    result = action()
    timings[what] = time.monotonic() - start
    assert result.returncode == 0, f"{what} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def build_images(logs: Path) -> subprocess.CompletedProcess[str]:
    """scripts/build-images.sh in the machine's dockerd (starting one if none answers). Its output goes to files: a
    daemon it leaves running must not hold a pipe of ours open."""
    with (logs / "build.log").open("w") as log:
        result = subprocess.run(["bash", str(BUILD_IMAGES)], stdout=log, stderr=log, timeout=IMAGES_TIMEOUT_S)
    return subprocess.CompletedProcess(result.args, result.returncode, "", (logs / "build.log").read_text())


def copy_images(state: Path) -> subprocess.CompletedProcess[str]:
    """Every reinforce-* image of the machine's dockerd into the cluster's (`docker save | docker load`: the layers
    they share travel once)."""
    listed = subprocess.run(
        [DOCKER, "image", "ls", "--filter", "reference=reinforce-*", "--format", "{{.Repository}}:{{.Tag}}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    images = " ".join(sorted(set(listed.stdout.split())))
    pipe = f"set -o pipefail; {DOCKER} save {images} | {DOCKER} -H unix://{state}/docker.sock load"
    return subprocess.run(["bash", "-c", pipe], capture_output=True, text=True, timeout=IMAGES_TIMEOUT_S)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if reason := single_node_skip_reason():
        pytest.skip(reason)
    # A state folder of its own: a developer's cluster in the default /run/reinforce-k8s is never touched (and the
    # skip above already saw that no other cluster runs).
    state = Path("/run") / f"reinforce-k8s-e2e-{secrets.token_hex(4)}"
    timings: dict[str, float] = {}
    logs = tmp_path_factory.mktemp("cluster-logs")
    # The images are built once per run, in the machine's dockerd, where docker-compose's tests find them built,
    # then copied into the cluster's. First, so that a dockerd the build starts is part of the machine `up` found.
    _timed(timings, "images", lambda: build_images(logs))
    before = Machine.read()
    try:
        _timed(timings, "cluster up", lambda: single_node("up", state, UP_TIMEOUT_S))
        pids = read_pids(state)
        assert set(pids) == CLUSTER_PROCESSES, pids
        _timed(timings, "images copied", lambda: copy_images(state))
        kubeconfig = state / "admin.kubeconfig"
        api_server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
        api = config.new_client_from_config(config_file=str(kubeconfig))
        volumes = tmp_path_factory.mktemp("volumes")
        yield Cluster(state, kubeconfig, api_server, api, volumes, timings, before, pids)
        api.close()
    finally:
        single_node("down", state, 300)  # also after a failed `up`: down must clean up whatever it started
        print("timings: " + ", ".join(f"{what} {seconds:.1f} s" for what, seconds in timings.items()))


@pytest.fixture(scope="module")
def chart_installed(cluster: Cluster) -> Cluster:
    """The chart, as a user installs it, with the values of a cluster without kube-proxy and registry."""
    host_port = cluster.api_server.removeprefix("https://")
    values = [
        "hostNetwork=true", f"apiServer={host_port}", f"healthPort={HEALTH_PORT}", "image.pullPolicy=Never",
        "operatorConfig.profile=host-network", "operatorConfig.imagePullPolicy=Never",
        "operatorConfig.images.redis=reinforce-redis:0.1.0", f"operatorConfig.tenancy.hostNetworkNamespaces={{{RUNS}}}",
        "operatorConfig.tenancy.tolerationKeys={nvidia.com/gpu}", "operatorConfig.tenancy.nodeSelectors.pool={gpu}",
        f"operatorConfig.tenancy.priorityClasses={{{PRIORITY_CLASS}}}",
    ]  # fmt: skip
    args = [HELM, "--kubeconfig", str(cluster.kubeconfig), "install", RELEASE, str(CHART),
            "-n", OPERATOR_NAMESPACE, "--create-namespace", "--wait", "--timeout", "5m"]  # fmt: skip
    for value in values:
        args += ["--set", value]
    _timed(cluster.timings, "helm install", lambda: subprocess.run(args, capture_output=True, text=True, timeout=400))
    cluster.kubectl("create", "namespace", RUNS)
    cluster.kubectl("label", "node", "--all", "pool=gpu")
    client.SchedulingV1Api(cluster.api).create_priority_class({"metadata": {"name": PRIORITY_CLASS}, "value": 1000})
    return cluster


def persistent_volumes(cluster: Cluster, run: str) -> dict[str, Path]:
    """A hostPath PersistentVolume bound ahead to each claim of the run; claim name -> its folder on the node."""
    sizes = KubernetesSpec()
    folders = {}
    for claim, size in ((f"{run}-data", sizes.storage_size), (f"{run}-redis-data", sizes.redis_storage_size)):
        folder = cluster.volumes / claim
        folder.mkdir()
        folder.chmod(0o777)  # the services run as uid 1000
        volume = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{RUNS}-{claim}"},
            "spec": {
                "capacity": {"storage": size},
                # one node: a hostPath folder serves pods that share it as well as one pod (a run of several
                # trainer pods claims ReadWriteMany)
                "accessModes": ["ReadWriteOnce", "ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": str(folder), "type": "Directory"},
                "claimRef": {"namespace": RUNS, "name": claim},
            },
        }
        client.CoreV1Api(cluster.api).create_persistent_volume(volume)
        folders[claim] = folder
    return folders


def apply_run(cluster: Cluster, name: str, **changes: Any) -> float:
    """`kubectl apply` examples/tiny.yaml as ReinforceRun `name`; returns the time it was applied."""
    run = example_run(name, **{"data.prompts": PROMPTS_IN_IMAGE, **changes})
    manifest = cluster.volumes / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump(run))
    applied = time.monotonic()
    cluster.kubectl("-n", RUNS, "apply", "-f", str(manifest))
    return applied


def wait_for_status(
    cluster: Cluster, name: str, done: Callable[[dict[str, Any]], bool], what: str, timeout_s: float = RUN_TIMEOUT_S
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = cluster.run_status(name)
        assert status.get("phase") != "Failed", (
            f"run {name} failed: {json.dumps(status, indent=1)}\n{diagnose(cluster)}"
        )
        if done(status):
            return status
        time.sleep(0.5)
    raise AssertionError(f"run {name}: {what} not within {timeout_s} s; status {status}\n{diagnose(cluster)}")


def diagnose(cluster: Cluster) -> str:
    """The pods and the last log lines of each: what a failure message needs."""
    pods = cluster.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
    logs = []
    for pod in client.CoreV1Api(cluster.api).list_namespaced_pod(RUNS).items:
        log = cluster.kubectl("-n", RUNS, "logs", pod.metadata.name, "--tail=30", check=False)
        logs.append(f"--- {pod.metadata.name}\n{log.stdout}{log.stderr}")
    operator = cluster.kubectl("-n", OPERATOR_NAMESPACE, "logs", "deploy/reinforce", "--tail=40", check=False)
    return f"{pods}\n" + "\n".join(logs) + f"\n--- operator\n{operator.stdout}{operator.stderr}"


def delete_run_and_its_children(cluster: Cluster, name: str) -> None:
    """`kubectl delete` the run: every object it owned goes (garbage collection of the owner references)."""
    cluster.kubectl("-n", RUNS, "delete", "reinforcerun", name, "--wait=true", "--timeout=120s")
    kinds = "pods,statefulsets,deployments,services,configmaps,secrets,persistentvolumeclaims"
    selector = f"{K8S_INSTANCE_LABEL}={name}"
    deadline = time.monotonic() + 180
    while (left := cluster.kubectl("-n", RUNS, "get", kinds, "-l", selector, "-o", "name").stdout.split()) and (
        time.monotonic() < deadline
    ):
        time.sleep(1)
    assert not left, f"children of {name} left after deleting it: {left}"


REINFORCE_COMPONENTS = {COMPONENT_TRAINER, COMPONENT_GENERATOR, COMPONENT_REWARD}


def write_pod_targets(cluster: Cluster, run: str, targets_file: Path, timeout_s: float = 120) -> None:
    """The run's pods as Prometheus scrape targets, labelled as the chart's monitors label them, once a pod of each
    REINFORCE component exists (before the first step: the scrapes of a fast run then cover all of it).

    Debian builds its Prometheus without Kubernetes discovery, so the test does the discovery through the API server
    and hands the pods over in a file_sd file. On the node's network every pod is 127.0.0.1; a generator's metrics
    port is ports.generator_metrics + its ordinal.
    """
    selector = f"{K8S_INSTANCE_LABEL}={run}"
    deadline = time.monotonic() + timeout_s
    while True:
        pods = client.CoreV1Api(cluster.api).list_namespaced_pod(RUNS, label_selector=selector).items
        if {p.metadata.labels[K8S_COMPONENT_LABEL] for p in pods} >= REINFORCE_COMPONENTS:
            break
        assert time.monotonic() < deadline, f"pods of {run} after {timeout_s} s: {[p.metadata.name for p in pods]}"
        time.sleep(0.5)
    targets = []
    ports = {COMPONENT_REWARD: PORTS.reward_metrics, COMPONENT_TRAINER: PORTS.trainer_metrics}
    for pod in pods:
        name, component = pod.metadata.name, pod.metadata.labels[K8S_COMPONENT_LABEL]
        ordinal = int(name.rsplit("-", 1)[1]) if component == COMPONENT_GENERATOR else None
        port = PORTS.generator_metrics + ordinal if ordinal is not None else ports.get(component)
        if port is not None:
            labels = {"run": run, "component": component, "instance": name}
            targets.append({"targets": [f"127.0.0.1:{port}"], "labels": labels})
    partial = targets_file.with_suffix(".partial")
    partial.write_text(json.dumps(targets))
    partial.rename(targets_file)  # Prometheus reads the file when it changes: never half of it


def test_helm_install_then_a_run_trains_in_pods(chart_installed: Cluster, tmp_path: Path) -> None:
    cluster = chart_installed
    operator_pods = client.CoreV1Api(cluster.api).list_namespaced_pod(OPERATOR_NAMESPACE).items
    assert [p.status.phase for p in operator_pods] == ["Running"]
    assert operator_pods[0].spec.service_account_name == RELEASE  # the chart's RBAC, not an admin's
    folders = persistent_volumes(cluster, "tiny")
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    file_sd = {"files": [str(targets)], "refresh_interval": "1s"}
    prometheus = Prometheus(tmp_path, [{"job_name": "pods", "file_sd_configs": [file_sd]}])
    try:
        applied = apply_run(
            cluster, "tiny", **{"kubernetes.trainer.template": PASTED, "kubernetes.generator.template": PASTED}
        )
        write_pod_targets(cluster, "tiny", targets)
        wait_for_status(cluster, "tiny", lambda s: (s.get("step") or 0) >= 1, "a first trained step")
        first_step_s = time.monotonic() - applied
        assert_pods_carry_the_template(cluster, "tiny")
        wait_for_status(cluster, "tiny", lambda s: (s.get("step") or 0) >= STEPS // 2, "half the steps")
        at = wait_until_scraped(prometheus, "tiny", REINFORCE_COMPONENTS)
        mid_run = cluster.run_status("tiny")
        # every service exports while the run goes on; the rates need the scrapes of the window before `at`
        assert mid_run.get("phase") != "Succeeded", f"the run ended before Prometheus had scraped it: {mid_run}"
        final = wait_for_status(cluster, "tiny", lambda s: s.get("phase") == "Succeeded", "phase Succeeded")
        total_s = time.monotonic() - applied
        # a REINFORCE run has no critic and no tools; tests/integration/test_dashboards.py answers their dashboards
        names = assert_every_dashboard_query_answers(
            prometheus, "tiny", at, skip=frozenset({"ppo.json", "environment.json"})
        )
    finally:
        prometheus.stop()

    run_dir = folders["tiny-data"] / "run"
    rewards = [row["train_rollouts/rewards"] for row in read_metrics(run_dir / "metrics.jsonl")]
    assert len(rewards) == STEPS
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1, rewards  # the reward rose
    assert_each_step_trained_once(run_dir, STEPS)
    assert final["publishedWeightVersion"] == STEPS
    generators = final["generators"]
    assert [g["name"] for g in generators] == ["tiny-generator-0"]
    # every published version went to every generator pod: versions 1..STEPS, each loaded once
    assert all(g["loadedVersion"] == STEPS and g["weightLoads"] == STEPS for g in generators), generators

    table = cluster.kubectl("-n", RUNS, "get", "reinforceruns").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "STEP", "REWARD", "KL", "GENERATORS", "AGE"]
    assert table[1].split()[:3] == ["tiny", "Succeeded", str(STEPS)]
    wide = cluster.kubectl("-n", RUNS, "get", "rr", "-o", "wide").stdout.splitlines()[0].split()
    assert "WEIGHTS" in wide

    cluster.timings |= {"kubectl apply to first step": first_step_s, "kubectl apply to Succeeded": total_s}
    print(f"{names} metric names answered")
    delete_run_and_its_children(cluster, "tiny")


def assert_pods_carry_the_template(cluster: Cluster, run: str) -> None:
    """The trainer and generator pods, scheduled and running, carry what the run's templates pasted."""
    core = client.CoreV1Api(cluster.api)
    for pod in (f"{run}-trainer-0", f"{run}-generator-0"):
        spec = cluster.api.sanitize_for_serialization(core.read_namespaced_pod(pod, RUNS).spec)
        assert PASTED["spec"]["tolerations"][0] in spec["tolerations"], spec
        assert spec["affinity"] == PASTED["spec"]["affinity"] and spec["priorityClassName"] == PRIORITY_CLASS, spec
        assert spec["priority"] == 1000 and spec["automountServiceAccountToken"] is False, spec


def test_pods_deleted_mid_run_lose_no_step(chart_installed: Cluster) -> None:
    """A generator pod, then the trainer pod, force-deleted mid-run: the run succeeds, each prompt trained once."""
    cluster = chart_installed
    folders = persistent_volumes(cluster, "faults")
    apply_run(cluster, "faults", **{"generation.numGenerators": 2, "training.checkpointEvery": 5})
    core = client.CoreV1Api(cluster.api)
    for pod, at_step in (("faults-generator-0", 6), ("faults-trainer-0", 13)):
        wait_for_status(cluster, "faults", lambda s, n=at_step: (s.get("step") or 0) >= n, f"step {at_step}")
        uid = core.read_namespaced_pod(pod, RUNS).metadata.uid
        cluster.kubectl("-n", RUNS, "delete", "pod", pod, "--grace-period=0", "--force")

        def replaced(_: dict[str, Any], pod: str = pod, uid: str = uid) -> bool:
            new = core.list_namespaced_pod(RUNS, field_selector=f"metadata.name={pod}").items
            return bool(new) and new[0].metadata.uid != uid and new[0].status.phase == "Running"

        wait_for_status(cluster, "faults", replaced, f"{pod} replaced")
    final = wait_for_status(cluster, "faults", lambda s: s.get("phase") == "Succeeded", "phase Succeeded")
    assert final["publishedWeightVersion"] == STEPS
    assert_each_step_trained_once(folders["faults-data"] / "run", STEPS)
    components = {p.metadata.labels[K8S_COMPONENT_LABEL] for p in core.list_namespaced_pod(RUNS).items}
    assert components <= {"redis", "reward", "generator", "trainer"}, components
    delete_run_and_its_children(cluster, "faults")


def test_kubectl_scale_mid_run_trains_every_step_once(chart_installed: Cluster) -> None:
    """Issue 26, item 3: a live run's generators scaled 1 -> 3 -> 1 with `kubectl scale` (the scale subresource,
    what an HPA or KEDA drives). Each scale-in SIGTERMs a generator, which hands its prompts back at once: the run
    succeeds with every step trained once, and the status follows the generators."""
    cluster = chart_installed
    folders = persistent_volumes(cluster, "elastic")
    # Long enough for two generator pods to start: at the tiny example's 30 steps, CI saw the run end before
    # they were ready (21 steps in under a minute), so the scale-out could never be seen.
    steps = 4 * STEPS
    apply_run(cluster, "elastic", **{"training.checkpointEvery": 5, "training.steps": steps})
    for replicas, at_step in ((3, 4), (1, 14)):
        wait_for_status(cluster, "elastic", lambda s, n=at_step: (s.get("step") or 0) >= n, f"step {at_step}")
        cluster.kubectl("-n", RUNS, "scale", "rr/elastic", "--replicas", str(replicas))

        def scaled(status: dict[str, Any], r: int = replicas) -> bool:
            return status.get("generatorReplicas") == r and status.get("generatorsReady") == f"{r}/{r}"

        status = wait_for_status(cluster, "elastic", scaled, f"{replicas} generators")
        assert (status.get("step") or 0) < steps, "the run ended before the scaling could be seen"
    final = wait_for_status(cluster, "elastic", lambda s: s.get("phase") == "Succeeded", "phase Succeeded")
    assert final["publishedWeightVersion"] == steps
    assert_each_step_trained_once(folders["elastic-data"] / "run", steps)
    delete_run_and_its_children(cluster, "elastic")


def test_two_trainer_pods_one_force_deleted_train_like_one_rank(chart_installed: Cluster, tiny_baseline: Path) -> None:
    """Issue 26, item 4: `training.numRanks: 2` runs two trainer pods, gloo ranks that meet at torchrun's rendezvous
    on pod 0, both mounting the run's one data volume, which they claim ReadWriteMany. Trainer pod 1
    is force-deleted mid-run: both ranks start again from the last checkpoint, and the run ends with the weights of
    the uninterrupted local one-rank run (two local ranks match it within 1e-5: tests/integration/test_pipeline.py),
    every step trained once."""
    cluster = chart_installed
    folders = persistent_volumes(cluster, "ranks")
    steps, every = BASELINE_TRAINING["steps"], BASELINE_TRAINING["checkpoint_every"]
    apply_run(cluster, "ranks", **{"training.steps": steps, "training.checkpointEvery": every, "training.numRanks": 2})
    core = client.CoreV1Api(cluster.api)
    status = wait_for_status(cluster, "ranks", lambda s: (s.get("step") or 0) >= every + 2, f"step {every + 2}")
    pods = core.list_namespaced_pod(RUNS, label_selector=f"{K8S_COMPONENT_LABEL}={COMPONENT_TRAINER}").items
    assert sorted(p.metadata.name for p in pods) == ["ranks-trainer-0", "ranks-trainer-1"]
    assert core.read_namespaced_persistent_volume_claim("ranks-data", RUNS).spec.access_modes == ["ReadWriteMany"]
    uid = core.read_namespaced_pod("ranks-trainer-1", RUNS).metadata.uid
    cluster.kubectl("-n", RUNS, "delete", "pod", "ranks-trainer-1", "--grace-period=0", "--force")
    assert (status.get("step") or 0) < steps, "the run ended before its trainer pod could be deleted"

    def replaced(_: dict[str, Any]) -> bool:
        new = core.list_namespaced_pod(RUNS, field_selector="metadata.name=ranks-trainer-1").items
        return bool(new) and new[0].metadata.uid != uid and new[0].status.phase == "Running"

    wait_for_status(cluster, "ranks", replaced, "ranks-trainer-1 replaced")
    final = wait_for_status(cluster, "ranks", lambda s: s.get("phase") == "Succeeded", "phase Succeeded")
    assert final["publishedWeightVersion"] == steps
    run_dir = folders["ranks-data"] / "run"
    assert_each_step_trained_once(run_dir, steps)
    assert max_weight_difference(tiny_baseline, run_dir) < 1e-5
    delete_run_and_its_children(cluster, "ranks")


TOOLS_EXAMPLE = REPO / "examples" / "tiny-tools.yaml"
TOOLS_PROMPTS_IN_IMAGE = "/opt/reinforce/examples/data/tiny-tools.jsonl"
# Run in the environment's container (kubectl exec): what model-written code would find there.
CONFINEMENT_PROBE = """
import os
for path in ("/opt/reinforce/probe", "/etc/probe", "/tmp/probe"):
    try:
        open(path, "w").close()
        print("wrote", path)
    except OSError as err:
        print("refused", path, err.strerror)
print("token", os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount"))
# the kubelet always adds the API server's Service (KUBERNETES_SERVICE_*), enableServiceLinks or not
links = [k for k in os.environ if k.endswith("_SERVICE_HOST") and not k.startswith("KUBERNETES_")]
print("variables", " ".join(sorted([*links, *(k for k in os.environ if "REINFORCE" in k)])))
"""


def tools_run(name: str) -> dict[str, Any]:
    """examples/tiny-tools.yaml (multi-turn, the calculator) as ReinforceRun `name`, its prompts the image's copy."""
    spec = yaml.safe_load(TOOLS_EXAMPLE.read_text())
    for excluded in crd.EXCLUDED_SPEC_FIELDS:
        spec.pop(excluded, None)
    spec["data"]["prompts"] = TOOLS_PROMPTS_IN_IMAGE
    body = {"metadata": {"name": name}, "spec": respell(spec, ReinforceRunSpec)}
    return {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, **body}


def test_a_tools_run_trains_in_pods_beside_its_locked_down_environment(chart_installed: Cluster) -> None:
    """Issue #24: examples/tiny-tools.yaml as a ReinforceRun. The operator adds the environment's Deployment, Service,
    NetworkPolicy and token; its pod runs on the kubelet with a read-only root (the scratch emptyDir at /tmp its only
    writable folder), no service-account token and only its own token; the generator's episodes call the calculator
    through it, and every step trains once."""
    cluster = chart_installed
    folders = persistent_volumes(cluster, "tools")
    run = tools_run("tools")
    steps = run["spec"]["training"]["steps"]
    manifest = cluster.volumes / "tools.yaml"
    manifest.write_text(yaml.safe_dump(run))
    cluster.kubectl("-n", RUNS, "apply", "-f", str(manifest))
    wait_for_status(cluster, "tools", lambda s: (s.get("step") or 0) >= 3, "three trained steps")
    selector = f"{K8S_INSTANCE_LABEL}=tools,{K8S_COMPONENT_LABEL}=environment"
    [pod] = client.CoreV1Api(cluster.api).list_namespaced_pod(RUNS, label_selector=selector).items
    assert pod.status.phase == "Running" and pod.spec.automount_service_account_token is False
    assert pod.spec.containers[0].security_context.read_only_root_filesystem is True
    probe = cluster.kubectl("-n", RUNS, "exec", pod.metadata.name, "--", "python", "-c", CONFINEMENT_PROBE).stdout
    lines = probe.splitlines()
    assert "refused /opt/reinforce/probe Read-only file system" in lines and "wrote /tmp/probe" in lines, probe
    assert "refused /etc/probe Read-only file system" in lines and "token False" in lines, probe
    assert "variables REINFORCE_ENVIRONMENT_TOKEN" in lines, probe  # no other secret, no other Service's address
    metrics = scrape(f"http://127.0.0.1:{PORTS.environment_metrics}/metrics", 5)  # the node's network
    assert metrics is not None and metrics["reinforce_environment_tool_calls_total"] > 0, metrics
    final = wait_for_status(cluster, "tools", lambda s: s.get("phase") == "Succeeded", "phase Succeeded")
    assert final["publishedWeightVersion"] == steps
    assert_each_step_trained_once(folders["tools-data"] / "run", steps)
    delete_run_and_its_children(cluster, "tools")


def test_a_pod_runs_and_down_leaves_the_machine_as_before(cluster: Cluster, tmp_path: Path) -> None:
    """tests/e2e/k8s-single-node.sh itself, last, on the cluster the runs above used: a real pod reaches the API
    server over the node's network, and `down` (with a pod left running: its container, cgroups and volume mounts)
    leaves the machine as it was before `up`, the runs' pods, volumes and chart included."""
    exercise_cluster(cluster.state, tmp_path)
    cluster.api.close()
    assert_down_leaves_the_machine_as_before(cluster.state, cluster.before, cluster.pids)
