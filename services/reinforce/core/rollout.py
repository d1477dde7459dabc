"""Weight rollout: one reconciler, used by the local supervisor and by the operator on Kubernetes.

Desired state: every generator has loaded the latest published weight version. Each pass reads the latest
WeightVersion from the run's queue, asks every generator for its loaded version, and sends the new version to
those behind. It is level-triggered: a pass after any failure (a generator restarting, a lost request)
converges again. With `relay_fanout` (weights.distribution relay) it plans a relay tree over the generators that
answered (plan_relay; generator/relay.py passes the bytes on) and names each one's ancestors in its load request;
relays already holding the version go to the top, and a generator that stops answering drops out of the next pass's
plan.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import redis
from pydantic import ValidationError

from reinforce.core import generator_api as api
from reinforce.core.names import CONTROL_TOKEN_ENV
from reinforce.core.queue import RolloutQueue, UnreadableRecord, add_redis_url_argument, connect
from reinforce.core.records_pb2 import RelayPlan, WeightVersion
from reinforce.core.spec import WeightsSpec

log = logging.getLogger("reinforce.rollout")
# A failing read is logged the first time and every this many times after (a pass runs every 50-100 ms).
_LOG_EVERY = 100


def relay_fanout(weights: WeightsSpec, default: str = "direct") -> int | None:
    """The reconciler's relay fan-out for a run's weights section, None for direct fetches. `default` stands for an
    unset `distribution`: direct locally, relay on Kubernetes. Only http transport relays: with file every generator
    reads the shared folder."""
    relayed = (weights.distribution or default) == "relay" and weights.transport == "http"
    return weights.relay_fanout if relayed else None


def plan_relay(relays: dict[str, str], fanout: int, first: Iterable[str] = ()) -> dict[str, list[str]]:
    """Each generator's ancestors' relay urls, nearest first, in a tree of fan-out `fanout` filled breadth first.

    `relays`: generator name -> its relay base url. The names in `first` (relays already holding the version) take
    the top of the tree; the rest follow in name order, so that consecutive passes plan the same tree.
    """
    held = set(first)
    order = [n for n in sorted(relays) if n in held] + [n for n in sorted(relays) if n not in held]
    plan: dict[str, list[str]] = {}
    for index, name in enumerate(order):
        ancestors, parent = [], index
        while parent > 0:
            parent = (parent - 1) // fanout
            ancestors.append(relays[order[parent]])
        plan[name] = ancestors
    return plan


@dataclass
class GeneratorWeights:
    name: str
    loaded_version: int | None  # None: the generator did not answer
    last_error: str = ""
    loads: int = 0  # versions the generator process has loaded since it started
    relay_url: str | None = None  # where other generators fetch from it (None: it relays nothing)
    relay_version: int | None = None  # the version its relay holds whole


class WeightReconciler:
    """Call `reconcile_once` often: it asks the generators only while one is behind, or every `resync_s`."""

    def __init__(
        self,
        queue: RolloutQueue,
        generator_urls: dict[str, str],
        control_token: str,
        timeout_s: float = 5.0,
        resync_s: float = 5.0,
        relay_fanout: int | None = None,
    ) -> None:
        self.queue = queue
        self.generator_urls = generator_urls
        self.client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {control_token}"})
        self.resync_s = resync_s
        self.relay_fanout = relay_fanout
        self.states: list[GeneratorWeights] = []
        self.read_failures = 0  # passes that could not read the published version (an outage, an unreadable record)
        self._last_pass = -float("inf")

    def retarget(self, generator_urls: dict[str, str]) -> None:
        """The generators to keep in sync changed (pods came or went): ask them all on the next pass."""
        if generator_urls != self.generator_urls:
            self.generator_urls = dict(generator_urls)
            self.states = []

    def reconcile_once(self) -> tuple[int | None, list[GeneratorWeights]]:
        """Returns the published version and each generator's loaded version as last seen."""
        try:
            latest = self.queue.latest_weights()
        except (redis.RedisError, UnreadableRecord) as err:  # Redis restarting, or garbage in the key: a later pass
            self.read_failures += 1
            if self.read_failures == 1 or self.read_failures % _LOG_EVERY == 0:
                log.warning("cannot read the published weight version (%d times): %s", self.read_failures, err)
            return None, self.states
        version = latest.version if latest is not None else None
        if self._converged(version) and time.monotonic() - self._last_pass < self.resync_s:
            return version, self.states
        self._last_pass = time.monotonic()
        self.states = [self._status(name, url) for name, url in self.generator_urls.items()]
        if latest is None:
            return version, self.states
        plan = self._relay_plan(latest)
        behind = [s for s in self.states if s.loaded_version is not None and s.loaded_version != version]
        # in the plan's order, so that a relay has its request before its successors ask it for the bytes
        order = {name: index for index, name in enumerate(plan)}
        for state in sorted(behind, key=lambda s: order.get(s.name, len(order))):
            self._push(state.name, self.generator_urls[state.name], latest, plan.get(state.name))
        return version, self.states

    def _relay_plan(self, latest: WeightVersion) -> dict[str, list[str]]:
        """Each relaying generator's ancestors (empty: direct for all, or nobody relays)."""
        if self.relay_fanout is None or not latest.chunk_sha256:  # a record without chunk digests goes direct
            return {}
        relays = {s.name: s.relay_url for s in self.states if s.relay_url and s.loaded_version is not None}
        holding = [s.name for s in self.states if s.relay_version == latest.version]
        plan = plan_relay(relays, self.relay_fanout, holding)
        # before any load request names them: a generator fetches only from the relays planned here
        try:
            self.queue.plan_relays(RelayPlan(version=latest.version, sha256=latest.sha256, sources=relays.values()))
        except redis.RedisError as err:  # Redis restarting: this pass asks for direct fetches
            log.warning("cannot record the relay plan of version %d: %s", latest.version, err)
            return {}
        return plan

    def _converged(self, version: int | None) -> bool:
        return len(self.states) == len(self.generator_urls) and all(
            s.loaded_version is not None and (version is None or s.loaded_version == version) for s in self.states
        )

    def _status(self, name: str, url: str) -> GeneratorWeights:
        try:
            reply = self.client.get(f"{url}{api.WEIGHTS_PATH}").raise_for_status()
            status = api.WeightsStatus.model_validate_json(reply.content)
        except (httpx.HTTPError, ValidationError):  # an answer of another shape is no answer
            return GeneratorWeights(name, None)
        port = status.relay_port
        # a generator relays at its control address's host (its pod IP), on a port of its own
        relay_url = f"{urlsplit(url).scheme}://{urlsplit(url).netloc.rpartition(':')[0]}:{port}" if port else None
        return GeneratorWeights(
            name, status.loaded_version, status.last_error, status.loads, relay_url, status.relay_version
        )

    def _push(self, name: str, url: str, weights: WeightVersion, relay_sources: list[str] | None) -> None:
        body = api.load_request_json(weights, relay_sources)
        try:
            reply = self.client.post(f"{url}{api.WEIGHTS_PATH}", json=body)
        except httpx.HTTPError as err:
            log.warning("generator %s: cannot request weight version %d: %s", name, weights.version, err)
            return
        if reply.status_code == 409:  # an expected race: the trainer published a newer version since this pass read it
            log.info(
                "generator %s: version %d is no longer the published one; the next pass asks", name, weights.version
            )
        elif reply.is_error:
            log.warning("generator %s: weight version %d refused (%d): %s", name, weights.version, reply.status_code,
                        reply.text[:500])  # fmt: skip

    def close(self) -> None:
        self.client.close()


