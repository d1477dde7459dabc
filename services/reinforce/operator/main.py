"""The operator: runs each ReinforceRun on Kubernetes (kopf).

    reinforce operator [--namespace NS ...] [--config operator.yaml] [--kubeconfig FILE]

Level-triggered, like the weight reconciler it drives. On every change of a run and every
`status_interval_s` it:

1. validates the spec with the model (resource.py), and refuses changes to fields that cannot change
   once the run started (everything but `suspend`, `generation.numGenerators` and `kubernetes`), naming
   them in the `SpecAccepted` condition, and settings the operator's `tenancy` configuration does not allow
   (tenancy.py), naming them likewise; a refused spec applies nothing;
2. applies every child (children.py) with server-side apply; a suspended or finished run gets zero
   replicas everywhere;
3. observes the pods and the trainer's metrics and writes the status;
4. posts an Event on the run (`kubectl describe rr`) for each phase change, spec refusal, pod restart seen and
   weight version every ready generator has loaded.

Apart from those passes a per-run loop (kopf daemon) has every ready generator load the published weight
version (core/rollout.py's reconciler, the local supervisor's too) within WEIGHT_POLL_S of its publication.

Deleting a run deletes its children (ownerReferences); a finalizer deletes its Redis keys first when the
Redis is external (the run's own Redis goes with its volume).
"""

from __future__ import annotations

import argparse
import base64
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kopf
import redis
import yaml
from kubernetes import client, config

from reinforce.core.metrics import TRAINER_STEP, prometheus_name, scrape
from reinforce.core.names import (
    COMPONENT_CRITIC,
    COMPONENT_ENVIRONMENT,
    K8S_COMPONENT_LABEL,
    K8S_INSTANCE_LABEL,
    OPERATOR_CONFIG_ENV,
)
from reinforce.core.queue import RolloutQueue
from reinforce.core.rollout import GeneratorWeights, WeightReconciler, relay_fanout
from reinforce.core.spec import RunSpec, SpecError, respell
from reinforce.operator.children import (
    REDIS_URL_KEY,
    OperatorConfig,
    Run,
    children,
    generator_port,
    kubernetes_weights,
    services_spec_yaml,
    trainer_pods,
)
from reinforce.operator.resource import GROUP, PLURAL, VERSION, ReinforceRunSpec, parse_run_resource
from reinforce.operator.tenancy import claim_refusals, redis_secret_refusal, refusals

log = logging.getLogger("reinforce.operator")
RUNS = (GROUP, VERSION, PLURAL)
FIELD_MANAGER = "reinforce-operator"
FINALIZER = f"{GROUP}/finalizer"
# Fields a running run may change; every other spec field is fixed at creation.
MUTABLE_FIELDS = ("suspend", "kubernetes", "generation.numGenerators")
# Objects with generated or bound content: created once, never re-applied.
CREATE_ONLY = {"Secret", "PersistentVolumeClaim"}
# kind -> (API class, the snake_case name in its method names)
_KINDS = {
    "ConfigMap": (client.CoreV1Api, "config_map"),
    "Secret": (client.CoreV1Api, "secret"),
    "Service": (client.CoreV1Api, "service"),
    "PersistentVolumeClaim": (client.CoreV1Api, "persistent_volume_claim"),
    "Deployment": (client.AppsV1Api, "deployment"),
    "StatefulSet": (client.AppsV1Api, "stateful_set"),
    "NetworkPolicy": (client.NetworkingV1Api, "network_policy"),
}
HTTP_TIMEOUT_S = 2.0
STATUS_INTERVAL_S = 2.0  # how often each run's pods and trainer are looked at and its status written
WEIGHT_POLL_S = 0.1  # how often each run's published weight version is checked
FINAL_SYNC_S = 30.0  # how long a finished run waits for its generators to load the final weights


# ---- applying the children --------------------------------------------------------------------------------
def apply(api: client.ApiClient, obj: dict[str, Any]) -> None:
    """Server-side apply: creates the object or brings our fields of it to `obj` (removing ones we dropped)."""
    api_class, kind = _KINDS[obj["kind"]]
    methods = api_class(api)
    name, namespace = obj["metadata"]["name"], obj["metadata"]["namespace"]
    if obj["kind"] in CREATE_ONLY:
        try:
            getattr(methods, f"create_namespaced_{kind}")(namespace, obj)
        except client.ApiException as err:
            if err.status != 409:
                raise
        return
    getattr(methods, f"patch_namespaced_{kind}")(
        name, namespace, obj, field_manager=FIELD_MANAGER, force=True, _content_type="application/apply-patch+yaml"
    )


