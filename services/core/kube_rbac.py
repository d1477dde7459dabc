"""What the operator may do on the cluster: exactly what its handlers call, nothing more.

The tests run the operator with a ServiceAccount token bound to this role (tests/test_operator.py), so a rule
missing here fails them, and a rule added here without a use is caught in review by the comments that say
which call needs it.
"""

from __future__ import annotations

from typing import Any

from reinforce.core.crd import GROUP, PLURAL

OPERATOR_NAME = "reinforce-operator"

OPERATOR_RULES: list[dict[str, Any]] = [
    # kopf discovers the resources it serves from the CRDs (read-only)
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
    # kopf, given --namespace, follows the namespaces that match (read-only)
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    # kopf watches the runs and patches its annotations and finalizer on them
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
    # children, applied with server-side apply (which creates what does not exist yet)
    {"apiGroups": [""], "resources": ["configmaps", "services"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets"], "verbs": ["get", "create", "patch"]},
    # created once; secrets are read back for the Redis URL and the generators' control token
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},
    {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["create"]},
    # status: readiness, restarts and addresses of the run's pods
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    # kopf reports handler failures as events on the run
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]


def operator_rbac(namespace: str, name: str = OPERATOR_NAME) -> list[dict[str, Any]]:
    """ServiceAccount, ClusterRole and ClusterRoleBinding of an operator running in `namespace`."""
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": OPERATOR_RULES,
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }
    return [account, role, binding]
