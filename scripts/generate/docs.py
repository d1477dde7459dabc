"""The documentation site's generated parts (docs/): the spec, ReinforceRun, operator, chart-value and metric
reference tables, the CLI and CRD pages, each algorithm's formulas beside the code that computes them, and the
repository's layout from its modules' docstrings.

A page of prose holds a generated block between `<!-- generated:NAME -->` and `<!-- end:NAME -->`; a page that is
wholly generated (the CLI, the CRD) is written whole. Both are compared with the committed files by the drift test.
"""

import argparse
import ast
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from generate.chart_values import ChartValues
from generate.dashboards import ALERTS, DASHBOARDS
from generate.escapes import escapes_markdown
from reinforce.cli import build_parser
from reinforce.core.metrics import STEP_METRICS, prometheus_name
from reinforce.core.spec import RunSpec, markdown_table, reference_markdown, reference_rows
from reinforce.operator.children import OperatorConfig
from reinforce.operator.resource import ReinforceRunSpec
from reinforce.trainer.algorithms import advantages, aggregation, dapo, ppo, reinforce, tensors

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CRD = ROOT / "charts" / "reinforce" / "crds" / "reinforceruns.yaml"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


CODE_SPAN = re.compile(r"(`[^`]*`)")


def _html_safe(table: str) -> str:
    """A markdown table as Python-Markdown renders it right: `<name>` outside code is text, not a tag, and a code
    span holding a table pipe (`str \\| None`) becomes <code> with the pipe as an entity (a backslash would show)."""

    def fix(part: str) -> str:
        if not part.startswith("`"):
            return part.replace("<", "&lt;").replace(">", "&gt;")
        if "\\|" not in part:
            return part
        inner = part[1:-1].replace("\\|", "|").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        return "<code>" + inner.replace("|", "&#124;") + "</code>"

    return "\n".join("".join(fix(p) for p in CODE_SPAN.split(line)) for line in table.splitlines())


def spec_markdown() -> str:
    """Every run-spec field, with its ReinforceRun spelling (camelCase) where that differs from the file's."""
    rows = reference_rows(RunSpec)
    aliases = reference_rows(RunSpec, by_alias=True)
    lines = ["| field | in a ReinforceRun | type | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for row, alias in zip(rows, aliases, strict=True):
        other = f"`{alias.path}`" if alias.path != row.path else "same"
        lines.append(f"| `{row.path}` | {other} | {row.type} | {row.default} | {_cell(row.meaning)} |")
    return "\n".join(lines)


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
        rows.append(f"| `{a.name}` | {a.severity} | `{_cell(a.expr)}`{pending} |")
    return "\n".join(rows)


# Each estimator: the module whose docstring holds its formulas (the n-th indented block), and the functions that
# compute them, shown as they are in the source.
ESTIMATORS: list[tuple[str, object, int, list[Callable]]] = [
    ("REINFORCE with the RLOO baseline (`advantage_estimator: rloo`)", reinforce, 0,
     [tensors.kl_per_token, tensors.sequence_kl, reinforce.rloo_baseline, reinforce.rloo_advantages,
      reinforce.policy_gradient_loss, reinforce.truncated_importance_weights]),
    ("GRPO, Dr. GRPO and REINFORCE++ (`advantage_estimator: grpo`, `dr_grpo`, `reinforce_plus_plus`)", advantages, 0,
     [advantages.group_deviations, advantages.grpo_advantages, advantages.dr_grpo_advantages,
      advantages.reinforce_plus_plus_advantages]),
    ("Clipped and GSPO losses (`policy_loss: clip`, `gspo`)", reinforce, 1,
     [reinforce.importance_ratio, ppo.clipped_surrogate]),
    ("Loss aggregation (`loss_aggregation`)", aggregation, 0, [aggregation.LossNormalizer.reduce]),
    ("DAPO's overlong shaping and dynamic sampling (`overlong_buffer`, `dynamic_sampling`)", dapo, 0,
     [dapo.overlong_penalty, dapo.uninformative]),
    ("PPO (`algorithm.name: ppo`)", ppo, 0,
     [ppo.token_rewards, ppo.generalized_advantages, tensors.masked_whiten, ppo.clipped_surrogate]),
]  # fmt: skip


def indented_blocks(docstring: str) -> list[str]:
    """The docstring's runs of lines indented by four spaces (its formulas), dedented."""
    blocks, current = [], []
    for line in docstring.splitlines():
        if line.startswith("    ") or (current and not line.strip()):
            current.append(line[4:])
        elif current:
            blocks.append("\n".join(current).rstrip())
            current = []
    if current:
        blocks.append("\n".join(current).rstrip())
    return blocks


def source_path(module: object) -> str:
    return str(Path(inspect.getfile(module)).relative_to(ROOT))


def estimators_markdown() -> str:
    parts = []
    for title, module, block, functions in ESTIMATORS:
        formulas = indented_blocks(inspect.getdoc(module))[block]
        parts += [f"### {title}", f"From `{source_path(module)}`'s docstring:", f"```text\n{formulas}\n```"]
        for function in functions:
            code = inspect.cleandoc(inspect.getsource(function))
            parts.append(f"`{function.__qualname__}` ({source_path(inspect.getmodule(function))}):")
            parts.append(f"```python\n{code}\n```")
    return "\n\n".join(parts)


# The layout table (docs/concepts.md): a row per package (its __init__.py's docstring) and per module (its own), each
# the first sentence of the docstring's first paragraph. Paths in the package are written from services/reinforce/,
# as the code's own prose writes them (`core/spec.py`).
PACKAGE = ROOT / "services" / "reinforce"
LAYOUT_FOLDERS = [PACKAGE, ROOT / "benchmarks", ROOT / "scripts"]
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(])")


