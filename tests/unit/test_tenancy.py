"""A tenant who may create ReinforceRuns but not Pods gets no more through the operator than its `tenancy`
configuration allows (R3-8): each refused setting is named by its field. Rendered objects only: no cluster."""

from __future__ import annotations

from typing import Any

import pytest
from k8s import example_run

from reinforce.operator.children import OperatorConfig, Run
from reinforce.operator.resource import EXTERNAL_REDIS_LABEL, ReinforceRunSpec
from reinforce.operator.tenancy import redis_secret_refusal, refusals

TENANCY = {
    "tolerationKeys": ["gpu"],
    "nodeSelectors": {"pool": ["gpu", "cpu"]},
    "maxResources": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "2"},
}
CONTROL_PLANE = "node-role.kubernetes.io/control-plane"
HOSTILE = {
    "generator": {"tolerations": [{"operator": "Exists"}]},
    "redis": {"tolerations": [{"key": CONTROL_PLANE, "operator": "Exists", "effect": "NoSchedule"}]},
    "trainer": {
        "nodeSelector": {CONTROL_PLANE: ""},
        "requests": {"cpu": "1000", "memory": "16Gi"},
        "limits": {"memory": "1Ti"},
        "gpus": 64,
    },
    "reward": {"requests": {"hugepages-1Gi": "1Gi"}},
    "critic": {"nodeSelector": {"pool": "control"}},
}


def run_of(kubernetes: dict[str, Any], tenancy: dict[str, Any], profile: str = "standard", ns: str = "team") -> Run:
    spec = ReinforceRunSpec.model_validate({**example_run()["spec"], "name": "tiny", "kubernetes": kubernetes})
    config = OperatorConfig.model_validate({"profile": profile, "tenancy": tenancy})
    return Run("tiny", ns, "uid-1", spec, config)


def test_a_hostile_runs_settings_are_refused_by_field_name() -> None:
    found = refusals(run_of(HOSTILE, TENANCY))
    fields = [message.split(": ", 1)[0] for message in found]
    assert fields == [
        "spec.kubernetes.redis.tolerations[0].key",
        "spec.kubernetes.reward.requests.hugepages-1Gi",
        "spec.kubernetes.generator.tolerations[0]",
        f"spec.kubernetes.trainer.nodeSelector.{CONTROL_PLANE}",
        "spec.kubernetes.trainer.requests.cpu",
        "spec.kubernetes.trainer.limits.memory",
        "spec.kubernetes.trainer.gpus",
        "spec.kubernetes.critic.nodeSelector.pool",
    ], found
    assert "tolerates every taint" in found[2]
    assert found[4].endswith("1000 is above tenancy.maxResources.cpu 8")
    assert found[6].endswith("64 is above tenancy.maxResources.nvidia.com/gpu 2")


def test_what_the_tenancy_allows_is_accepted() -> None:
    allowed = {
        "generator": {"tolerations": [{"key": "gpu", "operator": "Exists"}], "nodeSelector": {"pool": "gpu"}},
        "trainer": {"requests": {"cpu": "8", "memory": "16Gi"}, "limits": {"memory": "32Gi"}, "gpus": 2},
    }
    assert refusals(run_of(allowed, TENANCY)) == []
    assert refusals(run_of({}, {})) == []  # a run that asks for nothing special needs no configuration


def test_by_default_no_placement_is_allowed_and_resources_are_not_capped() -> None:
    found = refusals(run_of(HOSTILE, {}))
    assert [m.split(": ", 1)[0] for m in found] == [
        "spec.kubernetes.redis.tolerations[0].key",
        "spec.kubernetes.generator.tolerations[0]",
        f"spec.kubernetes.trainer.nodeSelector.{CONTROL_PLANE}",
        "spec.kubernetes.critic.nodeSelector.pool",
    ]


def test_a_quantity_that_is_not_one_is_refused_naming_it() -> None:
    [found] = refusals(run_of({"trainer": {"requests": {"cpu": "lots"}}}, TENANCY))
    assert found.startswith("spec.kubernetes.trainer.requests.cpu: 'lots' is not a Kubernetes quantity")
    with pytest.raises(ValueError, match=r"maxResources\.memory: 'big' is not a Kubernetes quantity"):
        OperatorConfig.model_validate({"tenancy": {"maxResources": {"memory": "big"}}})


def test_the_host_network_profile_only_for_the_namespaces_named() -> None:
    [found] = refusals(run_of({}, {}, profile="host-network", ns="team"))
    assert found.startswith("namespace team: ") and "tenancy.hostNetworkNamespaces" in found
    assert refusals(run_of({}, {"hostNetworkNamespaces": ["team"]}, profile="host-network", ns="team")) == []


