"""core/registry.py declares each seam's names once: the spec's choices, the services' factories, the optional
packages and the operator's generator images all follow it."""

from __future__ import annotations

from typing import get_args

import pytest

from reinforce.core import registry
from reinforce.core.optional import MissingPackage, require_backend, require_engine, require_package
from reinforce.core.spec import AlgorithmSpec, GenerationSpec, TrainingSpec
from reinforce.generator.engines import ENGINES
from reinforce.operator.children import Images
from reinforce.trainer.algorithms import ALGORITHMS
from reinforce.trainer.backends import BACKENDS


@pytest.mark.parametrize(
    ("model", "field", "names"),
    [
        (GenerationSpec, "engine", ("auto", *registry.ENGINES)),  # auto: supervisor/engine_choice.py
        (TrainingSpec, "backend", registry.BACKENDS),
        (AlgorithmSpec, "name", registry.ALGORITHMS),
        (AlgorithmSpec, "advantage_estimator", registry.ADVANTAGE_ESTIMATORS),
    ],
)
def test_the_spec_offers_the_registry_s_names(model: type, field: str, names: tuple[str, ...]) -> None:
    assert get_args(model.model_fields[field].annotation) == names


def test_each_service_builds_exactly_the_registry_s_names() -> None:
    assert tuple(ENGINES) == registry.ENGINES
    assert tuple(BACKENDS) == registry.BACKENDS
    assert tuple(ALGORITHMS) == registry.ALGORITHMS


def test_optional_packages_belong_to_declared_names() -> None:
    assert set(registry.ENGINE_PACKAGES) < set(registry.ENGINES)
    assert set(registry.BACKEND_PACKAGES) < set(registry.BACKENDS)


def test_the_operator_has_an_image_for_every_engine_with_a_package() -> None:
    """operator/children.py's default_image picks images.generator_<engine> for an engine with a package of its
    own, images.generator for the others."""
    fields = set(Images.model_fields)
    assert {f"generator_{engine}" for engine in registry.ENGINE_PACKAGES} <= fields
    assert "torch" not in registry.ENGINE_PACKAGES  # the generator image's own engine


def test_a_missing_package_is_refused_with_how_to_install_it() -> None:
    require_engine("torch")  # needs nothing more
    require_backend("torch")
    with pytest.raises(MissingPackage, match="pip install x"):
        require_package("no_such_package_here.core", "a test", "pip install x")  # its parent is missing too
