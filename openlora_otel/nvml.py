"""Moved to :mod:`openlora_otel.hardware.nvml`; kept so old imports work.

This module replaces itself in ``sys.modules`` with the real one, so
``openlora_otel.nvml`` and ``openlora_otel.hardware.nvml`` are the same module object:
names, and anything monkeypatched through either path, are shared.
"""

import sys

from openlora_otel.hardware import nvml as _moved

sys.modules[__name__] = _moved
