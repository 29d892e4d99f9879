"""A run's identity and life: what names it, and how it ends.

``resource``: the run's OpenTelemetry Resource and its attribute names; ``identity``: the run id every
rank of a job shares; ``info``: the run's name and hyperparameters (``openlora.run.info``);
``outcome``: how it ended (``openlora.run.outcome``); ``sigterm``: the final export on SIGTERM.
Nothing here imports torch at import time.
"""
