"""What a run may ask of the cluster through the operator (operator configuration `tenancy`).

The operator creates pods with its own rights: a tenant allowed to create ReinforceRuns but not Pods must get no
more placement, resources, Secrets, host access or images through a run than the operator's configuration grants.
A run's own `kubernetes` settings are checked field by field, its shorthands and its pod templates alike (images
against `allowedImages`; a template also against the pod the operator builds: operator/podtemplate.py), and each
refusal names the field as `kubectl` shows it (`spec.kubernetes.trainer.tolerations[0].key: ...`); the operator's
`pods` defaults are the administrator's and are not checked. Nothing of a refused spec is applied (operator/main.py:
condition SpecAccepted, reason NotPermitted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kubernetes.utils import parse_quantity
from pydantic import Field, field_validator

from reinforce.core.names import COMPONENTS, K8S_INSTANCE_LABEL, K8S_NAME_LABEL
from reinforce.core.spec import _Section
from reinforce.operator.podtemplate import operator_layer_refusals, template_refusals
from reinforce.operator.resource import EXTERNAL_REDIS_LABEL, GPU_RESOURCE, PodSpec

if TYPE_CHECKING:
    from reinforce.operator.children import OperatorConfig, Run

# (field as kubectl names it, resource, quantity) of what a pod asks for
Asked = tuple[str, str, str]


class Tenancy(_Section):
    """What a run's own `kubernetes` settings may ask for; empty lists allow nothing."""

    toleration_keys: list[str] = Field(
        default_factory=list,
        description="Taint keys a run's pods may tolerate. A toleration without a key (every taint, the control "
        "plane's included) is never allowed.",
    )
    node_selectors: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Node labels a run's pods may select on, each with the values allowed, e.g. {pool: [gpu, cpu]}.",
    )
    max_resources: dict[str, str] = Field(
        default_factory=dict,
        description="Per-pod ceiling of each resource a run may request or limit, e.g. {cpu: '16', memory: 64Gi, "
        "nvidia.com/gpu: '8'} (gpus counts as nvidia.com/gpu); once one is set, a resource without one is refused. "
        "Empty: no ceiling (a namespace's ResourceQuota still applies).",
    )
    priority_classes: list[str] = Field(
        default_factory=list,
        description="PriorityClasses a run's pod templates may name (priorityClassName; a higher priority preempts "
        "other pods): empty allows none.",
    )
    host_network_namespaces: list[str] = Field(
        default_factory=list,
        description="profile host-network: the namespaces whose runs it may lay out on the node's network "
        "(their pods share the node's network namespace); a run elsewhere is refused.",
    )

    @field_validator("max_resources")
    @classmethod
    def _quantities(cls, ceilings: dict[str, str]) -> dict[str, str]:
        for resource, value in ceilings.items():
            _quantity(value, f"maxResources.{resource}")
        return ceilings


def _quantity(value: str, where: str) -> object:
    try:
        return parse_quantity(value)
    except ValueError:
        raise ValueError(f"{where}: {value!r} is not a Kubernetes quantity (e.g. 500m, 2, 8Gi)") from None


def refusals(run: Run) -> list[str]:
    """Every setting of the run that the operator's tenancy configuration does not allow (empty: none)."""
    tenancy = run.config.tenancy
    found = []
    for component in COMPONENTS:
        settings: PodSpec = getattr(run.spec.kubernetes, component)
        where = f"spec.kubernetes.{component}"
        found += _toleration_refusals([t.key for t in settings.tolerations], where, tenancy)
        found += _node_selector_refusals(settings.node_selector, where, tenancy)
        found += _resource_refusals(_shorthand_resources(settings, where), tenancy)
        found += _image_refusals(settings.image, f"{where}.image", run.config)
    found += _template_refusals(run)
    if run.host_network and run.namespace not in tenancy.host_network_namespaces:
        found.append(
            f"namespace {run.namespace}: this operator lays runs out on the node's network (profile host-network), "
            f"which tenancy.hostNetworkNamespaces {tenancy.host_network_namespaces} does not allow here"
        )
    return found


