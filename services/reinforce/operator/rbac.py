"""The operator's least-privilege RBAC rules: exactly what its handlers call, nothing more.

The tests run the operator with a ServiceAccount token bound to these rules (tests/integration/test_operator.py,
and tests/integration/test_chart.py with the chart's namespaced Roles), so a missing rule fails them; the comment on
each rule says which call needs it. The chart's roles and operator/operator.yaml are generated from them
(scripts/generate).

CLUSTER_RULES must be cluster-wide (what kopf reads to start); NAMESPACED_RULES act on the runs and their children
only. An operator watching some namespaces (the chart's `watchNamespaces`) gets the namespaced rules through a Role
in each of them, so it can touch no Secret or workload elsewhere; one watching every namespace needs them all
cluster-wide (OPERATOR_RULES).
"""

from __future__ import annotations

from typing import Any

from reinforce.operator.resource import GROUP, PLURAL

CLUSTER_RULES: list[dict[str, Any]] = [
    # kopf discovers the resources it serves from the CRDs (read-only)
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
    # kopf, given --namespace, follows the namespaces that match (read-only)
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
]
NAMESPACED_RULES: list[dict[str, Any]] = [
    # kopf watches the runs and patches its annotations and finalizer on them
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
    # children, applied with server-side apply (which creates what does not exist yet)
    {"apiGroups": [""], "resources": ["configmaps", "services"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["get", "create", "patch"]},
    # created once; secrets are read back for the Redis URL and the generators' control token (and an external
    # Redis Secret's labels, which must opt in)
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},
    # created once; a claim a pod template names is read for its labels (another run's is refused)
    {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get", "create"]},
    # status: readiness, restarts and addresses of the run's pods
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    # kopf reports handler failures as events on the run
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]
OPERATOR_RULES: list[dict[str, Any]] = CLUSTER_RULES + NAMESPACED_RULES