# --- `reinforce rollout`: the reconciler on its own, where neither the supervisor nor the operator runs it ------


def follow(reconciler: WeightReconciler, interval_s: float, stop: threading.Event) -> None:
    """Reconcile until `stop` is set, logging each generator's change of loaded version."""
    loaded: dict[str, int | None] = {}
    while not stop.is_set():
        version, states = reconciler.reconcile_once()
        for state in states:
            if loaded.get(state.name, -1) != state.loaded_version:
                log.info("published %s; %s has loaded %s", version, state.name, state.loaded_version)
                loaded[state.name] = state.loaded_version
        stop.wait(interval_s)


def _generator(value: str) -> tuple[str, str]:
    name, sep, url = value.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"--generator {value!r}: expected NAME=http://HOST:PORT")
    return name, url.rstrip("/")


def _rollout(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    token = os.environ.get(CONTROL_TOKEN_ENV)
    if not token:
        raise SystemExit(f"error: ${CONTROL_TOKEN_ENV} is not set (the generators' control token)")
    queue = RolloutQueue(connect(args.redis_url), args.run)
    reconciler = WeightReconciler(queue, dict(args.generator), token)
    stop = threading.Event()
    # Explicitly: as a container's PID 1 the default action of SIGTERM is to ignore it (docker stop would wait
    # out its grace period and SIGKILL).
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        follow(reconciler, args.interval, stop)
    except KeyboardInterrupt:
        pass
    finally:
        reconciler.close()
    return 0


def add_rollout_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "rollout",
        help="keep generators on the latest published weights (docker compose; the supervisor and operator "
        "run this themselves)",
    )
    parser.add_argument("--run", required=True, help="the run's name (spec `name`): its keys in Redis")
    parser.add_argument(
        "--generator", type=_generator, action="append", required=True, metavar="NAME=URL",
        help="a generator's control address, e.g. generator-0=http://generator:9000 (repeat for each)",
    )  # fmt: skip
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between passes")
    add_redis_url_argument(parser)
    parser.set_defaults(handler=_rollout)
