"""The run's OpenTelemetry Resource: who is training, where, and which run.

Run identity (service, run id, torchrun ranks, host) lives here and nowhere
else: metric attributes stay free of it, so series do not multiply per run and
every exporter carries it the way the backend expects (``target_info`` on the
Prometheus pull path, resource attributes over OTLP).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.version import __version__ as _sdk_version

from openlora_otel._version import __version__
from openlora_otel.config import TelemetryConfig
from openlora_otel.names.resource import RUN_ATTEMPT_ATTRIBUTE, RUN_ID_ATTRIBUTE, RUN_NAME_ATTRIBUTE
from openlora_otel.run.identity import decided_run_id

__all__ = ["build_resource"]



def build_resource(
    config: TelemetryConfig,
    *,
    extra_attributes: Mapping[str, str | int | float | bool] | None = None,
) -> Resource:
    """Build the Resource from the resolved configuration, its run id decided (:func:`~.identity.decide_run_id`).

    Precedence, lowest first: SDK and host facts, ``OTEL_RESOURCE_ATTRIBUTES`` and
    rank variables (already in ``config.resource_attributes``), ``extra_attributes``
    (the caller's argument), then ``service.name``, the run id, its attempt and the run name,
    which always come from their dedicated settings.

    This does not call ``Resource.create()``: that would read the environment a
    second time with the SDK's own, more lenient parser.
    """
    attributes: dict[str, str | int | float | bool] = {
        "telemetry.sdk.language": "python",
        "telemetry.sdk.name": "opentelemetry",
        "telemetry.sdk.version": _sdk_version,
        "telemetry.distro.name": "openlora-otel",
        "telemetry.distro.version": __version__,
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
        "service.instance.id": str(uuid.uuid4()),
    }
    attributes.update(config.resource_attributes)
    if extra_attributes:
        attributes.update(extra_attributes)
    attributes["service.name"] = config.service_name
    attributes[RUN_ID_ATTRIBUTE] = decided_run_id(config)
    attributes[RUN_ATTEMPT_ATTRIBUTE] = config.run_attempt
    if config.run_name:
        # Stripped as openlora.run.info's name is (OPENLORA_RUN_NAME is; run_name= and a built config may not be).
        attributes[RUN_NAME_ATTRIBUTE] = config.run_name.strip()
    return Resource(attributes)
