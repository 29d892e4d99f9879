"""Serving metrics (openlora_otel.inference): the GenAI semantic conventions' server histograms, the
adapters' series, their attribute keys and bucket boundaries."""

from __future__ import annotations

import re

from openlora_otel.names.common import MetricSpec

__all__ = [
    "ATTR_ADAPTER",
    "ATTR_BASE_FINGERPRINT",
    "ATTR_BASE_MODEL",
    "ATTR_OPERATION",
    "ATTR_PROVIDER",
    "ATTR_REQUEST_MODEL",
    "ATTR_RESPONSE_MODEL",
    "ATTR_TOKEN_TYPE",
    "ATTR_TRAINING_EVAL_LOSS",
    "ATTR_TRAINING_RUN_ID",
    "ATTR_TRAINING_RUN_NAME",
    "CLIENT_ERROR_PATTERN",
    "CLIENT_ERROR_TYPES",
    "INFERENCE_METRICS",
    "REQUEST_DURATION_BUCKETS",
    "TOKEN_BUCKETS",
    "TPOT_BUCKETS",
    "TTFT_BUCKETS",
    "is_client_error",
    "is_client_error_status",
]

# Serving (openlora_otel.inference). The gen_ai.server.* names, units, attributes and bucket
# advisories are the OpenTelemetry GenAI semantic conventions (Development). Those define token
# usage for clients only (gen_ai.client.token.usage); a server's own count lives under
# openlora.inference.* with the same attribute and buckets. The adapter is an attribute of its
# own (no convention has one), capped per process (OPENLORA_INFERENCE_MAX_ADAPTERS).
ATTR_OPERATION = "gen_ai.operation.name"
ATTR_PROVIDER = "gen_ai.provider.name"
ATTR_REQUEST_MODEL = "gen_ai.request.model"
ATTR_RESPONSE_MODEL = "gen_ai.response.model"
ATTR_TOKEN_TYPE = "gen_ai.token.type"
ATTR_ADAPTER = "openlora.adapter.name"
# On openlora.inference.adapter.info only: where a served adapter came from (its training run, which
# labels its own series openlora.run.id / openlora.run.name; here under openlora.training.* so that
# they never clash with the serving process's own openlora.run.id, its Resource's), the base it
# runs on and the training's last evaluation loss.
ATTR_TRAINING_RUN_ID = "openlora.training.run.id"
ATTR_TRAINING_RUN_NAME = "openlora.training.run.name"
ATTR_TRAINING_EVAL_LOSS = "openlora.training.final_eval_loss"
ATTR_BASE_MODEL = "openlora.adapter.base_model"
ATTR_BASE_FINGERPRINT = "openlora.adapter.base_fingerprint"

# error.type values of failures a client causes, not the server: what the server-error ratio, its
# alert (OpenloraInferenceErrorRatioHigh) and the inference dashboard leave out. `serve`'s own
# refusals (an adapter it does not serve, a malformed request, a body too large, too deep or too
# slow, a client that went away); OpenAI's client error types; gRPC's status codes a client causes.
# An HTTP middleware records an answer with a client's status (4xx but 429) as one of these names
# (its body's code, else its type) or as the status itself, which CLIENT_ERROR_PATTERN also leaves
# out; a 429 (rate limited) and 5xx are the server's.
CLIENT_ERROR_TYPES: tuple[str, ...] = (
    "unknown_adapter", "invalid_request", "cancelled", "request_too_large", "json_too_deep", "request_timeout",
    "invalid_request_error", "authentication_error", "permission_error", "not_found_error", "conflict_error",
    "unprocessable_entity_error",
    "CANCELLED", "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "UNAUTHENTICATED",
    "FAILED_PRECONDITION", "OUT_OF_RANGE",
)  # fmt: skip
# The regex (fully anchored, as PromQL's =~ and !~ are) of CLIENT_ERROR_TYPES and the client statuses.
CLIENT_ERROR_PATTERN = "|".join((*CLIENT_ERROR_TYPES, "4[01][0-9]|42[0-8]|4[3-9][0-9]"))


_CLIENT_ERROR = re.compile(CLIENT_ERROR_PATTERN)


def is_client_error(error_type: str) -> bool:
    """Whether an ``error.type`` value is a client's fault: what CLIENT_ERROR_PATTERN matches, as PromQL
    matches it (the whole value)."""
    return _CLIENT_ERROR.fullmatch(error_type) is not None


def is_client_error_status(status: int) -> bool:
    """Whether an HTTP status is a client's fault: 400 to 499 but 429 (too many requests: the server's capacity)."""
    return 400 <= status <= 499 and status != 429


REQUEST_DURATION_BUCKETS: tuple[float, ...] = tuple(round(0.01 * 2**k, 2) for k in range(14))  # 0.01 .. 81.92
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
TPOT_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(4**k) for k in range(14))  # 1 .. 67108864

INFERENCE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gen_ai.server.request.duration",
        "histogram",
        "s",
        "Time from a request's arrival to its last output token (queue wait included); `error.type` on "
        "failed requests. Its count is the request count.",
    ),
    MetricSpec(
        "gen_ai.server.time_to_first_token",
        "histogram",
        "s",
        "Time from a request's arrival to its first output token (queue wait included); successful requests.",
    ),
    MetricSpec(
        "gen_ai.server.time_per_output_token",
        "histogram",
        "s",
        "Time per output token after the first: (duration - time to first token) / (output tokens - 1); "
        "successful requests with at least two output tokens.",
    ),
    MetricSpec(
        "openlora.inference.token.usage",
        "histogram",
        "{token}",
        "Tokens per successful request, `gen_ai.token.type` `input` (prompt) or `output` (generated); "
        "its sum over time is tokens/s.",
    ),
    MetricSpec(
        "openlora.inference.requests.running",
        "updowncounter",
        "{request}",
        "Requests being generated now (left the queue, not finished).",
    ),
    MetricSpec(
        "openlora.inference.requests.waiting",
        "updowncounter",
        "{request}",
        "Requests waiting in the server's queue for a generation slot.",
    ),
    MetricSpec(
        "openlora.inference.adapter.loaded",
        "gauge",
        "",
        f"1 per adapter (`{ATTR_ADAPTER}`) while it is loaded, 0 after it was unloaded; a loaded adapter "
        "shows whether or not it has requests.",
    ),
    MetricSpec(
        "openlora.inference.adapter.info",
        "gauge",
        "",
        f"1 per loaded adapter (`{ATTR_ADAPTER}`; none for adapters past the cap), with what is known of "
        f"where it came from: `{ATTR_TRAINING_RUN_ID}`, `{ATTR_TRAINING_RUN_NAME}` (its training run), "
        f"`{ATTR_BASE_MODEL}`, `{ATTR_BASE_FINGERPRINT}`, `{ATTR_TRAINING_EVAL_LOSS}`. Replaced when the "
        "adapter is loaded again, gone once it is unloaded; no request series carries these.",
    ),
    MetricSpec(
        "openlora.inference.adapter.load.duration",
        "histogram",
        "s",
        "Time to load an adapter; `error.type` on failed loads (their count is the failure count).",
    ),
)
