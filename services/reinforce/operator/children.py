"""The Kubernetes objects of one ReinforceRun, as plain manifests (the operator applies them).

For a run R in namespace N:

- ConfigMap ``R-spec``: the run spec the services read (``/etc/reinforce/spec.yaml``).
- Secret ``R-secrets``: one token per capability (the generators' control plane, the trainer's weight endpoint and,
  ppo, the critic; each pod gets only its service's) and, with the run's own Redis, its password and URL.
- PersistentVolumeClaim ``R-data``: the run folder of the trainer (checkpoints, weights, final model).
- StatefulSet + Service ``R-redis`` (AOF on a volume), unless ``kubernetes.externalRedisSecret`` names one.
- Deployment + Service ``R-reward``: the Triton reward server.
- Deployment ``R-generator``: ``generation.numGenerators`` replicas.
- environment.enabled: Deployment + Service ``R-environment``, the environment service (tools for multi-turn
  rollouts; it runs model-written code), and NetworkPolicy ``R-environment-network``: connections from the run's
  generators to its API port and from anywhere to its metrics port, and no egress at all. Its pod is also locked down
  past the others': a read-only root file system with a size-limited emptyDir at /tmp for scratch, no service links,
  resource limits by default, and an optional ``runtimeClassName`` (gVisor, ...) through its pod template.
- algorithm.name ppo: StatefulSet + Service ``R-critic`` and its PersistentVolumeClaim ``R-critic-data`` (the critic's
  initial model and checkpoints; the trainer checkpoints and restores it over HTTP).
- StatefulSet + headless Service ``R-trainer``: one pod per model replica (``training.numRanks`` /
  ``training.tensorParallel``), each running its replica's ``tensorParallel`` ranks (tensor parallelism wants the
  fast links inside a node; request that many GPUs per trainer pod); torchrun's rendezvous is pod 0 through that
  Service.
- NetworkPolicy ``R-network``: the run's pods (the environment's aside) accept connections from the run's own pods
  on any port, from the operator's pods (in its own namespace) on the ports it calls (Redis, the generators' control
  port), and from anywhere on their metrics ports only (Prometheus; generators and the critic serve metrics on ports
  of their own); nothing else reaches Redis, the trainer, the reward server or a control API.

Every pod passes the "restricted" Pod Security Standard (non-root, no privilege escalation, no capabilities,
RuntimeDefault seccomp) and mounts no service account token: no service of a run calls the Kubernetes API. The
host-network profile cannot pass it (hostNetwork is what "baseline" already forbids) but keeps every other setting
of it; it is for a single-node test cluster, and only for the namespaces tenancy.hostNetworkNamespaces names.
What a run's own settings may ask for (placement, resources, an external Redis Secret) is operator/tenancy.py's.
A component's pod template override (`kubernetes.<component>.template`, the operator's `pods` default first, then
the run's) is strategic-merged over the pod built here (operator/podtemplate.py).

Every object carries the run's labels and an ownerReference to the run (controller), so deleting the run
deletes them. These builders are pure functions of the run: the operator's reconcile is "apply them all".
"""

from __future__ import annotations

import secrets
import zlib
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import Field, field_validator

from reinforce.core import launch
from reinforce.core.launch_flags import (
    CriticFlags,
    EnvironmentFlags,
    GeneratorFlags,
    LaunchFlags,
    RewardFlags,
    ShellText,
    TrainerFlags,
)
from reinforce.core.names import (
    ANY_HOST,
    COMPONENT_CRITIC,
    COMPONENT_ENVIRONMENT,
    COMPONENT_GENERATOR,
    COMPONENT_REWARD,
    COMPONENTS,
    CONTROL_TOKEN_ENV,
    CRITIC_PORT,
    CRITIC_TOKEN_ENV,
    ENVIRONMENT_PORT,
    ENVIRONMENT_TOKEN_ENV,
    HEALTH_PATH,
    K8S_COMPONENT_LABEL,
    K8S_INSTANCE_LABEL,
    K8S_NAME_LABEL,
    LOCAL_HOST,
    OPERATOR_APP_NAME,
    POD_NAME_ENV,
    REDIS_URL_ENV,
    REWARD_LIVE_PATH,
    WEIGHTS_TOKEN_ENV,
)
from reinforce.core.registry import ENGINE_PACKAGES
from reinforce.core.spec import TrainingSpec, WeightsSpec, _Section, dump_spec
from reinforce.core.threads import OPENMP_ENVIRONMENT
from reinforce.operator.podtemplate import strategic_merge
from reinforce.operator.resource import (
    GPU_RESOURCE,
    GROUP,
    KIND,
    KUEUE_QUEUE_LABEL,
    VERSION,
    PodSpec,
    ReinforceRunSpec,
)
from reinforce.operator.tenancy import Tenancy

