"""The inference dashboard (grafana/dashboards/openlora-inference.json): a server's InferenceMetrics
series, which carry the adapter as a label: traffic, errors, latency, tokens, queue and adapters.

A `service` variable picks the servers, and the latency objective and error-ratio threshold it
draws are those of the `openlora-inference` alerts. A server's service name is target_info's
service_name when pulled; pushed (through a Collector or into Prometheus 3's OTLP receiver) it is
the job, and target_info has no service_name: the variable and its filter take either
(common.service_target_info).
"""

from __future__ import annotations

from typing import Any

from .common import (
    DATASOURCE_VARIABLE,
    RUN_NAME_REGEX,
    SERVICE_QUERY,
    SERVICE_REGEX,
    dashboard,
    histogram_quantile,
    panel,
    row,
    run_names,
    service_target_info,
    target,
    thresholds,
    variable,
)
from .layout import Grid

# A server's series (openlora_otel.inference, names.INFERENCE_METRICS) carry the adapter as its own
# label; the server's run id and service name are in target_info, as for training.
ADAPTER_SEL = 'job=~"$job", instance=~"$instance", openlora_adapter_name=~"$adapter"'
SERVING = " * on (job, instance) group_left (openlora_run_id) " + service_target_info('openlora_run_id=~"$run"')
REQUESTS = "gen_ai_server_request_duration_seconds"
# Errors the client caused (openlora_otel.names.inference.CLIENT_ERROR_PATTERN, written out: the builder
# imports nothing of the package); the rest (exceptions, overloaded, 429, 5xx) are the server's
# (OpenloraInferenceErrorRatioHigh in openlora_otel/rules/openlora.yml leaves out the same).
CLIENT_ERRORS = "unknown_adapter|invalid_request|cancelled|request_too_large|json_too_deep|request_timeout|invalid_request_error|authentication_error|permission_error|not_found_error|conflict_error|unprocessable_entity_error|CANCELLED|INVALID_ARGUMENT|NOT_FOUND|ALREADY_EXISTS|PERMISSION_DENIED|UNAUTHENTICATED|FAILED_PRECONDITION|OUT_OF_RANGE|4[01][0-9]|42[0-8]|4[3-9][0-9]"
SERVER_ERRORS = f'error_type!="", error_type!~"{CLIENT_ERRORS}"'
# OpenloraInferenceLatencyHigh: p95 of successful requests above this (openlora_otel/rules/openlora.yml);
# the latency panels draw it. Change both together (a test compares them).
LATENCY_OBJECTIVE_S = 10
ERROR_RATIO_THRESHOLD = 0.05  # OpenloraInferenceErrorRatioHigh
# The training dashboard (training.py) and its run variable, whose value is a run id: the adapters
# table links each adapter's training run there. The run may be days old: the link opens a week.
TRAINING_UID = "openlora-training"
TRAINING_RUN_LINK = (
    f"/d/{TRAINING_UID}?var-run=${{__data.fields.openlora_training_run_id}}&from=now-7d&to=now"
)
# openlora_inference_adapter_info's labels, as the table's columns (label, header), in this order.
ORIGIN_COLUMNS = (
    ("openlora_adapter_name", "Adapter"),
    ("instance", "Server"),
    ("openlora_training_run_name", "Training run"),
    ("openlora_training_run_id", "Run id"),
    ("openlora_adapter_base_model", "Base model"),
    ("openlora_adapter_base_fingerprint", "Base fingerprint"),
    ("openlora_training_final_eval_loss", "Final eval loss"),
)


def rate(series: str, selector: str) -> str:
    return f"rate({series}{{{selector}}}[$__rate_interval])"


