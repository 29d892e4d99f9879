"""``python -m openlora_otel``: the same command line as ``openlora-otel``."""

from openlora_otel.cli import main

raise SystemExit(main())
