"""Read runs from a Prometheus server over its HTTP API.

A run is found by its id (``target_info``) or its name (``openlora_run_info``); its curves come from
its lowest rank, one ``query_range`` per quantity over the span its ``target_info`` named the run,
each joined with that ``target_info`` (a port reused by a later run adds nothing). The rows have
the shape a history file gives. See docs/how-to/run-history.md.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from openlora_otel.config import ConfigError
from openlora_otel.config.checks import check_url
from openlora_otel.names import ATTR_TRAINING_PHASE, RUN_METRICS, TRAINING_PHASES
from openlora_otel.redaction import redact, redact_url, url_secrets
from openlora_otel.report.goodput import TIME_METRIC, TimeSample
from openlora_otel.report.model import (
    QUANTITIES,
    SHOWN_NAME,
    ProcessRows,
    Quantity,
    ReportError,
    Row,
    Run,
    promql_string,
    run_target,
    shown,
)
from openlora_otel.run.info import HPARAM_PREFIX, hyperparameters_from

__all__ = ["POINTS", "PrometheusSource", "read_prometheus"]
_PHASE_LABEL = ATTR_TRAINING_PHASE.replace(".", "_")

POINTS = 500
# How far back to look for a run: longer than Prometheus's default retention (15 d).
LOOKBACK = "30d"
TIMEOUT_S = 30.0
_RUN_INFO = RUN_METRICS[0].prometheus
_HPARAM_LABEL = HPARAM_PREFIX.replace(".", "_")


class PrometheusSource:
    """One Prometheus server; :meth:`run` reads one run from it."""

    def __init__(self, url: str, *, timeout_s: float = TIMEOUT_S) -> None:
        try:  # a bad port, "[::1", a space: a usage error that never shows the password, not a traceback
            check_url("--prometheus", url, host_port=True)
        except ConfigError as exc:
            raise ReportError(str(exc)) from None
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        self.shown = redact_url(url)
        self._secrets = url_secrets(url)
        self._headers = {"Accept": "application/json"}
        if parts.username is not None:  # urllib ignores user:password@ in a URL; Prometheus behind basic auth
            credentials = (
                f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
            )
            self._headers["Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode()
        netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        if parts.port:
            netloc += f":{parts.port}"
        self._base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        self._timeout = timeout_s

    # -- HTTP --------------------------------------------------------------------------------
    def get(self, path: str, params: list[tuple[str, str]]) -> Any:
        """The ``data`` of a Prometheus HTTP API answer to ``path`` with ``params``; ReportError, redacted,
        when it cannot be had."""
        url = f"{self._base}{path}?{urllib.parse.urlencode(params)}"
        request = urllib.request.Request(url, headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            detail = ""
            with contextlib.suppress(ValueError, AttributeError, OSError):  # not every proxy answers JSON
                detail = json.load(exc).get("error", "")
            raise ReportError(
                self._clean(
                    f"Prometheus at {self.shown} answered {exc.code} {exc.reason}"
                    + (f": {detail}" if detail else "")
                )
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ReportError(
                self._clean(
                    f"cannot reach Prometheus at {self.shown}: {reason} (is it running? check --prometheus)"
                )
            ) from None
        except ValueError:
            raise ReportError(f"{self.shown} did not answer with JSON: is it a Prometheus server?") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            error = body.get("error") if isinstance(body, dict) else body
            raise ReportError(self._clean(f"Prometheus at {self.shown} refused {path}: {error}"))
        return body["data"]

    def _clean(self, text: str) -> str:
        return redact(text, self._secrets)

    def series(self, match: str) -> list[dict[str, str]]:
        """Label sets of the series matching ``match`` over the whole stored time."""
        return self.get("/api/v1/series", [("match[]", match)])

    def _query(self, expr: str) -> list[dict[str, Any]]:
        return self.get("/api/v1/query", [("query", expr)])["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """The series ``expr`` gives from ``start`` to ``end`` every ``step`` seconds (``/api/v1/query_range``)."""
        params = [("query", expr), ("start", f"{start:.3f}"), ("end", f"{end:.3f}"), ("step", f"{step:.3f}")]
        return self.get("/api/v1/query_range", params)["result"]

    # -- runs --------------------------------------------------------------------------------
    def _samples(self, selector: str) -> list[dict[str, Any]]:
        """Every stored sample of the series ``selector`` matches in the last :data:`LOOKBACK`."""
        return self._query(f"{selector}[{LOOKBACK}]")

    def run_ids(self, wanted: str) -> list[str]:
        """The run ids ``wanted`` names: itself when it is a run id, else the runs called so.

        A name on ``openlora_run_info`` belongs to the run whose ``target_info`` came in the
        same scrapes (the same sample timestamps): a port reused by a later run under
        another name does not make that run answer to this name.
        """
        if self.series(run_target(wanted)):
            return [wanted]
        ids: list[str] = []
        for labels in self.series(f"target_info{{openlora_run_name={promql_string(wanted)}}}"):
            ids.append(labels["openlora_run_id"])
        for named in self._samples(f"{_RUN_INFO}{{openlora_run_name={promql_string(wanted)}}}"):
            stamps = {stamp for stamp, _ in named["values"]}
            for target in self._samples(f"target_info{{{_selector(named['metric'])}}}"):
                run_id = target["metric"].get("openlora_run_id")
                if run_id and stamps.intersection(stamp for stamp, _ in target["values"]):
                    ids.append(run_id)
        if not ids:
            raise ReportError(
                f"no run {wanted!r} on Prometheus at {self.shown}: no target_info series has "
                f"openlora_run_id={promql_string(wanted)} and no {_RUN_INFO} series has openlora_run_name={promql_string(wanted)} "
                "(a run id is the openlora_run_id label, a name the openlora_run_name label)"
            )
        return list(dict.fromkeys(ids))

    def run(self, run_id: str, *, every_rank: bool = False) -> Run:
        """Read run ``run_id``: its lowest rank's curves, its name and hyperparameters; with
        ``every_rank``, every process's samples and goodput readings too (:attr:`Run.processes`, for
        ``diagnose``), in one query per quantity for all of them."""
        targets = [t for t in self.series(run_target(run_id)) if "job" in t]
        if not targets:
            raise ReportError(f"no run {run_id!r} on Prometheus at {self.shown}")
        targets.sort(key=lambda t: (_rank(t) is None, _rank(t) or 0, t.get("instance", "")))
        target = targets[0]
        ranks = len(set(_rank_groups(targets).values()))
        selector = _selector(target)
        start, end = self._span(run_id, selector)
        step = max((end - start) / POINTS, 0.001)
        # Prometheus evaluates at start + k * step <= end: start on the grid that ends at `end`, so the
        # last evaluation is at `end` and sees the last scrape (the final evaluation of a run just ended).
        start = end - math.ceil((end - start) / step) * step
        processes = self._processes(run_id, targets) if every_rank else []
        lowest = next((p for p in processes if p.rank is not None and p.rank == _rank(target)), None)
        if lowest is not None:  # every rank read at once: the lowest's rows among them
            rows = lowest.rows
        else:
            times: dict[float, dict[str, float]] = {}
            for quantity in QUANTITIES:
                for series in self.query_range(quantity.promql(selector, run_id), start, end, step):
                    for stamp, text in series["values"]:
                        times.setdefault(float(stamp), {})[quantity.key] = float(text)
            rows = [Row(stamp, values) for stamp, values in sorted(times.items())]
        if not any("steps" in row.values for row in rows):
            raise ReportError(
                f"run {run_id!r} on Prometheus at {self.shown} has no optimizer steps "
                f"({QUANTITIES[0].spec.prometheus}{{{selector}}} has no samples while the run was there)"
            )
        name, hyperparameters = self._info(run_id, selector, start, end, step)
        return Run(
            run_id=run_id,
            name=name or target.get("openlora_run_name") or run_id,
            hyperparameters=hyperparameters,
            source=f"Prometheus at {self.shown} ({selector.replace(chr(34), '')})",
            rows=rows,
            rank=_rank(target),
            ranks=ranks,
            processes=processes,
        )

    def _processes(self, run_id: str, targets: list[dict[str, str]]) -> list[ProcessRows]:
        """Every rank of the run: its samples (one range query per quantity, all processes in it, over
        the run's whole span), each process's cut at its last ``target_info`` sample (a series pushed
        over OTLP has no staleness marker: a range query repeats its last value for minutes after), and
        its last seconds per goodput phase; the processes of one rank (its attempts, on other ports
        or pods) as one, lowest rank first."""
        seen = self._samples(run_target(run_id))
        last_seen: dict[tuple[str, str], float] = {}
        for series in seen:
            key = (series["metric"].get("job", ""), series["metric"].get("instance", ""))
            for stamp, _ in series["values"]:
                last_seen[key] = max(last_seen.get(key, -math.inf), float(stamp))
        if not last_seen:
            raise ReportError(f"run {run_id!r} on Prometheus at {self.shown} has no samples in the last {LOOKBACK}")
        start, end = _with_margin(min(float(s) for series in seen for s, _ in series["values"]), max(last_seen.values()))
        step = max((end - start) / POINTS, 0.001)
        start = end - math.ceil((end - start) / step) * step
        by = ("job", "instance")
        samples: dict[tuple[str, str], dict[float, dict[str, float]]] = {}
        for quantity in QUANTITIES:
            for series in self.query_range(quantity.promql("", run_id, by), start, end, step):
                key = (series["metric"].get("job", ""), series["metric"].get("instance", ""))
                for stamp, text in series["values"]:
                    # Up to the first grid point after its last sample, which holds that sample's value (the
                    # points before it may all precede the last scrape: a running run's newest fault).
                    if float(stamp) < last_seen.get(key, math.inf) + step:
                        samples.setdefault(key, {}).setdefault(float(stamp), {})[quantity.key] = float(text)
        phases: dict[tuple[str, str], tuple[float, dict[str, float]]] = {}
        time_query = Quantity("time", TIME_METRIC).promql("", run_id, (*by, _PHASE_LABEL))
        for series in self.query_range(time_query, start, end, step):
            key = (series["metric"].get("job", ""), series["metric"].get("instance", ""))
            phase = series["metric"].get(_PHASE_LABEL)
            if phase in TRAINING_PHASES and series["values"]:
                stamp, text = series["values"][-1]
                last = phases.setdefault(key, (float(stamp), {}))
                last[1][phase] = float(text)
        ranks = {(t.get("job", ""), t.get("instance", "")): _rank(t) for t in targets}
        groups = _rank_groups(targets)
        # Each process's attempt (openlora.run.attempt): goodput then tells a restart from a second rank.
        attempts = {(t.get("job", ""), t.get("instance", "")): a for t in targets if (a := _attempt(t)) is not None}
        hosts = {(t.get("job", ""), t.get("instance", "")): t.get("k8s_node_name") or t["host_name"]
                 for t in targets if t.get("k8s_node_name") or t.get("host_name")}  # fmt: skip
        by_rank: dict[object, tuple[list[Row], list[TimeSample], list[tuple[float, str]]]] = {}
        for key, by_time in samples.items():
            rank = ranks.get(key)
            rows, readings, named = by_rank.setdefault(groups.get(key, key), ([], [], []))
            rows.extend(Row(stamp, values) for stamp, values in by_time.items())
            if key in phases:
                lost = [v["steps_lost"] for _, v in sorted(by_time.items()) if "steps_lost" in v]
                readings.append(TimeSample(phases[key][0], phases[key][1], steps_lost=lost[-1] if lost else 0.0,
                                           attempt=attempts.get(key), rank=rank, process="/".join(key)))  # fmt: skip
            if key in hosts:  # the host of the rank's latest process (a resume may run on another node)
                named.append((last_seen.get(key, -math.inf), shown(hosts[key], SHOWN_NAME)))
        processes = [
            ProcessRows(who if isinstance(who, int) else None, sorted(rows, key=lambda r: r.time_s), readings,
                        max(named)[1] if named else None)
            for who, (rows, readings, named) in by_rank.items()
        ]  # fmt: skip
        return sorted(processes, key=lambda p: (p.rank is None, p.rank or 0))

    def _span(self, run_id: str, selector: str) -> tuple[float, float]:
        """While the process was this run: its ``target_info`` samples, with a margin on both sides.

        The margin is for the range query's grid; the queries themselves are scoped to the
        run (:func:`~openlora_otel.report.quantities.run_target`), so it adds no other run's values.
        """
        stamps = [
            float(stamp)
            for series in self._samples(run_target(run_id, selector))
            for stamp, _ in series["values"]
        ]
        if not stamps:
            raise ReportError(
                f"run {run_id!r} on Prometheus at {self.shown} has no samples in the last {LOOKBACK} "
                f"({run_target(run_id, selector)})"
            )
        return _with_margin(min(stamps), max(stamps))

    def _info(
        self, run_id: str, selector: str, start: float, end: float, step: float
    ) -> tuple[str | None, dict[str, str]]:
        """The name and hyperparameters of the run's latest ``openlora_run_info`` label set."""
        latest: tuple[float, dict[str, str]] | None = None
        scoped = (
            f"{_RUN_INFO}{{{selector}}} * on (job, instance) group_left () {run_target(run_id, selector)}"
        )
        for series in self.query_range(scoped, start, end, step):
            stamp = float(series["values"][-1][0])
            if latest is None or stamp > latest[0]:
                latest = (stamp, series["metric"])
        if latest is None:
            return None, {}
        labels = latest[1]
        hyperparameters = hyperparameters_from(labels, _HPARAM_LABEL)
        return labels.get("openlora_run_name"), hyperparameters


def read_prometheus(url: str, wanted: Sequence[str], *, every_rank: bool = False) -> list[Run]:
    """The runs ``wanted`` (ids or names) names, read from the Prometheus at ``url``, in that order;
    ``every_rank``: with every process's samples (:meth:`PrometheusSource.run`)."""
    source = PrometheusSource(url)
    ids: list[str] = []
    for item in wanted:
        ids += [run_id for run_id in source.run_ids(item) if run_id not in ids]
    return [source.run(run_id, every_rank=every_rank) for run_id in ids]


def _with_margin(begin: float, finish: float) -> tuple[float, float]:
    """The span from ``begin`` to ``finish`` with a margin on both sides for a range query's grid (never
    past now)."""
    margin = max(5.0, (finish - begin) * 0.01)
    return begin - margin, min(finish + margin, time.time())


def _rank(labels: dict[str, str]) -> int | None:
    try:
        return int(labels["openlora_rank"])
    except (KeyError, ValueError):
        return None


def _rank_groups(targets: list[dict[str, str]]) -> dict[tuple[str, str], object]:
    """Which rank each process (job, instance) is: its ``openlora_rank``; without one, the run's one
    process when every attempt has a single rank-less process (a run without torchrun, resumed on
    another port or pod), else a rank of its own."""
    keys = {(t.get("job", ""), t.get("instance", "")): t for t in targets}
    rankless = {key: _attempt(t) for key, t in keys.items() if _rank(t) is None}
    attempts = list(rankless.values())
    single = bool(attempts) and None not in attempts and len(set(attempts)) == len(attempts)
    return {key: _rank(t) if _rank(t) is not None else ("single",) if single else key for key, t in keys.items()}


def _attempt(labels: dict[str, str]) -> int | None:
    try:
        value = int(labels["openlora_run_attempt"])
    except (KeyError, ValueError):
        return None
    return value if value >= 1 else None


def _selector(labels: dict[str, str]) -> str:
    return ", ".join(f"{key}={promql_string(labels[key])}" for key in ("job", "instance") if key in labels)
