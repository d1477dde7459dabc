"""Build tools that write the repository's generated files; `make generate` runs them all.

Nothing in the installed package writes into the source tree: the CRD, the chart's values schema and RBAC
rules, operator/operator.yaml, the dashboards and alerts, the README's architecture picture and the
documentation site's reference pages (docs/) are written from here. Each
module's `generated_files()` returns path -> content; the drift tests compare it with the committed files.
"""
