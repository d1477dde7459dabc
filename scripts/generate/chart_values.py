"""The Helm chart's generated parts: `values.yaml`, `values.schema.json` and the operator's RBAC rules.

`ChartValues` is the typed model of `charts/reinforce/values.yaml` (Helm's camelCase); its `operatorConfig`
is the operator's own `OperatorConfig`, so the chart cannot accept an operator setting the operator would
refuse. `make generate` writes `values.yaml` (the model's defaults, every key under a `## @param` line with its
description, as Bitnami's charts document theirs), `values.schema.json` (Helm checks every install against it)
and `files/operator-rules.yaml` (the roles' rules: `CLUSTER_RULES` and `NAMESPACED_RULES`, one source);
tests/unit/test_generated.py fails when any of them drifts.
"""

from __future__ import annotations

import copy
import json
import textwrap
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from reinforce.core.spec import reference_rows
from reinforce.operator.children import OperatorConfig
from reinforce.operator.rbac import CLUSTER_RULES, NAMESPACED_RULES
from reinforce.operator.resource import PodSpec

CHART = Path(__file__).resolve().parents[2] / "charts" / "reinforce"


class _Values(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Image(_Values):
    """The operator's image (services/reinforce/operator/Dockerfile; `reinforce operator` is its command)."""

    repository: str = Field("reinforce-operator", description="Operator image repository.")
    tag: str = Field("", description="Image tag (empty: the chart's appVersion).")
    pullPolicy: str = Field("IfNotPresent", description="Image pull policy.")


class ServiceAccount(_Values):
    """The operator's ServiceAccount."""

    create: bool = Field(True, description="Create the operator's ServiceAccount.")
    name: str = Field("", description="Its name (empty: the release's full name).")


class ServiceMonitor(_Values):
    """Scraping of the runs' metrics by the Prometheus Operator."""

    enabled: bool = Field(
        True,
        description="A ServiceMonitor (reward, trainer; PPO's critics; environment services) and a PodMonitor "
        "(generators), where the Prometheus Operator's API exists; each scrapes the port named metrics.",
    )
    interval: str = Field("15s", description="Scrape interval.")


class Metrics(_Values):
    """Prometheus objects for the runs."""

    serviceMonitor: ServiceMonitor = Field(default_factory=ServiceMonitor)
    prometheusRule: bool = Field(True, description="Create the alert rules when the PrometheusRule API exists.")


class Dashboards(_Values):
    """The Grafana dashboards (charts/reinforce/dashboards)."""

    enabled: bool = Field(
        True, description="Ship the Grafana dashboards as ConfigMaps, picked up by the Grafana sidecar by `label`."
    )
    label: str = Field("grafana_dashboard", description="Label the Grafana sidecar looks for.")
    labelValue: str = Field("1", description="Its value.")


class ScaledRun(_Values):
    """A ReinforceRun whose generators KEDA scales (the run's scale subresource: generation.numGenerators)."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="The ReinforceRun's name.")
    namespace: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="Its namespace.")
    minReplicas: int = Field(1, ge=1, description="Fewest generators.")
    maxReplicas: int = Field(8, ge=1, description="Most generators.")
    metric: Literal["lag", "pending"] = Field(
        "lag",
        description="What the redis-streams trigger counts on the run's prompts stream: lag (prompts no generator "
        "has read yet: the backlog; Redis 7, as the run's own Redis is) or pending (prompts generators read and "
        "have not acknowledged: the work in hand, which grows with the backlog only while generators hold prompts "
        "for later steps, max_policy_lag > 0).",
    )
    target: int = Field(16, ge=1, description="Prompts of that metric per generator: KEDA sizes the run to it.")
    pollingInterval: int = Field(15, ge=1, description="Seconds between KEDA's reads of the stream.")
    cooldownPeriod: int = Field(300, ge=1, description="Seconds after the last activity before scaling to minReplicas.")


class Autoscaling(_Values):
    """KEDA ScaledObjects (keda.sh/v1alpha1) over runs' generators, rendered where KEDA's API exists."""

    runs: list[ScaledRun] = Field(
        default_factory=list,
        description="Runs to scale, each with a ScaledObject and a TriggerAuthentication (the run's Redis password "
        "from its Secret); runs on the operator's own Redis, not an external one.",
    )


class ChartValues(_Values):
    """charts/reinforce/values.yaml"""

    image: Image = Field(default_factory=Image)
    watchNamespaces: list[str] = Field(
        default_factory=list, description="Namespaces whose ReinforceRuns the operator runs (empty: all)."
    )
    serviceAccount: ServiceAccount = Field(default_factory=ServiceAccount)
    rbac: bool = Field(
        True,
        description="Create the operator's RBAC: exactly the calls it makes "
        "(charts/reinforce/files/operator-rules.yaml). With watchNamespaces a Role in each of them and a ClusterRole "
        "that only reads CRDs and namespaces; without, one ClusterRole.",
    )
    resources: dict[str, dict[str, str]] = Field(
        default_factory=lambda: {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
        description="The operator pod's resources.",
    )
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="The operator pod's node selector.")
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list, description="The operator pod's tolerations, as Kubernetes spells them."
    )
    hostNetwork: bool = Field(
        False,
        description="Run the operator pod on the node's network, for a single-node cluster without kube-proxy "
        "(with operatorConfig.profile host-network and apiServer).",
    )
    apiServer: str = Field(
        "",
        pattern=r"^$|^[^:/]+:[0-9]+$",
        description="host:port of the API server for an operator that cannot reach the `kubernetes` Service "
        "(no kube-proxy), e.g. 127.0.0.1:6443; empty: the in-cluster default.",
    )
    healthPort: int = Field(
        8080, ge=1, le=65535,
        description="Port of the operator's liveness endpoint (/healthz); with hostNetwork it must differ from the "
        "runs' ports (the generators take ports.generator + i there).",
    )  # fmt: skip
    operatorConfig: OperatorConfig = Field(
        default_factory=lambda: OperatorConfig(pods={"redis": PodSpec(requests={"cpu": "100m", "memory": "256Mi"})}),
        description="The operator's configuration (docs/reference/kubernetes.md): defaults for what a "
        "ReinforceRun leaves unset. operatorNamespace is the release's namespace, whatever is set here.",
    )
    metrics: Metrics = Field(default_factory=Metrics)
    dashboards: Dashboards = Field(default_factory=Dashboards)
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)


def values_schema() -> dict[str, Any]:
    """JSON Schema (draft 7) with every $ref inlined: Helm's validator then needs no reference resolution."""
    raw = ChartValues.model_json_schema()
    defs = raw.pop("$defs", {})
    schema = _inline(raw, defs)
    return {"$schema": "http://json-schema.org/draft-07/schema#", **schema}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    node = {k: v for k, v in node.items() if k != "title"}
    if "default" in node and isinstance(node["default"], dict) and not node["default"]:
        del node["default"]  # a section's {} says nothing that its fields' defaults do not
    return {key: _inline(value, defs) for key, value in node.items()}


VALUES_HEADER = """\
# Values of the reinforce chart, generated from scripts/generate/chart_values.py (ChartValues) by `make generate`:
# change the model, not this file. values.schema.json (generated from the same model) checks them: an unknown key or
# a wrong type fails `helm install` naming the key. Each `## @param` line documents a key (`<name>`: any map key).
"""
# The chart writes the release's namespace into the operator's configuration (templates/operator.yaml).
SET_BY_THE_CHART = {"operatorConfig": {"operator_namespace"}}


def values_yaml() -> str:
    """The model's defaults, each top-level key under the `## @param` lines of the keys it holds."""
    values = ChartValues().model_dump(mode="json", by_alias=True, exclude=SET_BY_THE_CHART)
    rows = reference_rows(ChartValues, by_alias=True)
    blocks = [VALUES_HEADER]
    for key, value in values.items():
        params = [r for r in rows if r.path == key or r.path.startswith((key + ".", key + "["))]
        comments = [_param_line(r.path, r.meaning) for r in params]
        blocks.append("\n".join(comments) + "\n" + yaml.safe_dump({key: value}, sort_keys=False, width=120))
    return "\n".join(blocks)


def _param_line(path: str, meaning: str) -> str:
    return textwrap.fill(
        meaning, 120, initial_indent=f"## @param {path} ", subsequent_indent="##   ", break_on_hyphens=False
    )


GENERATED = {
    CHART / "values.yaml": values_yaml,
    CHART / "values.schema.json": lambda: json.dumps(values_schema(), indent=2) + "\n",
    CHART / "files" / "operator-rules.yaml": lambda: (
        "# Generated from services/reinforce/operator/rbac.py by `make generate`. cluster: always in the\n"
        "# ClusterRole; namespaced: in a Role per watchNamespaces entry, or in the ClusterRole without them.\n"
        + yaml.safe_dump({"cluster": CLUSTER_RULES, "namespaced": NAMESPACED_RULES}, sort_keys=False)
    ),
}


def generated_files() -> dict[Path, str]:
    return {path: render() for path, render in GENERATED.items()}