def quantiles(histogram: str, selector: str) -> list[dict[str, Any]]:
    """p50 / p95 / p99 of a histogram over the selected servers and adapters."""
    return [
        target(
            histogram_quantile(q, histogram, (), lambda series: f"{rate(series, selector)}{SERVING}"),
            f"p{int(q * 100)}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


def objective_line(threshold: float) -> dict[str, Any]:
    return {
        "thresholds": thresholds((None, "green"), (threshold, "red")),
        "custom": {"thresholdsStyle": {"mode": "line"}},
    }


# The selected servers' and adapters' requests that succeeded, that failed; all requests per
# second, and those per second that failed through the server's fault.
SUCCEEDED = f'{ADAPTER_SEL}, error_type=""'
FAILED = f'{ADAPTER_SEL}, error_type!=""'
REQUEST_RATE = f"sum({rate(REQUESTS + '_count', ADAPTER_SEL)}{SERVING})"
SERVER_ERROR_RATE = f"sum({rate(REQUESTS + '_count', f'{ADAPTER_SEL}, {SERVER_ERRORS}')}{SERVING})"


def serving_overview(grid: Grid) -> list[dict[str, Any]]:
    """Traffic, server errors, latency, queue and adapters now, one stat each: the row, next on the grid."""
    panels: list[dict[str, Any]] = [row("Serving overview", grid.header())]
    stats = [
        (
            "Requests/s",
            f"Requests finished per second, every outcome, over the selected servers and adapters "
            f"(rate of {REQUESTS}_count).",
            "reqps",
            REQUEST_RATE,
            {},
        ),
        (
            "Server error ratio",
            "Share of requests that failed through the server's fault: an error_type other than a client's "
            "(serve's refusals, an app's 4xx answer but 429, OpenAI's client error types, gRPC's client status "
            f"codes; see the serving how-to) (rate of {REQUESTS}_count). 0 with no such error; "
            f"above {ERROR_RATIO_THRESHOLD:.0%} for 5 minutes OpenloraInferenceErrorRatioHigh fires.",
            "percentunit",
            f"({SERVER_ERROR_RATE} or vector(0)) / ({REQUEST_RATE} > 0)",
            {"thresholds": thresholds((None, "green"), (ERROR_RATIO_THRESHOLD, "red"))},
        ),
        (
            "p95 request duration",
            f"95th percentile of the successful requests' duration ({REQUESTS}); red above the "
            f"{LATENCY_OBJECTIVE_S} s objective of OpenloraInferenceLatencyHigh.",
            "s",
            histogram_quantile(0.95, REQUESTS, (), lambda series: f"{rate(series, SUCCEEDED)}{SERVING}"),
            {"thresholds": thresholds((None, "green"), (LATENCY_OBJECTIVE_S, "red"))},
        ),
        (
            "Running requests",
            "Requests being generated now (openlora_inference_requests_running).",
            "short",
            f"sum(openlora_inference_requests_running{{{ADAPTER_SEL}}}{SERVING})",
            {},
        ),
        (
            "Waiting requests",
            "Requests in the servers' queues now (openlora_inference_requests_waiting).",
            "short",
            f"sum(openlora_inference_requests_waiting{{{ADAPTER_SEL}}}{SERVING})",
            {},
        ),
        (
            "Adapters loaded",
            "Adapters loaded now, counted once per server (openlora_inference_adapter_loaded == 1).",
            "short",
            f"count((openlora_inference_adapter_loaded{{{ADAPTER_SEL}}} == 1){SERVING})",
            {},
        ),
    ]
    for title, description, unit, expr, defaults in stats:
        panels.append(
            panel("stat", title, description, unit, [target(expr, title)], at=grid.cell(4, 4), defaults=defaults)
        )
    return panels


def requests(grid: Grid) -> list[dict[str, Any]]:
    """Requests per second by adapter, error ratios by error type: the row, next on the grid."""
    panels: list[dict[str, Any]] = [row("Requests", grid.header())]
    panels += [
        panel(
            "timeseries",
            "Requests/s by adapter",
            f"Requests finished per second per adapter, every outcome (rate of {REQUESTS}_count by "
            "openlora_adapter_name). `base` is requests without an adapter, `other` adapters past the cap "
            "(OPENLORA_INFERENCE_MAX_ADAPTERS). A loaded adapter is listed at 0 before its first request.",
            "reqps",
            [
                target(
                    f"sum by (openlora_adapter_name) ({rate(REQUESTS + '_count', ADAPTER_SEL)}{SERVING})",
                    "{{openlora_adapter_name}}",
                )
            ],
            at=grid.cell(12, 8),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "Error ratio by error type",
            f"Share of all requests that failed, per error_type (rate of {REQUESTS}_count with error_type "
            "over the rate of all): unknown_adapter (404), invalid_request (400/422) and cancelled (the "
            "client left mid-stream) are the clients'; overloaded (503, queue full) and exception class names "
            "the server's. The server's together is the line OpenloraInferenceErrorRatioHigh watches "
            f"({ERROR_RATIO_THRESHOLD:.0%}).",
            "percentunit",
            [
                target(
                    f"sum by (error_type) ({rate(REQUESTS + '_count', FAILED)}{SERVING})"
                    f" / on () group_left () ({REQUEST_RATE} > 0)",
                    "{{error_type}}",
                ),
                target(f"{SERVER_ERROR_RATE} / ({REQUEST_RATE} > 0)", "server's errors together"),
            ],
            at=grid.cell(12, 8),
            defaults={"min": 0, **objective_line(ERROR_RATIO_THRESHOLD)},
        ),
    ]
    return panels


def latency(grid: Grid) -> list[dict[str, Any]]:
    """Request duration, time to first token, time per output token: the row, next on the grid."""
    panels: list[dict[str, Any]] = [row("Latency", grid.header())]
    panels += [
        panel(
            "timeseries",
            "Request duration p50 / p95 / p99",
            f"Duration of successful requests, from arrival to the last token, queue time included "
            f"({REQUESTS}). The line is the {LATENCY_OBJECTIVE_S} s objective: p95 above it over 5 minutes, "
            "for 10 minutes, fires OpenloraInferenceLatencyHigh. Buckets double from 10 ms: a "
            "percentile is exact to within its bucket.",
            "s",
            quantiles(REQUESTS, SUCCEEDED),
            at=grid.cell(8, 8),
            defaults=objective_line(LATENCY_OBJECTIVE_S),
        ),
        panel(
            "timeseries",
            "Time to first token p50 / p95 / p99",
            "From the request's arrival to its first output token, queue time included, successful requests "
            "(gen_ai_server_time_to_first_token_seconds): what a streaming client waits before text appears.",
            "s",
            quantiles("gen_ai_server_time_to_first_token_seconds", ADAPTER_SEL),
            at=grid.cell(8, 8),
        ),
        panel(
            "timeseries",
            "Time per output token p50 / p95 / p99",
            "Time per output token after the first, successful requests with at least two output tokens "
            "(gen_ai_server_time_per_output_token_seconds): the decoding speed a client sees.",
            "s",
            quantiles("gen_ai_server_time_per_output_token_seconds", ADAPTER_SEL),
            at=grid.cell(8, 8),
        ),
    ]
    panels += [
        panel(
            "timeseries",
            "p95 request duration by adapter",
            f"95th percentile of the successful requests' duration per adapter ({REQUESTS}), "
            f"with the {LATENCY_OBJECTIVE_S} s objective.",
            "s",
            [
                target(
                    histogram_quantile(
                        0.95, REQUESTS, ("openlora_adapter_name",), lambda series: f"{rate(series, SUCCEEDED)}{SERVING}"
                    ),
                    "{{openlora_adapter_name}}",
                )
            ],
            at=grid.cell(12, 8),
            defaults=objective_line(LATENCY_OBJECTIVE_S),
        ),
        panel(
            "timeseries",
            "p95 time to first token by adapter",
            "95th percentile of the time to first token per adapter (gen_ai_server_time_to_first_token_seconds).",
            "s",
            [
                target(
                    histogram_quantile(
                        0.95,
                        "gen_ai_server_time_to_first_token_seconds",
                        ("openlora_adapter_name",),
                        lambda series: f"{rate(series, ADAPTER_SEL)}{SERVING}",
                    ),
                    "{{openlora_adapter_name}}",
                )
            ],
            at=grid.cell(12, 8),
        ),
    ]
    return panels


def tokens_and_load(grid: Grid) -> list[dict[str, Any]]:
    """Tokens per second by adapter, running and waiting requests: the row, next on the grid."""
    panels: list[dict[str, Any]] = [row("Tokens and load", grid.header())]
    tokens = "openlora_inference_token_usage_sum"
    output, prompt = f'{ADAPTER_SEL}, gen_ai_token_type="output"', f'{ADAPTER_SEL}, gen_ai_token_type="input"'
    panels += [
        panel(
            "timeseries",
            "Output tokens/s by adapter",
            "Tokens generated per second per adapter, and prompt tokens read per second, successful requests "
            f'(rate of {tokens} with gen_ai_token_type="output" and "input").',
            "short",
            [
                target(
                    f"sum by (openlora_adapter_name) ({rate(tokens, output)}{SERVING})",
                    "{{openlora_adapter_name}}",
                ),
                target(
                    f"sum by (openlora_adapter_name) ({rate(tokens, prompt)}{SERVING})",
                    "input {{openlora_adapter_name}}",
                ),
            ],
            at=grid.cell(12, 8),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "Running and waiting requests",
            "Requests being generated (openlora_inference_requests_running) and requests in the queue "
            "(openlora_inference_requests_waiting), per server. A queue that never drains and keeps "
            "rising fires OpenloraInferenceQueueGrowing.",
            "short",
            [
                target(
                    f"sum by (instance) (openlora_inference_requests_running{{{ADAPTER_SEL}}}{SERVING})",
                    "running {{instance}}",
                ),
                target(
                    f"sum by (instance) (openlora_inference_requests_waiting{{{ADAPTER_SEL}}}{SERVING})",
                    "waiting {{instance}}",
                ),
            ],
            at=grid.cell(12, 8),
            defaults={"min": 0},
        ),
    ]
    return panels


def energy(grid: Grid) -> list[dict[str, Any]]:
    """The GPUs' energy per adapter: joules per output token and power: the row, next on the grid."""
    panels: list[dict[str, Any]] = [row("Energy", grid.header())]
    per_token = "adapter:openlora_inference_energy_per_output_token_joules:2m"
    power = "adapter:openlora_inference_energy_joules:rate2m"
    panels += [
        panel(
            "timeseries",
            "Energy per output token by adapter",
            f"Joules per generated token of each adapter over 2 minutes ({per_token}, openlora-energy rules): "
            "the server's GPU energy (hw_energy_joules_total; a GPU several servers report split by their "
            "output tokens) given to its adapters by the output tokens each generated, over those tokens. "
            "Within one server and window every adapter gets the same figure; they differ across servers, "
            "GPUs and time. Idle power and prompt tokens are in it: see the Energy section of the docs' GPU metrics page.",
            "joule",
            [target(f"{per_token}{{{ADAPTER_SEL}}}{SERVING}", "{{openlora_adapter_name}} {{instance}}")],
            at=grid.cell(12, 8),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "GPU power by adapter",
            f"Average power of each adapter's part of its server's GPUs over 2 minutes ({power}): the server's "
            "share of each GPU's energy counter, split by the output tokens each adapter generated "
            "(0 for a loaded adapter without traffic while others generate).",
            "watt",
            [target(f"{power}{{{ADAPTER_SEL}}}{SERVING}", "{{openlora_adapter_name}} {{instance}}")],
            at=grid.cell(12, 8),
            defaults={"min": 0},
        ),
    ]
    return panels


def adapters(grid: Grid) -> list[dict[str, Any]]:
    """When adapters were loaded, how long loads took, which failed: the row, next on the grid."""
    panels: list[dict[str, Any]] = [row("Adapters", grid.header())]
    loads = "openlora_inference_adapter_load_duration_seconds"
    link = {"title": "Training run ${__data.fields.openlora_training_run_name}", "url": TRAINING_RUN_LINK}
    shown = [label for label, _ in ORIGIN_COLUMNS]
    panels += [
        panel(
            "table",
            "Adapters and their training runs",
            "Each loaded adapter on each server and where it came from (openlora_inference_adapter_info): "
            "its training run's name and id, the base model it runs on and the fingerprint of the base it "
            "was trained on, and the training's final eval loss; blank where the server was not told "
            "(an adapter without openlora.json). The run's name and id link to the training dashboard "
            "with that run selected, over the last 7 days.",
            "string",
            [
                target(
                    f"openlora_inference_adapter_info{{{ADAPTER_SEL}}}{SERVING}",
                    "",
                    instant=True,
                    format="table",
                )
            ],
            at=grid.cell(24, 7),
            options={"showHeader": True, "sortBy": [{"displayName": "Adapter", "desc": False}]},
            transformations=[
                {
                    "id": "filterFieldsByName",
                    "options": {"include": {"names": shown}},
                },
                {
                    "id": "organize",
                    "options": {
                        "indexByName": {label: index for index, label in enumerate(shown)},
                        "renameByName": dict(ORIGIN_COLUMNS),
                    },
                },
            ],
        ),
        panel(
            "state-timeline",
            "Adapters loaded, per server",
            "When each adapter was loaded on each server (openlora_inference_adapter_loaded == 1; 0 after "
            "unload). An adapter stays listed while loaded, whether or not it has requests.",
            "short",
            [
                target(
                    f"(openlora_inference_adapter_loaded{{{ADAPTER_SEL}}} == 1){SERVING}",
                    "{{openlora_adapter_name}} {{instance}}",
                )
            ],
            at=grid.cell(8, 8),
            defaults={"mappings": [{"type": "value", "options": {"1": {"text": "loaded", "color": "green"}}}]},
            options={"mergeValues": True, "showValue": "never", "rowHeight": 0.8},
        ),
        panel(
            "bargauge",
            "Adapter load time, slowest first",
            f"Mean time each adapter took to load on each server, successful loads ({loads}_sum / "
            f"{loads}_count); usually one load each.",
            "s",
            [
                target(
                    f"sort_desc((sum by (job, instance, openlora_adapter_name) ({loads}_sum{{{SUCCEEDED}}})"
                    f" / (sum by (job, instance, openlora_adapter_name) ({loads}_count{{{SUCCEEDED}}}) > 0))"
                    f"{SERVING})",
                    "{{openlora_adapter_name}} {{instance}}",
                    instant=True,
                )
            ],
            at=grid.cell(8, 8),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "Failed adapter loads",
            f"Loads that failed since the server started, per adapter and error_type ({loads}_count with "
            "error_type). A new failure fires OpenloraInferenceAdapterLoadFailed.",
            "short",
            [
                target(
                    f"sum by (instance, openlora_adapter_name, error_type) "
                    f"({loads}_count{{{FAILED}}}{SERVING})",
                    "{{openlora_adapter_name}} {{error_type}} {{instance}}",
                )
            ],
            at=grid.cell(8, 8),
            defaults={"min": 0},
        ),
    ]
    # The run's name and id link to its training: overrides match the columns by their headers.
    table = next(p for p in panels if p["title"] == "Adapters and their training runs")
    table["fieldConfig"]["overrides"] = [
        {
            "matcher": {"id": "byName", "options": header},
            "properties": [{"id": "links", "value": [link]}],
        }
        for label, header in ORIGIN_COLUMNS
        if label in ("openlora_training_run_name", "openlora_training_run_id")
    ]
    return panels


def build() -> dict[str, Any]:
    """The inference dashboard: the selected services' servers, per adapter."""
    grid = Grid()
    panels = [
        *serving_overview(grid),
        *requests(grid),
        *latency(grid),
        *tokens_and_load(grid),
        *adapters(grid),
        *energy(grid),
    ]
    serving_runs = run_names('job=~"$job"', by_service=True)
    templating = [
        DATASOURCE_VARIABLE,
        variable("job", "Job", "label_values(target_info, job)"),
        variable("service", "Service", SERVICE_QUERY, regex=SERVICE_REGEX),
        variable("run", "Run", f"query_result({serving_runs})", regex=RUN_NAME_REGEX),
        variable(
            "instance",
            "Server / instance",
            "query_result(group by (instance) "
            + service_target_info('job=~"$job", openlora_run_id=~"$run"')
            + ")",
            regex='/instance="(?<value>[^"]+)"/',
        ),
        variable(
            "adapter",
            "Adapter",
            f'label_values({REQUESTS}_count{{job=~"$job", instance=~"$instance"}}, openlora_adapter_name)',
        ),
    ]
    return dashboard(
        "openlora-inference",
        "openlora-otel: inference",
        "LoRA adapters served with openlora-otel's InferenceMetrics (openlora-otel serve or your own server): "
        "traffic, errors, latency, tokens, queue and adapters, per adapter.",
        ["openlora", "inference"],
        templating,
        panels,
    )
