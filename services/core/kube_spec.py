"""The spec of a `ReinforceRun` custom resource: a run spec plus what only Kubernetes needs.

`ReinforceRunSpec` is `RunSpec` (the same model `reinforce run` reads) with two more fields: `suspend` and a
`kubernetes` section (images, resources, GPUs, placement, storage, an external Redis). The CRD's schema is
generated from it (core/crd.py), and the operator validates every ReinforceRun with it.

Paths in a ReinforceRun (`data.prompts`, `policy.path`, ...) are paths inside the containers: in the image or
on a volume.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError

from reinforce.core.spec import RunSpec, SpecError, _Section, format_validation_error

COMPONENTS = ("redis", "reward", "generator", "trainer")


class Toleration(_Section):
    """A pod toleration, as Kubernetes spells it."""

    key: str | None = Field(None, description="Taint key (None with operator Exists: every taint).")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Equal: match value; Exists: any value.")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate (None: all)."
    )
    toleration_seconds: int | None = Field(None, ge=0, description="NoExecute: how long the pod stays bound.")


class PodSpec(_Section):
    """Where and how one component's pods run. Unset fields take the operator's defaults."""

    image: str | None = Field(None, description="Container image (None: the operator's default for the component).")
    requests: dict[str, str] = Field(default_factory=dict, description="Resource requests, e.g. {cpu: '2'}.")
    limits: dict[str, str] = Field(default_factory=dict, description="Resource limits, e.g. {memory: 8Gi}.")
    gpus: int = Field(0, ge=0, description="NVIDIA GPUs per pod (adds the nvidia.com/gpu limit).")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints the pods tolerate.")


class KubernetesSpec(_Section):
    """How the operator lays the run out on the cluster."""

    redis: PodSpec = Field(default_factory=PodSpec)
    reward: PodSpec = Field(default_factory=PodSpec)
    generator: PodSpec = Field(default_factory=PodSpec)
    trainer: PodSpec = Field(default_factory=PodSpec)
    external_redis_secret: str | None = Field(
        None,
        description="A Secret of the run's namespace whose key `url` is the redis:// URL of an external Redis; "
        "then no Redis is created, and the run's keys are deleted with the run.",
    )
    storage_size: str = Field("10Gi", description="Size of the run's volume (checkpoints, weights, final model).")
    storage_class: str | None = Field(None, description="StorageClass of the run's volumes (None: the default).")
    redis_storage_size: str = Field("1Gi", description="Size of Redis' append-only-file volume.")


class ReinforceRunSpec(RunSpec):
    """A ReinforceRun's `spec`: a run spec (its `name` is the resource's name) and its place on the cluster."""

    suspend: bool = Field(False, description="Scale the run to zero; false again resumes it from its checkpoint.")
    kubernetes: KubernetesSpec = Field(default_factory=KubernetesSpec)

    def run_spec(self, run_dir: str) -> RunSpec:
        """The plain run spec the services read, with the run folder on the run's volume."""
        fields = self.model_dump(exclude={"suspend", "kubernetes"})
        return RunSpec.model_validate({**fields, "run_dir": run_dir})


def parse_run_resource(name: str, spec: dict) -> ReinforceRunSpec:
    """Validate a ReinforceRun's spec; errors name `spec.<field>` as `kubectl` shows them."""
    try:
        return ReinforceRunSpec.model_validate({**spec, "name": name})
    except ValidationError as err:
        raise SpecError(format_validation_error(err, f"ReinforceRun {name}").replace("\n  ", "\n  spec.")) from None
