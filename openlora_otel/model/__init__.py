"""The small model that ``openlora-otel demo`` trains and ``openlora-otel serve`` serves: what the two
programs share, so that neither imports the other.

``layout``: the directory ``demo --save DIR`` writes and ``serve DIR`` reads; ``corpus``: the demo's
text and the character tokenizer both use; ``device``: where the model computes (``--device`` of
``demo`` and ``serve``). Nothing here imports torch at import time.
"""