def first_sentence(path: Path) -> str | None:
    """The first sentence of a module's docstring (of its first paragraph, unwrapped); None without a docstring."""
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    if not docstring:
        return None
    return SENTENCE_END.split(" ".join(docstring.split("\n\n")[0].split()))[0]


def layout_path(path: Path) -> str:
    return str(path.relative_to(PACKAGE if path.is_relative_to(PACKAGE) and path.is_file() else ROOT))


def layout_sentence(path: Path) -> str:
    sentence = first_sentence(path)
    if sentence is None:
        sys.exit(f"{path.relative_to(ROOT)} has no docstring: its first sentence is its row of docs/concepts.md")
    return sentence


def layout_markdown() -> str:
    """Every package and module of the layout's folders (a package's __main__.py only where it has a docstring)."""
    rows = ["| path | what it is |", "| --- | --- |"]
    for top in LAYOUT_FOLDERS:
        for folder in sorted({top, *(p.parent for p in top.rglob("*.py"))}):
            if (folder / "__init__.py").exists():
                rows.append(f"| `{layout_path(folder)}/` | {_cell(layout_sentence(folder / '__init__.py'))} |")
            for module in sorted(p for p in folder.glob("*.py") if p.name != "__init__.py"):
                if module.name != "__main__.py" or first_sentence(module):
                    rows.append(f"| `{layout_path(module)}` | {_cell(layout_sentence(module))} |")
    return "\n".join(rows)


SOURCE_CODE = {"estimators"}  # code blocks, shown as they are
GENERATED: dict[str, tuple[str, Callable[[], str]]] = {
    "spec-reference": ("reference/spec.md", spec_markdown),
    "kubernetes-reference": ("reference/kubernetes.md", kubernetes_reference_markdown),
    "operator-config": ("reference/kubernetes.md", lambda: reference_markdown(OperatorConfig, by_alias=True)),
    "chart-values": ("reference/chart-values.md", chart_values_markdown),
    "metrics": ("reference/metrics.md", metrics_markdown),
    "dashboards": ("reference/metrics.md", dashboards_markdown),
    "alerts": ("reference/metrics.md", alerts_markdown),
    "estimators": ("algorithms.md", estimators_markdown),
    "escapes": ("environments.md", escapes_markdown),
    "layout": ("concepts.md", layout_markdown),
}


