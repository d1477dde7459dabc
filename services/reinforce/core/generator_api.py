"""What crosses the generator's control plane: its paths and JSON bodies, as the generator serves them and as the
weight reconciler (core/rollout.py: the supervisor's, the operator's, `reinforce rollout`) and the tests call them.

Probes and metrics are open (core/http_kit.py's add_probes: GET HEALTH_PATH answers {"ok": true}); the weight
endpoints demand `Authorization: Bearer $REINFORCE_CONTROL_TOKEN`.
A load request is a WeightVersion in proto3 JSON (the record the trainer published in Redis), plus RELAY_SOURCES_FIELD
when the version is relayed (generator/relay.py): it stays proto JSON, not a pydantic model, so that the record's
schema is written once, in records.proto. Importing this module pulls in pydantic and protobuf only, not torch.
"""

from __future__ import annotations

import re

from google.protobuf.json_format import MessageToDict, ParseDict
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from reinforce.core.names import HEALTH_PATH, METRICS_PATH, READY_PATH
from reinforce.core.records_pb2 import WeightVersion

WEIGHTS_PATH = "/v1/weights"  # GET: WeightsStatus; POST: a load request, answered LoadAccepted (202)
# Every route the generator serves, (method, path): tests/unit/test_generator_api.py holds the service to it.
ROUTES = frozenset(
    {
        ("GET", HEALTH_PATH),
        ("GET", READY_PATH),
        ("GET", METRICS_PATH),
        ("GET", WEIGHTS_PATH),
        ("POST", WEIGHTS_PATH),
    }
)
# A WeightVersion's JSON is a few hundred bytes; anything much larger is refused (413) before it is read.
MAX_CONTROL_BODY_BYTES = 64 * 1024
RELAY_SOURCES_FIELD = "relaySources"  # the load request's extra field: the ancestors' relay base urls
MAX_RELAY_SOURCES = 64
_RELAY_URL = re.compile(r"https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?|https?://\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")


class _Response(BaseModel):
    # A caller ignores fields it does not know: a generator of a later release may answer with more.
    model_config = ConfigDict(extra="ignore", frozen=True)


class Readiness(_Response):
    """503 while the generator is stopping."""

    ready: bool
    weight_version: NonNegativeInt = Field(description="The weight version the engine holds now.")


class WeightsStatus(_Response):
    loaded_version: NonNegativeInt
    loads: NonNegativeInt = Field(description="Versions loaded since the process started.")
    desired_version: NonNegativeInt | None = Field(description="The last accepted load request's version.")
    last_error: str = Field(description="Why the last load failed; empty after a success.")
    # only from a generator that relays (weights.distribution relay); absent otherwise
    relay_port: int | None = None
    relay_version: NonNegativeInt | None = Field(default=None, description="The version its relay holds whole.")


class LoadAccepted(_Response):
    accepted_version: NonNegativeInt


class ErrorBody(_Response):
    """The body of every 4xx answer: FastAPI's shape, which the token check (401) and a body's validation (422,
    a list of errors) also write."""

    detail: str | list


def load_request_json(weights: WeightVersion, ancestors: list[str] | None = None) -> dict:
    """The body of a generator's POST WEIGHTS_PATH: the WeightVersion (proto3 JSON), plus its ancestors' relay urls
    when the version is relayed. The chunk digests stay out: a generator takes them from the published record in
    Redis (whatever the model's size, the body stays small), and one of an earlier release refuses unknown fields."""
    body = MessageToDict(weights, always_print_fields_with_no_presence=True)
    body.pop("chunkBytes", None)
    body.pop("chunkSha256", None)
    if ancestors is not None:
        body[RELAY_SOURCES_FIELD] = ancestors
    return body


def parse_load_request(body: object) -> tuple[WeightVersion, list[str] | None]:
    """(the posted WeightVersion, its ancestors' relay urls or None for a direct fetch); ValueError or ParseError
    for anything else."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    fields = dict(body)
    ancestors = fields.pop(RELAY_SOURCES_FIELD, None)
    weights = ParseDict(fields, WeightVersion())
    if ancestors is None:
        return weights, None
    if not isinstance(ancestors, list) or len(ancestors) > MAX_RELAY_SOURCES:
        raise ValueError(f"{RELAY_SOURCES_FIELD}: a list of at most {MAX_RELAY_SOURCES} relay urls")
    for url in ancestors:
        if not isinstance(url, str) or not _RELAY_URL.fullmatch(url):
            raise ValueError(f"{RELAY_SOURCES_FIELD}: {url!r} is not a relay url http(s)://HOST:PORT")
    return weights, ancestors
