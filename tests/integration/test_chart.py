"""The Helm chart: lint, render, validate, and install into the real API server, whose operator (run in-process
with the chart's own ServiceAccount token, since there is no kubelet) then runs a ReinforceRun applied with
kubectl."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from k8s import API, HELM, KUBECTL, KubeCluster, example_run, install_crd, kube_apiserver, operator, wait_for  # noqa: F401
from kubernetes import client

from generate import crd
from generate.chart_values import CHART, ChartValues, ScaledRun
from generate.dashboards import ALERTS
from generate.operator_manifest import OPERATOR_RULES
from reinforce.core.names import PROMETHEUS_COMPONENT_LABEL, PROMETHEUS_INSTANCE_LABEL, PROMETHEUS_RUN_LABEL
from reinforce.core.queue import GENERATORS_GROUP
from reinforce.operator.rbac import CLUSTER_RULES, NAMESPACED_RULES

# The newest schemas kubernetes-validate ships that are closest to the test server's 1.20; every kind the
# chart renders is served, with the same schema, by both.
VALIDATE_VERSION = "1.25.0"
RUNS_NAMESPACE = "chart-runs"  # where the installed chart's operator runs ReinforceRuns
MONITORING_APIS = [
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PodMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result


def render(*args: str) -> list[dict[str, Any]]:
    out = helm("template", "rel", str(CHART), "--namespace", "reinforce-system", *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def test_values_file_is_the_model() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert ChartValues.model_validate(values).operatorConfig.images.redis == "redis:7.0"
    assert ChartValues.model_validate(values).image == ChartValues().image, (
        "values.yaml and the schema's defaults differ"
    )


def _property_names(schema: Any) -> set[str]:
    """Every key a values file may spell (the names under each `properties`), at any depth."""
    if isinstance(schema, list):
        return set().union(*map(_property_names, schema))
    if not isinstance(schema, dict):
        return set()
    own = set(schema.get("properties", {}))
    return own | set().union(*map(_property_names, schema.values()))


def test_values_are_camel_case_throughout() -> None:
    """Issue 25: the operator's configuration was snake_case inside camelCase values."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    names = _property_names(schema)
    assert {"operatorConfig", "imagePullPolicy", "generatorVllm", "hostNetworkNamespaces"} <= names
    assert not [name for name in names if "_" in name]
    assert "image_pull_policy" in helm("template", "rel", str(CHART), "--set", "operatorConfig.image_pull_policy=Never",
                                       check=False).stderr  # fmt: skip


def test_lint_passes() -> None:
    result = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in result.stdout


def test_rendered_objects_validate_and_the_role_is_the_operators() -> None:
    objects = render()
    kinds = sorted(o["kind"] for o in objects)
    dashboards = len(list((CHART / "dashboards").glob("*.json")))
    assert dashboards == 6  # run overview, generation, reward server, weight sync, PPO, environment
    assert kinds == sorted(
        ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment", "ServiceAccount"] + ["ConfigMap"] * dashboards
    )
    for obj in objects:
        kubernetes_validate.validate(obj, VALIDATE_VERSION, strict=True)
    role = next(o for o in objects if o["kind"] == "ClusterRole")
    assert role["rules"] == OPERATOR_RULES
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["reinforce", "operator"] and not any(c.startswith("--namespace") for c in command)
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rel-reinforce-config")
    assert yaml.safe_load(config["data"]["operator.yaml"])["images"]["redis"] == "redis:7.0"


def test_monitoring_objects_only_where_their_apis_exist() -> None:
    assert not {o["kind"] for o in render()} & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    args = [arg for api in MONITORING_APIS for arg in ("--api-versions", api)]
    objects = render(*args)
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"} <= {o["kind"] for o in objects}
    rules = next(o for o in objects if o["kind"] == "PrometheusRule")["spec"]["groups"][0]["rules"]
    assert [r["alert"] for r in rules] == [a.name for a in ALERTS]
    # Both monitors give every series the labels the dashboards and alerts select by.
    monitors = [o["spec"] for o in objects if o["kind"] in {"ServiceMonitor", "PodMonitor"}]
    for (endpoint,) in [m.get("endpoints") or m["podMetricsEndpoints"] for m in monitors]:
        assert {r["targetLabel"] for r in endpoint["relabelings"]} == {
            PROMETHEUS_RUN_LABEL,
            PROMETHEUS_COMPONENT_LABEL,
            PROMETHEUS_INSTANCE_LABEL,
        }


