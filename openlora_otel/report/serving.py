"""A served adapter for ``openlora-otel report --adapter NAME``: where it came from and how it served.

Where it came from is its ``openlora_inference_adapter_info`` series; how it served (latency, time to
first token, output tokens per second, joules per output token) is read from the same Prometheus with
the inference dashboard's PromQL, scoped to the servers whose info series named the adapter with
that training run. See docs/how-to/run-history.md.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from openlora_otel.names import (
    ATTR_ADAPTER,
    ATTR_BASE_FINGERPRINT,
    ATTR_BASE_MODEL,
    ATTR_TRAINING_EVAL_LOSS,
    ATTR_TRAINING_RUN_ID,
    ATTR_TRAINING_RUN_NAME,
    INFERENCE_METRICS,
    histogram_quantile,
)
from openlora_otel.report.model import Curve, Line, Panel, ReportError, promql_string

if TYPE_CHECKING:
    from openlora_otel.report.prometheus import PrometheusSource

__all__ = [
    "DEFAULT_SINCE",
    "SERVING_PANELS",
    "AdapterServing",
    "ServedAdapter",
    "ServingSummary",
    "curve_queries",
    "parse_duration",
    "rate_window",
    "read_adapter",
    "summarize_serving",
    "summary_lines",
    "summary_queries",
]

DEFAULT_SINCE = "1h"
POINTS = 500
MIN_WINDOW_S = 60

_SPECS = {spec.name: spec for spec in INFERENCE_METRICS}
INFO = _SPECS["openlora.inference.adapter.info"].prometheus
REQUESTS = _SPECS["gen_ai.server.request.duration"].prometheus
TTFT = _SPECS["gen_ai.server.time_to_first_token"].prometheus
TOKENS = _SPECS["openlora.inference.token.usage"].prometheus + "_sum"  # its sum: tokens
# The openlora-energy rules (openlora_otel/rules/openlora.yml): each adapter's part of its server's
# GPU power, by its output tokens.
POWER = "adapter:openlora_inference_energy_joules:rate2m"
POWER_WINDOW = "2m"  # the window of those rules: joules per token divides by tokens over the same

_ADAPTER = ATTR_ADAPTER.replace(".", "_")
_LABELS = {
    "run_id": ATTR_TRAINING_RUN_ID.replace(".", "_"),
    "run_name": ATTR_TRAINING_RUN_NAME.replace(".", "_"),
    "base_model": ATTR_BASE_MODEL.replace(".", "_"),
    "base_fingerprint": ATTR_BASE_FINGERPRINT.replace(".", "_"),
    "final_eval_loss": ATTR_TRAINING_EVAL_LOSS.replace(".", "_"),
}
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number with a unit, s, m, h, d or w (``90s``, ``30m``, ``2h``, ``1d``)."""
    value = text.strip().lower()
    try:
        number = float(value[:-1]) if value and value[-1] in _UNITS else math.nan
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{text!r} is not a duration (a number and s, m, h, d or w: 30m, 2h, 1d)")
    return number * _UNITS[value[-1]]


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter as its info series says: its name, its training run and base, the servers it was on."""

    name: str
    run_id: str | None = None
    run_name: str | None = None
    base_model: str | None = None
    base_fingerprint: str | None = None
    final_eval_loss: str | None = None  # as exported: 6 significant digits, or NaN
    servers: tuple[str, ...] = ()  # the instances that served it
    # Other training runs an adapter of this name came from (left out: the latest is drawn).
    others: tuple[str, ...] = ()

    @classmethod
    def from_labels(cls, name: str, labels: dict[str, str], servers: Sequence[str] = ()) -> ServedAdapter:
        return cls(
            name=name,
            servers=tuple(servers),
            **{key: labels.get(label) or None for key, label in _LABELS.items()},
        )

    def info_selector(self) -> str:
        """The adapter's info series, of its training run when it has one."""
        matchers = [f"{_ADAPTER}={promql_string(self.name)}"]
        run_label = _LABELS["run_id"]
        matchers.append(f"{run_label}={promql_string(self.run_id)}" if self.run_id else f'{run_label}=""')
        return f"{INFO}{{{', '.join(matchers)}}}"

    def selector(self, *more: str) -> str:
        """Matchers of the adapter's request series (and ``more``)."""
        return ", ".join([f"{_ADAPTER}={promql_string(self.name)}", *more])

    def join(self, window: str) -> str:
        """``* on (job, instance, adapter)`` the servers whose info named it in the ``window`` before each time."""
        return (
            f" * on (job, instance, {_ADAPTER}) group_left () "
            f"group by (job, instance, {_ADAPTER}) (last_over_time({self.info_selector()}[{window}]))"
        )


