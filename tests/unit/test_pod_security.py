"""Every pod of a run, and the operator's, passes the "restricted" Pod Security Standard; each run has a
NetworkPolicy selecting exactly its own pods (issue #13, finding 9). Rendered objects only: no cluster needed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from k8s import example_run

from generate.operator_manifest import operator_deployment
from reinforce.core.names import K8S_INSTANCE_LABEL, OPERATOR_APP_NAME
from reinforce.operator.children import OperatorConfig, Run, children
from reinforce.operator.resource import ReinforceRunSpec

CHART_TEMPLATES = Path(__file__).resolve().parents[2] / "charts" / "reinforce" / "templates"
CHART_OPERATOR = CHART_TEMPLATES / "operator.yaml"
CHART_MONITORING = CHART_TEMPLATES / "monitoring.yaml"
# https://kubernetes.io/docs/concepts/security/pod-security-standards/ (restricted, v1.20 onwards)
RESTRICTED_VOLUME_TYPES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What in a pod spec breaks the restricted profile (empty: it passes)."""
    found = [f"{key} set" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            found.append(f"volume {volume['name']}: {kinds - RESTRICTED_VOLUME_TYPES}")
    pod_context = pod.get("securityContext", {})
    for c in pod["containers"] + pod.get("initContainers", []):
        context = {**pod_context, **c.get("securityContext", {})}
        name = c["name"]
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation not false")
        if context.get("runAsNonRoot") is not True:
            found.append(f"{name}: runAsNonRoot not true")
        if context.get("runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        if context.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile not RuntimeDefault")
        capabilities = c.get("securityContext", {}).get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities not dropped")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities added")
        if any("hostPort" in p for p in c.get("ports", [])):
            found.append(f"{name}: hostPort")
    return found


def run_of(
    profile: str = "standard",
    name: str = "tiny",
    algorithm: str = "reinforce",
    config: dict[str, Any] | None = None,
    changes: dict[str, Any] | None = None,
) -> Run:
    body = example_run(name, **{"algorithm.name": algorithm, **(changes or {})})
    spec = ReinforceRunSpec.model_validate({**body["spec"], "name": name})
    return Run(name, "ns", "uid-1", spec, OperatorConfig.model_validate({"profile": profile, **(config or {})}))


