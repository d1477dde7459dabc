"""Weight rollout: one reconciler, used by the local supervisor (and by the operator on Kubernetes).

Desired state: every generator has loaded the latest published weight version. Each pass reads the latest
WeightVersion from the run's queue, asks every generator for its loaded version, and sends the new version to
those behind. It is level-triggered: a pass after any failure (a generator restarting, a lost request)
converges again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx
from google.protobuf.json_format import MessageToDict

from reinforce.core.queue import RolloutQueue
from reinforce.core.records_pb2 import WeightVersion

log = logging.getLogger("reinforce.rollout")


def weight_version_json(weights: WeightVersion) -> dict:
    """The body of a generator's POST /v1/weights (proto3 JSON mapping)."""
    return MessageToDict(weights, always_print_fields_with_no_presence=True)


@dataclass
class GeneratorWeights:
    name: str
    loaded_version: int | None  # None: the generator did not answer
    last_error: str = ""


class WeightReconciler:
    def __init__(self, queue: RolloutQueue, generator_urls: dict[str, str], timeout_s: float = 5.0) -> None:
        self.queue = queue
        self.generator_urls = generator_urls
        self.client = httpx.Client(timeout=timeout_s)

    def reconcile_once(self) -> tuple[int | None, list[GeneratorWeights]]:
        """Returns the published version and each generator's loaded version after this pass."""
        latest = self.queue.latest_weights()
        states = []
        for name, url in self.generator_urls.items():
            state = self._status(name, url)
            if latest is not None and state.loaded_version is not None and state.loaded_version < latest.version:
                self._push(name, url, latest)
            states.append(state)
        return (latest.version if latest is not None else None), states

    def _status(self, name: str, url: str) -> GeneratorWeights:
        try:
            body = self.client.get(f"{url}/v1/weights").raise_for_status().json()
        except httpx.HTTPError:
            return GeneratorWeights(name, None)
        return GeneratorWeights(name, body["loaded_version"], body.get("last_error", ""))

    def _push(self, name: str, url: str, weights: WeightVersion) -> None:
        try:
            self.client.post(f"{url}/v1/weights", json=weight_version_json(weights)).raise_for_status()
        except httpx.HTTPError as err:
            log.warning("generator %s: cannot request weight version %d: %s", name, weights.version, err)

    def close(self) -> None:
        self.client.close()
