"""deploy/prometheus/alerts.yaml and deploy/grafana/omniflow.json against what /metrics really
exposes (a real API scraped over HTTP after real workflows): every metric, label and label value
they use exists, so neither can drift from the code. With promtool installed (Debian package
`prometheus`), the rules are checked and unit-tested by it, and the dashboard's queries parsed."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from apiserver import api_factory  # noqa: F401 - fixture
from conftest import toy_spec
from helpers import eventually, metric_values

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "omniflow.json"
GRAFANA_VARS = {"$__rate_interval": "5m", "$pipeline": ".*", "$stage": ".*"}
METRIC = re.compile(r"\b(omniflow_[a-z0-9_]+)\b")
SELECTOR = re.compile(r"\b(omniflow_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([a-z_]+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")

SPEC = toy_spec()
SPEC["stages"]["thinker"]["executor"] = "workers_fixtures:MeteredLM"      # batched: batch sizes exist
SPEC["stages"]["thinker"]["params"].update({"max_batch": 4, "max_words": 4})
# the record keeps compute time in whole ms: a Code2Wav done in under 0.5 ms has no real-time factor
SPEC["stages"]["code2wav"]["params"].update({"chunk_delay_s": 0.005})


def alert_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [(rule["alert"], rule["expr"]) for group in rules["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [(f"panel {panel['title']!r}", target["expr"]) for panel in dash["panels"]
             for target in panel.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            inner = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["query"]["query"])
            assert inner, var
            exprs.append((f"variable {var['name']}", f'{inner[1]}{{{inner[2]}!=""}}'))
    return [(where, _grafana(expr)) for where, expr in exprs]


def _grafana(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return expr


class Exposition:
    """Sample names, their label names and label values, from one scrape."""

    def __init__(self, values: dict[Any, float]) -> None:
        self.labels: dict[str, set[str]] = defaultdict(set)
        self.values: dict[tuple[str, str], set[str]] = defaultdict(set)
        for name, labels in values:
            self.labels[name] |= {label for label, _ in labels}
            for label, value in labels:
                self.values[(name, label)].add(value)

    def problems(self, where: str, expr: str) -> list[str]:
        found = []
        names = set(METRIC.findall(expr))
        for name in sorted(names - set(self.labels)):
            found.append(f"{where}: {name} is not exposed")
        for name, matchers in SELECTOR.findall(expr):
            for label, op, value in MATCHER.findall(matchers):
                if name in self.labels and label not in self.labels[name]:
                    found.append(f"{where}: {name} has no label {label!r}")
                elif op == "=" and name in self.labels and value not in self.values[(name, label)]:
                    found.append(f"{where}: {name}{{{label}={value!r}}} is never exposed")
        known = set().union(*(self.labels.get(name, set()) for name in names)) if names else set()
        for group in GROUPING.findall(expr):
            for label in (x.strip() for x in group.split(",") if x.strip()):
                if label not in known:
                    found.append(f"{where}: grouping by {label!r}, a label none of {sorted(names)} has")
        return found


async def test_alerts_and_dashboard_use_only_what_metrics_exposes(api_factory) -> None:
    async with api_factory(SPEC) as (_engine, server), server.client() as http:
        for i in range(2):
            wf_id = (await http.post("/v1/workflows", json={"input": {"text": f"watch me {i}"}})).json()["id"]
            assert (await http.get(f"/v1/workflows/{wf_id}", params={"wait": 20})).json()["state"] == "completed"

        async def scraped() -> dict[Any, float] | None:
            values = metric_values((await http.get("/metrics")).text)
            rtf = ("omniflow_stage_rtf_count", (("pipeline", SPEC["name"]), ("stage", "code2wav")))
            return values if ("omniflow_batch_size_count", (("stage", "thinker"),)) in values \
                and values.get(rtf) == 2 else None

        exposition = Exposition(await eventually(scraped, timeout_s=15, interval_s=0.2,
                                                 what="the thinker's batch sizes and both workflows' RTF published"))
    problems = [p for where, expr in (*alert_exprs(), *dashboard_exprs()) for p in exposition.problems(where, expr)]
    assert not problems, "\n".join(problems)
    # and the check itself would catch a renamed metric, a wrong label, a value never exposed
    assert exposition.problems("x", "rate(omniflow_stage_rtf_bukket[5m])")
    assert exposition.problems("x", 'max by (stage) (omniflow_workers{state="sleeping"})')
    assert exposition.problems("x", 'max by (host) (omniflow_live_workers)')


def test_dashboard_is_a_grafana_dashboard() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "omniflow"
    for panel in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
    titles = " ".join(panel["title"] for panel in dash["panels"]).lower()
    for needed in ("throughput", "workflows by state", "queue lag", "time to first audio", "rtf", "underruns",
                   "workers by state"):
        assert needed in titles, needed


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_checks_and_unit_tests_the_rules(tmp_path: Path) -> None:
    checked = _promtool("check", "rules", str(ALERTS))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _promtool("test", "rules", str(ALERT_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # the dashboard's queries parse as PromQL: as recording rules of a throwaway rules file
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{i}", "expr": expr}
                                                        for i, (_, expr) in enumerate(dashboard_exprs())]}]}
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    parsed = _promtool("check", "rules", str(path))
    assert parsed.returncode == 0, parsed.stdout + parsed.stderr
