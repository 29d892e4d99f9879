"""``openlora-otel load``: a load generator for ``serve`` (openlora_otel.serving.load)."""

from __future__ import annotations

from typing import Any

from openlora_otel.serving import load


def register(commands: Any) -> None:
    load.add_parser(commands).set_defaults(func=load.main)
