"""``openlora-otel stack``: Prometheus and Alertmanager without Docker (openlora_otel.stack)."""

from __future__ import annotations

from typing import Any

from openlora_otel import stack


def register(commands: Any) -> None:
    stack.add_parser(commands).set_defaults(func=stack.run)
