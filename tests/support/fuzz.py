"""The settings of the property-based tests (hypothesis) over the parsers of outside input: files,
environment variables, request bodies, URLs and command-line values.

Bounded: ``OPENLORA_FUZZ_EXAMPLES`` examples per test (default 150), no per-example deadline (the
machines are shared and noisy), no example database written into the tree. Under CI the examples are
drawn from a fixed seed, so that a CI run is reproducible; elsewhere each run draws new ones. An input
that once found a bug is kept on its test as an ``@example(...)``, which runs every time.

A longer hunt, on a developer's machine: ``OPENLORA_FUZZ_EXAMPLES=20000 pytest -k fuzz``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("OPENLORA_FUZZ_EXAMPLES", "150"))

fuzz = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
