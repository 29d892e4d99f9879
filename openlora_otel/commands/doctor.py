"""`openlora-otel doctor`: check the configuration and its surroundings before a long run (its parser, too).

Prints the resolved configuration (header values, URL credentials, query values and fragment redacted),
checks that the Prometheus port can be bound and that the OTLP endpoint answers,
lists the optional packages, and says in plain words what to fix.

Every line goes through :func:`openlora_otel.redaction.redact` with the
credentials found in the environment, so text doctor did not write (an
exception from urllib, a socket error) cannot print them either.
"""

from __future__ import annotations

import argparse
import base64
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from openlora_otel._deps import OPTIONAL_PACKAGES, is_installed
from openlora_otel.commands._args import command_parser, usage_error
from openlora_otel.config import PROMETHEUS_PORT_VARIABLE, ConfigError, TelemetryConfig, secrets_in_env
from openlora_otel.redaction import redact

__all__ = ["Check", "register", "run", "run_doctor"]


@dataclass(frozen=True)
class Check:
    """One line of the report: ``ok`` is True, False (a problem) or None (information)."""

    name: str
    ok: bool | None
    detail: str
    fix: str = ""


def run_doctor(
    environ: Mapping[str, str] | None = None,
    *,
    timeout_s: float = 2.0,
    out: Callable[[str], None] = print,
) -> int:
    """Print the report; return 0 when nothing needs fixing, 1 otherwise, 2 for invalid configuration."""
    environ = os.environ if environ is None else environ
    # Known before parsing, so even the line of an invalid configuration is scrubbed.
    secrets = secrets_in_env(environ)
    raw_out = out

    def out(line: str) -> None:
        raw_out(redact(line, secrets))

    out("openlora-otel doctor")
    try:
        config = TelemetryConfig.from_env(environ)
    except ConfigError as exc:
        out(f"  [FAIL] configuration: {exc}")
        out(f"         fix: set {exc.variable} to {exc.accepted}, or unset it for the default")
        return 2

    for line in describe_config(config):
        out("  " + line)
    out("")
    checks = [*check_exporters(config, timeout_s=timeout_s), check_gpu(config), *check_packages(config)]
    for check in checks:
        mark = {True: " ok ", False: "FAIL", None: "info"}[check.ok]
        out(f"  [{mark}] {check.name}: {check.detail}")
        if check.fix:
            out(f"         fix: {check.fix}")
    problems = [c for c in checks if c.ok is False]
    out("")
    out(f"{len(problems)} problem(s) found." if problems else "All checks passed.")
    return 1 if problems else 0


def describe_config(config: TelemetryConfig) -> list[str]:
    """The resolved configuration as printable lines, secrets redacted."""
    otlp = config.otlp
    lines = [
        f"sdk disabled:        {config.sdk_disabled}",
        f"service.name:        {config.service_name}",
        f"run id:              {config.run_id or '(generated at setup)'}",
        f"resource attributes: {dict(config.resource_attributes) or '{}'}",
        f"exporters:           {','.join(config.exporters)}",
        f"prometheus endpoint: {config.prometheus_host}:{config.prometheus_port}",
        f"otlp endpoint:       {otlp.redacted_endpoint()} ({otlp.protocol}, "
        + (
            f"from {otlp.endpoint_variable})"
            if otlp.endpoint_set
            else "the default: OTEL_EXPORTER_OTLP_METRICS_ENDPOINT and OTEL_EXPORTER_OTLP_ENDPOINT are unset)"
        ),
        f"otlp headers:        {dict(otlp.redacted_headers()) or '{}'}",
        f"otlp timeout:        {otlp.timeout_s:g} s, compression {otlp.compression}, "
        f"temporality {otlp.temporality}",
    ]
    if otlp.protocol == "grpc":
        lines.append(f"otlp insecure:       {otlp.insecure}")
    if otlp.certificate or otlp.client_key or otlp.client_certificate:
        lines.append(
            f"otlp tls files:      ca={otlp.certificate} key={otlp.client_key} cert={otlp.client_certificate}"
        )
    lines += [
        f"export interval:     {config.export_interval_ms:g} ms (timeout {config.export_timeout_ms:g} ms)",
        f"shutdown bound:      {config.shutdown_timeout_s:g} s",
    ]
    return lines


def check_exporters(config: TelemetryConfig, *, timeout_s: float) -> list[Check]:
    if config.sdk_disabled:
        return [Check("exporters", None, "OTEL_SDK_DISABLED=true: nothing will be exported")]
    checks: list[Check] = []
    exporters = config.enabled_exporters
    if not exporters:
        checks.append(
            Check("exporters", None, "OTEL_METRICS_EXPORTER=none: metrics are recorded but not exported")
        )
    if "prometheus" in exporters:
        checks.append(_check_bind(config))
    if "otlp" in exporters:
        checks.append(_check_otlp(config, timeout_s))
    if "console" in exporters:
        checks.append(Check("console", None, "metrics are printed to standard output every export interval"))
    return checks


