"""The ReinforceRun CRD: generated from the spec model, committed, and checked by a real API server."""

from __future__ import annotations

import copy
import json
import re
import secrets
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from k8s import API, EXAMPLE, KUBECTL, KubeCluster, example_run, install_crd, kube_apiserver, wait_for  # noqa: F401
from kubernetes import client
from pydantic import BaseModel
from pydantic.alias_generators import to_camel

from generate import crd
from reinforce.core.spec import RunSpec, TrainingSpec, load_spec
from reinforce.operator.resource import ReinforceRunSpec, parse_run_resource

COMMITTED = crd.DEFAULT_OUTPUT


def _nodes(schema: dict[str, Any], path: str = "spec") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from _nodes(schema[key], f"{path}[]")


def test_spec_schema_is_structural() -> None:
    for path, node in _nodes(crd.spec_schema()):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        assert not {"$ref", "anyOf", "allOf", "oneOf", "prefixItems", "title", "const"} & node.keys(), path
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("default", 0) is not None, f"{path}: a null default"
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_spec_schema_covers_the_model_but_not_name_and_run_dir() -> None:
    properties = crd.spec_schema()["properties"]
    aliases = {field.alias for field in ReinforceRunSpec.model_fields.values()}
    assert set(properties) == aliases - {"name", "runDir"}  # camelCase, as Kubernetes spells fields
    assert {"suspend", "kubernetes"} < set(properties) and set(RunSpec.model_fields) < set(
        ReinforceRunSpec.model_fields
    )
    assert crd.spec_schema()["required"] == ["policy", "data"]
    # sections default to {} so that the API server fills in their fields' defaults
    assert properties["training"]["default"] == {}
    assert properties["training"]["properties"]["lr"] == {
        "type": "number",
        "description": "AdamW peak learning rate.",
        "default": 1e-6,
        "exclusiveMinimum": True,
        "minimum": 0,
    }
    assert properties["training"]["properties"]["adamBetas"]["minItems"] == 2
    assert properties["policy"]["properties"]["path"]["nullable"] is True
    assert properties["reward"]["properties"]["kwargs"]["x-kubernetes-preserve-unknown-fields"] is True


class _Union(BaseModel):
    x: int | str = 1


class _MixedTuple(BaseModel):
    t: tuple[int, str] = (1, "a")


class _Set(BaseModel):
    s: set[int] = set()


@pytest.mark.parametrize(
    ("model", "complaint"),
    [
        (_Union, "spec.x: a union of several types"),
        (_MixedTuple, "spec.t: a tuple of different types"),
        (_Set, "spec.s: 'uniqueItems' has no structural-schema equivalent"),
    ],
)
def test_fields_a_structural_schema_cannot_say_are_refused_by_name(model: type[BaseModel], complaint: str) -> None:
    with pytest.raises(crd.CRDSchemaError, match=re.escape(complaint)):
        crd.spec_schema(model, exclude=frozenset())


def test_typed_dicts_keep_their_value_schema() -> None:
    class Limits(BaseModel):
        limits: dict[str, int] = {}

    schema = crd.spec_schema(Limits, exclude=frozenset())["properties"]["limits"]
    assert schema == {"type": "object", "default": {}, "additionalProperties": {"type": "integer"}}


# ---- against a real API server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(kube_apiserver: KubeCluster) -> Iterator[client.ApiClient]:  # noqa: F811
    """The admin's client, with the committed CRD installed and Established (left installed for later modules)."""
    with kube_apiserver.api_client() as api_client:
        install_crd(api_client, yaml.safe_load(COMMITTED.read_text()))
        yield api_client


@pytest.fixture
def namespace(api: client.ApiClient) -> Iterator[str]:
    name = f"test-crd-{secrets.token_hex(3)}"
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


