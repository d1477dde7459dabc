"""Kueue (issue 25, item 4): a run with kubernetes.queueName starts suspended and its workloads and pods carry
Kueue's queue label. No Kueue binary runs here: the rendered objects are what Kueue would see."""

from __future__ import annotations

import pytest
from k8s import example_run

from reinforce.operator.children import OperatorConfig, Run, children
from reinforce.operator.main import PodState, phase_of
from reinforce.operator.resource import KUEUE_QUEUE_LABEL, ReinforceRunSpec


def _run(**changes: object) -> Run:
    spec = ReinforceRunSpec.model_validate({**example_run(**changes)["spec"], "name": "tiny"})
    return Run("tiny", "team", "uid-1", spec, OperatorConfig(), stopped=spec.suspended)


def _workloads(run: Run) -> list[dict]:
    return [o for o in children(run) if o["kind"] in ("Deployment", "StatefulSet")]


def test_a_queued_run_starts_suspended_and_every_workload_and_pod_is_labelled() -> None:
    run = _run(**{"kubernetes.queueName": "team-gpu"})
    assert run.spec.suspended and run.spec.suspend is None
    workloads = _workloads(run)
    assert {w["metadata"]["name"] for w in workloads} == {"tiny-redis", "tiny-reward", "tiny-generator", "tiny-trainer"}
    for workload in workloads:
        assert workload["spec"]["replicas"] == 0, workload["metadata"]["name"]
        assert workload["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-gpu"
        assert workload["spec"]["template"]["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-gpu"
        assert KUEUE_QUEUE_LABEL not in workload["spec"]["selector"]["matchLabels"]  # the selector never changes
    pods = [PodState("tiny-trainer-0", "trainer", True, 0, "10.0.0.1")]
    phase, reason, message = phase_of(run.spec, pods, None, False, False)
    assert (phase, reason) == ("Suspended", "Suspended") and "queued in team-gpu" in message


@pytest.mark.parametrize("queue", [None, "team-gpu"])
def test_suspend_false_starts_a_queued_run_and_unqueued_runs_start_at_once(queue: str | None) -> None:
    changes = {"kubernetes.queueName": queue, "suspend": False} if queue else {}
    run = _run(**changes)
    assert not run.spec.suspended
    for workload in _workloads(run):
        assert workload["spec"]["replicas"] >= 1
        assert workload["metadata"]["labels"].get(KUEUE_QUEUE_LABEL) == queue


def test_a_queue_name_must_be_an_object_name() -> None:
    with pytest.raises(ValueError, match="queueName"):
        _run(**{"kubernetes.queueName": "Team GPU"})
