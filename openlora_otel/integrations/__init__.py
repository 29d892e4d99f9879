"""Framework adapters: thin callbacks that translate hooks into `TrainingMetrics` calls.

Each lives in its own module and imports its framework only when imported
itself (``openlora_otel.integrations.hf``, ``openlora_otel.integrations.lightning``).
What they share, and the demo uses too (describing a LoRA adapter, the progress file), is
``openlora_otel.integrations.common``.
"""
