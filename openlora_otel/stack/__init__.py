"""``openlora-otel stack``: Prometheus and Alertmanager on this machine, without Docker.

:mod:`~openlora_otel.stack.servers` writes the configs, runs the two servers and prints the alerts;
:mod:`~openlora_otel.stack.rules` is the shipped rules with your runbook base (``openlora-otel rules``
prints them too); :mod:`openlora_otel.commands.stack` is the command's parser.
"""

from openlora_otel.stack.rules import DEFAULT_RUNBOOK_BASE, check_runbook_base, rules_text
from openlora_otel.stack.servers import (
    AlertPrinter,
    StackPlan,
    alertmanager_config,
    prometheus_config,
    receive_only,
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