def immutable_changes(accepted: dict[str, Any], wanted: dict[str, Any], prefix: str = "spec") -> list[str]:
    """Dotted paths (`spec.training.lr`) of fields that differ and may not change."""
    changed = []
    for key in sorted(set(accepted) | set(wanted)):
        path = f"{prefix}.{key}"
        if path.removeprefix("spec.") in MUTABLE_FIELDS:
            continue
        old, new = accepted.get(key), wanted.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changed += immutable_changes(old, new, path)
        elif old != new:
            changed.append(path)
    return changed


def accepted_spec(api: client.ApiClient, run: Run) -> dict[str, Any] | None:
    """The run spec the services were started with (the ConfigMap), or None before the first apply."""
    try:
        found = client.CoreV1Api(api).read_namespaced_config_map(run.child("spec"), run.namespace)
    except client.ApiException as err:
        if err.status == 404:
            return None
        raise
    return yaml.safe_load(found.data["spec.yaml"])


# ---- observing --------------------------------------------------------------------------------------------
@dataclass
class PodState:
    name: str
    component: str
    ready: bool
    restarts: int
    ip: str | None


def pod_states(api: client.ApiClient, run: Run) -> list[PodState]:
    pods = client.CoreV1Api(api).list_namespaced_pod(run.namespace, label_selector=f"{K8S_INSTANCE_LABEL}={run.name}")
    states = []
    for pod in pods.items:
        if pod.metadata.deletion_timestamp is not None:
            continue
        conditions = pod.status.conditions or []
        ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
        restarts = sum(c.restart_count for c in pod.status.container_statuses or [])
        component = pod.metadata.labels.get(K8S_COMPONENT_LABEL, "")
        states.append(PodState(pod.metadata.name, component, ready, restarts, pod.status.pod_ip))
    return sorted(states, key=lambda p: p.name)


def trainer_metrics(url: str) -> dict[str, float]:
    """Step, reward, KL and generated tokens/s from the trainer's Prometheus endpoint (empty when it does not
    answer)."""
    wanted = {
        TRAINER_STEP: "step",
        prometheus_name("train_rollouts/rewards"): "reward",
        prometheus_name("train_rollouts/init_policy_kl"): "kl",
        prometheus_name("throughput/generated_tokens_per_second"): "tokens_per_second",
    }
    found = scrape(url, HTTP_TIMEOUT_S) or {}
    return {key: found[name] for name, key in wanted.items() if name in found}


@dataclass
class RunMemory:
    """What the operator keeps per run between passes: connections, and facts it cannot read back."""

    reconciler: WeightReconciler | None = None
    redis_url: str = ""
    last_metrics: dict[str, float] = field(default_factory=dict)
    # set by the status pass, read by the weight rollout loop
    run: Run | None = None
    generator_urls: dict[str, str] = field(default_factory=dict)
    # set by the weight rollout loop, read by the status pass
    published: int | None = None
    loaded: list[GeneratorWeights] = field(default_factory=list)
    # when the last step's weights were first seen published (the generators get FINAL_SYNC_S to load them)
    final_published_at: float | None = None
    # what the events said last: each pod's restart count, the weight version every ready generator had loaded
    restarts: dict[str, int] = field(default_factory=dict)
    rolled_out: int | None = None

    def close(self) -> None:
        if self.reconciler is not None:
            self.reconciler.close()
            self.reconciler.queue.client.close()


def secret_value(api: client.ApiClient, namespace: str, name: str, key: str) -> str:
    return _decoded(client.CoreV1Api(api).read_namespaced_secret(name, namespace), key)


def _decoded(secret: client.V1Secret, key: str) -> str:
    if not secret.data or key not in secret.data:
        name = f"{secret.metadata.namespace}/{secret.metadata.name}"
        raise kopf.TemporaryError(f"Secret {name} has no key {key!r}", delay=10)
    return base64.b64decode(secret.data[key]).decode()


def _labels(read: Any, namespace: str, name: str) -> dict[str, str] | None:
    """The labels of the object `read(name, namespace)` returns (a CoreV1Api read_namespaced_*); None when there is
    no such object."""
    try:
        found = read(name, namespace)
    except client.ApiException as err:
        if err.status == 404:
            return None
        raise
    return found.metadata.labels or {}