def rate_window(step_s: float) -> str:
    """The curves' rate window: two steps (no request falls between two points), at least a minute."""
    return f"{max(MIN_WINDOW_S, math.ceil(2 * step_s))}s"


def _quantile(q: float, histogram: str, selector: str, how: str, window: str, join: str) -> str:
    return histogram_quantile(q, histogram, (), lambda series: f"{how}({series}{{{selector}}}[{window}]){join}")


def curve_queries(adapter: ServedAdapter, window: str) -> dict[str, str]:
    """The PromQL of each serving curve of ``adapter``, rates over ``window`` (``rate_window``)."""
    join = adapter.join(window)
    succeeded = adapter.selector('error_type=""')
    output = adapter.selector('gen_ai_token_type="output"')
    power = f"sum({POWER}{{{adapter.selector()}}}{adapter.join(POWER_WINDOW)})"
    tokens_power_window = f"sum(rate({TOKENS}{{{output}}}[{POWER_WINDOW}]){adapter.join(POWER_WINDOW)})"
    return {
        "latency_p50": _quantile(0.5, REQUESTS, succeeded, "rate", window, join),
        "latency_p95": _quantile(0.95, REQUESTS, succeeded, "rate", window, join),
        "ttft_p50": _quantile(0.5, TTFT, adapter.selector(), "rate", window, join),
        "ttft_p95": _quantile(0.95, TTFT, adapter.selector(), "rate", window, join),
        "tokens_per_s": f"sum(rate({TOKENS}{{{output}}}[{window}]){join})",
        "requests_per_s": f"sum(rate({REQUESTS}_count{{{adapter.selector()}}}[{window}]){join})",
        # Power and tokens/s over the rules' window: their ratio is joules per output token, their
        # sums over the range the range's figure.
        "power_w": power,
        "tokens_per_s_2m": tokens_power_window,
        "joules_per_token": f"{power} / ({tokens_power_window} > 0)",
    }


def summary_queries(adapter: ServedAdapter, range_s: float) -> dict[str, str]:
    """The PromQL of the figures over the whole range (evaluated at its end)."""
    window = f"{max(1, math.ceil(range_s))}s"
    join = adapter.join(window)
    succeeded = adapter.selector('error_type=""')
    failed = adapter.selector('error_type!=""')
    output = adapter.selector('gen_ai_token_type="output"')
    return {
        "requests": f"sum(increase({REQUESTS}_count{{{adapter.selector()}}}[{window}]){join})",
        "failed": f"sum(increase({REQUESTS}_count{{{failed}}}[{window}]){join})",
        "latency_p50": _quantile(0.5, REQUESTS, succeeded, "increase", window, join),
        "latency_p95": _quantile(0.95, REQUESTS, succeeded, "increase", window, join),
        "ttft_p50": _quantile(0.5, TTFT, adapter.selector(), "increase", window, join),
        "ttft_p95": _quantile(0.95, TTFT, adapter.selector(), "increase", window, join),
        "output_tokens": f"sum(increase({TOKENS}{{{output}}}[{window}]){join})",
    }


SERVING_PANELS: tuple[Panel, ...] = (
    Panel(
        "serving-latency",
        "Serving: request latency",
        "seconds",
        (Line("latency_p50", "p50", smooth=False), Line("latency_p95", "p95", "--", smooth=False)),
        f"Duration of the adapter's successful requests, arrival to last token, queue included ({REQUESTS}): "
        "p50 and p95 over the rate window, against the wall time.",
    ),
    Panel(
        "serving-ttft",
        "Serving: time to first token",
        "seconds",
        (Line("ttft_p50", "p50", smooth=False), Line("ttft_p95", "p95", "--", smooth=False)),
        f"From a request's arrival to its first output token, queue included ({TTFT}): p50 and p95.",
    ),
    Panel(
        "serving-tokens",
        "Serving: output tokens/s",
        "tokens / s",
        (Line("tokens_per_s", "output tokens / s", smooth=False),),
        f'Tokens the adapter generated per second (rate of {TOKENS} with gen_ai_token_type="output").',
    ),
    Panel(
        "serving-energy",
        "Serving: energy per output token",
        "joules / token",
        (Line("joules_per_token", "J / output token", smooth=False),),
        f"The adapter's part of its servers' GPU power ({POWER}, openlora-energy rules) over its output "
        f"tokens per second, both over {POWER_WINDOW}. Empty when the server had no GPU energy counter "
        "(hw_energy_joules_total) or Prometheus does not load the openlora-energy rules.",
    ),
)
NO_ENERGY = (
    "no data: no GPU energy for this adapter in the range (its server reported no hw_energy_joules_total, "
    "as on a CPU, or Prometheus does not evaluate the openlora-energy rules)"
)


