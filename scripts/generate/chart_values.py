"""The Helm chart's generated parts: `values.schema.json` and the operator's RBAC rules.

`ChartValues` is the typed model of `charts/reinforce/values.yaml` (Helm's camelCase); its `operatorConfig`
is the operator's own `OperatorConfig`, so the chart cannot accept an operator setting the operator would
refuse. `make generate` writes `values.schema.json` (Helm checks every install against it)
and `files/operator-rules.yaml` (the roles' rules: `CLUSTER_RULES` and `NAMESPACED_RULES`, one source);
tests/integration/test_chart.py fails when either drifts.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from reinforce.operator.children import OperatorConfig
from reinforce.operator.rbac import CLUSTER_RULES, NAMESPACED_RULES

CHART = Path(__file__).resolve().parents[2] / "charts" / "reinforce"


class _Values(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Image(_Values):
    repository: str = Field("reinforce-operator", description="Operator image repository.")
    tag: str = Field("", description="Image tag (empty: the chart's appVersion).")
    pullPolicy: str = Field("IfNotPresent", description="Image pull policy.")


class ServiceAccount(_Values):
    create: bool = Field(True, description="Create the operator's ServiceAccount.")
    name: str = Field("", description="Its name (empty: the release's full name).")


class ServiceMonitor(_Values):
    enabled: bool = Field(True, description="Create a ServiceMonitor and PodMonitor when their API exists.")
    interval: str = Field("15s", description="Scrape interval.")


class Metrics(_Values):
    serviceMonitor: ServiceMonitor = Field(default_factory=ServiceMonitor)
    prometheusRule: bool = Field(True, description="Create the alert rules when the PrometheusRule API exists.")


class Dashboards(_Values):
    enabled: bool = Field(True, description="Ship the Grafana dashboards as ConfigMaps.")
    label: str = Field("grafana_dashboard", description="Label the Grafana sidecar looks for.")
    labelValue: str = Field("1", description="Its value.")


class ChartValues(_Values):
    """charts/reinforce/values.yaml"""

    image: Image = Field(default_factory=Image)
    watchNamespaces: list[str] = Field(
        default_factory=list, description="Namespaces whose ReinforceRuns the operator runs (empty: all)."
    )
    serviceAccount: ServiceAccount = Field(default_factory=ServiceAccount)
    rbac: bool = Field(
        True,
        description="Create the operator's RBAC (least privilege): with watchNamespaces a Role per namespace and a "
        "ClusterRole that only reads CRDs and namespaces; without, one ClusterRole.",
    )
    resources: dict[str, dict[str, str]] = Field(default_factory=dict, description="The operator pod's resources.")
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="The operator pod's node selector.")
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list, description="The operator pod's tolerations, as Kubernetes spells them."
    )
    hostNetwork: bool = Field(False, description="Run the operator pod on the node's network (host-network profile).")
    apiServer: str = Field(
        "",
        pattern=r"^$|^[^:/]+:[0-9]+$",
        description="host:port of the API server for an operator that cannot reach the `kubernetes` Service "
        "(no kube-proxy), e.g. 127.0.0.1:6443; empty: the in-cluster default.",
    )
    healthPort: int = Field(
        8080, ge=1, le=65535,
        description="Port of the operator's liveness endpoint; with hostNetwork it must differ from the runs' ports.",
    )  # fmt: skip
    operatorConfig: OperatorConfig = Field(
        default_factory=OperatorConfig,
        description="The operator's configuration: images, ports and pod defaults of the runs' components.",
    )
    metrics: Metrics = Field(default_factory=Metrics)
    dashboards: Dashboards = Field(default_factory=Dashboards)


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


GENERATED = {
    CHART / "values.schema.json": lambda: json.dumps(values_schema(), indent=2) + "\n",
    CHART / "files" / "operator-rules.yaml": lambda: (
        "# Generated from services/reinforce/operator/rbac.py by `make generate`. cluster: always in the\n"
        "# ClusterRole; namespaced: in a Role per watchNamespaces entry, or in the ClusterRole without them.\n"
        + yaml.safe_dump({"cluster": CLUSTER_RULES, "namespaced": NAMESPACED_RULES}, sort_keys=False)
    ),
}


def generated_files() -> dict[Path, str]:
    return {path: render() for path, render in GENERATED.items()}