SPEC_DIR = "/etc/reinforce"
DEFAULT_OPERATOR_NAMESPACE = "reinforce-system"  # operator/operator.yaml's
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # every namespace's own name (set by Kubernetes from 1.21)
DATA_DIR = "/data"
RUN_DIR = f"{DATA_DIR}/run"
SPEC_FILE = f"{SPEC_DIR}/spec.yaml"
REDIS_URL_KEY = "url"  # the key of the Secret holding a redis:// URL (the run's own or an external one)
# The keys of Secret R-secrets holding each token, by the environment variable services read it from
SECRET_KEYS = {
    CONTROL_TOKEN_ENV: "control-token",
    WEIGHTS_TOKEN_ENV: "weights-token",
    CRITIC_TOKEN_ENV: "critic-token",
    ENVIRONMENT_TOKEN_ENV: "environment-token",
}
REDIS_CONFIG_DIR = "/run/redis"  # an in-memory emptyDir: the config file holding Redis' password
# The images' user (services/reinforce/core/Dockerfile); also the group that owns the volumes (fsGroup).
RUN_AS_USER = 1000
# "restricted": https://kubernetes.io/docs/concepts/security/pod-security-standards/
POD_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_USER,
    "runAsGroup": RUN_AS_USER,
    "fsGroup": RUN_AS_USER,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
# The environment service runs model-written code: nothing it runs may change the image's files either.
ENVIRONMENT_SECURITY_CONTEXT = {**CONTAINER_SECURITY_CONTEXT, "readOnlyRootFilesystem": True}
# The environment pod's uid is its run's own (ENVIRONMENT_UID_BASE plus a hash of the run's uid), not RUN_AS_USER
# (still its group): the kernel counts a tool call's RLIMIT_NPROC (environment.max_processes) over every process and
# thread of its uid on the node, and under the uid every other run pod has, a trainer's threads would leave the calls
# none (not a thread for `import numpy`, not a subprocess).
ENVIRONMENT_UID_BASE, ENVIRONMENT_UIDS = 100_000, 1 << 20
# Tool calls share the environment pod's IPC namespace: with shm_rmid_forced a System V shared memory segment ends
# with the last process attached to it, not with the pod (a call's would keep its pages outside every limit). One of
# Kubernetes' safe sysctls: it is the pod's IPC namespace's own, the node's is untouched.
ENVIRONMENT_SYSCTLS = [{"name": "kernel.shm_rmid_forced", "value": "1"}]
SCRATCH_DIR = "/tmp"  # the environment pod's only writable folder (tempfile's default: each tool call's folder)
# Unset environment resources: what the service itself takes beside its tool calls' memory, and what it asks for.
ENVIRONMENT_SERVICE_MEMORY_MIB = 512
ENVIRONMENT_REQUESTS = {"cpu": "100m", "memory": "256Mi"}


class Ports(_Section):
    """The ports the services listen on inside their pods."""

    redis: int = Field(6379, ge=1, le=65535, description="Redis.")
    reward_http: int = Field(8000, ge=1, le=65535, description="Triton HTTP (inference, readiness).")
    reward_grpc: int = Field(8001, ge=1, le=65535, description="Triton gRPC.")
    reward_metrics: int = Field(8002, ge=1, le=65535, description="Triton's Prometheus metrics.")
    generator: int = Field(8080, ge=1, le=65535, description="Generators' control plane: health, weight loading.")
    generator_metrics: int = Field(9080, ge=1, le=65535, description="Generators' Prometheus metrics.")
    trainer_metrics: int = Field(9000, ge=1, le=65535, description="Trainer's Prometheus metrics (and status).")
    trainer_weights: int = Field(9001, ge=1, le=65535, description="Trainer's weight endpoint (rank 0).")
    critic: int = Field(CRITIC_PORT, ge=1, le=65535, description="ppo: the critic service (API, probes).")
    critic_metrics: int = Field(CRITIC_PORT + 1, ge=1, le=65535, description="ppo: the critic's Prometheus metrics.")
    # not ENVIRONMENT_PORT itself, which is critic_metrics' default: host-network pods share the node's ports
    environment: int = Field(
        ENVIRONMENT_PORT + 1, ge=1, le=65535, description="environment.enabled: the environment service (API, probes)."
    )
    environment_metrics: int = Field(
        ENVIRONMENT_PORT + 2, ge=1, le=65535, description="environment.enabled: its Prometheus metrics."
    )
    rendezvous: int = Field(29500, ge=1, le=65535, description="torchrun's rendezvous on trainer pod 0.")


class Images(_Section):
    """Each component's image (services/reinforce/<component>/Dockerfile builds it; `make images` builds them all)."""

    redis: str = Field("redis:7.0", description="The run's Redis (needs `redis-server` and `sh`).")
    reward: str = Field("reinforce-reward:0.1.0", description="Reward server.")
    generator: str = Field(
        "reinforce-generator:0.1.0",
        description="Generators of generation.engine torch, and of auto (read as torch here).",
    )
    generator_vllm: str = Field(
        "reinforce-generator:0.1.0-vllm",
        description="Generators of generation.engine vllm (the generator image FROM the vLLM runtime).",
    )
    generator_tensorrt_llm: str = Field(
        "reinforce-generator:0.1.0-trtllm",
        description="Generators of generation.engine tensorrt_llm (GPU only: FROM the TensorRT-LLM runtime).",
    )
    trainer: str = Field("reinforce-trainer:0.1.0", description="Trainer.")
    critic: str = Field("reinforce-critic:0.1.0", description="ppo: the critic service.")
    environment: str = Field("reinforce-environment:0.1.0", description="environment.enabled: the environment service.")


