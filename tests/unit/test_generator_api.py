"""The generator's control plane serves exactly the routes core/generator_api.py declares, with its bodies."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.routing import APIRoute

from reinforce.core import generator_api as api
from reinforce.core.metrics import GeneratorMetrics
from reinforce.generator.worker import control_plane


def app() -> FastAPI:
    # Building the app touches nothing of the generator but its name and metrics: the handlers read it when called.
    return control_plane(SimpleNamespace(name="routes", metrics=GeneratorMetrics()), token="unused")  # type: ignore[arg-type]


def served_routes() -> set[tuple[str, str]]:
    routes = [r for r in app().routes if isinstance(r, APIRoute)]
    return {(method, r.path) for r in routes for method in r.methods}


def test_every_route_the_generator_serves_is_declared() -> None:
    assert served_routes() == api.ROUTES


def test_the_declared_bodies_are_what_the_routes_answer() -> None:
    answers = {(m, r.path): r.response_model for r in app().routes if isinstance(r, APIRoute) for m in r.methods}
    assert answers[("GET", api.WEIGHTS_PATH)] is api.WeightsStatus
    assert answers[("POST", api.WEIGHTS_PATH)] is api.LoadAccepted
    assert answers[("GET", api.READY_PATH)] is api.Readiness


def test_a_status_without_relay_fields_is_read_as_direct() -> None:
    status = api.WeightsStatus.model_validate_json(
        '{"loaded_version": 2, "loads": 1, "desired_version": null, "last_error": "", "later_field": 1}'
    )
    assert (status.relay_port, status.relay_version, status.loaded_version) == (None, None, 2)
