"""Bounded waits: for a condition to hold (:func:`wait_until`), for a call that may block (:func:`within`)."""

from __future__ import annotations

import threading
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


def within(seconds: float, call: Callable[[], T], what: str = "the call") -> T:
    """``call()`` in a daemon thread, failing the test (AssertionError naming ``what``) instead of hanging
    it when it takes longer than ``seconds``; its result, or what it raised (SystemExit included)."""
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"{what} blocked for over {seconds} s"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]  # type: ignore[return-value]
