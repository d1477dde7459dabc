"""Reward server: the spec's reward function served by a real Triton server (PyTriton) as model `reward`.

    python -m reinforce.reward --spec SPEC.yaml [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
        [--host 127.0.0.1] [--environment-url URL]
        (reward.function reinforce.reward.rewards:code_tests: the environment service's URL, and its bearer token in
        $REINFORCE_ENVIRONMENT_TOKEN, which this server holds only then)

Model `reward`: inputs `prompt` and `response` (BYTES, shape (1,) per row) and the optional `answer` (the prompt's
reference answer; this project's client always sends it, so that a dynamic batch never mixes rows with and without
it), output `reward` (FP32, shape (1,)), Triton's dynamic batcher with the spec's `max_batch_size` and
`max_queue_delay_us`. Once the model is loaded, one line `reward server ready: ...` is logged. Probe
`/v2/models/reward/ready`: Triton's `/v2/health/ready` already answers 200 for a moment before the model is loaded.
SIGTERM and SIGINT stop Triton and exit 0; a taken port or a bad spec exits 2 at once.

NaN and inf rewards are passed through as they are. An exception in the reward function becomes an error
response to every request of that dynamic batch (Triton's batch is the unit of failure); the server keeps
serving.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import sysconfig
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from reinforce.core.launch import REWARD
from reinforce.core.launch_flags import RewardFlags
from reinforce.core.names import (
    ENVIRONMENT_TOKEN_ENV,
    REWARD_FN_FAILED,
    REWARD_INPUT_ANSWER,
    REWARD_INPUT_PROMPT,
    REWARD_INPUT_RESPONSE,
    REWARD_MODEL,
    REWARD_OUTPUT,
)
from reinforce.core.spec import RewardSpec, SpecError, load_spec
from reinforce.core.threads import configure_threads
from reinforce.reward.rewards import RewardError, RewardFn, build_reward_fn

LOG = logging.getLogger("reinforce.reward")


class StartupError(RuntimeError):
    """The server cannot start in this environment (e.g. a port is taken)."""


class RewardFunctionFailed(RuntimeError):
    """The reward function raised; its message starts with REWARD_FN_FAILED so clients do not retry."""


def ensure_libpython_on_ld_path() -> None:
    """Put this Python's LIBDIR on LD_LIBRARY_PATH for the Triton child process.

    PyTriton's Python-backend stub links libpython3.x.so dynamically. A pyenv (or any non-system) Python
    keeps that library in its own LIBDIR, which the dynamic loader does not search: the stub then loads the
    system's libpython of the same minor version (Debian's 3.11.2 here) against this Python's 3.11.7
    stdlib, and loading the model fails ("'_thread.RLock' object has no attribute '_recursion_count'").
    PyTriton copies os.environ when it starts tritonserver, so setting it here, before start, is enough.
    """
    libdir = sysconfig.get_config_var("LIBDIR")
    if not libdir:
        return
    parts = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if libdir not in parts:
        os.environ["LD_LIBRARY_PATH"] = ":".join([libdir, *parts])


def check_ports_free(address: str, ports: Sequence[int]) -> None:
    """Fail fast on a taken port: PyTriton does not notice tritonserver dying of it and waits 120 s."""
    if len(set(ports)) != len(ports):
        raise StartupError(f"HTTP, gRPC and metrics ports must differ, got {list(ports)}")
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # SO_REUSEADDR as Triton sets it: a port in TIME_WAIT is usable, a listening one is not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((address, port))
            except OSError as err:
                raise StartupError(f"cannot bind {address}:{port}: {err.strerror}") from None


def _decode(column: np.ndarray) -> list[str]:
    # BYTES tensors arrive as an object array of bytes, shape (batch, 1).
    return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v) for v in column.reshape(-1)]


def make_infer_fn(reward_fn: RewardFn) -> Any:
    """The PyTriton inference callable: one call per dynamic batch, all rows scored together."""
    from pytriton.decorators import batch

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        prompt, response = inputs[REWARD_INPUT_PROMPT], inputs[REWARD_INPUT_RESPONSE]
        answer = inputs.get(REWARD_INPUT_ANSWER)
        answers = _decode(answer) if answer is not None else [""] * len(prompt)
        try:
            rewards = reward_fn(_decode(prompt), _decode(response), answers)
        except Exception as err:
            # Raising (not exiting) makes PyTriton answer this batch with an error and keep serving.
            LOG.exception("reward function failed on a batch of %d rows", len(prompt))
            raise RewardFunctionFailed(f"{REWARD_FN_FAILED}: {type(err).__name__}: {err}") from None
        # float32 keeps NaN and inf as they are: the trainer decides what they mean.
        return {REWARD_OUTPUT: np.asarray(rewards, dtype=np.float32).reshape(-1, 1)}

    return infer


def _triton(spec: RewardSpec, reward_fn: RewardFn, args: RewardFlags) -> Any:
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    config = TritonConfig(
        http_address=args.host,
        http_port=args.http_port,
        grpc_address=args.host,
        grpc_port=args.grpc_port,
        metrics_address=args.host,
        metrics_port=args.metrics_port,
        # Let in-flight requests finish on SIGTERM, but not long enough to outlive a pod's grace period.
        exit_timeout_secs=5,
    )
    triton = Triton(config=config)
    triton.bind(
        model_name=REWARD_MODEL,
        infer_func=make_infer_fn(reward_fn),
        inputs=[
            Tensor(name=REWARD_INPUT_PROMPT, dtype=bytes, shape=(1,)),
            Tensor(name=REWARD_INPUT_RESPONSE, dtype=bytes, shape=(1,)),
            Tensor(name=REWARD_INPUT_ANSWER, dtype=bytes, shape=(1,), optional=True),
        ],
        outputs=[Tensor(name=REWARD_OUTPUT, dtype=np.float32, shape=(1,))],
        config=ModelConfig(
            max_batch_size=spec.max_batch_size,
            batcher=DynamicBatcher(max_queue_delay_microseconds=spec.max_queue_delay_us),
        ),
        strict=True,
    )
    return triton


def serve(spec: RewardSpec, args: RewardFlags) -> int:
    token = os.environ.get(ENVIRONMENT_TOKEN_ENV)
    environment = (args.environment_url, token) if args.environment_url and token else None
    reward_fn = build_reward_fn(spec, environment)
    check_ports_free(args.host, [args.http_port, args.grpc_port, args.metrics_port])
    ensure_libpython_on_ld_path()
    stop = threading.Event()
    # The handler only sets a flag: stopping Triton from inside a signal handler would re-enter its locks.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.set())
    started = time.monotonic()
    triton = _triton(spec, reward_fn, args)
    try:
        triton.run()  # starts tritonserver and waits until the server and model `reward` are ready
        LOG.info(
            "reward server ready: http=%d grpc=%d metrics=%d model=%s type=%s max_batch_size=%d (%.1f s)",
            args.http_port, args.grpc_port, args.metrics_port, REWARD_MODEL, spec.type, spec.max_batch_size,
            time.monotonic() - started,
        )  # fmt: skip
        while not stop.wait(0.5):
            if not triton.is_alive():
                LOG.error("tritonserver exited unexpectedly")
                return 1
        LOG.info("stop signal received, shutting down Triton")
        return 0
    finally:
        triton.stop()


def main(argv: Sequence[str] | None = None) -> int:
    spec_file, args = RewardFlags.parse(REWARD.parser(__doc__.split("\n")[0]), argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    configure_threads()  # before a reward function imports torch (hf_classifier), which then reads it
    try:
        spec = load_spec(spec_file).reward
        return serve(spec, args)
    except (SpecError, RewardError, StartupError) as err:
        # Configuration and environment errors: one clear line, no traceback, a non-zero exit.
        LOG.error("reward server cannot start: %s", err)
        return 2
