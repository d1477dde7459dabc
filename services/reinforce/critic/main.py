"""The PPO critic as a service: values for the trainer's GAE, and the critic's own updates, in one process.

    python -m reinforce.critic --spec RUN_DIR/spec.yaml [--port N] [--host H] [--device D] [--metrics-port N]
        (the critic's bearer token comes from $REINFORCE_CRITIC_TOKEN, which only the trainer also holds)

The run spec's `critic` section says how the value model starts (from the initial policy or a reward model) and
trains (AdamW, value clipping, micro-batches); its checkpoints go to RUN_DIR/critic_checkpoints. server.py lists the
endpoints. On start the service loads the latest checkpoint in its folder, so a restarted critic continues exactly.
"""

from __future__ import annotations

import logging
import os

import uvicorn
from prometheus_client import start_http_server

from reinforce.core.launch import CRITIC
from reinforce.core.launch_flags import CriticFlags
from reinforce.core.names import CRITIC_TOKEN_ENV
from reinforce.core.policy import materialize_policy
from reinforce.core.spec import load_spec
from reinforce.core.threads import configure_threads
from reinforce.critic.config import CriticConfig
from reinforce.critic.critic import Critic
from reinforce.critic.server import create_app


def main(argv: list[str] | None = None) -> None:
    spec_file, args = CriticFlags.parse(CRITIC.parser(__doc__.splitlines()[0]), argv)
    token = os.environ.get(CRITIC_TOKEN_ENV)
    if not token:
        raise SystemExit(f"${CRITIC_TOKEN_ENV} must hold the critic's bearer token")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s critic %(levelname)s %(message)s")
    configure_threads()
    spec = load_spec(spec_file)
    config = CriticConfig.from_spec(spec, args.port, args.host, args.device)
    if spec.critic.init == "policy":
        # A pod has no supervisor to prepare it (locally this finds the supervisor's folder and returns).
        materialize_policy(spec.policy, config.model, spec.seed)
    critic = Critic(config)  # loads the model and resumes before the port opens: answering /readyz means ready
    if args.metrics_port:  # in a pod: what Prometheus may reach, apart from the API
        start_http_server(args.metrics_port, addr=config.host, registry=critic.metrics.registry)
    uvicorn.run(create_app(critic, token), host=config.host, port=config.port, log_level="warning")
