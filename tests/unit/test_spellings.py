"""Every spec field has two spellings (issue 25): snake_case, canonical in spec files, and camelCase, canonical in a
ReinforceRun and the operator's configuration (Kubernetes' API conventions). Both are read everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from reinforce.core.names import COMPONENTS
from reinforce.core.spec import SpecError, _is_section, load_spec, parse_spec, respell
from reinforce.operator.children import OperatorConfig
from reinforce.operator.resource import ReinforceRunSpec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"
POD = {
    "image": "img:1",
    "requests": {"cpu": "1"},
    "limits": {"memory": "1Gi"},
    "gpus": 1,
    "node_selector": {"pool": "gpu"},
    "tolerations": [{"key": "spot", "operator": "Equal", "value": "x", "effect": "NoExecute", "toleration_seconds": 5}],
}


def _every_field(model: type[BaseModel], by_alias: bool, prefix: str = "") -> set[str]:
    """Dotted paths of every field of the model and its sections, spelled one way."""
    paths = set()
    for name, field in model.model_fields.items():
        path = prefix + (field.alias if by_alias else name)
        paths.add(path)
        sections = [a for a in getattr(field.annotation, "__args__", (field.annotation,)) if _is_section(a)]
        origin = getattr(field.annotation, "__origin__", None)
        if sections and origin is not dict:  # a map's keys are the user's (components, labels)
            paths |= _every_field(sections[0], by_alias, path + ("[]." if origin is list else "."))
    return paths


def _paths(data: Any, prefix: str = "") -> set[str]:
    if isinstance(data, list):
        return set().union(*(_paths(item, prefix.removesuffix(".") + "[].") for item in data))
    if not isinstance(data, dict):
        return set()
    return {prefix + key for key in data} | set().union(*(_paths(v, f"{prefix}{key}.") for key, v in data.items()))


def _full_run() -> ReinforceRunSpec:
    """A ReinforceRun spec with every optional section present, so that each field of each section is in its dump."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data["training"]["lora"] = {}
    data["kubernetes"] = {component: POD for component in COMPONENTS}
    return ReinforceRunSpec.model_validate(data)


@pytest.mark.parametrize("model", [ReinforceRunSpec, OperatorConfig])
def test_every_field_round_trips_in_both_spellings(model: type[BaseModel]) -> None:
    spec = _full_run() if model is ReinforceRunSpec else OperatorConfig.model_validate({"pods": {"trainer": POD}})
    snake, camel = spec.model_dump(mode="json"), spec.model_dump(mode="json", by_alias=True)
    if model is ReinforceRunSpec:  # policy.path and random_init exclude each other: random_init's fields are here
        assert _every_field(model, False) - {"policy.path", "policy.gguf_file"} <= _paths(snake)
        assert _every_field(model, True) - {"policy.path", "policy.ggufFile"} <= _paths(camel)
    assert respell(snake, model) == camel and respell(camel, model, by_alias=False) == snake
    assert model.model_validate(snake) == spec and model.model_validate(camel) == spec
    # camelCase is Kubernetes': no underscore left, and the spellings differ exactly where a name has one
    assert not any("_" in path.rsplit(".", 1)[-1] for path in _every_field(model, True))
    assert (
        camel["kubernetes" if model is ReinforceRunSpec else "pods"]["trainer"]["tolerations"][0]["tolerationSeconds"]
        == 5
    )


def test_a_spec_file_may_spell_fields_in_camel_case(tmp_path: Path) -> None:
    camel = tmp_path / "camel.yaml"
    camel.write_text(yaml.safe_dump(respell(yaml.safe_load(EXAMPLE.read_text()), ReinforceRunSpec)))
    assert "maxNewTokens" in camel.read_text()
    assert load_spec(camel) == load_spec(EXAMPLE)


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ({"generation": {"top_p": 1.5}}, "generation.top_p: Input should be less than or equal to 1"),
        ({"generation": {"topP": 1.5}}, "generation.topP: Input should be less than or equal to 1"),
        ({"generation": {"topP": 0.5, "top_p": 0.5}}, "generation.top_p: Extra inputs are not permitted"),
    ],
)
def test_an_error_names_the_field_as_the_input_spelled_it(patch: dict, expected: str) -> None:
    data = {"name": "t", "policy": {"randomInit": {}}, "data": {"prompts": "p.txt"}, **patch}
    with pytest.raises(SpecError) as raised:
        parse_spec(data)
    assert expected in str(raised.value)


def test_a_field_in_both_spellings_takes_its_snake_case_one() -> None:
    """A ReinforceRun stored under the snake_case CRD of earlier releases and read through the camelCase one holds
    its own values by name and the server's defaults by alias (docs/kubernetes/upgrading.md): its own win, in any key
    order."""
    stored = {"generation": {"num_generators": 2, "numGenerators": 1, "maxNewTokens": 48, "max_new_tokens": 16}}
    assert respell(stored, ReinforceRunSpec) == {"generation": {"numGenerators": 2, "maxNewTokens": 16}}
    snake = {"generation": {"num_generators": 2, "max_new_tokens": 16}}
    assert respell(stored, ReinforceRunSpec, by_alias=False) == snake
