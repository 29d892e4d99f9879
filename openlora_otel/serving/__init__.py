"""The serving programs: ``openlora-otel serve`` (:mod:`~openlora_otel.serving.server`, over the saved
model and its adapters in :mod:`~openlora_otel.serving.model`) and ``openlora-otel load``
(:mod:`~openlora_otel.serving.load`, the standard library only).

What any server imports to measure its requests is the library below, :mod:`openlora_otel.inference`;
the saved-model layout that ``demo --save`` writes and ``serve`` reads is :mod:`openlora_otel.model.layout`.
Nothing here is imported by ``import openlora_otel``.
"""