def redis_url(api: client.ApiClient, namespace: str, run_name: str, external_secret: str | None) -> str:
    """The run's Redis URL: from its own Secret, or from the external one, which must consent
    (tenancy.redis_secret_refusal): the operator connects to no Redis that a run merely names."""
    if external_secret is None:
        return secret_value(api, namespace, f"{run_name}-secrets", REDIS_URL_KEY)
    secret = client.CoreV1Api(api).read_namespaced_secret(external_secret, namespace)
    if refusal := redis_secret_refusal(external_secret, namespace, secret.metadata.labels or {}):
        raise kopf.TemporaryError(refusal, delay=10)
    return _decoded(secret, REDIS_URL_KEY)


def not_permitted(api: client.ApiClient, run: Run) -> list[str]:
    """The run's settings that the operator's tenancy configuration refuses (empty: none)."""
    core = client.CoreV1Api(api)
    found = refusals(run)
    claims = core.read_namespaced_persistent_volume_claim
    found += claim_refusals(run, lambda name: _labels(claims, run.namespace, name))
    external = run.spec.kubernetes.external_redis_secret
    if external is not None:
        labels = _labels(core.read_namespaced_secret, run.namespace, external)
        found += [refusal] if (refusal := redis_secret_refusal(external, run.namespace, labels)) else []
    return found


def weight_reconciler(api: client.ApiClient, run: Run, memory: RunMemory) -> WeightReconciler:
    url = redis_url(api, run.namespace, run.name, run.spec.kubernetes.external_redis_secret)
    if memory.reconciler is None or memory.redis_url != url:
        memory.close()
        connection = redis.Redis.from_url(url, socket_timeout=HTTP_TIMEOUT_S, socket_connect_timeout=HTTP_TIMEOUT_S)
        token = secret_value(api, run.namespace, run.child("secrets"), "control-token")
        fanout = relay_fanout(kubernetes_weights(run.spec.weights))
        queue = RolloutQueue(connection, run.name)
        memory.reconciler = WeightReconciler(queue, {}, token, timeout_s=HTTP_TIMEOUT_S, relay_fanout=fanout)
        memory.redis_url = url
    return memory.reconciler


