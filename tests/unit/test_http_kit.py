"""core/http_kit.py: every request counted once, by route template and status code, and timed; the open probes."""

from __future__ import annotations

from fastapi import Depends, FastAPI, HTTPException
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from reinforce.core.http_kit import OTHER_ENDPOINT, add_probes, bearer_dependency, count_requests
from reinforce.core.metrics import RequestMetrics
from reinforce.core.names import HEALTH_PATH, METRICS_PATH, READY_PATH

TOKEN = "kit-token"


def served() -> tuple[TestClient, CollectorRegistry]:
    registry = CollectorRegistry()
    app = FastAPI()
    count_requests(app, RequestMetrics("kit", registry))

    @app.get("/v1/items/{item_id}", dependencies=[Depends(bearer_dependency(TOKEN))])
    def item(item_id: int) -> dict:
        if item_id == 0:
            raise HTTPException(409, "item 0 is taken")
        if item_id == 1:
            raise RuntimeError("a bug")
        return {"id": item_id}

    return TestClient(app, raise_server_exceptions=False), registry


def count(registry: CollectorRegistry, endpoint: str, code: str) -> float | None:
    return registry.get_sample_value("reinforce_kit_requests_total", {"endpoint": endpoint, "code": code})


def test_requests_are_counted_by_route_template_and_code() -> None:
    client, registry = served()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for item_id in (7, 8):
        assert client.get(f"/v1/items/{item_id}", headers=auth).json() == {"id": item_id}
    conflict = client.get("/v1/items/0", headers=auth)
    assert conflict.status_code == 409 and conflict.json() == {"detail": "item 0 is taken"}  # the one error shape
    assert client.get("/v1/items/1", headers=auth).status_code == 500
    assert client.get("/v1/items/7").status_code == 401
    assert client.get("/nowhere/3").status_code == 404
    template = "/v1/items/{item_id}"
    assert count(registry, template, "200") == 2  # ids in the path are one series
    assert (count(registry, template, "409"), count(registry, template, "500")) == (1, 1)
    assert count(registry, template, "401") == 1
    assert count(registry, OTHER_ENDPOINT, "404") == 1
    seconds = registry.get_sample_value("reinforce_kit_request_seconds_count", {"endpoint": template})
    assert seconds == 5


class Readiness(BaseModel):
    ready: bool
    detail_of_state: int


def test_probes_are_open_and_not_ready_is_503() -> None:
    registry, state = CollectorRegistry(), {"ready": True}
    app = FastAPI()
    count_requests(app, RequestMetrics("kit", registry))
    add_probes(app, registry, lambda: Readiness(ready=state["ready"], detail_of_state=3), Readiness)
    client = TestClient(app)
    assert client.get(HEALTH_PATH).json() == {"ok": True}
    assert client.get(READY_PATH).json() == {"ready": True, "detail_of_state": 3}
    state["ready"] = False
    not_ready = client.get(READY_PATH)
    assert not_ready.status_code == 503 and not_ready.json()["ready"] is False
    scraped = client.get(METRICS_PATH)
    assert scraped.headers["content-type"].startswith("text/plain")
    assert 'reinforce_kit_requests_total{code="503",endpoint="/readyz"} 1.0' in scraped.text
