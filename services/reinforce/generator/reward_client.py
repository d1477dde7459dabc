"""Client of the reward server (Triton model `reward`), with batching, time-outs and retries.

`score` splits rows into requests of at most `max_batch_size` rows (the server's largest dynamic batch),
sends them concurrently, and retries what failed for a transient reason: connection errors, time-outs,
5xx answers and "model not ready/unknown" answers of a server that is still starting. Retries back off
exponentially (0.5 s doubling, capped at 10 s, with jitter). A failure of the reward function itself is
not transient: it is raised at once, as is everything after the last retry, as `RewardServerError`
naming the URL.

tritonclient.http runs on gevent, whose connections belong to the thread that made them, so each thread
(the caller's for readiness checks, the client's workers for requests) gets its own connection.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from reinforce.core.names import (
    REWARD_FN_FAILED,
    REWARD_INPUT_ANSWER,
    REWARD_INPUT_PROMPT,
    REWARD_INPUT_RESPONSE,
    REWARD_MODEL,
    REWARD_OUTPUT,
)
from reinforce.core.spec import RewardSpec

LOG = logging.getLogger(__name__)

# Answers of a Triton whose HTTP port is up but whose model is not loaded yet: worth retrying.
_NOT_YET = ("unknown model", "not found", "not ready", "is not available")
_MESSAGE_LIMIT = 2000


class RewardServerError(RuntimeError):
    """The reward server could not score a batch: unreachable after retries, or the request failed."""


class RewardFunctionError(RewardServerError):
    """The reward function itself failed on a batch (raised, or returned the wrong count or type): not transient."""


def backoff_s(attempt: int, base_s: float = 0.5, cap_s: float = 10.0) -> float:
    """Delay before retry `attempt` (0-based): base * 2^attempt capped at cap, times a jitter in [0.5, 1)."""
    # Jitter keeps many generators that lost the same server from all coming back in the same instant.
    return min(cap_s, base_s * 2**attempt) * random.uniform(0.5, 1.0)


def _split_url(url: str) -> tuple[str, bool]:
    """tritonclient wants host:port without a scheme; https means TLS."""
    if url.startswith("https://"):
        return url[len("https://") :].rstrip("/"), True
    return url.removeprefix("http://").rstrip("/"), False


class RewardClient:
    """Scores (prompt, response) rows on the reward server at `url` (http://host:port or host:port)."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 60.0,
        max_retries: int = 5,
        max_batch_size: int = 64,
        concurrency: int = 4,
        model_name: str = REWARD_MODEL,
    ) -> None:
        if max_batch_size < 1 or concurrency < 1 or max_retries < 0 or timeout_s <= 0:
            raise ValueError("RewardClient: max_batch_size and concurrency >= 1, max_retries >= 0, timeout_s > 0")
        self.url = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.max_batch_size = max_batch_size
        self.concurrency = concurrency
        self.model_name = model_name
        self._host, self._ssl = _split_url(url)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    @classmethod
    def from_spec(cls, url: str, spec: RewardSpec, **kwargs: Any) -> RewardClient:
        return cls(url, spec.timeout_s, spec.max_retries, spec.max_batch_size, **kwargs)

    # -- connections ----------------------------------------------------------------------------------

    def _client(self) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            import tritonclient.http as httpclient

            client = httpclient.InferenceServerClient(
                self._host,
                concurrency=1,  # one request at a time per thread; threads give the concurrency
                connection_timeout=min(self.timeout_s, 10.0),
                network_timeout=self.timeout_s,
                ssl=self._ssl,
            )
            self._local.client = client
        return client

    def _reset_client(self) -> None:
        # After a transport failure the pooled connections may be half-dead: start from fresh ones.
        client = getattr(self._local, "client", None)
        self._local.client = None
        if client is not None:
            try:
                client.close()
            except Exception:  # a broken connection may fail to close; it is being dropped anyway
                LOG.debug("closing a broken reward client failed", exc_info=True)

    def close(self) -> None:
        """Stop the worker threads (their connections close with them) and close this thread's connection."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._reset_client()

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- readiness ------------------------------------------------------------------------------------

    def is_ready(self) -> bool:
        """Whether the server and model `reward` are ready now (False when unreachable)."""
        try:
            client = self._client()
            return bool(client.is_server_ready() and client.is_model_ready(self.model_name))
        except Exception:
            self._reset_client()
            return False

    def wait_ready(self, deadline_s: float = 120.0, poll_s: float = 0.25) -> float:
        """Poll until server and model are ready; return the seconds waited, or raise after `deadline_s`."""
        start = time.monotonic()
        while not self.is_ready():
            if time.monotonic() - start > deadline_s:
                raise RewardServerError(
                    f"reward server at {self.url}: model {self.model_name!r} not ready after {deadline_s:.0f} s"
                )
            time.sleep(poll_s)
        return time.monotonic() - start

    # -- scoring --------------------------------------------------------------------------------------

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str] | None = None
    ) -> list[float]:
        """One reward per response (NaN and inf come back as the reward function made them). `answers`: each prompt's
        reference answer (default: none, "")."""
        answers = [""] * len(prompts) if answers is None else answers
        if not len(prompts) == len(responses) == len(answers):
            raise ValueError(f"score: {len(prompts)} prompts, {len(responses)} responses, {len(answers)} answers")
        bounds = [(s, min(s + self.max_batch_size, len(prompts))) for s in range(0, len(prompts), self.max_batch_size)]
        done: dict[int, np.ndarray] = {}
        pending = list(range(len(bounds)))
        for attempt in range(self.max_retries + 1):
            failures = self._send_round(pending, bounds, (prompts, responses, answers), done)
            if not failures:
                break
            pending = [i for i, _ in failures]
            last = failures[0][1]
            if attempt == self.max_retries:
                raise RewardServerError(
                    f"reward server at {self.url}: {len(pending)} of {len(bounds)} requests failed after "
                    f"{self.max_retries} retries; last error: {_describe(last)}"
                ) from last
            delay = backoff_s(attempt)
            LOG.warning(
                "reward server at %s: %s; retry %d/%d in %.1f s",
                self.url,
                _describe(last),
                attempt + 1,
                self.max_retries,
                delay,
            )
            time.sleep(delay)
        return [float(v) for i in range(len(bounds)) for v in done[i].reshape(-1)]

    def _send_round(
        self,
        pending: list[int],
        bounds: list[tuple[int, int]],
        columns: tuple[Sequence[str], Sequence[str], Sequence[str]],
        done: dict[int, np.ndarray],
    ) -> list[tuple[int, BaseException]]:
        """Send the pending requests concurrently; fill `done`, return the transient failures."""
        futures = {i: self._pool().submit(self._infer, columns, *bounds[i]) for i in pending}
        failures: list[tuple[int, BaseException]] = []
        fatal: BaseException | None = None
        # Wait for every request, even after a failure, so that none is left running behind the caller.
        for i, future in futures.items():
            try:
                done[i] = future.result()
            except Exception as err:
                if _is_transient(err):
                    failures.append((i, err))
                elif fatal is None:
                    fatal = err
        if fatal is not None:
            error = RewardFunctionError if REWARD_FN_FAILED in str(fatal) else RewardServerError
            raise error(f"reward server at {self.url}: request failed: {_describe(fatal)}") from fatal
        return failures

    def _infer(self, columns: tuple[Sequence[str], Sequence[str], Sequence[str]], lo: int, hi: int) -> np.ndarray:
        """One synchronous request (prompts, responses, answers) on this worker thread's connection (a fresh one
        after a failure)."""
        names = (REWARD_INPUT_PROMPT, REWARD_INPUT_RESPONSE, REWARD_INPUT_ANSWER)
        inputs = [_bytes_input(name, column[lo:hi]) for name, column in zip(names, columns, strict=True)]
        try:
            return self._client().infer(self.model_name, inputs).as_numpy(REWARD_OUTPUT)
        except Exception as err:
            if _is_transient(err):
                self._reset_client()
            raise

    def _pool(self) -> ThreadPoolExecutor:
        # Worker threads rather than tritonclient's async_infer: gevent prints the traceback of every
        # failed greenlet to stderr, which buries real errors under expected retry noise.
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.concurrency, thread_name_prefix="reward-client")
            return self._executor


def _bytes_input(name: str, texts: Sequence[str]) -> Any:
    import tritonclient.http as httpclient

    data = np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_).reshape(len(texts), 1)
    tensor = httpclient.InferInput(name, list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data, binary_data=True)
    return tensor


def _describe(err: BaseException) -> str:
    text = str(err) or type(err).__name__
    if REWARD_FN_FAILED in text:
        # The server's answer wraps the reward function's error in PyTriton's traceback: keep the point.
        text = text[text.index(REWARD_FN_FAILED) :].strip()
    if len(text) > _MESSAGE_LIMIT:
        text = text[:_MESSAGE_LIMIT] + " ..."
    return f"{type(err).__name__}: {text}"


def _is_transient(err: BaseException) -> bool:
    """Worth retrying: transport failures, time-outs, 5xx, a model still loading; not a failing reward fn."""
    from tritonclient.utils import InferenceServerException

    if isinstance(err, InferenceServerException):
        message = (err.message() or "").lower()
        if REWARD_FN_FAILED in message:
            return False
        status = str(err.status() or "")
        if status.startswith("5") or any(marker in message for marker in _NOT_YET):
            return True
        # No status: tritonclient's own "failed to obtain inference response" (a time-out) and the like.
        return not status
    return isinstance(err, OSError | TimeoutError | EOFError) or type(err).__module__.startswith("gevent")
