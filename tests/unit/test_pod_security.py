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
from reinforce.core.spec import SpecError
from reinforce.operator.children import OperatorConfig, Run, children
from reinforce.operator.podtemplate import strategic_merge
from reinforce.operator.resource import ReinforceRunSpec, parse_run_resource
from reinforce.operator.tenancy import refusals

CHART_TEMPLATES = Path(__file__).resolve().parents[2] / "charts" / "reinforce" / "templates"
CHART_OPERATOR = CHART_TEMPLATES / "operator.yaml"
CHART_MONITORING = CHART_TEMPLATES / "monitoring.yaml"
# https://kubernetes.io/docs/concepts/security/pod-security-standards/ (restricted, v1.20 onwards)
RESTRICTED_VOLUME_TYPES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip
# the baseline profile's "safe" sysctls (restricted includes baseline)
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range",
}  # fmt: skip


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What in a pod spec breaks the restricted profile (empty: it passes)."""
    found = [f"{key} set" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            found.append(f"volume {volume['name']}: {kinds - RESTRICTED_VOLUME_TYPES}")
    pod_context = pod.get("securityContext", {})
    found += [f"sysctl {s['name']}" for s in pod_context.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS]
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
    own, operator, anyone, keda = policy["spec"]["ingress"]
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
    # R4-10: KEDA's redis-streams scaler reaches Redis from KEDA's namespace, and nothing else; null keeps it out
    assert keda == {
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}}],
        "ports": [{"port": p.redis, "protocol": "TCP"}],
    }
    closed = children(run_of(algorithm=algorithm, config={"operatorNamespace": "ops", "kedaNamespace": None}))
    [policy] = [o for o in closed if o["kind"] == "NetworkPolicy"]
    assert policy["spec"]["ingress"] == [own, operator, anyone]
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


# ---- pod template overrides (issue 25): kubernetes.<component>.template -------------------------------------------
# What a platform engineer pastes from a Pod manifest of a GPU node pool (quantities as numbers, as manifests have)
PASTED = {
    "metadata": {
        "labels": {"team": "vision"},
        "annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
    },
    "spec": {
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}]
                }
            }
        },
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
        ],
        "priorityClassName": "training",
        "imagePullSecrets": [{"name": "registry"}],
        "runtimeClassName": "nvidia",
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
        "containers": [
            {
                "name": "trainer",
                "resources": {"requests": {"cpu": 4, "memory": "16Gi"}, "limits": {"memory": "32Gi"}},
                "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
                "envFrom": [{"secretRef": {"name": "wandb"}}],
                "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
            }
        ],
    },
}


def test_a_template_pasted_from_a_pod_manifest_is_merged_over_the_operators_pod() -> None:
    run = run_of(changes={"kubernetes.trainer.template": PASTED, "kubernetes.trainer.gpus": 1})
    pod = pod_templates(children(run))["tiny-trainer"]
    plain = pod_templates(children(run_of(changes={"kubernetes.trainer.gpus": 1})))["tiny-trainer"]
    spec, pasted = pod["spec"], PASTED["spec"]
    for field in ("tolerations", "affinity", "topologySpreadConstraints", "priorityClassName", "imagePullSecrets",
                  "runtimeClassName"):  # fmt: skip
        assert spec[field] == pasted[field], field
    assert pod["metadata"]["labels"] == {**plain["metadata"]["labels"], "team": "vision"}
    assert pod["metadata"]["annotations"] == PASTED["metadata"]["annotations"]
    assert spec["volumes"] == [*plain["spec"]["volumes"], pasted["volumes"][0]]  # merged by name
    [container], [before] = spec["containers"], plain["spec"]["containers"]
    # the gpus shorthand and the template's resources merge; quantities become the strings Kubernetes returns
    assert container["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"},
                                      "limits": {"nvidia.com/gpu": "1", "memory": "32Gi"}}  # fmt: skip
    assert container["env"] == [*before["env"], pasted["containers"][0]["env"][0]]
    assert container["envFrom"] == [{"secretRef": {"name": "wandb"}}]
    assert container["volumeMounts"] == [*before["volumeMounts"], {"name": "shm", "mountPath": "/dev/shm"}]
    # what the run's guarantees rest on is as the operator built it
    for field in ("command", "ports", "securityContext", "image", "readinessProbe"):
        assert container[field] == before[field], field
    assert spec["securityContext"] == plain["spec"]["securityContext"] and spec["automountServiceAccountToken"] is False
    assert restricted_violations(spec) == []
    assert pod_templates(children(run))["tiny-generator"] == pod_templates(children(run_of()))["tiny-generator"]


def test_the_operators_template_comes_first_and_the_runs_wins() -> None:
    """Both are strategic merges as `kubectl patch` does them: maps and keyed lists merge, other lists are replaced,
    and null removes a field."""
    config = {
        "pods": {
            "generator": {
                "template": {
                    "spec": {
                        "priorityClassName": "batch",
                        "nodeSelector": {"a": "1"},
                        "tolerations": [{"key": "spot", "operator": "Exists"}],
                    }
                }
            }
        }
    }
    changes = {
        "kubernetes.generator.template": {
            "spec": {
                "nodeSelector": {"b": "2"},
                "priorityClassName": None,
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
            }
        }
    }
    spec = pod_templates(children(run_of(config=config, changes=changes)))["tiny-generator"]["spec"]
    assert spec["nodeSelector"] == {"a": "1", "b": "2"} and "priorityClassName" not in spec
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}]


def test_strategic_merge_merges_keyed_lists_by_their_key() -> None:
    base = {"spec": {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["-v"]}]}}
    patch = {"spec": {"containers": [{"name": "a", "env": [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}],
                                      "args": ["-q"]}, {"name": "b"}]}}  # fmt: skip
    merged = strategic_merge(base, patch)
    assert merged == {"spec": {"containers": [
        {"name": "a", "env": [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}], "args": ["-q"]},
        {"name": "b"},
    ]}}  # fmt: skip
    assert base["spec"]["containers"][0]["env"] == [{"name": "X", "value": "1"}]  # neither input changes


TEMPLATE = "spec.kubernetes.trainer.template"


@pytest.mark.parametrize(
    ("template", "refusal"),
    [
        ({"spec": {"securityContext": {"runAsUser": 0}}}, "spec.securityContext: the restricted security context"),
        ({"spec": {"automountServiceAccountToken": True}}, "spec.automountServiceAccountToken: no run pod mounts"),
        ({"spec": {"serviceAccountName": "admin"}}, "spec.serviceAccountName: no run pod runs as a service account"),
        ({"spec": {"hostNetwork": True}}, "spec.hostNetwork: the node's network is the operator's profile"),
        ({"spec": {"hostPID": True}}, "spec.hostPID: a run pod shares no namespace of the node"),
        ({"spec": {"nodeName": "control-plane-0"}}, "spec.nodeName: it bypasses the scheduler"),
        ({"spec": {"initContainers": [{"name": "x", "image": "busybox"}]}}, "spec.initContainers: only the run's own"),
        ({"spec": {"containers": [{"name": "miner"}]}}, "spec.containers[0].name: 'miner' is none of"),
        ({"spec": {"containers": [{"name": "trainer", "securityContext": {"privileged": True}}]}},
         "spec.containers[0].securityContext: the operator's"),
        ({"spec": {"containers": [{"name": "trainer", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}},
         "spec.containers[0].securityContext: the operator's"),
        ({"spec": {"containers": [{"name": "trainer", "ports": [{"containerPort": 22}]}]}},
         "spec.containers[0].ports: the operator's"),
        ({"spec": {"containers": [{"name": "trainer", "command": ["sh"]}]}},
         "spec.containers[0].command: the operator's"),
        ({"spec": {"volumes": [{"name": "data", "emptyDir": {}}]}}, "spec.volumes[0].name: 'data' is the run's own"),
        ({"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}},
         "spec.volumes[0]: hostPath is no volume a template may add (the restricted Pod Security Standard's"),
        ({"spec": {"volumes": [{"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}]}},
         "spec.volumes[0].projected: no run pod mounts a service account token"),
        ({"spec": {"containers": [{"name": "trainer", "volumeMounts": [{"name": "x", "mountPath": "/data"}]}]}},
         "spec.containers[0].volumeMounts[0].mountPath: /data is where the run's own volume is mounted"),
        ({"spec": {"containers": [{"name": "trainer", "env": [{"name": "REINFORCE_REDIS_URL", "value": "redis://x"}]}]}},
         "spec.containers[0].env[0].name: 'REINFORCE_REDIS_URL' is the run's own setting"),
        ({"metadata": {"labels": {K8S_INSTANCE_LABEL: "other"}}},
         f"metadata.labels.{K8S_INSTANCE_LABEL}: the run's own"),
        ({"metadata": {"name": "x"}}, "metadata.name: a template sets only labels and annotations"),
        # the red team's R4-8
        ({"spec": {"schedulerName": "mine"}}, "spec.schedulerName: another scheduler would place the pod"),
        ({"spec": {"hostAliases": [{"ip": "10.0.0.9", "hostnames": ["tiny-redis"]}]}},
         "spec.hostAliases: it rewrites the pod's /etc/hosts"),
        ({"spec": {"shareProcessNamespace": True}}, "spec.shareProcessNamespace: the run's containers do not see"),
        ({"metadata": {"annotations": {"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}}},
         "metadata.annotations.container.apparmor.security.beta.kubernetes.io/trainer: the containers' confinement"),
        ({"spec": {"containers": [{"name": "trainer", "env": [{"name": "LD_PRELOAD", "value": "/tmp/x.so"}]}]}},
         "spec.containers[0].env[0].name: 'LD_PRELOAD' would load other code into the service"),
        ({"spec": {"volumes": [{"name": "v", "csi": {"driver": "hostpath.csi.k8s.io"}}]}},
         "spec.volumes[0]: csi is no volume a template may add (the restricted Pod Security Standard's, less inline"),
    ],
)  # fmt: skip
def test_what_would_break_the_runs_guarantees_is_refused_by_name(template: dict[str, Any], refusal: str) -> None:
    [found] = refusals(run_of(changes={"kubernetes.trainer.template": template}))
    assert found.startswith(f"{TEMPLATE}.{refusal}"), found


def test_a_template_that_is_no_pod_template_is_refused_naming_the_field() -> None:
    bad = {"spec": {"tolerations": [{"key": "gpu", "tolerationSecond": 5}], "priorityClassName": 7}}
    with pytest.raises(SpecError) as raised:
        parse_run_resource("tiny", example_run(**{"kubernetes.trainer.template": bad})["spec"])
    message = str(raised.value)
    assert f"{TEMPLATE}: Value error, not a PodTemplateSpec: " in message
    assert "spec.tolerations[0].tolerationSecond: Extra inputs are not permitted" in message
    assert "spec.priorityClassName: Input should be a valid string" in message


def test_a_runtime_the_operator_chose_stays_and_one_it_did_not_may_be_added() -> None:
    """R4-8: the administrator's gVisor for the pods that run model code cannot be removed (null) or replaced by a
    run's template; where the operator sets no runtime class, a run may choose one (docs/environments.md)."""
    gvisor = {"pods": {"trainer": {"template": {"spec": {"runtimeClassName": "gvisor"}}}}}

    def asking(runtime: str | None, config: dict | None = None) -> list[str]:
        template = {"spec": {"runtimeClassName": runtime}}
        return refusals(run_of(config=config or {}, changes={"kubernetes.trainer.template": template}))

    why = "the runtime the operator's pods run in is the operator's ('gvisor')"
    assert asking(None, gvisor) == asking("runc", gvisor) == [f"{TEMPLATE}.spec.runtimeClassName: {why}"]
    assert asking("gvisor", gvisor) == asking("gvisor") == []