@dataclass
class ServingSummary:
    """The adapter's serving figures over the range (None: no data)."""

    requests: float | None = None
    failed: float | None = None
    latency_p50: float | None = None
    latency_p95: float | None = None
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    output_tokens: float | None = None
    tokens_per_s: float | None = None  # mean over the points with traffic
    tokens_per_s_peak: float | None = None
    joules_per_token: float | None = None  # the range's energy over its output tokens

    @property
    def has_energy(self) -> bool:
        return self.joules_per_token is not None


@dataclass
class AdapterServing:
    """One ``--adapter``: its origin, its serving curves (time -> value per key) and the range's figures."""

    adapter: ServedAdapter
    start: float
    end: float
    curves: dict[str, Curve] = field(default_factory=dict)
    summary: ServingSummary = field(default_factory=ServingSummary)
    notes: list[str] = field(default_factory=list)  # said under the summary and on the page


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def summarize_serving(curves: dict[str, Curve], totals: dict[str, float]) -> ServingSummary:
    """The range's figures: ``totals`` (from :func:`summary_queries`), tokens/s and energy from the curves.

    Tokens/s is the mean and the peak of the points with traffic; joules per output token the sum
    of the power points over the sum of the tokens/s points at the same times (the range's energy
    over its tokens, sampled every step).
    """
    rates = [y for _, y in curves.get("tokens_per_s", []) if math.isfinite(y) and y > 0]
    power = {t: y for t, y in curves.get("power_w", []) if math.isfinite(y)}
    tokens = {t: y for t, y in curves.get("tokens_per_s_2m", []) if math.isfinite(y)}
    shared = [t for t in power if t in tokens]
    token_sum = sum(tokens[t] for t in shared)
    return ServingSummary(
        requests=_finite(totals.get("requests")),
        failed=_finite(totals.get("failed")),
        latency_p50=_finite(totals.get("latency_p50")),
        latency_p95=_finite(totals.get("latency_p95")),
        ttft_p50=_finite(totals.get("ttft_p50")),
        ttft_p95=_finite(totals.get("ttft_p95")),
        output_tokens=_finite(totals.get("output_tokens")),
        tokens_per_s=sum(rates) / len(rates) if rates else None,
        tokens_per_s_peak=max(rates) if rates else None,
        joules_per_token=sum(power[t] for t in shared) / token_sum if token_sum > 0 else None,
    )