def render_block(text: str, name: str, make: Callable[[], str], page: str) -> str:
    pattern = re.compile(rf"(<!-- generated:{name} -->\n)(?:.*?\n)?(<!-- end:{name} -->)", re.S)
    if not pattern.search(text):
        sys.exit(f"docs/{page} lacks the markers of the generated block {name!r}")
    block = make() if name in SOURCE_CODE else _html_safe(make())
    return pattern.sub(lambda m: m.group(1) + block + "\n" + m.group(2), text)


def _flags(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
    takes_value = action.nargs != 0 and not isinstance(action, argparse._StoreConstAction)
    if action.option_strings and takes_value:
        names += f" `{action.metavar or action.dest.upper()}`"
    return names


def _default(action: argparse.Action) -> str:
    if action.required or action.default in (None, argparse.SUPPRESS) or action.nargs == 0:
        return "required" if action.required else ""
    return f"`{action.default}`"


def cli_markdown() -> str:
    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help for choice in commands._choices_actions}
    lines = [
        "# Command line",
        "",
        "Generated from the argument parsers (`make generate`, scripts/generate/docs.py): every command of",
        "`reinforce` and its arguments.",
    ]
    for name, sub in commands.choices.items():
        lines += ["", f"## `reinforce {name}`", "", _cell(helps.get(name) or sub.description or "")]
        if sub.description and sub.description != helps.get(name):
            lines += ["", sub.description]
        lines += ["", "| argument | default | meaning |", "| --- | --- | --- |"]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            meaning = _cell((action.help or "") % {"default": action.default} if action.help else "")
            lines.append(f"| {_flags(action)} | {_default(action)} | {meaning} |")
    return _html_safe("\n".join(lines)) + "\n"


def crd_markdown() -> str:
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]
    names = spec["names"]
    lines = [
        "# The ReinforceRun CRD",
        "",
        f"Generated from `{CRD.relative_to(ROOT)}` (itself generated from the spec model by `make generate`).",
        "Its fields are the [spec](spec.md) in camelCase plus the [Kubernetes fields](kubernetes.md).",
        "",
        "| | |",
        "| --- | --- |",
        f"| group | `{spec['group']}` |",
        f"| kind | `{names['kind']}` (plural `{names['plural']}`, short names "
        + ", ".join(f"`{s}`" for s in names.get("shortNames", []))
        + ") |",
        f"| scope | {spec['scope']} |",
    ]
    for version in spec["versions"]:
        sub = ", ".join(f"`{k}`" for k in version.get("subresources", {}))
        lines += [
            f"| version | `{version['name']}` (served: {version['served']}, storage: {version['storage']}) |",
            f"| subresources | {sub} |",
        ]
        lines += ["", "`kubectl get rr` columns (`-o wide` adds those of priority 1):", ""]
        lines += ["| column | type | JSON path | priority |", "| --- | --- | --- | --- |"]
        for c in version.get("additionalPrinterColumns", []):
            lines.append(f"| {c['name']} | {c['type']} | `{c['jsonPath']}` | {c.get('priority', 0)} |")
    return "\n".join(lines) + "\n"


WHOLE: dict[str, Callable[[], str]] = {"reference/cli.md": cli_markdown, "reference/crd.md": crd_markdown}


def generated_files() -> dict[Path, str]:
    pages: dict[Path, str] = {}
    for name, (page, make) in GENERATED.items():
        path = DOCS / page
        text = pages.get(path, path.read_text())
        pages[path] = render_block(text, name, make, page)
    pages.update({DOCS / page: make() for page, make in WHOLE.items()})
    return pages
