"""Framework adapters: thin callbacks that translate hooks into `TrainingMetrics` calls.

Each lives in its own module and imports its framework only when imported
itself (``openlora_otel.integrations.hf``, ``openlora_otel.integrations.lightning``).
"""