@pytest.fixture
def runs(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


@pytest.mark.slow
def test_crd_is_established_with_a_structural_schema(api: client.ApiClient) -> None:
    found = client.ApiextensionsV1Api(api).read_custom_resource_definition(f"{crd.PLURAL}.{crd.GROUP}")
    conditions = {c.type: c.status for c in found.status.conditions}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"
    assert conditions.get("NonStructuralSchema") != "True", found.status.conditions
    assert found.status.accepted_names.short_names == ["rr"]


@pytest.mark.slow
def test_example_is_accepted_and_defaulted_by_the_server(runs: client.CustomObjectsApi, namespace: str) -> None:
    created = runs.create_namespaced_custom_object(*API, namespace, crd.PLURAL, example_run())
    spec = created["spec"]
    assert spec["training"]["lr"] == 3e-3  # from the example
    assert spec["training"]["weightDecay"] == 0  # defaults, filled in by the API server
    assert spec["reward"]["maxBatchSize"] == 64
    assert spec["restart"]["maxRestarts"] == 3 and spec["restart"]["maxBackoffS"] == 30  # a whole absent section
    assert spec["policy"]["randomInit"]["maxPositionEmbeddings"] == 256
    assert spec["reward"]["kwargs"] == {"char": "a"}  # free-form, kept as written
    # What the server stored is the run the CLI would run: the server's defaults are the model's.
    run = parse_run_resource(created["metadata"]["name"], spec)
    assert run.model_dump(exclude={"suspend", "kubernetes"}) == load_spec(EXAMPLE).model_dump()
    assert run.suspended is False and run.kubernetes.storage_size == "10Gi"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "value", "complaint"),
    [
        ("training.lr", "fast", "must be of type number"),
        ("training.lr", -1, "should be greater than 0"),
        ("generation.top_p", 2, "should be less than or equal to 1"),
        ("training.steps", 1.5, "must be of type integer"),
        ("reward.type", "magic", "supported values"),
        ("reward.function", "not a function", "should match"),
        ("training.adam_betas", [0.9], "should have at least 2 items"),
        ("policy.random_init.vocab", "a", "should be at least 2 chars long"),
    ],
)
def test_invalid_runs_are_rejected_naming_the_field(
    runs: client.CustomObjectsApi, namespace: str, path: str, value: Any, complaint: str
) -> None:
    with pytest.raises(client.ApiException) as raised:
        runs.create_namespaced_custom_object(*API, namespace, crd.PLURAL, example_run("bad", **{path: value}))
    assert raised.value.status == 422
    message = json.loads(raised.value.body)["message"]
    camel = ".".join(to_camel(part) for part in path.split("."))  # example_run takes spec-file paths
    assert f"spec.{camel}" in message and complaint in message, message


@pytest.mark.slow
def test_a_run_without_its_required_fields_is_rejected(runs: client.CustomObjectsApi, namespace: str) -> None:
    body = example_run("bad")
    del body["spec"]["data"]["prompts"]
    with pytest.raises(client.ApiException) as raised:
        runs.create_namespaced_custom_object(*API, namespace, crd.PLURAL, body)
    assert raised.value.status == 422
    assert "spec.data.prompts: Required value" in json.loads(raised.value.body)["message"]


@pytest.mark.slow
def test_unknown_fields_are_pruned(runs: client.CustomObjectsApi, namespace: str) -> None:
    # API level 1.20 has no server-side field validation (1.25+): a structural schema drops unknown fields
    # silently. The operator refuses them by validating the spec with the model (tests/unit/test_spec.py).
    body = example_run(**{"training.bogus": 1, "bogus": {"x": 1}})
    created = runs.create_namespaced_custom_object(*API, namespace, crd.PLURAL, body)
    assert "bogus" not in created["spec"]["training"] and "bogus" not in created["spec"]
    stored = runs.get_namespaced_custom_object(*API, namespace, crd.PLURAL, "tiny")
    assert "bogus" not in stored["spec"]["training"]


