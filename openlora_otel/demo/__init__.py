"""`openlora-otel demo`: a real, small LoRA fine-tune on CPU with live telemetry.

Imports torch, transformers and peft only when run (extra ``demo``).
"""