def pod_templates(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o["spec"]["template"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")}


def test_every_pod_of_a_run_passes_restricted_and_mounts_no_token() -> None:
    templates = pod_templates(children(run_of()))
    assert set(templates) == {f"tiny-{c}" for c in ("redis", "reward", "generator", "trainer")}
    for name, template in templates.items():
        pod = template["spec"]
        assert restricted_violations(pod) == [], name
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsUser"] != 0, name


def test_redis_password_is_on_no_command_line() -> None:
    redis = pod_templates(children(run_of()))["tiny-redis"]["spec"]["containers"][0]
    command = " ".join(redis["command"])
    assert "--requirepass" not in command
    # the password reaches redis-server through a private config file written by a shell builtin
    assert re.search(r"printf 'requirepass .*' \"\$REDIS_PASSWORD\" > (\S+) && exec redis-server \1 ", command)


def test_the_network_policy_selects_exactly_the_runs_pods() -> None:
    objects = children(run_of())
    [policy] = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["spec"]["policyTypes"] == ["Ingress"]
    selector = policy["spec"]["podSelector"]["matchLabels"]

    def selected(labels: dict[str, str]) -> bool:
        return selector.items() <= labels.items()

    assert all(selected(t["metadata"]["labels"]) for t in pod_templates(objects).values())
    for other in (children(run_of(name="other")), [operator_deployment()]):
        assert not any(selected(t["metadata"]["labels"]) for t in pod_templates(other).values())
    assert selector[K8S_INSTANCE_LABEL] == "tiny"


def _ports(rule: dict[str, Any]) -> set[int]:
    return {p["port"] for p in rule["ports"]}


@pytest.mark.parametrize("algorithm", ["reinforce", "ppo"])
def test_the_network_policy_pins_the_operator_and_opens_metrics_ports_only(algorithm: str) -> None:
    """R3-9: the operator is let in from its own namespace only, on the ports it calls; anyone else reaches metrics
    ports only, and no metrics port is a control API (generators and the critic serve metrics on ports of their
    own)."""
    run = run_of(algorithm=algorithm, config={"operatorNamespace": "ops"})
    objects = children(run)
    [policy] = [o for o in objects if o["kind"] == "NetworkPolicy"]
    own_pods = policy["spec"]["podSelector"]["matchLabels"]
    own, operator, anyone = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": own_pods}}]}  # the run's own pods: every port
    assert operator["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": OPERATOR_APP_NAME}},
        }
    ]
    p = run.config.ports
    assert _ports(operator) == {p.redis, p.generator}  # the published version in Redis; weight loading
    critic = {p.critic_metrics} if algorithm == "ppo" else set()
    assert (
        "from" not in anyone and _ports(anyone) == {p.reward_metrics, p.generator_metrics, p.trainer_metrics} | critic
    )
    # each of those is a container port named "metrics", and every control API is on another port
    containers = [c for t in pod_templates(objects).values() for c in t["spec"]["containers"]]
    named_metrics = {port["containerPort"] for c in containers for port in c["ports"] if port["name"] == "metrics"}
    assert named_metrics == _ports(anyone)
    control = {p.redis, p.generator, p.critic, p.trainer_weights, p.reward_http, p.reward_grpc, p.rendezvous}
    assert not control & _ports(anyone)
    generator = " ".join(pod_templates(objects)["tiny-generator"]["spec"]["containers"][0]["command"])
    assert f"--port {p.generator} --metrics-port {p.generator_metrics}" in generator
    if algorithm == "ppo":
        critic_command = pod_templates(objects)["tiny-critic"]["spec"]["containers"][0]["command"]
        assert critic_command[critic_command.index("--metrics-port") + 1] == str(p.critic_metrics)
    # the chart's monitors scrape the ports named "metrics" (and no other)
    assert CHART_MONITORING.read_text().count("- port: metrics") == 2
    assert "port: control" not in CHART_MONITORING.read_text() and "port: http" not in CHART_MONITORING.read_text()


def test_an_external_redis_is_not_the_operators_port() -> None:
    run = run_of(changes={"kubernetes.external_redis_secret": "shared"})
    [policy] = [o for o in children(run) if o["kind"] == "NetworkPolicy"]
    assert _ports(policy["spec"]["ingress"][1]) == {run.config.ports.generator}


def test_the_operators_pod_passes_restricted() -> None:
    pod = operator_deployment()["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    chart = CHART_OPERATOR.read_text()
    for line in ("capabilities: {drop: [ALL]}", "seccompProfile: {type: RuntimeDefault}", "runAsNonRoot: true",
                 "allowPrivilegeEscalation: false", "runAsUser: 1000"):  # fmt: skip
        assert line in chart, line


@pytest.mark.parametrize("component", ["redis", "reward", "generator", "trainer"])
def test_host_network_is_the_only_exemption(component: str) -> None:
    """hostNetwork cannot pass restricted (nor baseline): that profile is for the single-node test cluster only,
    and keeps every other setting of restricted (R3-8: it had none)."""
    pod = pod_templates(children(run_of("host-network")))[f"tiny-{component}"]["spec"]
    assert pod["hostNetwork"] is True and pod["automountServiceAccountToken"] is False
    assert restricted_violations(pod) == ["hostNetwork set"]


@pytest.mark.parametrize("profile", ["standard", "host-network"])
def test_pods_bind_every_interface_explicitly(profile: str) -> None:
    """Services bind 127.0.0.1 unless told otherwise (issue #13, finding 4): a pod's must answer its Service."""
    templates = pod_templates(children(run_of(profile)))
    for component in ("reward", "generator", "trainer"):
        command = " ".join(templates[f"tiny-{component}"]["spec"]["containers"][0]["command"])
        assert "--host 0.0.0.0" in command, component
    generator = " ".join(templates["tiny-generator"]["spec"]["containers"][0]["command"])
    expected = "127.0.0.1:9001" if profile == "host-network" else "tiny-trainer-0.tiny-trainer.ns.svc:9001"
    assert f"--weights-url http://{expected}" in generator  # where the token may go: the run's trainer only