def test_an_external_redis_secret_must_consent() -> None:
    field = "spec.kubernetes.externalRedisSecret: "
    assert redis_secret_refusal("db", "team", None) == f"{field}there is no Secret db in namespace team"
    refused = redis_secret_refusal("db", "team", {"app": "billing"})
    assert refused == f"{field}Secret db is not labelled {EXTERNAL_REDIS_LABEL}=true (its owner's consent)"
    assert redis_secret_refusal("db", "team", {EXTERNAL_REDIS_LABEL: "false"}) is not None
    assert redis_secret_refusal("db", "team", {EXTERNAL_REDIS_LABEL: "true"}) is None


@pytest.mark.parametrize(
    ("allowed", "image", "refusal"),
    [
        (None, "reinforce-trainer:0.1.0", None),  # the operator's own image
        (None, "mine:1", "'mine:1' is none of the operator's images ["),
        (["registry.example/reinforce-"], "registry.example/reinforce-trainer:0.2", None),
        (["registry.example/reinforce-"], "registry.example/other:1", "starts with none of allowedImages"),
    ],
)
def test_a_runs_image_must_be_allowed(allowed: list[str] | None, image: str, refusal: str | None) -> None:
    """Issue 25: a tenant who may create runs but not Pods would otherwise run any image with the operator's rights."""
    config = OperatorConfig.model_validate({"allowedImages": allowed, "pods": {"reward": {"image": "r:2"}}})
    spec = ReinforceRunSpec.model_validate({**example_run()["spec"], "name": "tiny"})
    spec = ReinforceRunSpec.model_validate({**spec.model_dump(), "kubernetes": {"trainer": {"image": image}}})
    found = refusals(Run("tiny", "team", "uid-1", spec, config))
    if refusal is None:
        assert found == []
    else:
        (message,) = found
        assert message.startswith("spec.kubernetes.trainer.image: ") and refusal in message, message
    assert "r:2" in config.configured_images()  # the operator's pod defaults count as configured


# Issue 25: a pod template asks for placement, resources, images and priority as the shorthands do, under the same rules
HOSTILE_TEMPLATE = {
    "spec": {
        "tolerations": [{"operator": "Exists"}, {"key": CONTROL_PLANE, "operator": "Exists"}],
        "nodeSelector": {CONTROL_PLANE: ""},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["control-plane-0"]}]},
                        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu", "control"]}]},
                    ]
                },
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 1, "preference": {"matchExpressions": [{"key": CONTROL_PLANE, "operator": "Exists"}]}}
                ],
            }
        },
        "priorityClassName": "system-node-critical",
        "containers": [{"name": "trainer", "image": "attacker/miner:1", "resources": {"limits": {"cpu": 1000}}}],
    }
}


def test_a_templates_placement_resources_image_and_priority_are_checked_by_field_name() -> None:
    found = refusals(run_of({"trainer": {"template": HOSTILE_TEMPLATE}}, TENANCY))
    where = "spec.kubernetes.trainer.template.spec"
    required = f"{where}.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
    preferred = f"{where}.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference"
    assert [message.split(": ", 1)[0] for message in found] == [
        f"{where}.tolerations[0]",
        f"{where}.tolerations[1].key",
        f"{where}.nodeSelector.{CONTROL_PLANE}",
        f"{required}[0].matchFields",
        f"{required}[1].matchExpressions[0].values",
        f"{preferred}.matchExpressions[0]",
        f"{where}.containers[0].resources.limits.cpu",
        f"{where}.containers[0].image",
        f"{where}.priorityClassName",
    ], found
    assert "['control'] are not allowed by tenancy.nodeSelectors (pool: ['gpu', 'cpu'])" in found[4]
    assert found[6].endswith("1000 is above tenancy.maxResources.cpu 8")
    assert "'system-node-critical' is not in tenancy.priorityClasses []" in found[8]


def test_what_the_tenancy_allows_is_accepted_from_a_template_too() -> None:
    allowed = {
        "spec": {
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 60}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}
                        ]
                    }
                }
            },
            "priorityClassName": "training",
            "containers": [{"name": "generator", "resources": {"requests": {"cpu": 8, "nvidia.com/gpu": 1}}}],
        }
    }
    assert refusals(run_of({"generator": {"template": allowed}}, {**TENANCY, "priorityClasses": ["training"]})) == []


def test_devices_claimed_by_dynamic_resource_allocation_are_refused_where_resources_are_bounded() -> None:
    """R4-8: a DRA claim asks for devices no quantity of tenancy.maxResources counts, so where it bounds any a
    template claims none; an operator that bounds nothing lets them through."""
    template = {
        "spec": {
            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "eight-gpus"}],
            "containers": [{"name": "trainer", "resources": {"claims": [{"name": "gpus"}]}}],
        }
    }
    found = refusals(run_of({"trainer": {"template": template}}, TENANCY))
    where = "spec.kubernetes.trainer.template.spec"
    assert found == [
        f"{where}.resourceClaims: devices claimed here are beyond what tenancy.maxResources can bound",
        f"{where}.containers[0].resources.claims: devices claimed here are beyond what tenancy.maxResources can bound",
    ]
    assert refusals(run_of({"trainer": {"template": template}}, {})) == []
