"""The Tinker training API as a service: the `tinker` SDK's loops train LoRA adapters of the run's policy.

    python -m reinforce.training_api --spec SPEC.yaml [--host H] [--port N] [--redis-url URL]
        (the API key comes from $REINFORCE_TRAINING_API_KEY and must begin with `tml-`, as the SDK demands;
         the Redis address from --redis-url or $REINFORCE_REDIS_URL)

The spec's `policy` is the base model (materialised into RUN_DIR/initial_policy as for a run, so its tokenizer's
folder is what get_info names); its `seed` draws a new adapter where the client gives no seed; training.lora.alpha
(where the spec has that section) is every adapter's alpha. Checkpoints go to RUN_DIR/training_api/. server.py
lists the routes, worker.py how requests are applied, store.py what Redis holds.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import uvicorn

from reinforce.core.launch_flags import LaunchFlags, flag
from reinforce.core.names import LOCAL_HOST, REDIS_URL_ENV
from reinforce.core.policy import materialize_policy
from reinforce.core.run_dir import RunPaths, ensure_run_id
from reinforce.core.spec import LoraSpec, PolicySpec, load_spec
from reinforce.core.threads import configure_threads
from reinforce.training_api import sampling
from reinforce.training_api.server import create_app
from reinforce.training_api.store import FutureStore, WorkQueue
from reinforce.training_api.tenants import Tenants
from reinforce.training_api.worker import Worker

API_KEY_ENV = "REINFORCE_TRAINING_API_KEY"
API_KEY_PREFIX = "tml-"  # the SDK refuses any other key before it sends anything
DEFAULT_PORT = 5558


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingApiFlags(LaunchFlags):
    host: str = flag(f"Bind address (default {LOCAL_HOST}).", LOCAL_HOST)
    port: int = flag(f"Port of the API (default {DEFAULT_PORT}).", DEFAULT_PORT)
    redis_url: str | None = flag(f"redis://[:PASSWORD@]HOST:PORT/DB (default: ${REDIS_URL_ENV})", None, REDIS_URL_ENV)


def base_model_name(policy: PolicySpec) -> str:
    """The name clients pass as base_model: the policy's path, or `random_init` for a tiny random model."""
    return policy.path if policy.path is not None else "random_init"


def main(argv: list[str] | None = None) -> None:
    parser = TrainingApiFlags.parser("python -m reinforce.training_api", __doc__.splitlines()[0])
    spec_file, args = TrainingApiFlags.parse(parser, argv)
    api_key = os.environ.get(API_KEY_ENV, "")
    if not api_key.startswith(API_KEY_PREFIX):
        raise SystemExit(f"${API_KEY_ENV} must hold the API key, which begins with {API_KEY_PREFIX!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s training-api %(levelname)s %(message)s")
    configure_threads()
    spec = load_spec(spec_file)
    paths = RunPaths(spec.resolved_run_dir())
    materialize_policy(spec.policy, paths.initial_policy, spec.seed)
    alpha = (spec.training.lora or LoraSpec()).alpha
    tenants = Tenants(
        paths.initial_policy, base_model_name(spec.policy), alpha, spec.seed, paths.root / "training_api",
        ensure_run_id(paths),
    )  # fmt: skip
    queue = WorkQueue(args.redis_url)
    if abandoned := queue.abandon_unfinished():
        logging.warning("failed %d requests a previous process accepted and did not finish", abandoned)
    Worker(tenants, queue).start()
    # The port opens once the base model is loaded: answering means ready.
    app = create_app(tenants, FutureStore(args.redis_url), api_key, extensions=[sampling.routes])
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
