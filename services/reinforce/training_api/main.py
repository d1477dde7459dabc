"""The Tinker training API as a service: the `tinker` SDK's loops train LoRA adapters of the run's policy.

    python -m reinforce.training_api --spec SPEC.yaml [--host H] [--port N] [--redis-url URL]
                                     [--session-timeout-s S]
        (the API key comes from $REINFORCE_TRAINING_API_KEY and must begin with `tml-`, as the SDK demands;
         the Redis address from --redis-url or $REINFORCE_REDIS_URL; a session silent for S seconds expires)

The spec's `policy` is the base model (materialised into RUN_DIR/initial_policy as for a run, so its tokenizer's
folder is what get_info names); its `seed` draws a new adapter where the client gives no seed; training.lora.alpha
(where the spec has that section) is every adapter's alpha. Checkpoints and each model's live snapshot go to
RUN_DIR/training_api/; at start the worker brings every model back from its live snapshot and re-queues what a
killed process left unfinished (worker.py's `recover`). server.py lists the routes, worker.py how requests are
applied, store.py what Redis holds, live.py what a live snapshot holds.
"""

from __future__ import annotations

import logging
import os

import uvicorn

from reinforce.core.launch import TRAINING_API
from reinforce.core.names import TRAINING_API_KEY_ENV, TRAINING_API_KEY_PREFIX
from reinforce.core.policy import materialize_policy
from reinforce.core.run_dir import RunPaths, ensure_run_id
from reinforce.core.spec import LoraSpec, PolicySpec, load_spec
from reinforce.core.threads import configure_threads
from reinforce.training_api import sampling
from reinforce.training_api.server import create_app
from reinforce.training_api.store import FutureStore, WorkQueue
from reinforce.training_api.tenants import Tenants
from reinforce.training_api.worker import Worker, recover


def base_model_name(policy: PolicySpec) -> str:
    """The name clients pass as base_model: the policy's path, or `random_init` for a tiny random model."""
    return policy.path if policy.path is not None else "random_init"


def main(argv: list[str] | None = None) -> None:
    parser = TRAINING_API.parser(__doc__.splitlines()[0])
    spec_file, args = TRAINING_API.flags.parse(parser, argv)
    api_key = os.environ.get(TRAINING_API_KEY_ENV, "")
    if not api_key.startswith(TRAINING_API_KEY_PREFIX):
        raise SystemExit(f"${TRAINING_API_KEY_ENV} must hold the API key, beginning with {TRAINING_API_KEY_PREFIX!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s training-api %(levelname)s %(message)s")
    configure_threads()
    spec = load_spec(spec_file)
    paths = RunPaths(spec.resolved_run_dir())
    materialize_policy(spec.policy, paths.initial_policy, spec.seed)
    alpha = (spec.training.lora or LoraSpec()).alpha
    tenants = Tenants(
        paths.initial_policy, base_model_name(spec.policy), alpha, spec.seed, paths.training_api,
        ensure_run_id(paths),
    )  # fmt: skip
    queue = WorkQueue(args.redis_url)
    recovered = recover(tenants, queue)
    logging.info(
        "recovered %d models from their live snapshots; %d unfinished requests on the queue",
        len(tenants.tenants), recovered.requeued,
    )  # fmt: skip
    Worker(tenants, queue, args.session_timeout_s, recovered).start()
    # The port opens once the base model is loaded: answering means ready.
    app = create_app(tenants, FutureStore(args.redis_url), api_key, extensions=[sampling.routes])
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