@pytest.mark.slow
def test_status_subresource(runs: client.CustomObjectsApi, namespace: str) -> None:
    created = runs.create_namespaced_custom_object(*API, namespace, crd.PLURAL, example_run())
    status = {
        "phase": "Running",
        "step": 3,
        "publishedWeightVersion": 3,
        "generatorsReady": "1/1",
        "generators": [{"name": "tiny-generator-0", "ready": True, "loadedVersion": 3}],
        "reward": 0.25,
        "kl": 0.01,
        "observedGeneration": 1,
        "conditions": [{"type": "Ready", "status": "True", "reason": "Training", "message": "step 3 of 30"}],
    }
    changed_spec = copy.deepcopy(created["spec"])
    changed_spec["training"]["steps"] = 99
    patched = runs.patch_namespaced_custom_object_status(
        *API, namespace, crd.PLURAL, "tiny", {"status": status, "spec": changed_spec}
    )
    assert patched["status"] == status
    assert patched["spec"] == created["spec"], "the status subresource changed the spec"
    assert patched["metadata"]["generation"] == created["metadata"]["generation"] == 1

    # and the main resource ignores status, while a spec change bumps the generation
    body = {"spec": {"training": {"steps": 40}}, "status": {"phase": "Failed"}}
    updated = runs.patch_namespaced_custom_object(*API, namespace, crd.PLURAL, "tiny", body)
    assert updated["status"]["phase"] == "Running"
    assert updated["spec"]["training"]["steps"] == 40 and updated["metadata"]["generation"] == 2


