"""The run's history as a file: OTLP JSON Lines, written from a background reader.

With ``OPENLORA_HISTORY_DIR`` set, a reader of its own (whatever else is exported, at its own
interval, encoding on its own thread) appends one OTLP/JSON ``ExportMetricsServiceRequest`` per
collection, cumulative, so each line stands alone. Lines are whole, the file is bounded by
``OPENLORA_HISTORY_MAX_BYTES`` (thinned, never cut off), and failures are logged once by
:class:`~openlora_otel.exporters.outage.GuardedExporter`. See docs/how-to/run-history.md.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource

from openlora_otel._deps import require
from openlora_otel.config import DIRECTORY_ACCEPTED, ConfigError, TelemetryConfig
from openlora_otel.exporters.otlp import temporality_for
from openlora_otel.exporters.outage import GuardedExporter
from openlora_otel.names import RANK_ATTRIBUTE, RUN_ID_ATTRIBUTE

__all__ = ["HistoryExporter", "build_history_exporter", "encode_line", "history_path", "history_reader"]

_logger = logging.getLogger(__name__)

_VARIABLE = "OPENLORA_HISTORY_DIR"
_ENCODER = "opentelemetry.exporter.otlp.proto.common"
# Where a trace or span id sits in an exemplar (bytes: base64 in protobuf's mapping, hex in OTLP/JSON).
_ID_FIELDS = ("traceId", "spanId")
_POINT_KINDS = ("gauge", "sum", "histogram", "exponentialHistogram", "summary")


class HistoryLineTooLarge(OSError):
    """One line is bigger than the whole bound leaves room for; it is dropped, the run goes on."""


def history_path(directory: str | os.PathLike[str], resource: Resource) -> Path:
    """``<directory>/<run id>.jsonl``, or ``<run id>.rank<RANK>.jsonl`` when the Resource has a rank.

    A run id (or rank) of letters, digits, ``.``, ``_`` and ``-`` that does not start with ``.`` and has
    no ``.rank`` in it is the name as it is. Any other (``.``, ``..``, ``a/b``, ``ü``) is named by its
    letters, digits, ``.``, ``_`` and ``-`` (others ``_``, leading dots dropped, at most 64) followed by
    ``-`` and 12 hex digits of its SHA-256: no value (``openlora.rank=/../x`` in
    ``OTEL_RESOURCE_ATTRIBUTES`` included) can name a file elsewhere or a subdirectory, and two runs
    never share a file (``.`` and ``..`` both used to be ``run.jsonl``).
    """
    name = _name_part(str(resource.attributes.get(RUN_ID_ATTRIBUTE) or "run"))
    rank = resource.attributes.get(RANK_ATTRIBUTE)
    if rank is not None:
        name += f".rank{_name_part(str(rank))}"
    return Path(directory) / f"{name}.jsonl"


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def _name_part(text: str) -> str:
    """``text`` in a file name, one to one (see :func:`history_path`)."""
    if _PLAIN_NAME.fullmatch(text) and ".rank" not in text:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip(".")[:64]
    return f"{readable or 'run'}-{digest}"


def _encoder() -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    except ImportError:  # older releases keep it in _internal only
        from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import (  # type: ignore[no-redef]
            encode_metrics,
        )
    return encode_metrics


def encode_line(metrics_data: MetricsData) -> bytes:
    """One collection as one OTLP/JSON ``ExportMetricsServiceRequest``, UTF-8, ending in a newline."""
    from google.protobuf import json_format

    request = _encoder()(metrics_data)
    body = json_format.MessageToDict(request, use_integers_for_enums=True)
    _ids_to_hex(body)
    # allow_nan=False: the mapping already writes NaN and infinities as "NaN" / "Infinity" strings;
    # a bare float one would be a line no JSON parser reads.
    return (json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False) + "\n").encode()


def _ids_to_hex(body: Mapping[str, Any]) -> None:
    """Exemplar trace and span ids from base64 (protobuf's mapping) to hex (OTLP/JSON), in place."""
    for resource_metrics in body.get("resourceMetrics", ()):
        for scope_metrics in resource_metrics.get("scopeMetrics", ()):
            for metric in scope_metrics.get("metrics", ()):
                for kind in _POINT_KINDS:
                    for point in metric.get(kind, {}).get("dataPoints", ()):
                        for exemplar in point.get("exemplars", ()):
                            for key in _ID_FIELDS:
                                if key in exemplar:
                                    with contextlib.suppress(binascii.Error, ValueError):
                                        exemplar[key] = base64.b64decode(exemplar[key]).hex()


class HistoryExporter(MetricExporter):
    """Appends one OTLP/JSON line per written collection to ``path``, keeping the file within ``max_bytes``.

    ``export`` raises ``OSError`` when the file cannot be written: wrap it in a
    :class:`GuardedExporter`, which logs that once. ``shutdown`` writes the last
    collection when the thinning had skipped it, so the file always ends with the
    run's final values.
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        super().__init__(preferred_temporality=temporality_for("cumulative"))
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._pid = os.getpid()
        # Every `stride`-th collection is written; doubles at each compaction.
        self.stride = 1
        self._since_written = 0
        self._skipped: MetricsData | None = None
        self._last_write_failed = False
        self.lines_written = 0
        self.compactions = 0

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        with self._lock:
            self._since_written += 1
            if self._since_written < self.stride:
                # Not encoded: only kept in case it is the run's last collection.
                self._skipped = metrics_data
                return MetricExportResult.SUCCESS
            self._skipped = None
            self._write(metrics_data)
            return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """Write the last collection if the thinning skipped it; never raises."""
        with self._lock:
            skipped, self._skipped = self._skipped, None
            if skipped is None or os.getpid() != self._pid:
                return
            try:
                self._write(skipped)
            except Exception as exc:
                # The guard has already said the file is failing: once is enough.
                log = _logger.debug if self._last_write_failed else _logger.warning
                log("openlora-otel: the final line of the run history %s was not written (%s)", self.path, exc)

    # -- writing ---------------------------------------------------------------
    def _write(self, metrics_data: MetricsData) -> None:
        try:
            line = encode_line(metrics_data)
            size = self._size()
            while size + len(line) > self.max_bytes:
                compacted = self._compact()
                if compacted is None:
                    raise HistoryLineTooLarge(
                        errno.EFBIG,
                        f"a line of {len(line)} bytes does not fit in OPENLORA_HISTORY_MAX_BYTES={self.max_bytes} "
                        f"next to the {size} bytes kept; the line is dropped",
                    )
                size = compacted
                self.stride *= 2
            self._append(line, size)
        except BaseException:
            self._last_write_failed = True
            raise
        self._last_write_failed = False
        self._since_written = 0
        self.lines_written += 1

    def _size(self) -> int:
        try:
            return os.stat(self.path).st_size
        except FileNotFoundError:
            return 0  # removed (by hand, or never created): appending starts a new file

    def _append(self, line: bytes, size: int) -> None:
        # Unbuffered, one os.write loop: the line leaves this process in as few writes as the OS allows.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(line)
            try:
                while view:
                    view = view[os.write(fd, view) :]
            except OSError:
                # A torn line would glue itself to the next one: cut back to the last whole line.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)

    def _compact(self) -> int | None:
        """Keep the first, the last and every other line in between; the new size, or None when
        there is nothing left to drop (two lines or fewer)."""
        folder = self.path.parent
        descriptor, temporary = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=folder)
        try:
            kept = total = 0
            with open(self.path, "rb") as source, os.fdopen(descriptor, "wb") as target:
                held: bytes | None = None
                for index, line in enumerate(source):
                    if not line.endswith(b"\n"):
                        break  # a torn last line (the process died mid-write): not a line
                    total += 1
                    if held is not None and (index - 1) % 2 == 0:
                        target.write(held)
                        kept += 1
                    held = line
                if held is not None:
                    target.write(held)  # the last line, whatever its index
                    kept += 1
            if kept == total and total <= 2:
                return None
            mode = stat.S_IMODE(os.stat(self.path).st_mode)
            os.chmod(temporary, mode)  # mkstemp makes it 0600; keep what the file had
            os.replace(temporary, self.path)
            temporary = ""
        finally:
            if temporary:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
        self.compactions += 1
        _logger.info(
            "openlora-otel: run history %s reached OPENLORA_HISTORY_MAX_BYTES=%d: kept %d of %d lines, "
            "now writing every %d collections",
            self.path,
            self.max_bytes,
            kept,
            total,
            self.stride * 2,
        )
        return os.stat(self.path).st_size


def build_history_exporter(config: TelemetryConfig, resource: Resource) -> HistoryExporter:
    """Check the package and the directory, then the exporter; nothing is started yet.

    Raises :class:`~openlora_otel._deps.MissingDependencyError` without the
    encoder package and :class:`ConfigError` (``OPENLORA_HISTORY_DIR``) when the
    directory cannot be created or the file cannot be opened for appending.
    """
    assert config.history_dir is not None
    require(_ENCODER, f"{_VARIABLE} (the run history file)")
    path = history_path(config.history_dir, resource)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # The real test of "writable": open the file as every line will. An existing file of a run
        # with the same id (a restart) is appended to.
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
    except OSError as exc:
        raise ConfigError(
            _VARIABLE,
            config.history_dir,
            DIRECTORY_ACCEPTED + ", writable by this process",
            f"{exc.strerror or exc}: {exc.filename or path}",
        ) from None
    return HistoryExporter(path, config.history_max_bytes)


def history_reader(exporter: HistoryExporter, config: TelemetryConfig) -> PeriodicExportingMetricReader:
    """The background reader that writes a line every ``OPENLORA_HISTORY_INTERVAL`` milliseconds."""
    guarded = GuardedExporter(exporter, describe=f"run history file {exporter.path}")
    return PeriodicExportingMetricReader(
        guarded,
        export_interval_millis=config.history_interval_ms,
        export_timeout_millis=config.export_timeout_ms,
    )