def check_gpu(config: TelemetryConfig) -> Check:
    """Whether NVML starts, and what OPENLORA_GPU_METRICS will do about it."""
    from openlora_otel.hardware import nvml

    name = "gpu metrics"
    if config.gpu_metrics == "off":
        return Check(name, None, "OPENLORA_GPU_METRICS=off")
    needed = config.gpu_metrics == "on"
    try:
        backend = nvml.start_backend()
    except nvml.NvmlUnavailable as exc:
        if exc.missing_package:
            fix = "pip install 'openlora-otel[gpu]'"
        else:
            fix = "install the NVIDIA driver, or set OPENLORA_GPU_METRICS=auto or off"
        return Check(name, False if needed else None, f"{exc}, so no GPU metrics", fix if needed else "")
    try:
        count, driver = backend.device_count(), backend.driver_version()
    except nvml.GpuError as exc:
        return Check(
            name, False, f"NVML started but cannot list GPUs ({exc})", "check the driver with nvidia-smi"
        )
    finally:
        backend.shutdown()
    return Check(
        name, True, f"NVML works: {count} GPU(s), driver {driver}; reporting {config.gpu_devices!r} devices"
    )


def check_packages(config: TelemetryConfig) -> list[Check]:
    needed: set[str] = set()
    if "otlp" in config.enabled_exporters:
        needed.add(
            f"opentelemetry.exporter.otlp.proto.{'grpc' if config.otlp.protocol == 'grpc' else 'http'}"
        )
    checks = []
    for module, (distribution, extra) in OPTIONAL_PACKAGES.items():
        installed = is_installed(module)
        if installed:
            checks.append(Check(f"package {distribution}", None, "installed"))
        elif module in needed:
            checks.append(
                Check(
                    f"package {distribution}",
                    False,
                    "missing, and the configured exporter needs it",
                    f"pip install 'openlora-otel[{extra}]'",
                )
            )
        else:
            checks.append(Check(f"package {distribution}", None, f"not installed (extra [{extra}])"))
    return checks


def _check_bind(config: TelemetryConfig) -> Check:
    host, port = config.prometheus_host, config.prometheus_port
    name = "prometheus endpoint"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return Check(
            name,
            False,
            f"cannot resolve {host!r}: {exc}",
            "set OTEL_EXPORTER_PROMETHEUS_HOST to a valid address",
        )
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(address)
        except OSError as exc:
            return Check(
                name,
                False,
                f"cannot bind {host}:{port}: {exc.strerror or exc}",
                f"stop what holds port {port}, or set {PROMETHEUS_PORT_VARIABLE} "
                "to another port (0 = any free port)",
            )
    shown = "any free port" if port == 0 else str(port)
    return Check(name, True, f"{host}:{shown} can be bound; scrape http://{host}:{port}/metrics")


def _check_otlp(config: TelemetryConfig, timeout_s: float) -> Check:
    otlp = config.otlp
    name = "otlp endpoint"
    url = otlp.endpoint if "://" in otlp.endpoint else "http://" + otlp.endpoint
    parts = urlsplit(url)
    secrets = otlp.secrets()
    host = parts.hostname or "localhost"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    where = otlp.redacted_endpoint()
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        return Check(
            name,
            False,
            f"nothing answers at {host}:{port} ({redact(str(exc.strerror or exc), secrets)})",
            "start the OpenTelemetry Collector, or point OTEL_EXPORTER_OTLP_ENDPOINT at a running one; "
            "training will still run, exports fail until it is reachable",
        )
    if otlp.protocol == "grpc":
        return Check(name, True, f"{where} accepts connections (gRPC)")
    # An empty ExportMetricsServiceRequest is a valid OTLP request: a collector answers 200.
    headers = {"Content-Type": "application/x-protobuf", **dict(otlp.headers)}
    if "@" in parts.netloc:
        # urllib cannot take user:password@ in a URL; the exporter (requests) sends it
        # as Basic auth, replacing any Authorization header, so doctor does the same.
        credentials = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        headers["Authorization"] = (
            "Basic " + base64.b64encode(credentials.encode("latin-1", "replace")).decode()
        )
        url = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    request = urllib.request.Request(url, data=b"", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:
        return Check(
            name,
            False,
            f"{where} accepts connections but the request failed: {redact(str(exc), secrets)}",
            "check the URL and TLS settings",
        )
    if 200 <= status < 300:
        return Check(name, True, f"{where} answered HTTP {status} to an empty OTLP request")
    hint = {
        401: "check OTEL_EXPORTER_OTLP_HEADERS (credentials)",
        403: "check OTEL_EXPORTER_OTLP_HEADERS (credentials)",
        404: "the path is wrong: a per-signal OTEL_EXPORTER_OTLP_METRICS_ENDPOINT must end in /v1/metrics",
    }.get(status, "check that this is an OTLP/HTTP receiver")
    return Check(name, False, f"{where} answered HTTP {status}", hint)


def register(commands: Any) -> None:
    doctor = command_parser(
        commands,
        "doctor",
        help="check the configuration, the ports and endpoints it names, and the optional packages",
        description="Print the configuration resolved from the environment (secrets redacted), check that "
        "the Prometheus port can be bound and the OTLP endpoint answers, list optional packages, and say "
        "what to fix. Exit status: 0 all good, 1 a check failed, 2 invalid configuration.",
    )
    doctor.add_argument(
        "--timeout", type=float, default=2.0, metavar="SECONDS", help="per network check (default 2)"
    )
    doctor.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        usage_error(args, "--timeout must be > 0")
    return run_doctor(timeout_s=args.timeout)