# ---- status -----------------------------------------------------------------------------------------------
def condition(kind: str, true: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    status = "True" if true else "False"
    return {"type": kind, "status": status, "reason": reason, "message": message, "observedGeneration": generation}


def with_transition_times(new: list[dict], old: list[dict]) -> list[dict]:
    """Keep a condition's lastTransitionTime while its status stays the same."""
    before = {c["type"]: c for c in old or []}
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for c in new:
        previous = before.get(c["type"])
        same = previous is not None and previous.get("status") == c["status"]
        c["lastTransitionTime"] = previous.get("lastTransitionTime", now) if same else now
    return new


def phase_of(
    spec: ReinforceRunSpec, pods: list[PodState], published: int | None, finished_before: bool, final_synced: bool
) -> tuple[str, str, str]:
    """(phase, reason, message) from what is observed. final_synced: every ready generator has the last step's
    weights, or FINAL_SYNC_S passed since they were published (the run ends with its generators on its final
    policy, but a generator that refuses them does not keep it from ending)."""
    steps = spec.training.steps
    if finished_before or (published is not None and published >= steps and final_synced):
        return "Succeeded", "Finished", f"trained all {steps} steps"
    crashing = [p for p in pods if p.restarts > spec.restart.max_restarts]
    if crashing:
        names = ", ".join(f"{p.name} ({p.restarts} restarts)" for p in crashing)
        return "Failed", "CrashLooping", f"more than restart.maxRestarts={spec.restart.max_restarts}: {names}"
    if spec.suspended:
        why = "spec.suspend is true" if spec.suspend else f"queued in {spec.kubernetes.queue_name}, spec.suspend unset"
        return "Suspended", "Suspended", f"{why}: every component is scaled to zero"
    needed = {"reward": 1, "trainer": trainer_pods(spec.training), "generator": 1}
    if spec.algorithm.name == "ppo":
        needed[COMPONENT_CRITIC] = 1
    if spec.environment.enabled:
        needed[COMPONENT_ENVIRONMENT] = 1
    if spec.kubernetes.external_redis_secret is None:
        needed["redis"] = 1
    missing = [f"{c} ({n} ready pods needed)" for c, n in needed.items() if _ready(pods, c) < n]
    if missing:
        return "Pending", "ComponentsNotReady", "waiting for " + ", ".join(missing)
    return "Running", "Training", f"step {published or 0} of {steps}"


def _ready(pods: list[PodState], component: str) -> int:
    return sum(p.ready for p in pods if p.component == component)


# ---- handlers ---------------------------------------------------------------------------------------------
@dataclass
class OperatorState:
    api: client.ApiClient
    config: OperatorConfig
    runs: dict[str, RunMemory] = field(default_factory=dict)
    # Set on the operator's exit. kopf stops the daemons it knows of then, but one spawned for an event still in
    # processing is never told: it must see this, or its thread keeps the operator's process from exiting.
    exiting: threading.Event = field(default_factory=threading.Event)


def _state(memo: kopf.Memo) -> OperatorState:
    return memo["state"]


def _invalid(body: kopf.Body, patch: kopf.Patch, status: dict, message: str, generation: int) -> None:
    patch.status["phase"] = "Failed"
    patch.status["observedGeneration"] = generation
    refused = condition("SpecAccepted", False, "InvalidSpec", message, generation)
    announce_refusal(body, status, refused)
    announce_phase(body, status.get("phase"), "Failed", "InvalidSpec", "the spec is refused")
    patch.status["conditions"] = with_transition_times([refused], status.get("conditions", []))


# ---- events: what `kubectl describe rr` tells ---------------------------------------------------------------
# Each pass sees the whole state: an event is posted only where it differs from what the run's status (or, for
# restarts and weights, the operator's memory of the run) said before, so a pass every 2 s posts nothing new.
def announce_phase(body: kopf.Body, before: str | None, phase: str, reason: str, message: str) -> None:
    if phase != before:
        kind = "Warning" if phase == "Failed" else "Normal"
        kopf.event(body, type=kind, reason=reason, message=f"phase {before or 'none'} -> {phase}: {message}")


def announce_refusal(body: kopf.Body, status: dict, accepted: dict[str, Any]) -> None:
    """A refused spec (SpecAccepted False), once per refusal: posted when the condition's reason or message
    changes."""
    previous = next((c for c in status.get("conditions", []) if c["type"] == "SpecAccepted"), {})
    same = all(previous.get(key) == accepted[key] for key in ("status", "reason", "message"))
    if accepted["status"] == "False" and not same:
        kopf.event(body, type="Warning", reason=accepted["reason"], message=accepted["message"])


def announce_restarts(body: kopf.Body, pods: list[PodState], memory: RunMemory) -> None:
    """Restarts seen since the last pass (a pod first seen is counted from there: the operator may be new)."""
    for pod in pods:
        before = memory.restarts.get(pod.name)
        if before is not None and pod.restarts > before:
            message = f"pod {pod.name} ({pod.component}) restarted: {pod.restarts} restarts in all"
            kopf.event(body, type="Warning", reason="PodRestarted", message=message)
        memory.restarts[pod.name] = pod.restarts


def announce_rollout(body: kopf.Body, published: int | None, ready_generators: int, memory: RunMemory) -> None:
    """Called when no ready generator lags: weight version `published` is rolled out."""
    if published is not None and ready_generators and published != memory.rolled_out:
        message = f"every ready generator ({ready_generators}) loaded weight version {published}"
        kopf.event(body, type="Normal", reason="WeightsRolledOut", message=message)
        memory.rolled_out = published


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING
    config_file = os.environ.get(OPERATOR_CONFIG_ENV)
    memo["state"] = OperatorState(_api_client(), load_config(Path(config_file) if config_file else None))


@kopf.on.cleanup()
def close_connections(memo: kopf.Memo, **_: Any) -> None:
    state = _state(memo)
    state.exiting.set()
    for memory in state.runs.values():
        memory.close()


def _api_client() -> client.ApiClient:
    """In a pod: its ServiceAccount; elsewhere $KUBECONFIG or ~/.kube/config (read now, not at import)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        return client.ApiClient()
    return config.new_client_from_config(config_file=os.environ.get("KUBECONFIG") or "~/.kube/config")


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # The same choice as _api_client, so that both act with the same credentials and server. In a pod: the
    # kubernetes client's in-cluster reader, which honours KUBERNETES_SERVICE_HOST/PORT (the chart's `apiServer`;
    # kopf's own service-account reader always dials kubernetes.default.svc, which needs cluster DNS).
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return kopf.login_via_client(**kwargs)
    return kopf.login_with_kubeconfig(**kwargs)


def _run(state: OperatorState, body: kopf.Body, spec: ReinforceRunSpec, status: dict) -> Run:
    meta = body["metadata"]
    stopped = spec.suspended or status.get("phase") == "Succeeded"
    return Run(meta["name"], meta["namespace"], meta["uid"], spec, state.config, stopped=stopped)


@kopf.on.resume(*RUNS)
@kopf.on.create(*RUNS)
@kopf.on.update(*RUNS, field="spec")
@kopf.timer(*RUNS, interval=STATUS_INTERVAL_S, initial_delay=1.0)
def reconcile(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: Any) -> None:
    state = _state(memo)
    meta, status = body["metadata"], dict(body.get("status") or {})
    generation = meta.get("generation", 0)
    try:
        spec = parse_run_resource(meta["name"], dict(body["spec"]))
    except SpecError as err:
        _invalid(body, patch, status, str(err), generation)
        return
    run = _run(state, body, spec, status)
    accepted = accepted_spec(state.api, run)
    # the services' spec file spells fields by name; the refusal names them as the ReinforceRun does
    wanted = yaml.safe_load(services_spec_yaml(run))
    refused = immutable_changes(respell(accepted, RunSpec), respell(wanted, RunSpec)) if accepted else []
    denied = [] if refused else not_permitted(state.api, run)
    conditions = []
    if refused:
        message = f"{', '.join(refused)}: cannot change once the run started; revert, or create a new run"
        conditions.append(condition("SpecAccepted", False, "ImmutableFieldChanged", message, generation))
    elif denied:
        message = "; ".join(denied) + ". Not permitted by the operator's tenancy configuration: nothing is applied"
        conditions.append(condition("SpecAccepted", False, "NotPermitted", message, generation))
    else:
        for obj in children(run):
            apply(state.api, obj)
        conditions.append(condition("SpecAccepted", True, "Applied", "every child is applied", generation))
        patch.status["observedGeneration"] = generation
    announce_refusal(body, status, conditions[0])
    observe(state, body, run, patch, status, conditions)


def observe(
    state: OperatorState, body: kopf.Body, run: Run, patch: kopf.Patch, status: dict, conditions: list[dict]
) -> None:
    memory = state.runs.setdefault(run.uid, RunMemory())
    pods = pod_states(state.api, run)
    announce_restarts(body, pods, memory)
    generators = [p for p in pods if p.component == "generator"]
    memory.run = run
    memory.generator_urls = {
        p.name: f"http://{p.ip}:{generator_port(run, p.name)}" for p in generators if p.ready and p.ip
    }
    published, loaded = memory.published, memory.loaded
    trainer_0 = next((p for p in pods if p.name == f"{run.child('trainer')}-0" and p.ip), None)
    if trainer_0 is not None:
        memory.last_metrics.update(
            trainer_metrics(f"http://{trainer_0.ip}:{state.config.ports.trainer_metrics}/metrics")
        )
    finished = status.get("phase") == "Succeeded"
    versions = {g.name: g.loaded_version for g in loaded}
    loads = {g.name: g.loads for g in loaded}
    lagging = [g.name for g in generators if g.ready and published is not None and versions.get(g.name) != published]
    if published is not None and published >= run.spec.training.steps and memory.final_published_at is None:
        memory.final_published_at = time.monotonic()
    final_synced = memory.final_published_at is not None and (
        not lagging or time.monotonic() - memory.final_published_at > FINAL_SYNC_S
    )
    phase, reason, message = phase_of(run.spec, pods, published, finished, final_synced)
    announce_phase(body, status.get("phase"), phase, reason, message)
    if not lagging:
        announce_rollout(body, published, _ready(pods, "generator"), memory)
    generation = conditions[0]["observedGeneration"]
    conditions.append(condition("Ready", phase == "Running", reason, message, generation))
    in_sync = f"every ready generator has version {published}" if not lagging else f"behind: {', '.join(lagging)}"
    conditions.append(
        condition("WeightsInSync", not lagging, "Synced" if not lagging else "Lagging", in_sync, generation)
    )
    patch.status.update(
        phase=phase,
        conditions=with_transition_times(conditions, status.get("conditions", [])),
        generatorsReady=f"{_ready(pods, 'generator')}/{run.replicas(run.spec.generation.num_generators)}",
        # the scale subresource's (generation.numGenerators): what an HPA or KEDA reads back
        generatorReplicas=len(generators),
        generatorSelector=",".join(f"{k}={v}" for k, v in run.selector("generator").items()),
        generators=[
            {"name": g.name, "ready": g.ready, "loadedVersion": versions.get(g.name), "weightLoads": loads.get(g.name)}
            for g in generators
        ],
        publishedWeightVersion=published,
        # version v is published just before step v's metrics: a pass between the two must not show step v - 1
        step=max(int(memory.last_metrics.get("step", 0)), published or 0),
        reward=memory.last_metrics.get("reward"),
        kl=memory.last_metrics.get("kl"),
        tokensPerSecond=memory.last_metrics.get("tokens_per_second"),
    )
    if phase == "Succeeded" and not finished:
        log.info("run %s/%s finished: scaling it to zero", run.namespace, run.name)


@kopf.daemon(*RUNS, cancellation_timeout=10)
def roll_out_weights(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    """Weight rollout, apart from the status pass: an on-policy step waits for it, so it polls every
    WEIGHT_POLL_S (one Redis GET while nothing changes) instead of the status pass's interval."""
    state = _state(memo)
    memory = state.runs.setdefault(body["metadata"]["uid"], RunMemory())
    while not (stopped or state.exiting.is_set()):
        run = memory.run
        if run is None:  # the first status pass has not run yet (or the spec is invalid)
            stopped.wait(STATUS_INTERVAL_S)
            continue
        try:
            reconciler = weight_reconciler(state.api, run, memory)
        except (client.ApiException, kopf.TemporaryError) as err:  # the secrets are not there yet
            log.info("run %s: weight rollout waits: %s", run.name, err)
            stopped.wait(STATUS_INTERVAL_S)
            continue
        reconciler.retarget(memory.generator_urls)
        memory.published, memory.loaded = reconciler.reconcile_once()
        stopped.wait(WEIGHT_POLL_S)


def _external_redis_secret(spec: kopf.Spec | dict) -> str | None:
    return (spec.get("kubernetes") or {}).get("externalRedisSecret")


def _uses_external_redis(spec: kopf.Spec, **_: Any) -> bool:
    return bool(_external_redis_secret(spec))


@kopf.on.delete(*RUNS, when=_uses_external_redis)
def delete_redis_keys(body: kopf.Body, memo: kopf.Memo, retry: int, **_: Any) -> None:
    """The run's own Redis goes with its volume; an external one keeps the keys unless they are deleted."""
    state, meta = _state(memo), body["metadata"]
    secret = _external_redis_secret(body["spec"])
    try:
        url = redis_url(state.api, meta["namespace"], meta["name"], secret)
        connection = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        deleted = RolloutQueue(connection, meta["name"]).delete_run_keys()
        connection.close()
    except (redis.RedisError, client.ApiException, kopf.TemporaryError) as err:
        if retry >= 5:  # never block the deletion for ever: say so and let it go
            log.warning("run %s: Redis keys not deleted after %d tries: %s", meta["name"], retry + 1, err)
            return
        raise kopf.TemporaryError(f"cannot delete the run's Redis keys yet: {err}", delay=5) from err
    log.info("run %s: deleted %d Redis keys", meta["name"], deleted)


@kopf.on.delete(*RUNS, optional=True)
def forget(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memory = _state(memo).runs.pop(body["metadata"]["uid"], None)
    if memory is not None:
        memory.close()


# ---- command line -----------------------------------------------------------------------------------------
def add_operator_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("operator", help="run the Kubernetes operator for ReinforceRun resources")
    parser.add_argument(
        "--namespace", "-n", action="append", default=[], help="watch this namespace (repeat); default: all"
    )
    parser.add_argument("--config", type=Path, help="operator configuration YAML (OperatorConfig)")
    parser.add_argument(
        "--kubeconfig", type=Path, help="kubeconfig (default: $KUBECONFIG, ~/.kube/config or in-cluster)"
    )
    parser.add_argument("--liveness", metavar="URL", help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.set_defaults(handler=operator_command)


def load_config(path: Path | None) -> OperatorConfig:
    if path is None:
        return OperatorConfig()
    try:
        return OperatorConfig.model_validate(yaml.safe_load(path.read_text()) or {})
    except (OSError, yaml.YAMLError, ValueError) as err:
        raise SpecError(f"{path}: invalid operator configuration: {err}") from None


def operator_command(args: argparse.Namespace) -> int:
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = str(args.kubeconfig)
    if args.config:
        load_config(args.config)  # a bad file is an error now, not in the first handler
        os.environ[OPERATOR_CONFIG_ENV] = str(args.config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s operator %(levelname)s %(message)s")
    kopf.run(
        standalone=True, clusterwide=not args.namespace, namespaces=args.namespace, liveness_endpoint=args.liveness
    )
    return 0
