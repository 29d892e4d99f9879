"""``openlora-otel stack``: Prometheus and Alertmanager on this machine, without Docker.

:mod:`~openlora_otel.stack.servers` writes the configs, runs the two servers and prints the alerts;
:mod:`openlora_otel.commands.stack` is the command's parser.
"""

from openlora_otel.stack.servers import (
    DEFAULT_RUNBOOK_BASE,
    AlertPrinter,
    StackPlan,
    alertmanager_config,
    check_runbook_base,
    prometheus_config,
    receive_only,
    rules_text,
    start,
    write,
)

__all__ = [
    "DEFAULT_RUNBOOK_BASE",
    "AlertPrinter",
    "StackPlan",
    "alertmanager_config",
    "check_runbook_base",
    "prometheus_config",
    "receive_only",
    "rules_text",
    "start",
    "write",
]