def _seconds(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _count(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _utc(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stamp))


def origin_text(adapter: ServedAdapter) -> str:
    """Where the adapter came from, in words."""
    if adapter.run_id:
        run = adapter.run_id + (f" ({adapter.run_name})" if adapter.run_name and adapter.run_name != adapter.run_id else "")
        parts = [f"trained by run {run}"]
    else:
        parts = ["no training run recorded"]
    if adapter.base_model:
        fingerprint = f" (fingerprint {adapter.base_fingerprint})" if adapter.base_fingerprint else ""
        parts.append(f"base model {adapter.base_model}{fingerprint}")
    parts.append(f"final eval loss {adapter.final_eval_loss or 'n/a'}")
    if adapter.servers:
        parts.append(f"served by {', '.join(adapter.servers)}")
    return ", ".join(parts)


def summary_lines(serving: AdapterServing) -> list[str]:
    """The printed summary of one adapter: where it came from, then its serving figures over the range."""
    adapter, s = serving.adapter, serving.summary
    failed = f" ({_count(s.failed)} failed)" if s.failed else ""
    tokens = (
        "n/a"
        if s.tokens_per_s is None
        else f"{s.tokens_per_s:,.1f} tokens/s while serving (peak {s.tokens_per_s_peak:,.1f})"
    )
    energy = f"{s.joules_per_token:.4g} J" if s.joules_per_token is not None else NO_ENERGY
    lines = [
        f"adapter {adapter.name}: {origin_text(adapter)}",
        f"  serving from {_utc(serving.start)} to {_utc(serving.end)}: {_count(s.requests)} requests{failed}",
        f"  request latency p50 {_seconds(s.latency_p50)}, p95 {_seconds(s.latency_p95)}; "
        f"time to first token p50 {_seconds(s.ttft_p50)}, p95 {_seconds(s.ttft_p95)}",
        f"  output tokens {_count(s.output_tokens)}, {tokens}",
        f"  energy per output token: {energy}",
    ]
    lines += [f"  note: {note}" for note in serving.notes]
    return lines


# -- reading -----------------------------------------------------------------------------------
def adapter_names(source: PrometheusSource) -> list[str]:
    """Every adapter name on an info series Prometheus holds."""
    names = source.get(f"/api/v1/label/{_ADAPTER}/values", [("match[]", INFO)])
    return sorted(str(name) for name in names or [])


def find_adapter(source: PrometheusSource, name: str, start: float, end: float, step: float) -> ServedAdapter:
    """The adapter ``name`` as its latest info series in the range says (else the latest stored anywhere).

    An adapter of that name from several training runs: the one seen last; the others are named.
    """
    selector = f"{INFO}{{{_ADAPTER}={promql_string(name)}}}"
    seen: dict[tuple[str, ...], tuple[float, dict[str, str], set[str]]] = {}
    for series in source.query_range(selector, start, end, step):
        labels = series["metric"]
        key = tuple(labels.get(label, "") for label in _LABELS.values())
        last = float(series["values"][-1][0]) if series["values"] else start
        stamp, _, servers = seen.get(key, (last, labels, set()))
        servers.add(labels.get("instance", "?"))
        seen[key] = (max(stamp, last), labels, servers)
    if not seen:  # not served in the range: what the store holds, without times
        for labels in source.series(selector):
            key = tuple(labels.get(label, "") for label in _LABELS.values())
            _, _, servers = seen.get(key, (0.0, labels, set()))
            servers.add(labels.get("instance", "?"))
            seen[key] = (0.0, labels, servers)
    if not seen:
        known = adapter_names(source)
        raise ReportError(
            f"no adapter {name!r} on Prometheus at {source.shown}: no {INFO} series has "
            f"{_ADAPTER}={promql_string(name)}; "
            + (f"the adapters there are: {', '.join(known)}" if known else "it holds no adapter info series at all")
        )
    ordered = sorted(seen.values(), key=lambda item: item[0], reverse=True)
    _, labels, servers = ordered[0]
    others = tuple(
        dict.fromkeys(item[1].get(_LABELS["run_id"]) or "(none)" for item in ordered[1:])
    )
    return dataclasses.replace(ServedAdapter.from_labels(name, labels, sorted(servers)), others=others)


def read_adapter(source: PrometheusSource, name: str, since_s: float, *, now: float | None = None) -> AdapterServing:
    """Adapter ``name``'s origin, serving curves and figures over the last ``since_s`` seconds."""
    end = time.time() if now is None else now
    start = end - since_s
    step = max(since_s / POINTS, 1.0)
    start = end - math.ceil(since_s / step) * step  # the grid ends at `end`
    adapter = find_adapter(source, name, start, end, step)
    serving = AdapterServing(adapter, start, end)
    for key, expr in curve_queries(adapter, rate_window(step)).items():
        for series in source.query_range(expr, start, end, step):
            serving.curves[key] = [(float(t), float(v)) for t, v in series["values"]]
    totals = {}
    for key, expr in summary_queries(adapter, end - start).items():
        result = source.get("/api/v1/query", [("query", expr), ("time", f"{end:.3f}")])["result"]
        if result:
            totals[key] = float(result[0]["value"][1])
    serving.summary = summarize_serving(serving.curves, totals)
    if adapter.others:
        serving.notes.append(
            f"an adapter named {name} also came from the training run(s) {', '.join(adapter.others)}; "
            "this is the one served last"
        )
    if not any(serving.curves.get(key) for key in ("latency_p50", "tokens_per_s", "requests_per_s")):
        serving.notes.append(f"no requests to {name} in the range: widen it with --since")
    return serving