def _template_refusals(run: Run) -> list[str]:
    """A run's pod templates: what would break the run's guarantees, then what the tenancy does not allow."""
    from reinforce.operator.children import base_pod_templates  # children builds pods with this module's Tenancy

    found = []
    for component, base in base_pod_templates(run).items():
        template = getattr(run.spec.kubernetes, component).template
        if template is None:
            continue
        where = f"spec.kubernetes.{component}.template"
        found += template_refusals(base, template, where)
        found += operator_layer_refusals(run.config.pods.get(component, PodSpec()).template, template, where)
        found += _template_tenancy_refusals(template.get("spec", {}), f"{where}.spec", run.config)
    return found


def claim_refusals(run: Run, labels_of: Callable[[str], dict[str, str] | None]) -> list[str]:
    """Template volumes that mount a run's PersistentVolumeClaim (another run's, or this run's own in a pod the
    operator does not give it to): its checkpoints, weights and samples are the operator's to mount.
    `labels_of(claim name)`: the claim's labels, None where there is no such claim."""
    found = []
    for component in COMPONENTS:
        template = getattr(run.spec.kubernetes, component).template or {}
        for i, volume in enumerate(template.get("spec", {}).get("volumes", [])):
            name = volume.get("persistentVolumeClaim", {}).get("claimName")
            labels = labels_of(name) if name else None
            if labels is not None and labels.get(K8S_NAME_LABEL) == "reinforce":
                owner = labels.get(K8S_INSTANCE_LABEL, "?")
                found.append(
                    f"spec.kubernetes.{component}.template.spec.volumes[{i}].persistentVolumeClaim.claimName: "
                    f"{name!r} is run {owner}'s claim: the operator mounts a run's claims where the run needs them"
                )
    return found


def _template_tenancy_refusals(spec: dict[str, Any], where: str, config: OperatorConfig) -> list[str]:
    tenancy = config.tenancy
    found = _toleration_refusals([t.get("key") for t in spec.get("tolerations", [])], where, tenancy)
    found += _node_selector_refusals(spec.get("nodeSelector", {}), where, tenancy)
    found += _node_affinity_refusals(spec.get("affinity", {}).get("nodeAffinity", {}), f"{where}.affinity", tenancy)
    found += _resource_refusals(_template_resources(spec, where), tenancy)
    found += _device_claim_refusals(spec, where, tenancy)
    for i, container in enumerate(spec.get("containers", [])):
        found += _image_refusals(container.get("image"), f"{where}.containers[{i}].image", config)
    priority = spec.get("priorityClassName")
    if priority is not None and priority not in tenancy.priority_classes:
        found.append(
            f"{where}.priorityClassName: {priority!r} is not in tenancy.priorityClasses {tenancy.priority_classes}"
        )
    return found


def _toleration_refusals(keys: list[str | None], where: str, tenancy: Tenancy) -> list[str]:
    found = []
    for i, key in enumerate(keys):
        if not key:
            found.append(f"{where}.tolerations[{i}]: no key, so it tolerates every taint; name one")
        elif key not in tenancy.toleration_keys:
            found.append(
                f"{where}.tolerations[{i}].key: {key!r} is not in tenancy.tolerationKeys {tenancy.toleration_keys}"
            )
    return found


def _node_selector_refusals(selector: dict[str, str], where: str, tenancy: Tenancy) -> list[str]:
    return [
        f"{where}.nodeSelector.{label}: {value!r} is not allowed by tenancy.nodeSelectors "
        f"({label}: {tenancy.node_selectors.get(label, [])})"
        for label, value in selector.items()
        if value not in tenancy.node_selectors.get(label, [])
    ]


def _node_affinity_refusals(affinity: dict[str, Any], where: str, tenancy: Tenancy) -> list[str]:
    """Node affinity selects nodes as a node selector does, under the same rule: `In` a label of
    tenancy.nodeSelectors with values it allows (`Exists`, `NotIn`, `DoesNotExist` of such a label narrow no
    further than no selector); node names (matchFields) and `Gt`/`Lt` never."""
    required = "nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    preferred = "nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution"
    terms = [
        (f"{where}.{required}.nodeSelectorTerms[{i}]", term)
        for i, term in enumerate(affinity.get(required.split(".")[1], {}).get("nodeSelectorTerms", []))
    ]
    terms += [
        (f"{where}.{preferred}[{i}].preference", weighted.get("preference", {}))
        for i, weighted in enumerate(affinity.get(preferred.split(".")[1], []))
    ]
    found = []
    for path, term in terms:
        if term.get("matchFields"):
            found.append(f"{path}.matchFields: a run's pods may not pick nodes by name")
        for j, expression in enumerate(term.get("matchExpressions", [])):
            label, operator = expression["key"], expression["operator"]
            allowed = tenancy.node_selectors.get(label, [])
            rule = f"tenancy.nodeSelectors ({label}: {allowed})"
            refused = sorted(set(expression.get("values", [])) - set(allowed)) if operator == "In" else []
            if label not in tenancy.node_selectors or operator in ("Gt", "Lt"):
                found.append(f"{path}.matchExpressions[{j}]: {label} {operator} is not allowed by {rule}")
            elif refused:
                found.append(f"{path}.matchExpressions[{j}].values: {refused} are not allowed by {rule}")
    return found


