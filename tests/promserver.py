"""A real Prometheus (Debian's) for the tests, and the checks every dashboard query must pass against it.

Used by tests/integration/test_dashboards.py (scraping a local run through the supervisor's targets file),
tests/e2e/test_cluster_e2e.py (scraping the pods of a single-node cluster through the API server) and
tests/e2e/test_compose.py (the checks only, against docker-compose.yml's own Prometheus).
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import yaml
from conftest import free_port

from generate.dashboards import (
    ALERTS,
    ALERTS_FILE,
    DASHBOARDS,
    RATE_INTERVAL,
    RUN_VARIABLE,
    dashboard_json,
)
from reinforce.core.names import (
    COMPONENT_CRITIC,
    COMPONENT_ENVIRONMENT,
    COMPONENT_GENERATOR,
    COMPONENT_REWARD,
    COMPONENT_TRAINER,
)
from reinforce.core.names import COMPONENTS as ALL_COMPONENTS

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
# Series Prometheus makes itself about each target, not exported by any service.
SYNTHETIC = {"up"}
RATE_WINDOW_S = 10  # the rate interval of expand(): the scrapes are 1 s apart
COMPONENTS = {COMPONENT_TRAINER, COMPONENT_GENERATOR, COMPONENT_REWARD, COMPONENT_CRITIC}  # a PPO run's
TOOLS_COMPONENTS = {COMPONENT_TRAINER, COMPONENT_GENERATOR, COMPONENT_REWARD, COMPONENT_ENVIRONMENT}  # a tools run's


class PrometheusAPI:
    """The HTTP API of a Prometheus at `url`: one these tests start, or docker-compose.yml's."""

    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: object) -> dict | list:
        answer = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10).json()
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str, at: float) -> list[dict]:
        return self.api("query", query=expr, time=at)["result"]


class Prometheus(PrometheusAPI):
    """Debian's prometheus on a free loopback port, scraping every second, with the alert rules loaded."""

    def __init__(self, folder: Path, scrape_configs: list[dict]) -> None:
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS_FILE)],
            "scrape_configs": scrape_configs,
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        super().__init__(f"http://127.0.0.1:{free_port()}")
        argv = [PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'tsdb'}",
                f"--web.listen-address={self.url.removeprefix('http://')}"]  # fmt: skip
        self.log = folder / "prometheus.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        started = time.monotonic()
        while not self._ready():
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() - started < 30, "prometheus not ready in 30 s"
            time.sleep(0.1)
        self.start_s = time.monotonic() - started

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


# --- the dashboards' queries --------------------------------------------------------------------------------------


def expand(expr: str, run: str) -> str:
    """What Grafana sends with the run selected."""
    return expr.replace(RATE_INTERVAL, f"{RATE_WINDOW_S}s").replace(RUN_VARIABLE, run)


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL) of every query of every dashboard, as written to the JSON."""
    return [
        (d.file, p["title"], t["expr"]) for d in DASHBOARDS for p in dashboard_json(d)["panels"] for t in p["targets"]
    ]


def alert_queries() -> list[tuple[str, str]]:
    return [(a.name, a.expr) for a in ALERTS]


_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                 "offset", "inf", "nan"}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, keywords, label names
    (inside {...} or the label lists of by/on/...), strings or durations."""
    expr = re.sub(r'"[^"]*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)  # label matchers, range durations
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    expr = re.sub(r"\boffset\s+\w+", " ", expr)
    names = set(re.findall(r"\b([a-zA-Z_:][\w:]*)\b(?!\s*\()", expr))
    return {n for n in names if n.lower() not in _PROMQL_WORDS and not n[0].isdigit()}


def wait_until_scraped(
    prometheus: PrometheusAPI, run: str, components: set[str], scrapes: int = 3, timeout_s: float = 120
) -> float:
    """Waits until each instance of the run's `components` answered at least `scrapes` scrapes in the last rate window,
    so that a rate over that window has the two samples it needs; returns that moment (time.time())."""
    deadline = time.monotonic() + timeout_s
    expr = f'min by (component) (sum_over_time(up{{run="{run}"}}[{RATE_WINDOW_S}s]))'
    while True:
        at = time.time()
        answered = {r["metric"]["component"]: float(r["value"][1]) for r in prometheus.query(expr, at)}
        if all(answered.get(c, 0) >= scrapes for c in components):
            return at
        assert time.monotonic() < deadline, f"scrapes of {run} in the last {RATE_WINDOW_S} s: {answered}"
        time.sleep(0.5)


# The alerts fire only after their condition has held for minutes (`for:`). A healthy tiny run can cross a
# threshold for a scrape: it publishes weight versions faster than the 1 s scrapes see a generator load them
# (ReinforceGeneratorLagging, two versions behind, in CI; once through 5 s of scrapes, on the cluster). So a
# condition fails the test only when it held at each of the last ALERT_HOLD_S one-second scrapes.
ALERT_HOLD_S = 10


def _only_of(expr: str, skipped: set[str]) -> bool:
    """Whether an expression selects skipped dashboards' metrics and no others (`up` is every component's)."""
    exported = metric_names(expr) - SYNTHETIC
    return bool(exported) and exported <= skipped


def assert_every_dashboard_query_answers(
    prometheus: PrometheusAPI, run: str, at: float, skip: frozenset[str] = frozenset()
) -> int:
    """At time `at` of a healthy running run: every panel query has a finite value, no alert's condition held
    through the last ALERT_HOLD_S seconds,
    and every metric a dashboard or alert names has a series from one of the run's components. Returns the
    number of metric names checked. `skip`: dashboard files of components the run does not have (a REINFORCE
    run has no critic, a run without tools no environment); an alert on their metrics alone is skipped too."""
    queries = [q for q in panel_queries() if q[0] not in skip]
    checked = {n for _, _, e in queries for n in metric_names(e)}
    skipped = {n for file, _, e in panel_queries() if file in skip for n in metric_names(e)} - checked
    alerts = [(name, expr) for name, expr in alert_queries() if not _only_of(expr, skipped)]
    empty = []
    for file, title, expr in queries:
        result = prometheus.query(expand(expr, run), at)
        if not any(math.isfinite(float(r["value"][1])) for r in result):
            empty.append(f"{file}: {title}: {expand(expr, run)} -> {result}")
    assert not empty, "queries without a finite value:\n" + "\n".join(empty)
    for name, expr in alerts:  # a healthy run: no alert's condition holds for ALERT_HOLD_S scrapes
        held = [
            any(r["metric"].get("run") == run for r in prometheus.query(expr, at - seconds))
            for seconds in range(ALERT_HOLD_S)
        ]
        assert not all(held), name
    names = checked | ({n for _, e in alerts for n in metric_names(e)} - SYNTHETIC)
    for name in sorted(names):
        series = prometheus.api("series", **{"match[]": f'{name}{{run="{run}"}}', "start": at - 60, "end": at})
        assert {s["component"] for s in series} & set(ALL_COMPONENTS), name
    return len(names)
