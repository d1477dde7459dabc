"""Pod template overrides: `kubernetes.<component>.template`, a PodTemplateSpec fragment in Kubernetes' own schema.

A template is validated with the kubernetes client's own PodTemplateSpec model (its field names, types and unknown
fields; a fragment need not name the pod's containers), strategic-merged over the pod the operator builds
(children.py) as `kubectl patch` merges it (lists of containers, volumes, env, ... by their merge key; other lists
replaced; maps merged; null removes), and refused by field name where it would change what the run's guarantees
rest on (`template_refusals`): the restricted security context, no service account token, the node's namespaces,
the run's own containers, volumes, mounts, environment, ports and labels. What a tenant may ask through it
(tolerations, node selection, resources, images, priority) is operator/tenancy.py's.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client import V1PodTemplateSpec
from pydantic import ValidationError

# Strategic merge's list keys in a pod template (the patchMergeKey tags of Kubernetes' core/v1 types); a list not
# named here is replaced whole, as `kubectl patch` does (tolerations, envFrom, args, ...).
MERGE_KEYS = {
    ("spec", "containers"): "name",
    ("spec", "initContainers"): "name",
    ("spec", "volumes"): "name",
    ("spec", "imagePullSecrets"): "name",
    ("spec", "hostAliases"): "ip",
    ("spec", "topologySpreadConstraints"): "topologyKey",
    ("spec", "containers", "env"): "name",
    ("spec", "containers", "volumeMounts"): "mountPath",
    ("spec", "containers", "volumeDevices"): "devicePath",
    ("spec", "containers", "ports"): "containerPort",
}
# Pod fields a template may not set, with why: each is part of what the run guarantees (docs/kubernetes/security.md).
POD_FIELDS_OF_THE_RUN = {
    "securityContext": "the restricted security context is the operator's",
    "automountServiceAccountToken": "no run pod mounts a service account token",
    "serviceAccountName": "no run pod runs as a service account of its choosing (nor mounts its token)",
    "serviceAccount": "no run pod runs as a service account of its choosing (nor mounts its token)",
    "hostNetwork": "the node's network is the operator's profile (host-network) to choose",
    "hostPID": "a run pod shares no namespace of the node",
    "hostIPC": "a run pod shares no namespace of the node",
    "hostUsers": "a run pod shares no namespace of the node",
    "nodeName": "it bypasses the scheduler and tenancy.nodeSelectors",
    "initContainers": "only the run's own containers run in its pods",
    "ephemeralContainers": "only the run's own containers run in its pods",
    "schedulerName": "another scheduler would place the pod without tenancy.nodeSelectors' say",
    "hostAliases": "it rewrites the pod's /etc/hosts: the run's Services would answer at other addresses",
    "shareProcessNamespace": "the run's containers do not see each other's processes",
}
# Pod fields a template may add but not change or remove where the operator's own pod (its `pods` defaults
# included) sets them: a sandboxing runtime (gVisor) chosen by the administrator stays.
POD_FIELDS_OF_THE_OPERATOR = {"runtimeClassName": "the runtime the operator's pods run in is the operator's"}
# Annotations that choose a container's confinement: the operator's (AppArmor's, seccomp's before securityContext).
CONFINEMENT_ANNOTATIONS = ("container.apparmor.security.beta.kubernetes.io/", "seccomp.security.alpha.kubernetes.io/")
# Variables the dynamic loader and Python read before the service's code runs: they would run other code in it.
LOADER_VARIABLES = ("LD_", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE")
# What a template may set on the run's container; the rest (command, args, ports, probes, securityContext with
# privileged and capabilities, lifecycle hooks, ...) is how the operator runs the service.
CONTAINER_FIELDS = ("name", "image", "imagePullPolicy", "resources", "env", "envFrom", "volumeMounts")
# The volume kinds a template may add: those the restricted Pod Security Standard allows (no hostPath, no node-level
# plugins), less inline `csi`, an ephemeral volume of whatever driver the node has with whatever attributes the run
# writes
TEMPLATE_VOLUME_KINDS = frozenset(
    {"configMap", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)


def validate_template(template: dict[str, Any]) -> dict[str, Any]:
    """The template with every field spelled as Kubernetes does; ValueError naming each field that the client's
    PodTemplateSpec refuses (unknown, wrong type). Quantities may be numbers (`cpu: 2`), as in a manifest."""
    spec = template.get("spec")
    partial = isinstance(spec, dict) and "containers" not in spec  # a fragment: the pod's containers are the run's
    data = {**template, "spec": {**spec, "containers": []}} if partial else template
    try:
        model = V1PodTemplateSpec.model_validate(_quantities_as_strings(data))
    except ValidationError as err:
        problems = [f"{_path(e['loc'])}: {e['msg']}" for e in err.errors()]
        raise ValueError("not a PodTemplateSpec: " + "; ".join(problems)) from None
    out = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
    if partial:
        del out["spec"]["containers"]
    return out


def _path(loc: tuple[Any, ...]) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def _quantities_as_strings(template: dict[str, Any]) -> dict[str, Any]:
    """Kubernetes' quantities are int-or-string (`cpu: 2`); the client's model types them as strings."""
    spec = template.get("spec")
    if not isinstance(spec, dict):
        return template
    containers = [
        {**c, "resources": _resources_as_strings(c["resources"])} if isinstance(c, dict) and "resources" in c else c
        for c in spec.get("containers", [])
    ]
    spec = {**spec, "containers": containers}
    if "resources" in spec:
        spec["resources"] = _resources_as_strings(spec["resources"])
    return {**template, "spec": spec}


def _resources_as_strings(resources: Any) -> Any:
    if not isinstance(resources, dict):
        return resources
    return {
        kind: {r: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for r, v in amounts.items()}
        if kind in ("limits", "requests") and isinstance(amounts, dict)
        else amounts
        for kind, amounts in resources.items()
    }


def strategic_merge(base: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """`patch` merged over `base` as a strategic merge patch of a pod template is (MERGE_KEYS); neither changes."""
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return patch
    out = dict(base)
    for key, value in patch.items():
        where = (*path, key)
        if value is None:
            out.pop(key, None)
        elif where in MERGE_KEYS and isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = _merge_list(out[key], value, MERGE_KEYS[where], where)
        else:
            out[key] = strategic_merge(out.get(key), value, where)
    return out


def _merge_list(base: list[Any], patch: list[Any], key: str, path: tuple[str, ...]) -> list[Any]:
    """Items of `patch` merged into the item of `base` with the same key, or appended."""
    out = list(base)
    for item in patch:
        index = next((i for i, old in enumerate(out) if old.get(key) == item.get(key)), None)
        if index is None:
            out.append(item)
        else:
            out[index] = strategic_merge(out[index], item, path)
    return out


def template_refusals(base: dict[str, Any], template: dict[str, Any], where: str) -> list[str]:
    """What in `template` would change the guarantees of `base`, the operator's pod template (empty: nothing),
    each named by its field under `where`."""
    found = [
        f"{where}.metadata.{key}: a template sets only labels and annotations"
        for key in template.get("metadata", {})
        if key not in ("labels", "annotations")
    ]
    base_labels = base["metadata"]["labels"]
    found += [
        f"{where}.metadata.labels.{label}: the run's own label (its workloads select its pods by it)"
        for label in template.get("metadata", {}).get("labels", {})
        if label in base_labels
    ]
    found += [
        f"{where}.metadata.annotations.{key}: the containers' confinement is the operator's"
        for key in template.get("metadata", {}).get("annotations") or {}
        if key.startswith(CONFINEMENT_ANNOTATIONS)
    ]
    spec, base_spec = template.get("spec", {}), base["spec"]
    found += [f"{where}.spec.{key}: {why}" for key, why in POD_FIELDS_OF_THE_RUN.items() if key in spec]

    found += _volume_refusals(spec.get("volumes", []), base_spec["volumes"], f"{where}.spec.volumes")
    containers = {c["name"]: c for c in base_spec["containers"]}
    for i, container in enumerate(spec.get("containers", [])):
        field = f"{where}.spec.containers[{i}]"
        if container["name"] not in containers:
            found.append(f"{field}.name: {container['name']!r} is none of the pod's containers {sorted(containers)}")
            continue
        found += _container_refusals(container, containers[container["name"]], field)
    return found


def operator_layer_refusals(layer: dict[str, Any] | None, template: dict[str, Any], where: str) -> list[str]:
    """What in a run's `template` changes or removes a POD_FIELDS_OF_THE_OPERATOR field that the operator's own
    template for the same pods (`pods.<component>.template`, `layer`) sets."""
    ours, spec = (layer or {}).get("spec", {}), template.get("spec", {})
    return [
        f"{where}.spec.{key}: {why} ({ours[key]!r})"
        for key, why in POD_FIELDS_OF_THE_OPERATOR.items()
        if key in spec and key in ours and spec[key] != ours[key]
    ]


def _volume_refusals(volumes: list[dict[str, Any]], base: list[dict[str, Any]], where: str) -> list[str]:
    own = {v["name"] for v in base}
    found = []
    for i, volume in enumerate(volumes):
        kinds = set(volume) - {"name"}
        if volume["name"] in own:
            found.append(f"{where}[{i}].name: {volume['name']!r} is the run's own volume")
        elif kinds - TEMPLATE_VOLUME_KINDS:
            found.append(
                f"{where}[{i}]: {', '.join(sorted(kinds - TEMPLATE_VOLUME_KINDS))} is no volume a template may add "
                f"(the restricted Pod Security Standard's, less inline csi: {', '.join(sorted(TEMPLATE_VOLUME_KINDS))})"
            )
        elif any("serviceAccountToken" in s for s in volume.get("projected", {}).get("sources", [])):
            found.append(f"{where}[{i}].projected: no run pod mounts a service account token")
    return found


def _container_refusals(container: dict[str, Any], base: dict[str, Any], where: str) -> list[str]:
    found = [
        f"{where}.{key}: the operator's (a template's container sets only {', '.join(CONTAINER_FIELDS[1:])})"
        for key in container
        if key not in CONTAINER_FIELDS
    ]
    own_env = {e["name"] for e in base.get("env", [])}
    found += [
        f"{where}.env[{i}].name: {e['name']!r} is the run's own setting"
        for i, e in enumerate(container.get("env", []))
        if e["name"] in own_env
    ]
    found += [
        f"{where}.env[{i}].name: {e['name']!r} would load other code into the service before it starts"
        for i, e in enumerate(container.get("env", []))
        if e["name"].startswith(LOADER_VARIABLES)
    ]
    own_paths = {m["mountPath"] for m in base.get("volumeMounts", [])}
    found += [
        f"{where}.volumeMounts[{i}].mountPath: {m['mountPath']} is where the run's own volume is mounted"
        for i, m in enumerate(container.get("volumeMounts", []))
        if m["mountPath"] in own_paths
    ]
    return found