class OperatorConfig(_Section):
    """The operator's configuration: defaults for what a ReinforceRun leaves unset (`--config FILE`)."""

    images: Images = Field(default_factory=Images)
    image_pull_policy: str = Field("IfNotPresent", description="Pull policy of every container.")
    pods: dict[str, PodSpec] = Field(
        default_factory=dict,
        description="Default pod settings per component (redis, reward, generator, trainer, critic, environment); a "
        "run's own win.",
    )
    ports: Ports = Field(default_factory=Ports)
    profile: Literal["standard", "host-network"] = Field(
        "standard",
        description="standard: pods reach each other through Services and cluster DNS (real clusters). "
        "host-network: every pod uses the node's network and reaches the others on 127.0.0.1, for a single-node "
        "cluster without kube-proxy or DNS; one run per node, generator i listens on ports.generator + i "
        "(metrics: ports.generatorMetrics + i).",
    )
    tenancy: Tenancy = Field(default_factory=Tenancy)
    allowed_images: list[str] | None = Field(
        None,
        description="Prefixes a run's own `kubernetes.<component>.image` must start with, e.g. "
        "[registry.example/reinforce-] (end each with / or - so that it cannot match another registry or "
        "repository); null: only the images configured here (`images` and `pods`). A run's image runs with what "
        "the operator gives its pods (placement, volumes, Secrets), so its author may not pick any image.",
    )
    operator_namespace: str = Field(
        DEFAULT_OPERATOR_NAMESPACE,
        description="The namespace of the operator's pod: the runs' NetworkPolicies let the operator in from there "
        "only (the chart sets its release's namespace).",
    )
    keda_namespace: str | None = Field(
        "keda",
        description="The namespace KEDA runs in: the runs' NetworkPolicies let its pods reach the run's Redis port "
        "there, where its redis-streams scaler reads the prompts stream (docs/kubernetes/autoscaling.md). null: "
        "KEDA is not let in, and under a CNI that enforces NetworkPolicies its scaler never reads a run's Redis.",
    )

    def configured_images(self) -> set[str]:
        """The images this configuration names: the only ones a run may choose while allowed_images is null."""
        return {*self.images.model_dump().values(), *(pod.image for pod in self.pods.values() if pod.image)}

    @field_validator("pods")
    @classmethod
    def _known_components(cls, pods: dict[str, PodSpec]) -> dict[str, PodSpec]:
        unknown = set(pods) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"unknown components {sorted(unknown)}: expected some of {list(COMPONENTS)}")
        return pods


@dataclass(frozen=True)
class Run:
    """One ReinforceRun as the builders see it."""

    name: str
    namespace: str
    uid: str
    spec: ReinforceRunSpec
    config: OperatorConfig
    stopped: bool = False  # suspended, or finished: every workload at zero replicas
    overrides: bool = True  # merge the pod template overrides (False: the operator's own pods, checked against)

    def child(self, component: str) -> str:
        return f"{self.name}-{component}"

    @property
    def labels(self) -> dict[str, str]:
        return {
            K8S_NAME_LABEL: "reinforce",
            K8S_INSTANCE_LABEL: self.name,
            "app.kubernetes.io/managed-by": "reinforce-operator",
        }

    def selector(self, component: str) -> dict[str, str]:
        return {K8S_INSTANCE_LABEL: self.name, K8S_COMPONENT_LABEL: component}

    def metadata(self, name: str, component: str | None = None) -> dict[str, Any]:
        labels = {**self.labels, **({K8S_COMPONENT_LABEL: component} if component else {})}
        owner = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        return {"name": name, "namespace": self.namespace, "labels": labels, "ownerReferences": [owner]}

    @property
    def queue_label(self) -> dict[str, str]:
        """Kueue's queue label for the run's workloads and pods (empty without kubernetes.queueName)."""
        queue = self.spec.kubernetes.queue_name
        return {KUEUE_QUEUE_LABEL: queue} if queue else {}

    @property
    def redis_secret(self) -> str:
        return self.spec.kubernetes.external_redis_secret or self.child("secrets")

    def replicas(self, wanted: int) -> int:
        return 0 if self.stopped else wanted

    @property
    def ppo(self) -> bool:
        """PPO runs have a critic service."""
        return self.spec.algorithm.name == "ppo"

    @property
    def environment(self) -> bool:
        """Multi-turn runs with tools have an environment service."""
        return self.spec.environment.enabled

    @property
    def host_network(self) -> bool:
        return self.config.profile == "host-network"

    def host(self, component: str) -> str:
        """Where the other pods reach a component's Service (host-network: the node itself)."""
        return LOCAL_HOST if self.host_network else f"{self.child(component)}.{self.namespace}.svc"


def children(run: Run) -> list[dict[str, Any]]:
    """Every object the run owns, in the order they are applied (what others mount or call comes first)."""
    objects = [spec_config_map(run), secrets_secret(run), data_volume(run)]
    if run.spec.kubernetes.external_redis_secret is None:
        objects += [redis_volume(run), redis_service(run), redis_stateful_set(run)]
    objects += [reward_service(run), reward_deployment(run)]
    if run.environment:  # before the generators, which call it
        objects += [environment_service(run), environment_deployment(run), environment_network_policy(run)]
    objects += [generator_deployment(run)]
    if run.ppo:
        objects += [critic_volume(run), critic_service(run), critic_stateful_set(run)]
    objects += [trainer_service(run), trainer_stateful_set(run), network_policy(run)]
    return objects


def kubernetes_weights(weights: WeightsSpec) -> WeightsSpec:
    """On Kubernetes the generators do not share the trainer's volume: weights always go over HTTP, relayed from
    generator to generator unless the spec says direct."""
    return weights.model_copy(update={"transport": "http", "distribution": weights.distribution or "relay"})


