"""The environment service on Kubernetes (issue #24): the objects the operator renders for a run with
environment.enabled. It runs model-written code, so its pod is locked down past the restricted Pod Security
Standard (read-only root, a size-limited scratch folder, limits by default, no service links) and a NetworkPolicy of
its own lets in the run's generators only and lets nothing out. Rendered objects only: tests/integration/
test_operator.py applies such a run to a real API server."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from test_pod_security import pod_templates, restricted_violations, run_of

from reinforce.core import launch
from reinforce.core.launch_flags import EnvironmentFlags
from reinforce.core.names import (
    CONTROL_TOKEN_ENV,
    CRITIC_TOKEN_ENV,
    ENVIRONMENT_TOKEN_ENV,
    K8S_COMPONENT_LABEL,
    REDIS_URL_ENV,
    WEIGHTS_TOKEN_ENV,
)
from reinforce.core.spec import CODE_TESTS_REWARD
from reinforce.operator.children import SPEC_FILE, OperatorConfig, Ports, Run, children, secrets_secret
from reinforce.operator.main import PodState, phase_of
from reinforce.operator.tenancy import refusals

ENABLED = {"environment.enabled": True}


def environment_run(profile: str = "standard", name: str = "tiny", **changes: Any) -> Run:
    return run_of(profile, name, changes={**ENABLED, **changes})


def by_kind_and_name(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def container(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return pod_templates(objects)[f"tiny-{component}"]["spec"]["containers"][0]


def secret_env(c: dict[str, Any]) -> dict[str, tuple[str, str]]:
    refs = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in c.get("env", [])}
    return {name: (ref["name"], ref["key"]) for name, ref in refs.items() if ref}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In/NotIn) against a pod's labels, as Kubernetes does."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        inside = labels.get(e["key"]) in e["values"]
        if (e["operator"] == "In") != inside:
            return False
    return True


def test_a_run_with_environment_gets_its_deployment_service_policy_and_token() -> None:
    objects = children(environment_run())
    found = by_kind_and_name(objects)
    assert {("Deployment", "tiny-environment"), ("Service", "tiny-environment"),
            ("NetworkPolicy", "tiny-environment-network")} <= set(found)  # fmt: skip
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    # created before the generators that call it
    assert names.index(("Deployment", "tiny-environment")) < names.index(("Deployment", "tiny-generator"))
    p = Ports()
    deployment = found[("Deployment", "tiny-environment")]["spec"]
    assert deployment["replicas"] == 1  # episodes live in the one pod's memory
    env = container(objects, "environment")
    assert env["image"] == "reinforce-environment:0.1.0"
    assert env["command"] == launch.ENVIRONMENT.command(
        "python", SPEC_FILE, EnvironmentFlags(port=p.environment, metrics_port=p.environment_metrics, host="0.0.0.0")
    )
    assert env["readinessProbe"]["httpGet"] == {"path": launch.ENVIRONMENT.ready_path, "port": p.environment}
    service = found[("Service", "tiny-environment")]["spec"]
    assert {port["name"]: port["port"] for port in service["ports"]} == {
        "http": p.environment,
        "metrics": p.environment_metrics,
    }
    assert service["selector"] == {"app.kubernetes.io/instance": "tiny", K8S_COMPONENT_LABEL: "environment"}
    # the token: in the run's Secret, held by the environment service and the generators and no one else
    token = secrets_secret(environment_run())["stringData"]["environment-token"]
    assert len(token) >= 32
    assert secret_env(env) == {ENVIRONMENT_TOKEN_ENV: ("tiny-secrets", "environment-token")}
    generator = container(objects, "generator")
    assert secret_env(generator)[ENVIRONMENT_TOKEN_ENV] == ("tiny-secrets", "environment-token")
    for other in ("reward", "trainer", "redis"):
        assert ENVIRONMENT_TOKEN_ENV not in secret_env(container(objects, other)), other
    command = generator["command"]
    assert command[command.index("--environment-url") + 1] == f"http://tiny-environment.ns.svc:{p.environment}"


def test_a_run_without_environment_has_none_of_it() -> None:
    objects = children(run_of())
    assert not any("environment" in o["metadata"]["name"] for o in objects)
    assert "--environment-url" not in container(objects, "generator")["command"]
    assert "environment-token" not in secrets_secret(run_of())["stringData"]
    [policy] = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert "matchExpressions" not in policy["spec"]["podSelector"]


@pytest.mark.parametrize("algorithm", ["reinforce", "ppo"])
def test_the_environment_pod_is_locked_down(algorithm: str) -> None:
    objects = children(run_of(algorithm=algorithm, changes=ENABLED))
    pod = pod_templates(objects)["tiny-environment"]["spec"]
    assert restricted_violations(pod) == []
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    pod_context = pod["securityContext"]
    assert pod_context["runAsNonRoot"] is True and pod_context["runAsGroup"] == 1000
    # a uid of the run's own, not the one every other run pod has (1000): RLIMIT_NPROC counts a uid's tasks node-wide
    assert 100_000 <= pod_context["runAsUser"] < 100_000 + 2**20
    other = children(replace(run_of(algorithm=algorithm, changes=ENABLED), uid="uid-2"))
    assert pod_templates(other)["tiny-environment"]["spec"]["securityContext"]["runAsUser"] != pod_context["runAsUser"]
    # the tool calls' System V shared memory ends with them (their IPC namespace is the pod's)
    assert pod_context["sysctls"] == [{"name": "kernel.shm_rmid_forced", "value": "1"}]
    [c] = pod["containers"]
    context = c["securityContext"]
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]} and context["runAsNonRoot"] is True
    # the only writable folder: a size-limited emptyDir at /tmp (tempfile's scratch folders)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["scratch"]["emptyDir"] == {"sizeLimit": "1Gi"}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/tmp"]["name"] == "scratch" and mounts["/etc/reinforce"]["readOnly"] is True
    assert set(mounts) == {"/tmp", "/etc/reinforce"}  # not the run's volume, nor any Secret's file
    # limits by default, from the spec's own: 4 concurrent calls of 512 MB address space, plus the service's 512 MiB
    assert c["resources"] == {
        "limits": {"cpu": "4", "memory": "2560Mi"},
        "requests": {"cpu": "100m", "memory": "256Mi"},
    }
    # the other components keep a writable root (caches, Triton's model repository)
    assert "readOnlyRootFilesystem" not in container(objects, "trainer")["securityContext"]


def test_the_runs_own_resources_and_scratch_size_win() -> None:
    run = environment_run(**{
        "environment.max_concurrent_calls": 2,
        "kubernetes.environment.limits": {"memory": "1Gi"},
        "kubernetes.environment.requests": {"cpu": "500m"},
        "kubernetes.environment_scratch_size": "256Mi",
    })  # fmt: skip
    pod = pod_templates(children(run))["tiny-environment"]["spec"]
    # memory: the run's limit, and no default request above it (Kubernetes requests the limit); cpu: 2 calls
    assert pod["containers"][0]["resources"] == {"limits": {"cpu": "2", "memory": "1Gi"}, "requests": {"cpu": "500m"}}
    assert {v["name"]: v for v in pod["volumes"]}["scratch"]["emptyDir"] == {"sizeLimit": "256Mi"}
    plain = environment_run(**{"environment.max_concurrent_calls": 1, "environment.memory_limit_mb": 256})
    resources = pod_templates(children(plain))["tiny-environment"]["spec"]["containers"][0]["resources"]
    assert resources["limits"] == {"cpu": "1", "memory": "768Mi"}


def test_a_sandboxing_runtime_comes_through_the_template_and_the_lockdown_does_not_bend() -> None:
    gvisor = {"kubernetes.environment.template": {"spec": {"runtimeClassName": "gvisor"}}}
    pod = pod_templates(children(environment_run(**gvisor)))["tiny-environment"]["spec"]
    assert pod["runtimeClassName"] == "gvisor" and pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"]
    writable = {"spec": {"containers": [{"name": "environment", "securityContext": {"readOnlyRootFilesystem": False}}]}}
    [refused] = refusals(environment_run(**{"kubernetes.environment.template": writable}))
    assert refused.startswith("spec.kubernetes.environment.template.spec.containers[0].securityContext: the operator's")
    token = {"spec": {"automountServiceAccountToken": True}}
    [refused] = refusals(environment_run(**{"kubernetes.environment.template": token}))
    assert "automountServiceAccountToken: no run pod mounts" in refused


def test_only_the_runs_generators_reach_the_environment_and_it_reaches_nothing() -> None:
    objects = children(environment_run())
    p = Ports()
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    mine, run_wide = policies["tiny-environment-network"], policies["tiny-network"]
    labels = {name.removeprefix("tiny-"): t["metadata"]["labels"] for name, t in pod_templates(objects).items()}
    # policies add up: the run-wide one (every own pod, every port) must not select the environment's pod
    assert not selects(run_wide["podSelector"], labels["environment"])
    assert all(selects(run_wide["podSelector"], labels[c]) for c in ("redis", "reward", "generator", "trainer"))
    assert selects(mine["podSelector"], labels["environment"])
    assert not any(selects(mine["podSelector"], labels[c]) for c in labels if c != "environment")
    assert mine["policyTypes"] == ["Ingress", "Egress"] and mine["egress"] == []  # no egress at all
    api, metrics = mine["ingress"]
    assert api["ports"] == [{"port": p.environment, "protocol": "TCP"}]
    [peer] = api["from"]
    assert set(peer) == {"podSelector"}  # the run's own namespace only
    assert selects(peer["podSelector"], labels["generator"])
    assert not any(selects(peer["podSelector"], labels[c]) for c in ("redis", "reward", "trainer", "environment"))
    other_generator = pod_templates(children(environment_run(name="other")))["other-generator"]["metadata"]["labels"]
    assert not selects(peer["podSelector"], other_generator)
    assert metrics == {"ports": [{"port": p.environment_metrics, "protocol": "TCP"}]}  # Prometheus, from anywhere
    named_metrics = [port for port in container(objects, "environment")["ports"] if port["name"] == "metrics"]
    assert named_metrics == [{"name": "metrics", "containerPort": p.environment_metrics, "protocol": "TCP"}]


def test_host_network_reaches_the_environment_on_the_node() -> None:
    objects = children(environment_run("host-network"))
    pod = pod_templates(objects)["tiny-environment"]["spec"]
    assert pod["hostNetwork"] is True and restricted_violations(pod) == ["hostNetwork set"]
    command = container(objects, "generator")["command"][2]  # sh -c "exec python -m reinforce.generator ..."
    assert f"--environment-url http://127.0.0.1:{Ports().environment}" in command


def test_default_ports_differ_so_host_network_pods_can_share_a_node() -> None:
    ports = list(Ports().model_dump().values())
    assert len(set(ports)) == len(ports)


def test_the_run_is_pending_until_its_environment_is_ready() -> None:
    spec = environment_run().spec

    def pods(environment_ready: bool) -> list[PodState]:
        ready = {"redis": True, "reward": True, "generator": True, "trainer": True, "environment": environment_ready}
        return [PodState(f"tiny-{c}-0", c, r, 0, "127.0.0.1") for c, r in ready.items()]

    phase, reason, message = phase_of(spec, pods(False), 0, False, False)
    assert (phase, reason) == ("Pending", "ComponentsNotReady") and "environment (1 ready pods needed)" in message
    assert phase_of(spec, pods(True), 0, False, False)[0] == "Running"


def test_each_pod_of_a_ppo_tools_run_holds_only_its_credentials() -> None:
    objects = children(run_of(algorithm="ppo", changes=ENABLED))
    held = {name.removeprefix("tiny-"): set(secret_env(t["spec"]["containers"][0])) for name, t in
            pod_templates(objects).items()}  # fmt: skip
    assert held["environment"] == {ENVIRONMENT_TOKEN_ENV}
    assert held["generator"] == {REDIS_URL_ENV, CONTROL_TOKEN_ENV, WEIGHTS_TOKEN_ENV, ENVIRONMENT_TOKEN_ENV}
    assert held["trainer"] == {REDIS_URL_ENV, WEIGHTS_TOKEN_ENV, CRITIC_TOKEN_ENV}
    assert held["critic"] == {CRITIC_TOKEN_ENV} and held["reward"] == set()
    assert OperatorConfig().configured_images() >= {"reinforce-environment:0.1.0"}


def test_a_code_tests_reward_server_holds_the_environment_token_and_reaches_the_environment() -> None:
    """reward.function code_tests runs tests in the environment: the reward pod gets its URL and token, and the
    environment's policy lets the run's reward pod in beside its generators; other runs' pods stay out."""
    code_tests = {"reward.type": "python", "reward.function": CODE_TESTS_REWARD}
    objects = children(environment_run(**code_tests))
    reward = container(objects, "reward")
    assert secret_env(reward) == {ENVIRONMENT_TOKEN_ENV: ("tiny-secrets", "environment-token")}
    url = reward["command"][reward["command"].index("--environment-url") + 1]
    generator = container(objects, "generator")["command"]
    assert url == generator[generator.index("--environment-url") + 1]  # the generators' URL of the environment
    policy = next(o["spec"] for o in objects if o["metadata"]["name"] == "tiny-environment-network")
    peers = policy["ingress"][0]["from"]
    labels = {name.removeprefix("tiny-"): t["metadata"]["labels"] for name, t in pod_templates(objects).items()}
    reaching = {c for c in labels if any(selects(peer["podSelector"], labels[c]) for peer in peers)}
    assert reaching == {"generator", "reward"}
    other = pod_templates(children(environment_run(name="other", **code_tests)))["other-reward"]["metadata"]["labels"]
    assert not any(selects(peer["podSelector"], other) for peer in peers)
    # without code_tests the reward pod holds no token and no URL (test above: held["reward"] == set())
    assert "--environment-url" not in container(children(environment_run()), "reward")["command"]
