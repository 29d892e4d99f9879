"""Export backends, one module each, imported only when selected.

Each module exposes one builder that turns the resolved
:class:`~openlora_otel.config.TelemetryConfig` into a ``MetricReader`` (and, for
the pull endpoint, the server that serves it); :mod:`.readers` is the one place that says which
builders a configuration selects.
"""
