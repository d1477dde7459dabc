"""`make generate` (PYTHONPATH=scripts python -m generate): write every generated file of the repository."""

from pathlib import Path

from generate import chart_values, crd, dashboards, docs, operator_manifest, readme

ROOT = Path(__file__).resolve().parents[2]

# docs last: its tables describe the CRD, dashboards and alerts written before it.
for module in (crd, chart_values, operator_manifest, dashboards, readme, docs):
    for path, content in module.generated_files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        print(f"wrote {path.relative_to(ROOT)}")
