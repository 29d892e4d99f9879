"""Moved to :mod:`openlora_otel.training.guard`; kept so old imports work.

This module replaces itself in ``sys.modules`` with the real one, so
``openlora_otel.guard`` and ``openlora_otel.training.guard`` are the same module object:
names, and anything monkeypatched through either path, are shared.
"""

import sys

from openlora_otel.training import guard as _moved

sys.modules[__name__] = _moved
