"""A host-metrics source for tests: every read passed to a real one, or to a scripted stand-in, and recorded."""

from __future__ import annotations

import threading

__all__ = ["Recorded"]


class Recorded:
    """A source that passes every read to ``inner`` (or to what ``replaced`` names) and records which
    read ran on which thread."""

    name = "recorded"

    def __init__(self, inner: object, **replaced: object) -> None:
        self._inner = inner
        self._replaced = replaced
        self.reads: list[tuple[str, str]] = []

    def __getattr__(self, method: str) -> object:
        real = self._replaced.get(method) or getattr(self._inner, method)

        def read(*args: object, **kwargs: object) -> object:
            self.reads.append((method, threading.current_thread().name))
            return real(*args, **kwargs)  # type: ignore[operator]

        return read
