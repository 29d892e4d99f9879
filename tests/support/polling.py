"""One bounded wait for a condition to hold."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], timeout: float, what: str | None = None, *, interval: float = 0.5
) -> T:
    """Call ``condition()`` every ``interval`` seconds until it returns something truthy, for at most
    ``timeout`` seconds and once more at the end; return that value.

    If it never does: with ``what``, fail (AssertionError naming ``what``); without, return the last
    falsy value, for the caller to assert on (``assert wait_until(...), details``) or to go on and
    check what it waited for itself."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            break
        time.sleep(interval)
    if what is not None:
        raise AssertionError(f"not within {timeout} s: {what}")
    return value