def _shorthand_resources(settings: PodSpec, where: str) -> list[Asked]:
    asked = [
        (f"{where}.{kind}.{r}", r, v) for kind in ("requests", "limits") for r, v in getattr(settings, kind).items()
    ]
    if settings.gpus:
        asked.append((f"{where}.gpus", GPU_RESOURCE, str(settings.gpus)))
    return asked


def _template_resources(spec: dict[str, Any], where: str) -> Iterator[Asked]:
    """The resources a template asks for: its containers' and (Kubernetes 1.32 on) the pod's own."""
    owners = [
        (f"{where}.containers[{i}].resources", c.get("resources", {})) for i, c in enumerate(spec.get("containers", []))
    ]
    owners.append((f"{where}.resources", spec.get("resources", {})))
    for field, resources in owners:
        for kind in ("requests", "limits"):
            for resource, value in resources.get(kind, {}).items():
                yield f"{field}.{kind}.{resource}", resource, value


def _device_claim_refusals(spec: dict[str, Any], where: str, tenancy: Tenancy) -> list[str]:
    """Devices claimed through dynamic resource allocation are counted by no quantity that tenancy.maxResources
    bounds: where it bounds any, a template claims none."""
    if not tenancy.max_resources:
        return []
    claims = [f"{where}.resourceClaims"] if spec.get("resourceClaims") else []
    claims += [
        f"{where}.containers[{i}].resources.claims"
        for i, container in enumerate(spec.get("containers", []))
        if (container.get("resources") or {}).get("claims")
    ]
    return [f"{claim}: devices claimed here are beyond what tenancy.maxResources can bound" for claim in claims]


def _resource_refusals(asked: list[Asked] | Iterator[Asked], tenancy: Tenancy) -> list[str]:
    ceilings = tenancy.max_resources
    if not ceilings:
        return []
    found = []
    for field, resource, value in asked:
        if resource not in ceilings:
            found.append(f"{field}: tenancy.maxResources sets no ceiling for {resource}, so a run may not ask for it")
            continue
        try:
            above = _quantity(value, field) > _quantity(ceilings[resource], resource)
        except ValueError as err:
            found.append(str(err))
            continue
        if above:
            found.append(f"{field}: {value} is above tenancy.maxResources.{resource} {ceilings[resource]}")
    return found


def _image_refusals(image: str | None, field: str, config: OperatorConfig) -> list[str]:
    if image is None:
        return []
    if config.allowed_images is None:
        configured = sorted(config.configured_images())
        if image in configured:
            return []
        return [f"{field}: {image!r} is none of the operator's images {configured} (allowedImages is unset)"]
    if any(image.startswith(prefix) for prefix in config.allowed_images):
        return []
    return [f"{field}: {image!r} starts with none of allowedImages {config.allowed_images}"]


def redis_secret_refusal(name: str, namespace: str, labels: dict[str, str] | None) -> str | None:
    """Why a run may not use Secret `name` as its external Redis (None: it may). labels None: no such Secret.

    A Secret's `url` goes into every pod of the run (and the operator connects to it): only Secrets whose owner
    labelled them for that purpose qualify, not any Secret a tenant can name."""
    field = "spec.kubernetes.externalRedisSecret"
    if labels is None:
        return f"{field}: there is no Secret {name} in namespace {namespace}"
    if labels.get(EXTERNAL_REDIS_LABEL) != "true":
        return f"{field}: Secret {name} is not labelled {EXTERNAL_REDIS_LABEL}=true (its owner's consent)"
    return None
