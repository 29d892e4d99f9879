"""Moved to :mod:`openlora_otel.training.flops`; kept so old imports work.

This module replaces itself in ``sys.modules`` with the real one, so
``openlora_otel.flops`` and ``openlora_otel.training.flops`` are the same module object:
names, and anything monkeypatched through either path, are shared.
"""

import sys

from openlora_otel.training import flops as _moved

sys.modules[__name__] = _moved