def services_spec_yaml(run: Run) -> str:
    spec = run.spec.run_spec(RUN_DIR)
    return dump_spec(spec.model_copy(update={"weights": kubernetes_weights(spec.weights)}))


def spec_config_map(run: Run) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": run.metadata(run.child("spec")),
        "data": {"spec.yaml": services_spec_yaml(run)},
    }


def secrets_secret(run: Run) -> dict[str, Any]:
    """Fresh random values: the operator creates this once and never replaces it (see CREATE_ONLY). One token per
    capability (SECRET_KEYS); each pod's environment takes only its service's (launch.Service.credentials)."""
    values = {key: secrets.token_urlsafe(24) for name, key in SECRET_KEYS.items() if launch.opened(name, run.spec)}
    if run.spec.kubernetes.external_redis_secret is None:
        password = secrets.token_urlsafe(24)
        values["redis-password"] = password
        address = f"{run.host('redis')}:{run.config.ports.redis}"
        values[REDIS_URL_KEY] = f"redis://:{password}@{address}/0"
    return {"apiVersion": "v1", "kind": "Secret", "metadata": run.metadata(run.child("secrets")), "stringData": values}


def _claim_spec(run: Run, size: str, access_mode: str = "ReadWriteOnce") -> dict[str, Any]:
    claim: dict[str, Any] = {"accessModes": [access_mode], "resources": {"requests": {"storage": size}}}
    if run.spec.kubernetes.storage_class:
        claim["storageClassName"] = run.spec.kubernetes.storage_class
    return claim


def data_access_mode(run: Run) -> str:
    """Every trainer pod mounts the run's data volume (the checkpoints are written there, and every rank reads them on
    resume): several pods, possibly on several nodes, need ReadWriteMany storage (NFS, CephFS, a cloud file store)."""
    return "ReadWriteMany" if trainer_pods(run.spec.training) > 1 else "ReadWriteOnce"


def data_volume(run: Run) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": run.metadata(run.child("data"), "trainer"),
        "spec": _claim_spec(run, run.spec.kubernetes.storage_size, data_access_mode(run)),
    }


def redis_volume(run: Run) -> dict[str, Any]:
    """Redis' own claim, owned by the run like every child: a StatefulSet's volumeClaimTemplates would make a claim
    that no owner reference ties to the run, left behind when the run is deleted (Kubernetes before 1.27)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": run.metadata(run.child("redis-data"), "redis"),
        "spec": _claim_spec(run, run.spec.kubernetes.redis_storage_size),
    }


def _service(run: Run, component: str, ports: dict[str, int], headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": run.selector(component),
        # protocol spelled out: server-side apply (1.20) keys the list by port and protocol
        "ports": [{"name": name, "port": port, "targetPort": port, "protocol": "TCP"} for name, port in ports.items()],
    }
    if headless:
        # DNS names for each trainer pod, published before they are ready: torchrun's rendezvous needs them.
        spec.update(clusterIP="None", publishNotReadyAddresses=True)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": run.metadata(run.child(component), component),
        "spec": spec,
    }


def _env_from_secret(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _credential_env(run: Run, service: launch.Service) -> list[dict[str, Any]]:
    """The service's credentials from the run's Secrets, those of services the run has (launch.holds)."""
    return [
        _env_from_secret(name, run.redis_secret, REDIS_URL_KEY)
        if name == REDIS_URL_ENV
        else _env_from_secret(name, run.child("secrets"), SECRET_KEYS[name])
        for name in service.credentials
        if launch.holds(service, name, run.spec)  # the reward server's only for reward.function code_tests
    ]


def _service_env(run: Run, service: launch.Service) -> list[dict[str, Any]]:
    """The service's credentials, and nothing else secret, then the plain settings."""
    return [
        *_credential_env(run, service),
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        *({"name": name, "value": value} for name, value in OPENMP_ENVIRONMENT.items()),
    ]


def pod_settings(run: Run, component: str) -> PodSpec:
    """The run's settings for a component's pods, over the operator's defaults (field by field)."""
    default = run.config.pods.get(component, PodSpec())
    mine = getattr(run.spec.kubernetes, component)
    settings = PodSpec.model_validate({**default.model_dump(exclude_unset=True), **mine.model_dump(exclude_unset=True)})
    return _environment_resources(run, settings) if component == COMPONENT_ENVIRONMENT else settings


def _environment_resources(run: Run, settings: PodSpec) -> PodSpec:
    """The environment pod never runs unbounded: each resource limit left unset gets a default from the spec's
    own limits (a CPU per concurrent tool call; their address-space limits plus the service's own memory), and a
    small request where neither a request nor a limit of that resource is set (a limit alone makes Kubernetes
    request the limit)."""
    e = run.spec.environment
    memory_mib = e.max_concurrent_calls * e.memory_limit_mb + ENVIRONMENT_SERVICE_MEMORY_MIB
    limits = {"cpu": str(e.max_concurrent_calls), "memory": f"{memory_mib}Mi", **settings.limits}
    requests = {
        **{r: v for r, v in ENVIRONMENT_REQUESTS.items() if r not in settings.limits},
        **settings.requests,
    }
    return settings.model_copy(update={"limits": limits, "requests": requests})


def default_image(run: Run, component: str) -> str:
    """The operator's image for a component; a generator's is the one built for its engine: images.generator_ENGINE
    for an engine that needs a package of its own (core/registry.py's ENGINE_PACKAGES), images.generator else."""
    engine = run.spec.generation.resolved_engine()
    if component == COMPONENT_GENERATOR and engine in ENGINE_PACKAGES:
        return getattr(run.config.images, f"generator_{engine}")
    return getattr(run.config.images, component)


