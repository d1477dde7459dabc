"""Regenerate the README's generated tables (spec reference, chart values, metrics) from the code that defines them."""

import re
import sys
from pathlib import Path

from generate.chart_values import ChartValues
from generate.dashboards import ALERTS, DASHBOARDS
from reinforce.core.metrics import STEP_METRICS, prometheus_name
from reinforce.core.spec import RunSpec, markdown_table, reference_markdown, reference_rows
from reinforce.operator.children import OperatorConfig
from reinforce.operator.resource import ReinforceRunSpec

README = Path(__file__).resolve().parents[2] / "README.md"


def metrics_markdown() -> str:
    rows = ["| metrics.jsonl name | Prometheus name | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{name}` | `{prometheus_name(name)}` | {doc} |" for name, doc in STEP_METRICS.items()]
    return "\n".join(rows)


def kubernetes_reference_markdown() -> str:
    """The fields a ReinforceRun has beyond a run spec, spelled as a ReinforceRun does (camelCase)."""
    return reference_markdown(ReinforceRunSpec, skip=tuple(RunSpec.model_fields), by_alias=True)


def chart_values_markdown() -> str:
    """The chart's values; operatorConfig's keys are the operator configuration table's."""
    rows = reference_rows(ChartValues, by_alias=True)
    return markdown_table([r for r in rows if not r.path.startswith("operatorConfig.")])


def dashboards_markdown() -> str:
    rows = ["| dashboard (uid) | shows | panels |", "| --- | --- | --- |"]
    rows += [f"| {d.title} (`{d.uid}`) | {d.description} | {len(d.panels)} |" for d in DASHBOARDS]
    return "\n".join(rows)


def alerts_markdown() -> str:
    rows = ["| alert | severity | fires when |", "| --- | --- | --- |"]
    for a in ALERTS:
        pending = f", for {a.for_minutes} min" if a.for_minutes else ""
        rows.append(f"| `{a.name}` | {a.severity} | `{a.expr}`{pending} |")
    return "\n".join(rows)


GENERATED = {
    "spec-reference": reference_markdown,
    "kubernetes-reference": kubernetes_reference_markdown,
    "chart-values": chart_values_markdown,
    "operator-config": lambda: reference_markdown(OperatorConfig, by_alias=True),  # the chart's values: camelCase
    "metrics": metrics_markdown,
    "dashboards": dashboards_markdown,
    "alerts": alerts_markdown,
}


def render(text: str) -> str:
    for name, make in GENERATED.items():
        pattern = re.compile(rf"(<!-- generated:{name} -->\n)(?:.*?\n)?(<!-- end:{name} -->)", re.S)
        if not pattern.search(text):
            sys.exit(f"README.md lacks the markers of the generated block {name!r}")
        text = pattern.sub(lambda m, make=make: m.group(1) + make() + "\n" + m.group(2), text)
    return text


def generated_files() -> dict[Path, str]:
    return {README: render(README.read_text())}
