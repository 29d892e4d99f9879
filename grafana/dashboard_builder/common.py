"""What the generated dashboards share: the panel, query target, threshold, row and variable
helpers that build Grafana's JSON as plain dicts, the data source and template variables, the
settings of every dashboard (dashboard()), and the query pieces more than one dashboard module uses.

Every training query filters by the template variables (job, run, instance, gpu) and joins
target_info on (job, instance) for the run id (RUN), which works the same on the pull path and
through the collector. Where the paths name a series differently (hw.gpu.* gauges with unit 1 get
_ratio through the collector), the query matches both names with a __name__ regex.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .layout import GridPos

DS = {"type": "prometheus", "uid": "${datasource}"}

# -- the training dashboard's selectors and joins (training.py, training_hardware.py) --------

# The run filter: multiplying by target_info (value 1) keeps the value, keeps only the
# selected runs' processes, and adds the run id as a label.
RUN_FILTER = ' * on (job, instance) group_left (openlora_run_id) target_info{openlora_run_id=~"$run"}'
# Then openlora_run_info (value 1, one series per process) adds the run's name and the value of
# the hyperparameter the hparam variable picks, for legends that tell runs apart. A key the run
# does not have leaves that part of its legend empty; a process without openlora_run_info at all
# (an older openlora-otel) drops out of the panels.
RUN_INFO = " * on (job, instance) group_left (openlora_run_name, openlora_hparam_$hparam) openlora_run_info"
RUN = RUN_FILTER + RUN_INFO
BY_RUN = "openlora_run_id, openlora_run_name, openlora_hparam_$hparam"
RUN_LEGEND = "{{openlora_run_name}} $hparam={{openlora_hparam_$hparam}}"
LEGEND = RUN_LEGEND + " {{instance}}"
SEL = 'job=~"$job", instance=~"$instance"'
GPU = f'{SEL}, hw_id=~"$gpu"'


def histogram_quantile(q: float | str, histogram: str, by: Sequence[str], inner: Callable[[str], str]) -> str:
    """The ``q``-quantile of ``histogram`` summed ``by`` these labels, over classic buckets (``<histogram>_bucket``)
    or native histograms (``<histogram>``, exponential ones through Prometheus 3), joined with ``or``;
    ``inner(series)`` is the vector around a series name. Written out as
    ``openlora_otel.names.histogram_quantile`` writes it (the builder imports nothing of the package; a
    test holds the two alike)."""
    labels = ", ".join(by)
    classic = f"sum by (le{', ' + labels if labels else ''}) ({inner(histogram + '_bucket')})"
    native = f"sum by ({labels}) ({inner(histogram)})" if labels else f"sum ({inner(histogram)})"
    return f"histogram_quantile({q}, {classic} or {native})"


def target(expr: str, legend: str, ref: str = "A", **extra: Any) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, **extra}


def panel(
    kind: str,
    title: str,
    description: str,
    unit: str,
    targets: list[dict],
    at: GridPos,
    defaults: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    for index, item in enumerate(targets):
        item["refId"] = chr(ord("A") + index)
    body: dict[str, Any] = {
        "id": 0,  # numbered by dashboard()
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": at,
        "fieldConfig": {"defaults": {"unit": unit, **(defaults or {})}, "overrides": []},
        "targets": targets,
    }
    if kind == "timeseries":
        body["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi"},
        }
    if kind == "stat":
        body["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
        }
    if kind == "bargauge":
        # One bar per series, in the order the query returns them (sort_desc: worst first).
        body["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "orientation": "horizontal",
            "displayMode": "gradient",
            "showUnfilled": True,
        }
    body.update(extra)
    return body


def thresholds(*steps: tuple[float | None, str]) -> dict[str, Any]:
    """Grafana threshold steps: the first has no lower bound (None)."""
    return {"mode": "absolute", "steps": [{"value": value, "color": color} for value, color in steps]}


def row(title: str, at: GridPos) -> dict[str, Any]:
    """A row header at ``at`` (a grid's :meth:`~dashboard_builder.layout.Grid.header`)."""
    return {
        "id": 0,  # numbered by dashboard()
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": at,
        "panels": [],
    }


def variable(
    name: str, label: str, query: str, *, regex: str = "", default: str | None = None
) -> dict[str, Any]:
    """A query variable refreshed on time range change: several values, All at first; or,
    given a default, one value."""
    body: dict[str, Any] = {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-query"},
        "definition": query,
        "regex": regex,
        "refresh": 2,
        "includeAll": default is None,
        "multi": default is None,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }
    if default is None:
        body["allValue"] = ".*"
    else:
        body["current"] = {"selected": True, "text": default, "value": default}
    return body


# The runs seen in the time range, each offered by its name (openlora_run_info) with its run id
# as the value, so that the panels keep filtering target_info by id. openlora_run_info has no id:
# the join on (job, instance) is evaluated at each step of a subquery (two runs one after the
# other on the same endpoint are never joined to each other's name), and each pair's value is the
# last time it was seen: sorted newest first, a run renamed at train start (the callbacks) is
# offered by its latest name (Grafana keeps the first option of a value). The subquery's steps are
# multiples of $__interval, so the same join at the query's own time is added: a run started (or
# renamed) since the last multiple is offered by its name at once, not by its id for up to
# $__interval. A run without openlora_run_info (an older openlora-otel) is still offered, by its id.
def run_names(targets: str, *, by_service: bool = False) -> str:
    """The run variable's query over the target_info series that match ``targets`` (and, ``by_service``,
    the servers the service variable picks: see :func:`service_target_info`)."""
    info = service_target_info(targets) if by_service else f"target_info{{{targets}}}"
    last = (
        service_target_info(targets, "[$__range]", around="last_over_time")
        if by_service
        else f"last_over_time(target_info{{{targets}}}[$__range])"
    )
    named = (
        "timestamp(group by (openlora_run_id, openlora_run_name) ("
        f"openlora_run_info * on (job, instance) group_left (openlora_run_id) {info}))"
    )
    return (
        f"sort_desc(max_over_time({named}[$__range:$__interval]) or {named}"
        f" or on (openlora_run_id) group by (openlora_run_id) ({last}))"
    )


def service_target_info(matchers: str, range_: str = "", *, around: str = "") -> str:
    """target_info{``matchers``} of the services the ``service`` variable picks, on every path: pulled,
    target_info carries service_name; pushed, service.name is the job and target_info has none (the
    Collector's exporters and Prometheus' OTLP receiver move it to job). ``around``: a function
    applied to each selector (with ``range_``), as ``last_over_time``."""
    parts = [
        f'target_info{{{matchers}, service_name=~"$service"}}{range_}',
        f'target_info{{{matchers}, service_name="", job=~"$service"}}{range_}',
    ]
    if around:
        parts = [f"{around}({part})" for part in parts]
    return f"({parts[0]} or {parts[1]})"


# The service variable: target_info's service_name when there is one, else its job (see above).
SERVICE_QUERY = (
    'query_result(group by (service_name) (target_info{job=~"$job", service_name!=""})'
    ' or group by (job) (target_info{job=~"$job", service_name=""}))'
)
SERVICE_REGEX = '/(?:service_name|job)="(?<value>[^"]+)"/'


RUN_NAMES = run_names('job=~"$job"')
# Grafana's named groups: text is what the list shows, value what $run becomes. The g flag
# lets the two groups match in either order; without a name, the text is the id.
RUN_NAME_REGEX = '/openlora_run_id="(?<value>[^"]+)"|openlora_run_name="(?<text>[^"]+)"/g'
RUN_VARIABLE = variable("run", "Run", f"query_result({RUN_NAMES})", regex=RUN_NAME_REGEX)
# The hyperparameter legends show: a key of openlora_run_info's openlora_hparam_<key> labels.
HPARAM_VARIABLE = variable(
    "hparam",
    "Hyperparameter in legends",
    "label_names(openlora_run_info)",
    regex="/^openlora_hparam_(.+)$/",
    default="learning_rate",
)


# Every openlora dashboard links to the others (Grafana lists the dashboards with this tag),
# keeping the time range and the variables they share (job, run).
LINKS = [
    {
        "title": "openlora dashboards",
        "type": "dashboards",
        "tags": ["openlora"],
        "asDropdown": True,
        "includeVars": True,
        "keepTime": True,
    }
]

DATASOURCE_VARIABLE = {
    "name": "datasource",
    "label": "Data source",
    "type": "datasource",
    "query": "prometheus",
    "current": {"selected": True, "text": "Prometheus", "value": "openlora-prometheus"},
    "hide": 0,
}


def dashboard(
    uid: str,
    title: str,
    description: str,
    tags: list[str],
    templating: list[dict[str, Any]],
    panels: list[dict[str, Any]],
) -> dict[str, Any]:
    """The settings every openlora dashboard shares around its own variables and panels; numbers the
    panels (their ids) 1, 2, ... in their order."""
    for number, item in enumerate(panels, start=1):
        item["id"] = number
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": tags,
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": templating},
        "annotations": {"list": []},
        "links": LINKS,
        "panels": panels,
    }


# -- alert thresholds and GPU states the training and cluster dashboards both draw --------------

# OpenloraInputBound fires when a process's data-wait fraction averages above this
# (openlora_otel/rules/openlora.yml); the panels draw it as a line.
INPUT_BOUND_THRESHOLD = 0.25


# hw.status as one number per GPU for the state timeline: 0 ok, 1 degraded, 2 failed (the current
# state's series is 1, the other two 0).
GPU_STATES = (("ok", 0, "green"), ("degraded", 1, "orange"), ("failed", 2, "red"))
# Those numbers shown as their state's name and colour (the training dashboard's state timeline,
# the cluster dashboard's worst status per rank).
GPU_STATE_MAPPINGS = [
    {
        "type": "value",
        "options": {str(value): {"text": state, "color": color, "index": value} for state, value, color in GPU_STATES},
    }
]
GPU_STATE_THRESHOLDS = thresholds((None, "green"), (1, "orange"), (2, "red"))
