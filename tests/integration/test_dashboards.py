"""Grafana dashboards and Prometheus alert rules (scripts/generate/dashboards.py).

The committed files must equal what the module writes; promtool checks the rules and runs their unit tests (each
alert fires); and a real Prometheus (Debian's) scrapes a real tiny run through the supervisor's
prometheus_targets.json (a PPO run, so that the critic is scraped too; the trainer exports every step metric,
REINFORCE's at 0; and a multi-turn run, examples/tiny-tools.yaml, whose environment service the environment dashboard
shows), where every panel's query must return data and every metric a dashboard or alert names must be exported by a
service. There is no Grafana server to be had: its part is the PromQL.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from promserver import (
    COMPONENTS,
    SYNTHETIC,
    TOOLS_COMPONENTS,
    Prometheus,
    alert_queries,
    assert_every_dashboard_query_answers,
    expand,
    metric_names,
    panel_queries,
    wait_until_scraped,
)
from runs import start, wait_for_step, write_spec

from generate.dashboards import (
    ALERTS,
    ALERTS_FILE,
    DASHBOARDS,
    DASHBOARDS_DIR,
    Triton,
)
from reinforce.core.metrics import (
    STEP_METRICS,
    CriticMetrics,
    EnvironmentMetrics,
    GeneratorMetrics,
    TrainerMetrics,
    prometheus_name,
)
from reinforce.core.names import (
    COMPONENT_CRITIC,
    COMPONENT_ENVIRONMENT,
    COMPONENT_GENERATOR,
    COMPONENT_REWARD,
    COMPONENT_TRAINER,
)
from reinforce.supervisor.children import PROMETHEUS_TARGETS

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
RULES_TEST = ALERTS_FILE.with_name("reinforce-rules.test.yaml")


# The series a family is scraped as (a labelled family has no sample before its first label values are used).
SCRAPED_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def known_metric_names() -> set[str]:
    """Every name the services export as scraped, from metrics.py's own registries, and Triton's."""
    names = {prometheus_name(n) for n in STEP_METRICS}
    registries = (TrainerMetrics(jsonl_path=None), GeneratorMetrics(), CriticMetrics(), EnvironmentMetrics())
    for registry in (m.registry for m in registries):
        for family in registry.collect():
            names |= {s.name for s in family.samples}
            names |= {family.name + suffix for suffix in SCRAPED_SUFFIXES.get(family.type, ("",))}
    return names | {v for k, v in vars(Triton).items() if k.isupper()}


# --- the files ----------------------------------------------------------------------------------------------------


def test_dashboards_are_grafana_models():
    for d in DASHBOARDS:
        model = json.loads((DASHBOARDS_DIR / d.file).read_text())
        assert model["schemaVersion"] == 39 and model["uid"] == d.uid and len(model["uid"]) <= 40
        assert [v["name"] for v in model["templating"]["list"]] == ["datasource", "run"]
        panels = model["panels"]
        assert [p["id"] for p in panels] == list(range(1, len(panels) + 1))
        cells = set()
        for p in panels:
            assert p["type"] in {"timeseries", "stat"} and p["targets"], p["title"]
            assert p["datasource"]["uid"] == "${datasource}"
            grid = p["gridPos"]
            assert grid["x"] + grid["w"] <= 24
            mine = {
                (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
            }
            assert not mine & cells, f"{d.file}: panel {p['title']!r} overlaps another"
            cells |= mine
        assert len({d.uid for d in DASHBOARDS}) == len(DASHBOARDS)


def test_every_query_names_only_defined_metrics():
    """A typo in a metric name would give an empty panel and no error anywhere: names come from metrics.py."""
    known = known_metric_names() | SYNTHETIC
    queries = [(f"{f}: {title}", e) for f, title, e in panel_queries()] + alert_queries()
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric found in {expr}"
        assert names <= known, f"{where}: {sorted(names - known)} are exported by no service"
    panel_names = {n for _, _, e in panel_queries() for n in metric_names(e)}
    assert panel_names >= {Triton.REQUEST_SUCCESS, Triton.QUEUE_US, prometheus_name("timers/weight_publish")}
    tools = EnvironmentMetrics()
    for metric, part in ((tools.tool_calls, "_total"), (tools.tool_errors, "_total"), (tools.seconds, "_bucket")):
        assert metric.describe()[0].name + part in panel_names


def test_the_environment_dashboard_and_alert_show_calls_errors_and_latency():
    """Issue #24, item 7: tool calls/s, the tool error rate (errors and timeouts over calls run; malformed calls
    apart) and tool latency quantiles, per run and per tool; and an alert on an error rate that stays high."""
    [board] = [d for d in DASHBOARDS if d.file == "environment.json"]
    exprs = {p.title: [q.expr for q in p.queries] for p in board.panels}
    assert {"Tool calls/s", "Tool error rate", "Tool latency p99", "Tool latency"} <= set(exprs)
    [rate] = exprs["Tool error rate"]
    errors, calls = rate.split(" / ")
    assert 'reinforce_environment_tool_errors_total{run=~"$run", tool!="invalid"}' in errors
    assert "reinforce_environment_tool_timeouts_total" in errors and "reinforce_environment_tool_calls_total" in calls
    assert [e.split("(")[1] for e in exprs["Tool latency"]] == ["0.5, sum by ", "0.99, sum by "]
    assert all("sum by (run, tool, le)" in e for e in exprs["Tool latency"])
    [alert] = [a for a in ALERTS if a.name == "ReinforceToolErrorRateHigh"]
    assert alert.expr.endswith(" > 0.5") and "[15m]" in alert.expr and "$run" not in alert.expr
    assert alert.for_minutes == 15 and alert.severity == "warning"


def test_metric_name_extraction():
    expr = 'max by (run) (a_b{run=~"x"}) - on (run) group_right () c:d offset 5m and rate(e_total{l="by"}[1m]) > 1'
    assert metric_names(expr) == {"a_b", "c:d", "e_total"}


def test_panel_queries_parse(tmp_path):
    """promtool parses each panel's PromQL (as a recording rule) with Grafana's variables filled in."""
    rules = [{"record": f"panel_{i}", "expr": expand(e, "tiny")} for i, (_, _, e) in enumerate(panel_queries())]
    path = tmp_path / "panels.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    result = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


# --- the alert rules ----------------------------------------------------------------------------------------------


def test_rules_pass_promtool_check():
    result = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS_FILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_each_alert_fires_in_the_rule_unit_tests():
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert fired == {a.name for a in ALERTS}
    result = subprocess.run([PROMTOOL, "test", "rules", RULES_TEST.name], capture_output=True, text=True,
                            cwd=RULES_TEST.parent)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


# --- against a live run -------------------------------------------------------------------------------------------


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # Prometheus watches the folder of the targets file, which the supervisor writes later
    targets = {"files": [str(run_dir / PROMETHEUS_TARGETS)], "refresh_interval": "1s"}
    server = Prometheus(tmp_path, [{"job_name": "reinforce", "file_sd_configs": [targets]}])
    yield server
    server.stop()


@pytest.mark.slow
def test_every_panel_query_returns_data_from_a_live_run(tmp_path, prometheus):
    print(f"prometheus ready in {prometheus.start_s:.2f} s")
    spec = write_spec(tmp_path, "tiny-ppo", training={"steps": 15, "checkpoint_every": 15})
    run_dir = tmp_path / "run"
    run = start("run", str(spec))
    try:
        wait_for_step(run, run_dir, 12)
        at = wait_until_scraped(prometheus, "tiny-ppo", COMPONENTS)  # the run is still going: every service exports
        targets = json.loads((run_dir / PROMETHEUS_TARGETS).read_text())
        time.sleep(2)  # the scrapes up to `at` are stored
        assert run.wait(timeout=120) == 0, run.communicate()[1][-3000:]
    finally:
        if run.poll() is None:
            run.terminate()
            run.wait(timeout=60)

    assert [t["labels"]["instance"] for t in targets] == ["reward", "critic", "generator-0", "trainer"]
    assert json.loads((run_dir / PROMETHEUS_TARGETS).read_text()) == [], "a finished run still lists targets"
    up = prometheus.api("query", query='up{run="tiny-ppo"}', time=at)["result"]
    components = {r["metric"]["component"]: r["value"][1] for r in up}
    assert components == {
        COMPONENT_REWARD: "1",
        COMPONENT_CRITIC: "1",
        COMPONENT_GENERATOR: "1",
        COMPONENT_TRAINER: "1",
    }

    names = assert_every_dashboard_query_answers(prometheus, "tiny-ppo", at, skip=frozenset({"environment.json"}))
    rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {a.name for a in ALERTS}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    print(f"{len(panel_queries())} panel queries and {names} metric names checked")


@pytest.mark.slow
def test_the_environment_dashboard_answers_from_a_live_tools_run(tmp_path, prometheus):
    """examples/tiny-tools.yaml (multi-turn, the calculator) scraped live: every dashboard but PPO's answers, the
    environment's included (its tools' series exist from the start, so the error rates are 0, not missing), and no
    alert's condition holds."""
    spec = write_spec(tmp_path, "tiny-tools", training={"steps": 40, "checkpoint_every": 40})
    run_dir = tmp_path / "run"
    run = start("run", str(spec))
    try:
        wait_for_step(run, run_dir, 10)
        at = wait_until_scraped(prometheus, "tiny-tools", TOOLS_COMPONENTS)
        time.sleep(2)  # the scrapes up to `at` are stored
        names = assert_every_dashboard_query_answers(prometheus, "tiny-tools", at, skip=frozenset({"ppo.json"}))
        calls = prometheus.query('sum(reinforce_environment_tool_calls_total{run="tiny-tools"})', at)
        errors = prometheus.query('reinforce_environment_tool_errors_total{run="tiny-tools"}', at)
        assert run.wait(timeout=300) == 0, run.communicate()[1][-3000:]
    finally:
        if run.poll() is None:
            run.terminate()
            run.wait(timeout=60)
    assert float(calls[0]["value"][1]) > 0  # the episodes called the calculator
    assert {r["metric"]["tool"] for r in errors} == {"calculator", "invalid"}  # exported at 0 before any error
    assert {r["metric"]["component"] for r in errors} == {COMPONENT_ENVIRONMENT}
    print(f"{names} metric names checked against a tools run")
