"""SIGTERM: the final export before the process ends.

Python's default SIGTERM, which Kubernetes, Slurm and torchrun send, ends the process without
``atexit``, losing everything since the last export. :class:`SigtermGuard`, when the application
has no handler of its own, runs the bounded ``Telemetry.shutdown()`` on a thread of its own and
exits with status 143; it hears the signal through the wakeup fd even while the main thread is
stuck in C code, stands aside for an application's handler and is dropped in forked children.
See docs/concepts/lifecycle.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType

__all__ = ["EXIT_STATUS", "SigtermGuard"]

_logger = logging.getLogger(__name__)

# 128 + SIGTERM: what a shell, Kubernetes and Slurm report for a process ended by SIGTERM.
EXIT_STATUS = 128 + signal.SIGTERM
# How long the main thread may sit on one instruction after a SIGTERM before the
# watcher takes it as stuck in C code (a hung collective) and acts for it.
STUCK_AFTER_S = 0.5


def _main_position() -> tuple[int, int, int] | None:
    """Where the main thread is: its innermost frame and instruction (None if unknown)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return None
    return (id(frame), frame.f_lasti, frame.f_lineno or 0)


class SigtermGuard:
    """Runs ``on_terminate`` (the bounded shutdown) on SIGTERM, then exits with status 143.

    Build it with :meth:`install`; ``uninstall()`` puts the default back.
    """

    def __init__(self, on_terminate: Callable[[], object], on_chained: Callable[[], object]) -> None:
        self._on_terminate = on_terminate
        self._on_chained = on_chained
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._shutting_down = False
        self._installed = False
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._watcher: threading.Thread | None = None
        self._pid = os.getpid()

    @classmethod
    def install(
        cls, on_terminate: Callable[[], object], on_chained: Callable[[], object]
    ) -> SigtermGuard | None:
        """Install the guard, or return None (and change nothing) when it should not be.

        ``on_terminate`` is the bounded shutdown run before exiting; ``on_chained``
        (a flush) is what a later application handler gets when it calls ours as
        "the previous handler": that application decides when the process ends.
        """
        if threading.current_thread() is not threading.main_thread():
            _logger.info(
                "openlora-otel: setup_telemetry() ran outside the main thread, where Python cannot set a "
                "SIGTERM handler; SIGTERM ends the process without a final export (call telemetry.shutdown() "
                "from your own handler)"
            )
            return None
        current = signal.getsignal(signal.SIGTERM)
        if current is not signal.SIG_DFL:
            # The application's own handler (or SIG_IGN, or a handler set outside Python) stays.
            _logger.debug("SIGTERM already has a handler (%r); leaving it alone", current)
            return None
        guard = cls(on_terminate, on_chained)
        signal.signal(signal.SIGTERM, guard._on_signal)
        guard._installed = True
        guard._start_watcher()
        _GUARDS.add(guard)
        return guard

    # -- the two ways a SIGTERM reaches us ---------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler, run by the main thread: start the shutdown and return at once."""
        if not self._is_current():
            # An application handler installed after ours called us as its previous
            # handler (Lightning's signal connector does): it is stopping the run its
            # own way, so deliver what was recorded and never end the process for it.
            threading.Thread(target=self._flush, name="openlora-otel-sigterm-flush", daemon=True).start()
            return
        self._terminate()

    def _flush(self) -> None:
        try:
            self._on_chained()
        except Exception:  # pragma: no cover - force_flush never raises
            _logger.debug("flush on a chained SIGTERM raised", exc_info=True)

    def _start_watcher(self) -> None:
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        try:
            previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):  # pragma: no cover - main thread checked above
            reader.close()
            writer.close()
            return
        if previous != -1:
            # Someone (asyncio's signal handling) owns the wakeup fd: give it back and
            # rely on the Python-level handler alone.
            signal.set_wakeup_fd(previous)
            reader.close()
            writer.close()
            return
        self._reader, self._writer = reader, writer
        self._watcher = threading.Thread(target=self._watch, name="openlora-otel-sigterm-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        reader = self._reader
        assert reader is not None
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                self._on_wakeup()

    def _on_wakeup(self) -> None:
        """The watcher heard a SIGTERM (the wakeup fd carries every signal with a Python handler).

        It acts only while the handler is ours (an application handler installed
        after setup_telemetry() decides for itself) and the shutdown has not begun
        elsewhere. The watcher may get the GIL late: by then an application handler
        may have run and put ours back, and the main thread may be inside the
        shutdown it called next; that is not a stuck main thread.
        """
        if self._is_current() and not self._shutting_down:
            self._act_if_main_is_stuck()

    def shutdown_started(self) -> None:
        """``Telemetry.shutdown()`` has begun: the watcher no longer acts for the main thread.

        The Python-level handler still does: a SIGTERM during the shutdown waits
        for it to end, then ends the process with status 143.
        """
        self._shutting_down = True

    def _is_current(self) -> bool:
        return bool(signal.getsignal(signal.SIGTERM) == self._on_signal)

    def _act_if_main_is_stuck(self) -> None:
        """Terminate only when the main thread cannot run the Python handler itself.

        A main thread that runs Python code runs whichever handler was installed
        when the signal came (ours, or an application's that was swapped in and out
        since): the watcher must not second-guess it. One that stays on the same
        instruction for ``STUCK_AFTER_S`` is inside a C call and will not.
        """
        before = _main_position()
        if self._started.wait(STUCK_AFTER_S):
            return  # the Python-level handler ran
        if before is not None and before == _main_position() and self._is_current() and not self._shutting_down:
            _logger.info("openlora-otel: the main thread is inside a C call; handling SIGTERM from a thread")
            self._terminate()

    def _terminate(self) -> None:
        # Never block here: a second SIGTERM can re-enter this handler on the main thread
        # while the first holds the lock, and waiting would deadlock it.
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._started.is_set():
                return
            self._started.set()
        finally:
            self._lock.release()
        threading.Thread(target=self._shutdown_and_exit, name="openlora-otel-sigterm", daemon=True).start()

    def _shutdown_and_exit(self) -> None:
        try:
            _logger.info(
                "openlora-otel: SIGTERM received; final export, then exit with status %d", EXIT_STATUS
            )
            self._on_terminate()
        except BaseException:  # pragma: no cover - shutdown never raises; exiting matters more
            _logger.debug("shutdown on SIGTERM raised", exc_info=True)
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            # Like the default SIGTERM: no atexit handlers, no cleanup of other threads.
            os._exit(EXIT_STATUS)

    # -- teardown -------------------------------------------------------------------
    def uninstall(self) -> None:
        """Put the default SIGTERM back (when still ours) and stop the watcher; idempotent.

        Only the main thread can change signal handlers and the wakeup fd. From
        another thread both stay, and so do the watcher's sockets (closing the one
        the C signal handler writes to would let it write into whatever file next
        gets that descriptor number); a later SIGTERM then ends the process at once
        with status 143.
        """
        _GUARDS.discard(self)
        on_main = threading.current_thread() is threading.main_thread()
        if not (on_main and os.getpid() == self._pid):
            return
        if self._installed:
            self._installed = False
            if self._is_current():
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self._writer is not None:
            try:
                previous = signal.set_wakeup_fd(-1)
                if previous != self._writer.fileno():
                    # Someone (asyncio) took the wakeup fd after us: it is theirs, put it back.
                    signal.set_wakeup_fd(previous)
            except ValueError:  # pragma: no cover - main thread checked above
                return
        self._close_sockets()

    def _close_sockets(self, *, wake_watcher: bool = True) -> None:
        reader = self._reader
        if wake_watcher and reader is not None:
            # close() alone does not wake a thread blocked in recv(); shutdown() does.
            with contextlib.suppress(OSError):
                reader.shutdown(socket.SHUT_RDWR)
        for sock in (self._writer, reader):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self._reader = self._writer = None
        watcher, self._watcher = self._watcher, None
        if wake_watcher and watcher is not None and watcher is not threading.current_thread():
            watcher.join(1.0)

    def _reset_in_child(self) -> None:
        """After fork, in the child: default SIGTERM, no wakeup fd, no sockets shared with the parent."""
        self._installed = False
        self._started.set()  # the child never runs the parent's shutdown
        try:
            if signal.getsignal(signal.SIGTERM) == self._on_signal:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if self._writer is not None:
                signal.set_wakeup_fd(-1)
        except ValueError:  # pragma: no cover - fork from a thread Python does not see as main
            pass
        # shutdown() would act on the socket the parent shares: only close the child's copies.
        self._close_sockets(wake_watcher=False)


_GUARDS: weakref.WeakSet[SigtermGuard] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for guard in list(_GUARDS):
        guard._reset_in_child()
    _GUARDS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