def _container(run: Run, component: str, command: list[str], ports: dict[str, int], **extra: Any) -> dict[str, Any]:
    settings = pod_settings(run, component)
    limits = dict(settings.limits)
    if settings.gpus:
        limits[GPU_RESOURCE] = str(settings.gpus)
    resources = {key: value for key, value in (("requests", settings.requests), ("limits", limits)) if value}
    return {
        "name": component,
        "image": settings.image or default_image(run, component),
        "imagePullPolicy": run.config.image_pull_policy,
        "command": command,
        "ports": [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports.items()],
        "resources": resources,
        "securityContext": ENVIRONMENT_SECURITY_CONTEXT
        if component == COMPONENT_ENVIRONMENT
        else CONTAINER_SECURITY_CONTEXT,
        **extra,
    }


def _pod_template(run: Run, component: str, containers: list[dict], volumes: list[dict]) -> dict[str, Any]:
    settings = pod_settings(run, component)
    # No service of a run calls the Kubernetes API: no token to steal from its pods.
    spec: dict[str, Any] = {
        "containers": containers,
        "volumes": volumes,
        "automountServiceAccountToken": False,
        "securityContext": POD_SECURITY_CONTEXT,
    }
    if run.host_network:
        spec.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    if settings.node_selector:
        spec["nodeSelector"] = settings.node_selector
    if settings.tolerations:
        spec["tolerations"] = [t.model_dump(exclude_none=True, by_alias=True) for t in settings.tolerations]
    template = {"metadata": {"labels": {**run.labels, K8S_COMPONENT_LABEL: component, **run.queue_label}}, "spec": spec}
    if not run.overrides:
        return template
    for layer in (run.config.pods.get(component, PodSpec()), getattr(run.spec.kubernetes, component)):
        if layer.template is not None:
            template = strategic_merge(template, layer.template)
    return template


def base_pod_templates(run: Run) -> dict[str, dict[str, Any]]:
    """Each component's pod template as the operator builds it, before any template override."""
    workloads = children(replace(run, overrides=False))
    return {
        o["spec"]["template"]["metadata"]["labels"][K8S_COMPONENT_LABEL]: o["spec"]["template"]
        for o in workloads
        if o["kind"] in ("Deployment", "StatefulSet")
    }


def _spec_volume(run: Run) -> tuple[dict[str, Any], dict[str, Any]]:
    volume = {"name": "spec", "configMap": {"name": run.child("spec")}}
    return volume, {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True}


def _http_probe(path: str, port: int, period_s: int = 5) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period_s}


def _python_service(service: launch.Service, flags: LaunchFlags) -> list[str]:
    # Services bind loopback unless told otherwise; a pod's must answer its Service (and, host-network, the node).
    return service.command("python", SPEC_FILE, replace(flags, host=ANY_HOST))


def redis_service(run: Run) -> dict[str, Any]:
    return _service(run, "redis", {"redis": run.config.ports.redis})


def redis_stateful_set(run: Run) -> dict[str, Any]:
    port = run.config.ports.redis
    command = ["sh", "-c", launch.redis_shell_command(port, DATA_DIR, REDIS_CONFIG_DIR, "REDIS_PASSWORD")]
    env = [_env_from_secret("REDIS_PASSWORD", run.child("secrets"), "redis-password")]
    container = _container(
        run, "redis", command, {"redis": port},
        env=env,
        volumeMounts=[{"name": "data", "mountPath": DATA_DIR}, {"name": "config", "mountPath": REDIS_CONFIG_DIR}],
        readinessProbe={"tcpSocket": {"port": port}, "periodSeconds": 5},
    )  # fmt: skip
    volumes = [
        {"name": "data", "persistentVolumeClaim": {"claimName": run.child("redis-data")}},
        {"name": "config", "emptyDir": {"medium": "Memory"}},  # the password never reaches a disk
    ]
    return _stateful_set(run, "redis", 1, _pod_template(run, "redis", [container], volumes))


def reward_service(run: Run) -> dict[str, Any]:
    p = run.config.ports
    return _service(run, "reward", {"http": p.reward_http, "grpc": p.reward_grpc, "metrics": p.reward_metrics})


def reward_deployment(run: Run) -> dict[str, Any]:
    p = run.config.ports
    # reward.function code_tests runs the tests in the environment service
    environment = environment_url(run) if run.spec.reward.uses_environment else None
    flags = RewardFlags(
        http_port=p.reward_http, grpc_port=p.reward_grpc, metrics_port=p.reward_metrics, environment_url=environment
    )
    command = _python_service(launch.REWARD, flags)
    volume, mount = _spec_volume(run)
    container = _container(
        run, "reward", command, {"http": p.reward_http, "grpc": p.reward_grpc, "metrics": p.reward_metrics},
        volumeMounts=[mount],
        **({"env": _credential_env(run, launch.REWARD)} if environment else {}),
        readinessProbe=_http_probe(launch.REWARD.ready_path, p.reward_http),
        livenessProbe={**_http_probe(REWARD_LIVE_PATH, p.reward_http, 10), "initialDelaySeconds": 30},
    )  # fmt: skip
    return _deployment(run, "reward", 1, _pod_template(run, "reward", [container], [volume]))


