"""The Grafana dashboards as the tests read them: their panels and queries, Grafana's variables
resolved against a store as its Prometheus datasource does, and every query of a dashboard run."""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
GRAFANA = ROOT / "grafana"
CLUSTER_DASHBOARD = GRAFANA / "dashboards" / "openlora-cluster.json"
TRAINING_DASHBOARD = GRAFANA / "dashboards" / "openlora-training.json"


# -- the dashboards' queries -----------------------------------------------------------------------


def dashboard(path: Path) -> dict:
    return json.loads(path.read_text())


def panels(path: Path) -> list[dict]:
    return [p for p in dashboard(path)["panels"] if p["type"] != "row"]


# What Grafana puts in for its own variables: $__rate_interval in panels; $__range (the time range,
# in seconds) and $__interval (the datasource's scrape interval, timeInterval in the provisioned
# datasource) in variable queries. Dashboard variables default to All (.*); hparam to its default.
DATASOURCE_INTERVAL = yaml.safe_load(
    (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
)["datasources"][0]["jsonData"]["timeInterval"]
SUBSTITUTIONS = {
    "$__rate_interval": "15s",
    "$__range": "3600s",
    "$__interval": DATASOURCE_INTERVAL,
    "$job": ".*",
    "$run": ".*",
    "$hparam": "learning_rate",
    "$instance": ".*",
    "$gpu": ".*",
    "$service": ".*",
    "$adapter": ".*",
}


def substitute(expr: str, **values: str) -> str:
    for key, value in {**SUBSTITUTIONS, **{f"${k}": v for k, v in values.items()}}.items():
        expr = expr.replace(key, value)
    return expr


# -- Grafana's query variables, resolved as its Prometheus datasource does --------------------------
# (grafana/packages/grafana-prometheus metric_find_query.ts and the variables' regex handling,
# metricNamesToVariableValues): label_values(selector, label) asks /api/v1/label/<label>/values,
# label_names(metric) /api/v1/labels for series whose name contains metric, query_result(expr) an
# instant query whose series become `name{label="value",...} value timestamp_ms` lines. Then the
# variable's regex: named groups text and value (with the g flag, from any of the matches), else
# the first group, else the whole item; options with the same value keep the first.


def grafana_regex(pattern: str) -> tuple[re.Pattern[str], bool]:
    """A variable's regex, JavaScript `/source/flags` (else anchored), as Python's; and its g flag."""
    match = re.fullmatch(r"/(.*)/([gimsuy]*)", pattern, re.S)
    source, flags = (match.group(1), match.group(2)) if match else (f"^{pattern}$", "")
    source = re.sub(r"\(\?<(?=[A-Za-z_])", "(?P<", source)  # named groups; (?<= and (?<! stay
    return re.compile(source, re.I if "i" in flags else 0), "g" in flags


def apply_variable_regex(pattern: str, items: list[str]) -> list[tuple[str, str]]:
    """(text, value) of each item the regex keeps, as Grafana lists them."""
    options: list[tuple[str, str]] = []
    regex, every = grafana_regex(pattern) if pattern else (None, False)
    for item in items:
        text = value = item
        if regex is not None:
            matches = list(regex.finditer(item)) if every else [m for m in [regex.search(item)] if m]
            if not matches:
                continue
            named = [m.groupdict() for m in matches]
            value_group = next((g["value"] for g in named if g.get("value")), None)
            text_group = next((g["text"] for g in named if g.get("text")), None)
            if value_group or text_group:
                value, text = value_group or text_group, text_group or value_group
            elif matches[0].groups():
                text = value = matches[0].group(1)
        if value not in {v for _, v in options}:
            options.append((text, value))
    return options


def http_variable_options(base_url: str) -> Callable[[dict, dict[str, str]], list[tuple[str, str]]]:
    """The options (text, value) Grafana offers for a query variable, asking the store at base_url."""

    def get(path: str, **params: str) -> Any:
        with urllib.request.urlopen(
            f"{base_url}{path}?" + urllib.parse.urlencode(params), timeout=10
        ) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def options(variable: dict, values: dict[str, str]) -> list[tuple[str, str]]:
        query = substitute(variable["query"]["query"], **values)
        if match := re.fullmatch(r"label_values\((.+), (\w+)\)", query):
            items = get(f"/api/v1/label/{match.group(2)}/values", **{"match[]": match.group(1)})
        elif match := re.fullmatch(r"label_names\((.+)\)", query):
            items = get("/api/v1/labels", **{"match[]": f'{{__name__=~".*{match.group(1)}.*"}}'})
        elif match := re.fullmatch(r"query_result\((.+)\)", query):
            result = get("/api/v1/query", query=match.group(1))["result"]
            items = [
                series["metric"].get("__name__", "")
                + "{"
                + ",".join(f'{k}="{v}"' for k, v in series["metric"].items() if k != "__name__")
                + "}"
                + f" {series['value'][1]} {int(series['value'][0] * 1000)}"
                for series in result
            ]
        else:
            raise AssertionError(f"variable {variable['name']}: a query Grafana does not know: {query}")
        return apply_variable_regex(variable.get("regex", ""), items)

    return options


VariableOptions = Callable[[dict, dict[str, str]], list[tuple[str, str]]]


def run_every_query(
    path: Path,
    query: Callable[[str], list[dict]],
    variable_options: VariableOptions,
    run_ids: str | list[str],
    *,
    run_names: dict[str, str] | None = None,
    hparam: str | None = None,
    without_data: Collection[str] = (),
) -> list[str]:
    """Resolve every variable of a dashboard and run every panel query with them; the problems found
    (empty = every variable has values and every query returned data). The panels titled in
    ``without_data`` must still evaluate, but may be empty (what the test's processes cannot produce,
    such as GPU energy from a server on the CPU; another test gives them data).

    The run variable must offer each of ``run_ids`` (all selected, as Grafana writes several values:
    ``(a|b)``), shown by its name in ``run_names`` where given; the hparam variable, where the
    dashboard has one, must offer ``hparam`` and is set to it."""
    run_ids = [run_ids] if isinstance(run_ids, str) else run_ids
    values = {"run": run_ids[0] if len(run_ids) == 1 else "(" + "|".join(run_ids) + ")"}
    problems = []
    for variable in dashboard(path)["templating"]["list"]:
        if variable["type"] != "query":
            continue
        try:
            offered = variable_options(variable, values)
        except Exception as error:  # an invalid query: say which
            problems.append(f"variable {variable['name']}: {error}")
            continue
        if not offered:
            problems.append(f"variable {variable['name']} has no values")
        by_value = {value: text for text, value in offered}
        if variable["name"] == "run":
            for run_id in run_ids:
                if run_id not in by_value:
                    problems.append(f"variable run does not offer {run_id}: {offered}")
                elif run_names and run_names.get(run_id, by_value[run_id]) != by_value[run_id]:
                    problems.append(f"variable run shows {run_id} as {by_value[run_id]!r}: {offered}")
        if variable["name"] == "hparam":
            if hparam not in by_value:
                problems.append(f"variable hparam does not offer {hparam}: {offered}")
            values["hparam"] = hparam or ""
    for panel in panels(path):
        for target in panel["targets"]:
            expr = substitute(target["expr"], **values)
            try:
                result = query(expr)
            except Exception as error:  # an invalid query: say which
                problems.append(f"{panel['title']}: {expr}: {error}")
                continue
            if not result and panel["title"] not in without_data:
                problems.append(f"{panel['title']}: no data: {expr}")
    return problems