def test_keda_scaled_objects_render_as_kedas_models_read_them() -> None:
    """autoscaling.runs: a ScaledObject on each run's scale subresource and prompts stream, and the
    TriggerAuthentication that gives it the run's Redis password; checked against KEDA's CRD models."""
    from cloudcoil.models.keda.v1alpha1 import ScaledObject, TriggerAuthentication

    runs = json.dumps([{"name": "tiny", "namespace": "ml", "maxReplicas": 6}, {"name": "big", "namespace": "ml",
                       "metric": "pending", "target": 8}])  # fmt: skip
    assert not {o["kind"] for o in render("--set-json", f"autoscaling.runs={runs}")} & {"ScaledObject"}
    objects = render("--api-versions", "keda.sh/v1alpha1/ScaledObject", "--set-json", f"autoscaling.runs={runs}")
    models = {"ScaledObject": ScaledObject, "TriggerAuthentication": TriggerAuthentication}
    keda = [o for o in objects if o["kind"] in models]
    for obj in keda:  # every key is one KEDA knows: its model's round trip keeps them all, with their types
        model = models[obj["kind"]].model_validate(obj)
        assert model.model_dump(by_alias=True, exclude_none=True, mode="json") == obj
    scaled = {o["metadata"]["name"]: o["spec"] for o in keda if o["kind"] == "ScaledObject"}
    tiny = scaled["tiny-generators"]
    assert tiny["scaleTargetRef"] == {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "name": "tiny"}
    defaults = ScaledRun(name="tiny", namespace="ml")  # what a run that sets nothing else gets
    assert (tiny["minReplicaCount"], tiny["maxReplicaCount"]) == (defaults.minReplicas, 6)
    assert (tiny["pollingInterval"], tiny["cooldownPeriod"]) == (defaults.pollingInterval, defaults.cooldownPeriod)
    assert defaults.metric == "lag" and defaults.target == 16
    assert tiny["triggers"] == [{
        "type": "redis-streams",
        "metadata": {"address": "tiny-redis.ml.svc:6379", "stream": "reinforce:tiny:prompts",
                     "consumerGroup": GENERATORS_GROUP, "lagCount": "16"},
        "authenticationRef": {"name": "tiny-redis"},
    }]  # fmt: skip
    assert scaled["big-generators"]["triggers"][0]["metadata"]["pendingEntriesCount"] == "8"
    auth = next(o for o in keda if o["kind"] == "TriggerAuthentication" and o["metadata"]["name"] == "tiny-redis")
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": "password", "name": "tiny-secrets", "key": "redis-password"}
    ]


def test_namespaces_and_operator_config_reach_the_operator() -> None:
    objects = render("--set", "watchNamespaces={team-a,team-b}", "--set", "operatorConfig.images.trainer=mine:2")
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-2:] == ["--namespace=team-a", "--namespace=team-b"]
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rel-reinforce-config")
    operator_config = yaml.safe_load(config["data"]["operator.yaml"])
    assert operator_config["images"]["trainer"] == "mine:2"
    # the runs' NetworkPolicies admit the operator from the release's namespace only
    assert operator_config["operatorNamespace"] == "reinforce-system"


def test_watch_namespaces_get_roles_and_nothing_cluster_wide_touches_secrets_or_workloads() -> None:
    """R3-10: an operator limited to some namespaces can read or create no Secret and create no workload elsewhere."""
    objects = render("--set", "watchNamespaces={team-a,team-b}")
    for obj in objects:
        kubernetes_validate.validate(obj, VALIDATE_VERSION, strict=True)
    [cluster_role] = [o for o in objects if o["kind"] == "ClusterRole"]
    assert cluster_role["rules"] == CLUSTER_RULES
    cluster_wide = {
        (group, resource) for r in cluster_role["rules"] for group in r["apiGroups"] for resource in r["resources"]
    }
    assert cluster_wide == {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces")}
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in cluster_role["rules"])  # read-only
    roles = {o["metadata"]["namespace"]: o for o in objects if o["kind"] == "Role"}
    assert set(roles) == {"team-a", "team-b"} and all(r["rules"] == NAMESPACED_RULES for r in roles.values())
    bindings = {o["metadata"]["namespace"]: o for o in objects if o["kind"] == "RoleBinding"}
    assert set(bindings) == {"team-a", "team-b"}
    for binding in bindings.values():
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "rel-reinforce"}
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "rel-reinforce", "namespace": "reinforce-system"}
        ]