def generator_deployment(run: Run) -> dict[str, Any]:
    """A Deployment; in the host-network profile a StatefulSet, whose pod ordinal i gives the port base + i."""
    p = run.config.ports
    reward_url = f"http://{run.host('reward')}:{p.reward_http}"
    weights_url = launch.weights_url(trainer_pod_address(run, 0), p.trainer_weights)
    environment = environment_url(run) if run.environment else None
    volume, mount = _spec_volume(run)
    volumes = [volume, {"name": "cache", "emptyDir": {}}]
    mounts = [mount, {"name": "cache", "mountPath": DATA_DIR}]
    replicas = run.spec.generation.num_generators
    if not run.host_network:
        flags = GeneratorFlags(
            reward_url=reward_url, port=p.generator, metrics_port=p.generator_metrics, id=f"$({POD_NAME_ENV})",
            weights_url=weights_url, environment_url=environment,
        )  # fmt: skip
        command = _python_service(launch.GENERATOR, flags)
        container = _container(
            run, "generator", command, {"control": p.generator, "metrics": p.generator_metrics},
            env=_service_env(run, launch.GENERATOR),
            volumeMounts=mounts,
            readinessProbe=_http_probe(launch.GENERATOR.ready_path, p.generator),
            livenessProbe={**_http_probe(HEALTH_PATH, p.generator, 10), "initialDelaySeconds": 60},
        )  # fmt: skip
        return _deployment(run, "generator", replicas, _pod_template(run, "generator", [container], volumes))
    port, metrics_port = (ShellText(f"$(({base} + ${{POD_NAME##*-}}))") for base in (p.generator, p.generator_metrics))
    flags = GeneratorFlags(
        reward_url=reward_url, port=port, metrics_port=metrics_port, id=f"${POD_NAME_ENV}", weights_url=weights_url,
        environment_url=environment,
    )  # fmt: skip
    generator = _python_service(launch.GENERATOR, flags)
    probe = {
        "exec": {
            "command": [
                "python",
                "-c",
                _READY_BY_ORDINAL.format(host=LOCAL_HOST, base=p.generator, path=launch.GENERATOR.ready_path),
            ]
        },
        "periodSeconds": 5,
    }
    container = _container(
        run, "generator", ["sh", "-c", "exec " + " ".join(generator)], {},
        env=_service_env(run, launch.GENERATOR),
        volumeMounts=mounts,
        readinessProbe=probe,
    )  # fmt: skip
    return _stateful_set(run, "generator", replicas, _pod_template(run, "generator", [container], volumes))


# host-network readiness: the port depends on the pod's ordinal, which a probe's fixed port cannot say.
# (In a hostNetwork pod HOSTNAME is the node's name: the pod's name comes from the downward API, POD_NAME.)
_READY_BY_ORDINAL = (
    "import os, urllib.request; "
    'urllib.request.urlopen(f\'http://{host}:{{{base} + int(os.environ["POD_NAME"].rsplit("-", 1)[1])}}{path}\', '
    "timeout=3)"
)


def generator_port(run: Run, pod_name: str) -> int:
    """The control port of a generator pod (host-network: base + its ordinal)."""
    base = run.config.ports.generator
    return base + int(pod_name.rsplit("-", 1)[1]) if run.host_network else base


def _workload(kind: str, run: Run, component: str, replicas: int, template: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": run.replicas(replicas),
        "selector": {"matchLabels": run.selector(component)},
        "template": template,
    }
    if kind == "StatefulSet":
        # Parallel: pods start (and trainer ranks rendezvous) at once rather than one after the other
        spec.update(serviceName=run.child(component), podManagementPolicy="Parallel")
    metadata = run.metadata(run.child(component), component)
    metadata["labels"].update(run.queue_label)  # Kueue's Deployment and StatefulSet integrations read it here
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": metadata, "spec": spec}


def _stateful_set(run: Run, component: str, replicas: int, template: dict[str, Any]) -> dict[str, Any]:
    return _workload("StatefulSet", run, component, replicas, template)


def _deployment(run: Run, component: str, replicas: int, template: dict[str, Any]) -> dict[str, Any]:
    return _workload("Deployment", run, component, replicas, template)


def trainer_service(run: Run) -> dict[str, Any]:
    p = run.config.ports
    ports = {"metrics": p.trainer_metrics, "weights": p.trainer_weights, "rendezvous": p.rendezvous}
    return _service(run, "trainer", ports, headless=True)


def trainer_pod_address(run: Run, ordinal: int) -> str:
    """The DNS name of trainer pod `ordinal` through the headless Service (host-network: the node)."""
    if run.host_network:
        return LOCAL_HOST
    return f"{run.child('trainer')}-{ordinal}.{run.child('trainer')}.{run.namespace}.svc"


