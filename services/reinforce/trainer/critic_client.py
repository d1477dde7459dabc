"""The trainer's client of the critic service: values, train, checkpoint, restore, wait_ready.

A request that never reached the critic (connection refused or timed out while connecting) and a 503 are retried
with exponential back-off, so a critic that is killed and restarted (by the supervisor or Kubernetes) is ridden
out. A request that was sent and whose answer was lost is retried only when repeating it is harmless (values,
checkpoint, restore, probes): a lost /v1/train answer raises, because the steps may or may not have been applied.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import httpx
from pydantic import BaseModel

from reinforce.core.critic_api import (
    CHECKPOINT_PATH,
    RESTORE_PATH,
    TRAIN_PATH,
    VALUES_PATH,
    CheckpointRequest,
    CheckpointResponse,
    Minibatch,
    ReadyResponse,
    TrainRequest,
    TrainResponse,
    ValuesRequest,
    ValuesResponse,
)
from reinforce.core.names import READY_PATH

log = logging.getLogger(__name__)


class CriticError(RuntimeError):
    """The critic refused a request, or could not be reached within the retries."""


class CriticClient:
    def __init__(
        self,
        base_url: str,
        token: str,
        timeout_s: float = 600.0,
        max_retries: int = 8,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
    ) -> None:
        """timeout_s bounds one request (a train request of many minibatches takes a while); with the defaults the
        retries wait up to about a minute in all for a restarting critic."""
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
        )

    @property
    def base_url(self) -> str:
        return str(self._http.base_url)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CriticClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ---- API -------------------------------------------------------------------------------------------------
    def values(self, prompt_token_ids: list[list[int]], response_token_ids: list[list[int]]) -> list[list[float]]:
        """V(s_t) for every response token: row i has len(response_token_ids[i]) values."""
        body = ValuesRequest(prompt_token_ids=prompt_token_ids, response_token_ids=response_token_ids)
        return ValuesResponse.model_validate_json(self._post(VALUES_PATH, body, idempotent=True)).values

    def train(self, minibatches: Sequence[Minibatch]) -> TrainResponse:
        """One optimizer step per minibatch, in order."""
        body = TrainRequest(minibatches=list(minibatches))
        return TrainResponse.model_validate_json(self._post(TRAIN_PATH, body, idempotent=False))

    def checkpoint(self, step: int) -> CheckpointResponse:
        body = CheckpointRequest(step=step)
        return CheckpointResponse.model_validate_json(self._post(CHECKPOINT_PATH, body, idempotent=True))

    def restore(self, step: int) -> CheckpointResponse:
        body = CheckpointRequest(step=step)
        return CheckpointResponse.model_validate_json(self._post(RESTORE_PATH, body, idempotent=True))

    def wait_ready(self, deadline_s: float = 300.0, poll_s: float = 0.5) -> ReadyResponse:
        """Poll /readyz until the critic answers ready (it answers only once its model is loaded and resumed)."""
        deadline = time.monotonic() + deadline_s
        last = "no answer"
        while True:
            try:
                response = self._http.get(READY_PATH)
                if response.status_code == 200:
                    return ReadyResponse.model_validate_json(response.content)
                last = f"HTTP {response.status_code}"
            except httpx.TransportError as err:
                last = repr(err)
            if time.monotonic() >= deadline:
                raise CriticError(f"critic at {self.base_url} not ready after {deadline_s} s: {last}")
            time.sleep(poll_s)

    # ---- transport -------------------------------------------------------------------------------------------
    def _post(self, path: str, body: BaseModel, idempotent: bool) -> bytes:
        content = body.model_dump_json().encode()
        delay, attempt = self.backoff_s, 0
        while True:
            try:
                response = self._http.post(path, content=content, headers={"Content-Type": "application/json"})
            except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                failure = repr(err)  # never reached the critic: safe to send again
            except httpx.TransportError as err:
                if not idempotent:
                    raise CriticError(
                        f"{path}: the connection failed after the request was sent ({err!r}); the critic may or may "
                        "not have applied it, so it is not repeated"
                    ) from err
                failure = repr(err)
            else:
                if response.status_code == 503:  # starting or stopping: try again
                    failure = "HTTP 503"
                elif response.is_success:
                    return response.content
                else:
                    raise CriticError(f"{path}: HTTP {response.status_code}: {_detail(response)}")
            if attempt == self.max_retries:
                raise CriticError(f"{path}: critic at {self.base_url} unreachable: {failure}")
            log.warning("%s: %s; retrying in %.1f s", path, failure, delay)
            time.sleep(delay)
            delay, attempt = min(delay * 2, self.max_backoff_s), attempt + 1


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail", response.text))
    except ValueError:
        return response.text