def test_host_network_profile_points_the_operator_at_the_api_server() -> None:
    objects = render(
        "--set", "hostNetwork=true", "--set", "apiServer=127.0.0.1:6443", "--set", "operatorConfig.profile=host-network"
    )  # fmt: skip
    pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env == {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"}
    assert (
        "env" not in next(o for o in render() if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    )


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("rbac=maybe", "rbac"),
        ("bogus=1", "bogus"),
        ("operatorConfig.ports.generator=70000", "generator"),
        ("operatorConfig.pods.trainer.gpus=-1", "gpus"),
        ("apiServer=https://x", "apiServer"),
        ("operatorConfig.profile=flat", "profile"),
    ],
)
def test_the_schema_refuses_bad_values_naming_them(setting: str, complaint: str) -> None:
    result = helm("template", "rel", str(CHART), "--set", setting, check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr and complaint in result.stderr


# ---- installed into the real API server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def installed(kube_apiserver: KubeCluster) -> Iterator[str]:  # noqa: F811
    """`helm install` into namespace reinforce-chart, watching RUNS_NAMESPACE (so the operator has the namespaced
    Roles only there); yields the release's namespace."""
    namespace = "reinforce-chart"
    kubeconfig = str(kube_apiserver.admin_kubeconfig)
    with kube_apiserver.api_client() as admin:
        client.CoreV1Api(admin).create_namespace({"metadata": {"name": RUNS_NAMESPACE}})
    helm("install", "rel", str(CHART), "--namespace", namespace, "--create-namespace", "--kubeconfig", kubeconfig,
         "--set", f"watchNamespaces={{{RUNS_NAMESPACE}}}")  # fmt: skip
    yield namespace
    helm("uninstall", "rel", "--namespace", namespace, "--kubeconfig", kubeconfig)


@pytest.mark.slow
def _read_or_none(read: Callable[[str, str], Any], name: str, namespace: str = RUNS_NAMESPACE) -> Any:
    """The object, or None while it does not exist yet (404)."""
    try:
        return read(name, namespace)
    except client.ApiException as err:
        if err.status == 404:
            return None
        raise


def test_helm_install_then_kubectl_apply_a_run_gets_its_children(
    kube_apiserver: KubeCluster,  # noqa: F811
    installed: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with kube_apiserver.api_client() as admin:
        deployment = client.AppsV1Api(admin).read_namespaced_deployment("rel-reinforce", installed)
        assert deployment.spec.template.spec.service_account_name == "rel-reinforce"
        install_crd(admin, yaml.safe_load(crd.DEFAULT_OUTPUT.read_text()))  # helm's copy may predate this session
        config = client.CoreV1Api(admin).read_namespaced_config_map("rel-reinforce-config", installed)
        runs_namespace = RUNS_NAMESPACE

    # the operator as the chart deploys it: its ServiceAccount's token, its ConfigMap's configuration
    (tmp_path / "operator.yaml").write_text(config.data["operator.yaml"])
    monkeypatch.setenv("REINFORCE_OPERATOR_CONFIG", str(tmp_path / "operator.yaml"))
    monkeypatch.setenv("KUBECONFIG", str(kube_apiserver.kubeconfig_for_service_account(installed, "rel-reinforce")))
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(example_run("from-kubectl")))
    with operator(runs_namespace):
        applied = subprocess.run(
            [
                KUBECTL,
                "--kubeconfig",
                str(kube_apiserver.admin_kubeconfig),
                "-n",
                runs_namespace,
                "apply",
                "-f",
                str(run_file),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert applied.returncode == 0, applied.stderr
        with kube_apiserver.api_client() as admin:
            apps = client.AppsV1Api(admin)
            names = lambda: {d.metadata.name for d in apps.list_namespaced_deployment(runs_namespace).items}  # noqa: E731
            assert wait_for(lambda: names() == {"from-kubectl-reward", "from-kubectl-generator"}, 30)
            # Children appear one apply after another: wait for the one read here too (not only the Deployments).
            trainer = wait_for(lambda: _read_or_none(apps.read_namespaced_stateful_set, "from-kubectl-trainer"), 30)
            # the chart's operatorConfig
            assert trainer.spec.template.spec.containers[0].image == "reinforce-trainer:0.1.0"
            runs = client.CustomObjectsApi(admin)
            wait_for(
                lambda: (
                    (
                        runs.get_namespaced_custom_object(*API, runs_namespace, crd.PLURAL, "from-kubectl").get(
                            "status"
                        )
                        or {}
                    ).get("phase")
                    == "Pending"
                ),
                15,
            )
    listed = subprocess.run(
        [
            KUBECTL,
            "--kubeconfig",
            str(kube_apiserver.admin_kubeconfig),
            "-n",
            runs_namespace,
            "get",
            "rr",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(listed.stdout)["items"][0]["status"]["generatorsReady"] == "0/1"