def trainer_command(run: Run) -> list[str]:
    p = run.config.ports
    flags = TrainerFlags(
        metrics_port=p.trainer_metrics,
        weights_port=p.trainer_weights,
        advertise_host=trainer_pod_address(run, 0),
        stay_up=True,  # a StatefulSet restarts a container that exits; the operator scales the run to zero instead
        critic_url=f"http://{run.host(COMPONENT_CRITIC)}:{p.critic}" if run.ppo else None,
    )
    trainer = _python_service(launch.TRAINER, flags)
    training = run.spec.training
    if training.num_ranks == 1:
        return trainer
    # One model replica per pod, meeting at torchrun's c10d rendezvous, which pod 0's torchrun hosts. A rank that
    # dies fails its peers' next collective; each pod's torchrun then exits (no restarts of its own), the kubelet
    # restarts the containers, and all ranks meet again and resume from the last checkpoint. (With the static
    # rendezvous a replacement pod could join the dying pod 0's store, then wait forever on its successor's.)
    # Ranks follow the sorted node addresses (below), so pod 0 is rank 0, which serves the weights and the metrics.
    # torchrun numbers a node's processes consecutively: a replica's tensor-parallel ranks are consecutive global
    # ranks, the layout Megatron and trainer/distributed.py expect.
    ordinal = f"${{{POD_NAME_ENV}##*-}}"
    launcher = (
        f"python -m torch.distributed.run --nnodes={trainer_pods(training)} "
        f"--nproc-per-node={training.tensor_parallel} --rdzv-backend=c10d --rdzv-id={run.child('trainer')} "
        f"--rdzv-endpoint={trainer_pod_address(run, 0)}:{p.rendezvous} "
        f"--rdzv-conf=is_host=$([ {ordinal} = 0 ] && echo 1 || echo 0) --max-restarts=0"
    )
    # torchrun tells nodes apart by address and process id. On the node's network the pods share the address and,
    # each in its own PID namespace, likely the process id too: each pod takes a loopback address of its own.
    own_address = f"${POD_NAME_ENV}.{run.child('trainer')}.{run.namespace}.svc"
    launcher += f" --local-addr={f'127.0.0.$((1 + {ordinal}))' if run.host_network else own_address}"
    return ["sh", "-c", f"exec {launcher} -m {' '.join(trainer[2:])}"]


def trainer_pods(training: TrainingSpec) -> int:
    """Trainer pods: one per model replica (data-parallel rank), holding its tensor-parallel ranks."""
    return training.num_ranks // training.tensor_parallel


def trainer_stateful_set(run: Run) -> dict[str, Any]:
    p = run.config.ports
    volume, mount = _spec_volume(run)
    ports = {"metrics": p.trainer_metrics, "weights": p.trainer_weights, "rendezvous": p.rendezvous}
    pods = trainer_pods(run.spec.training)
    readiness: dict[str, Any] = {"tcpSocket": {"port": p.trainer_metrics}, "periodSeconds": 5}
    if pods > 1:
        # Only pod 0 (the main rank) serves metrics and weights: the others are ready while their ranks run. On the
        # node's network the pods' ports are host ports, which two pods on one node cannot both declare.
        command = ["python", "-c", _MAIN_TRAINER_LISTENS.format(host=LOCAL_HOST, port=p.trainer_metrics)]
        readiness = {"exec": {"command": command}, "periodSeconds": 5}
        if run.host_network:
            ports = {}
    container = _container(
        run, "trainer", trainer_command(run), ports,
        env=_service_env(run, launch.TRAINER),
        volumeMounts=[mount, {"name": "data", "mountPath": DATA_DIR}],
        readinessProbe=readiness,
    )  # fmt: skip
    volumes = [volume, {"name": "data", "persistentVolumeClaim": {"claimName": run.child("data")}}]
    return _stateful_set(run, "trainer", pods, _pod_template(run, "trainer", [container], volumes))


# Readiness of trainer pod N: pod 0 once its metrics port listens, any other pod while its container runs.
_MAIN_TRAINER_LISTENS = (
    "import os, socket; "
    'os.environ["POD_NAME"].endswith("-0") and socket.create_connection(("{host}", {port}), timeout=3).close()'
)


def metrics_ports(run: Run) -> list[int]:
    """The ports Prometheus scrapes: metrics only, none of them a control API."""
    p = run.config.ports
    return [p.reward_metrics, p.generator_metrics, p.trainer_metrics, *([p.critic_metrics] if run.ppo else [])]


def operator_ports(run: Run) -> list[int]:
    """The ports the operator calls: the run's Redis (the published weight version) and the generators' control
    plane (weight loading). It reads the trainer's metrics port, open to anyone."""
    p = run.config.ports
    return [*([p.redis] if run.spec.kubernetes.external_redis_secret is None else []), p.generator]


def _own_pods(run: Run) -> dict[str, str]:
    return {K8S_NAME_LABEL: run.labels[K8S_NAME_LABEL], K8S_INSTANCE_LABEL: run.name}


def _tcp(ports: list[int]) -> list[dict[str, Any]]:
    return [{"port": port, "protocol": "TCP"} for port in ports]