@pytest.mark.slow
def test_kubectl_scale_sets_the_number_of_generators(
    kube_apiserver: KubeCluster,  # noqa: F811
    runs: client.CustomObjectsApi,
    namespace: str,
) -> None:
    """The scale subresource (what `kubectl scale`, an HPA and KEDA use) is generation.numGenerators, with the
    generator pods' selector and count from the status the operator writes."""
    runs.create_namespaced_custom_object(*API, namespace, crd.PLURAL, example_run())
    selector = "app.kubernetes.io/instance=tiny,app.kubernetes.io/component=generator"
    status = {"generatorReplicas": 1, "generatorSelector": selector}
    runs.patch_namespaced_custom_object_status(*API, namespace, crd.PLURAL, "tiny", {"status": status})
    scale = runs.get_namespaced_custom_object_scale(*API, namespace, crd.PLURAL, "tiny")
    assert scale["spec"]["replicas"] == 1  # the server's default of numGenerators
    assert scale["status"] == {"replicas": 1, "selector": selector}
    kubectl = [KUBECTL, "--kubeconfig", str(kube_apiserver.admin_kubeconfig), "-n", namespace]
    done = subprocess.run([*kubectl, "scale", "rr/tiny", "--replicas", "4"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    stored = runs.get_namespaced_custom_object(*API, namespace, crd.PLURAL, "tiny")
    assert stored["spec"]["generation"]["numGenerators"] == 4 and stored["metadata"]["generation"] == 2
    refused = subprocess.run([*kubectl, "scale", "rr/tiny", "--replicas", "0"], capture_output=True, text=True)
    assert refused.returncode != 0 and "spec.generation.numGenerators" in refused.stderr  # suspend scales to zero


@pytest.mark.slow
def test_invalid_status_is_rejected(runs: client.CustomObjectsApi, namespace: str) -> None:
    runs.create_namespaced_custom_object(*API, namespace, crd.PLURAL, example_run())
    with pytest.raises(client.ApiException) as raised:
        runs.patch_namespaced_custom_object_status(*API, namespace, crd.PLURAL, "tiny", {"status": {"phase": "Done"}})
    assert raised.value.status == 422 and "status.phase" in json.loads(raised.value.body)["message"]


@pytest.mark.slow
def test_printer_columns(
    kube_apiserver: KubeCluster,  # noqa: F811
    runs: client.CustomObjectsApi,
    namespace: str,
) -> None:
    runs.create_namespaced_custom_object(*API, namespace, crd.PLURAL, example_run())
    status = {
        "phase": "Running",
        "step": 7,
        "reward": 0.5,
        "kl": 0.02,
        "generatorsReady": "2/3",
        "publishedWeightVersion": 7,
        "tokensPerSecond": 1234.5,
    }
    runs.patch_namespaced_custom_object_status(*API, namespace, crd.PLURAL, "tiny", {"status": status})
    # what `kubectl get rr` shows: the server renders the columns as a Table
    request = urllib.request.Request(
        f"{kube_apiserver.server}/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{namespace}/{crd.PLURAL}",
        headers={
            "Authorization": f"Bearer {kube_apiserver.admin_token}",
            "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io",
        },
    )
    context = ssl.create_default_context(cafile=str(kube_apiserver.ca_file))
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        table = json.load(response)
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns == ["Name", "Phase", "Step", "Reward", "KL", "Generators", "Weights", "Tokens/s", "Age"]
    assert table["rows"][0]["cells"][:8] == ["tiny", "Running", 7, 0.5, 0.02, "2/3", 7, 1234.5]
    wide = {c["name"] for c in table["columnDefinitions"] if c["priority"] == 1}
    assert wide == {"Weights", "Tokens/s"}  # what `kubectl get rr -o wide` adds


@pytest.mark.slow
def test_deleting_a_run_collects_what_it_owns(
    api: client.ApiClient, runs: client.CustomObjectsApi, namespace: str
) -> None:
    created = runs.create_namespaced_custom_object(*API, namespace, crd.PLURAL, example_run())
    owner = {
        "apiVersion": created["apiVersion"],
        "kind": crd.KIND,
        "name": "tiny",
        "uid": created["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    core = client.CoreV1Api(api)
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "tiny-spec", "ownerReferences": [owner]}})
    runs.delete_namespaced_custom_object(*API, namespace, crd.PLURAL, "tiny")

    def collected() -> bool:
        try:
            core.read_namespaced_config_map("tiny-spec", namespace)
            return False
        except client.ApiException as err:
            return err.status == 404

    # the garbage collector notices a new resource type at its next discovery sync (every 30 s)
    wait_for(collected, timeout_s=90, interval_s=0.5)


@pytest.mark.slow
def test_rbac_governs_who_may_touch_runs(
    kube_apiserver: KubeCluster,  # noqa: F811
    api: client.ApiClient,
    namespace: str,
) -> None:
    # A ServiceAccount and a user group, each bound to a role that may only read ReinforceRuns in one namespace.
    rbac = client.RbacAuthorizationV1Api(api)
    rule = {"apiGroups": [crd.GROUP], "resources": [crd.PLURAL], "verbs": ["get", "list", "watch"]}
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "run-reader"}, "rules": [rule]})
    subjects = [
        {"kind": "ServiceAccount", "name": "reader", "namespace": namespace},
        {"kind": "Group", "name": "run-readers", "apiGroup": "rbac.authorization.k8s.io"},
    ]
    role_ref = {"kind": "Role", "name": "run-reader", "apiGroup": "rbac.authorization.k8s.io"}
    rbac.create_namespaced_role_binding(
        namespace, {"metadata": {"name": "run-reader"}, "subjects": subjects, "roleRef": role_ref}
    )
    client.CustomObjectsApi(api).create_namespaced_custom_object(*API, namespace, crd.PLURAL, example_run())
    kubeconfigs = [
        kube_apiserver.kubeconfig_for_service_account(namespace, "reader"),
        kube_apiserver.kubeconfig_for_user("ada", groups=["run-readers"]),
    ]
    for kubeconfig in kubeconfigs:
        with kube_apiserver.api_client(kubeconfig) as reader_client:
            reader = client.CustomObjectsApi(reader_client)
            found = reader.list_namespaced_custom_object(*API, namespace, crd.PLURAL)
            assert [item["metadata"]["name"] for item in found["items"]] == ["tiny"]
            with pytest.raises(client.ApiException) as raised:
                reader.create_namespaced_custom_object(*API, namespace, crd.PLURAL, example_run("other"))
            assert raised.value.status == 403
            with pytest.raises(client.ApiException) as raised:
                reader.list_namespaced_custom_object(*API, "default", crd.PLURAL)
            assert raised.value.status == 403


@pytest.mark.slow
def test_kubectl_explain_answers_with_the_models_descriptions(
    api: client.ApiClient,
    kube_apiserver: KubeCluster,  # noqa: F811
) -> None:
    """Issue 25: `kubectl explain reinforcerun.spec.training` reads the API server's published OpenAPI."""
    command = [KUBECTL, "--kubeconfig", str(kube_apiserver.admin_kubeconfig), "explain", "reinforcerun.spec.training"]

    def explained() -> str | None:  # the server publishes a new CRD's schema a moment after it is established
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        return " ".join(result.stdout.split()) if result.returncode == 0 else None

    text = wait_for(explained, 60)
    assert TrainingSpec.__doc__ in text
    ranks = TrainingSpec.model_fields["num_ranks"]
    assert f"numRanks <integer> {ranks.description}" in text, text