def network_policy(run: Run) -> dict[str, Any]:
    """Who may connect to the run's pods: the run's own pods on every port; the operator's pods, of its own
    namespace only (a label alone anyone can set), on the ports it calls; anyone on the metrics ports (Prometheus
    may run anywhere, and no metrics port serves anything else); KEDA's namespace on Redis's port (its scaler)."""
    own_pods = _own_pods(run)
    selected: dict[str, Any] = {"matchLabels": own_pods}
    if run.environment:  # R-environment-network alone says who reaches it (policies add up: none may let more in)
        selected["matchExpressions"] = [
            {"key": K8S_COMPONENT_LABEL, "operator": "NotIn", "values": [COMPONENT_ENVIRONMENT]}
        ]
    operator = {
        "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: run.config.operator_namespace}},
        "podSelector": {"matchLabels": {K8S_NAME_LABEL: OPERATOR_APP_NAME}},
    }
    ingress = [
        {"from": [{"podSelector": {"matchLabels": own_pods}}]},
        {"from": [operator], "ports": _tcp(operator_ports(run))},
        {"ports": _tcp(metrics_ports(run))},
    ]
    if run.config.keda_namespace:  # KEDA's redis-streams scaler reads the prompts stream: Redis's port only
        keda = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: run.config.keda_namespace}}}
        ingress.append({"from": [keda], "ports": _tcp([run.config.ports.redis])})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": run.metadata(run.child("network")),
        "spec": {"podSelector": selected, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def critic_volume(run: Run) -> dict[str, Any]:
    """The critic's own claim: its initial model (materialised in the pod) and its checkpoints."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": run.metadata(run.child("critic-data"), COMPONENT_CRITIC),
        "spec": _claim_spec(run, run.spec.kubernetes.critic_storage_size),
    }


def critic_service(run: Run) -> dict[str, Any]:
    p = run.config.ports
    return _service(run, COMPONENT_CRITIC, {"http": p.critic, "metrics": p.critic_metrics})


def critic_stateful_set(run: Run) -> dict[str, Any]:
    """One critic pod (a StatefulSet: never two on the same volume, even during a rollout)."""
    port, metrics_port = run.config.ports.critic, run.config.ports.critic_metrics
    command = _python_service(launch.CRITIC, CriticFlags(port=port, metrics_port=metrics_port))
    volume, mount = _spec_volume(run)
    container = _container(
        run, COMPONENT_CRITIC, command, {"http": port, "metrics": metrics_port},
        env=_service_env(run, launch.CRITIC),
        volumeMounts=[mount, {"name": "data", "mountPath": DATA_DIR}],
        readinessProbe=_http_probe(launch.CRITIC.ready_path, port),
        livenessProbe={**_http_probe(HEALTH_PATH, port, 10), "initialDelaySeconds": 60},
    )  # fmt: skip
    volumes = [volume, {"name": "data", "persistentVolumeClaim": {"claimName": run.child("critic-data")}}]
    return _stateful_set(run, COMPONENT_CRITIC, 1, _pod_template(run, COMPONENT_CRITIC, [container], volumes))


def environment_url(run: Run) -> str:
    """Where the generators reach the environment service (their --environment-url)."""
    return f"http://{run.host(COMPONENT_ENVIRONMENT)}:{run.config.ports.environment}"


def environment_service(run: Run) -> dict[str, Any]:
    p = run.config.ports
    return _service(run, COMPONENT_ENVIRONMENT, {"http": p.environment, "metrics": p.environment_metrics})


def environment_uid(run: Run) -> int:
    """The environment pod's uid: its run's own, the same whenever the pod starts again (a hash of the run's uid)."""
    return ENVIRONMENT_UID_BASE + zlib.crc32(run.uid.encode()) % ENVIRONMENT_UIDS


def environment_deployment(run: Run) -> dict[str, Any]:
    """One environment pod: its episodes live in its memory, so a second replica behind the Service would answer
    404 for the first one's episodes. It holds the environment token alone (launch.ENVIRONMENT.credentials)."""
    port, metrics_port = run.config.ports.environment, run.config.ports.environment_metrics
    command = _python_service(launch.ENVIRONMENT, EnvironmentFlags(port=port, metrics_port=metrics_port))
    volume, mount = _spec_volume(run)
    container = _container(
        run, COMPONENT_ENVIRONMENT, command, {"http": port, "metrics": metrics_port},
        env=_service_env(run, launch.ENVIRONMENT),
        volumeMounts=[mount, {"name": "scratch", "mountPath": SCRATCH_DIR}],
        readinessProbe=_http_probe(launch.ENVIRONMENT.ready_path, port),
        livenessProbe={**_http_probe(HEALTH_PATH, port, 10), "initialDelaySeconds": 30},
    )  # fmt: skip
    scratch = {"name": "scratch", "emptyDir": {"sizeLimit": run.spec.kubernetes.environment_scratch_size}}
    template = _pod_template(run, COMPONENT_ENVIRONMENT, [container], [volume, scratch])
    # No other Service's address in its environment: a tool call's code sees none of it (the sandbox empties the
    # environment anyway), and the service needs none.
    template["spec"]["enableServiceLinks"] = False
    template["spec"]["securityContext"] = {
        **POD_SECURITY_CONTEXT,
        "runAsUser": environment_uid(run),
        "sysctls": ENVIRONMENT_SYSCTLS,
    }
    return _deployment(run, COMPONENT_ENVIRONMENT, 1, template)


def environment_network_policy(run: Run) -> dict[str, Any]:
    """Who may connect to the environment pod: the run's generators on its API port (and its reward server, when
    reward.function code_tests runs tests there), anyone on its metrics port (Prometheus); and it may connect to
    nothing (no egress rule: model-written code reaches no address, the cluster's DNS and the API server included;
    answers to allowed connections still flow)."""
    p = run.config.ports
    callers = [COMPONENT_GENERATOR, *([COMPONENT_REWARD] if run.spec.reward.uses_environment else [])]
    clients = [{"podSelector": {"matchLabels": {**_own_pods(run), K8S_COMPONENT_LABEL: c}}} for c in callers]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": run.metadata(run.child("environment-network"), COMPONENT_ENVIRONMENT),
        "spec": {
            "podSelector": {"matchLabels": run.selector(COMPONENT_ENVIRONMENT)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {"from": clients, "ports": _tcp([p.environment])},
                {"ports": _tcp([p.environment_metrics])},
            ],
            "egress": [],
        },
    }
