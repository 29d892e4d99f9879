"""Prometheus file-based service discovery: each rank registers its pull endpoint while it runs.

With ``OPENLORA_PROMETHEUS_FILE_SD_DIR`` set, a process serving the pull endpoint writes
``<dir>/openlora-<host>-<port>.json`` once its port is bound and removes it at shutdown, after the
final scrape. The file carries no labels (run identity stays on ``target_info``); the files of
processes that died without a shutdown are removed by the next registration on their host, once
their endpoint refuses connections. See docs/how-to/many-nodes.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import socket
import stat
import tempfile
from pathlib import Path

from openlora_otel.config import FILE_SD_ACCEPTED, ConfigError

__all__ = ["FileSdRegistration", "scrape_address"]

_logger = logging.getLogger(__name__)

_VARIABLE = "OPENLORA_PROMETHEUS_FILE_SD_DIR"
# Stale files of this host checked at one registration (each costs one refused connect at most).
_MAX_STALE_CHECKS = 64
_STALE_CONNECT_TIMEOUT_S = 0.2
# Our files are one short target list; anything bigger is not one of them.
_MAX_FILE_BYTES = 4096
_WILDCARDS = ("0.0.0.0", "::", "")


def _host_label() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"


def scrape_address(bound_host: str, port: int) -> str:
    """The ``host:port`` a scraper uses to reach an endpoint bound on ``bound_host``.

    A wildcard bind (``0.0.0.0``, ``::``) is reached by this machine's host name;
    any other host is used as it was given.
    """
    host = socket.gethostname() if bound_host in _WILDCARDS else bound_host
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"


class FileSdRegistration:
    """One endpoint's file in a file_sd directory; :meth:`remove` deletes it (idempotent)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pid = os.getpid()

    @classmethod
    def register(cls, directory: str, bound_host: str, port: int) -> FileSdRegistration:
        """Write this endpoint's target file; a directory that cannot be used raises :class:`ConfigError`."""
        folder = Path(directory)
        target = scrape_address(bound_host, port)
        path = folder / f"openlora-{_host_label()}-{port}.json"
        body = json.dumps([{"targets": [target], "labels": {}}], indent=2) + "\n"
        temporary: str | None = None
        try:
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                folder.chmod(0o755)  # whatever the umask: a Prometheus running as another user must list it
            # A fresh, exclusive temporary (never a planted symlink), renamed over the target:
            # Prometheus never reads a half-written file (the temporary name does not match *.json).
            descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                handle.write(body)
            os.chmod(temporary, 0o644)  # mkstemp makes it 600
            os.replace(temporary, path)
        except OSError as exc:
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
            raise ConfigError(
                _VARIABLE, directory, FILE_SD_ACCEPTED + ", writable by this process", exc.strerror or str(exc)
            ) from None
        _remove_stale(folder, keep=path)
        _logger.debug("registered %s for file-based discovery in %s", target, path)
        return cls(path)

    def remove(self) -> None:
        """Delete the file (in the process that wrote it only: a forked child leaves it); never raises."""
        if os.getpid() != self._pid:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            _logger.warning("openlora-otel: could not remove %s (%s); Prometheus keeps the target", self.path, exc)
        self._pid = -1


def _remove_stale(folder: Path, keep: Path) -> None:
    """Remove this host's files whose endpoint refuses connections (left by a killed process).

    Best effort: whatever the directory holds, registration goes on.
    """
    prefix = f"openlora-{_host_label()}-"
    try:
        candidates = sorted(p for p in folder.glob(prefix + "*.json") if p != keep)[:_MAX_STALE_CHECKS]
    except OSError:
        return
    for path in candidates:
        try:
            _remove_if_stale(path)
        except Exception:  # a file we cannot judge is not ours to remove
            _logger.debug("skipped %s while looking for stale files", path, exc_info=True)


def _remove_if_stale(path: Path) -> None:
    before = os.lstat(path)
    if not stat.S_ISREG(before.st_mode) or before.st_size > _MAX_FILE_BYTES:
        return  # a FIFO would block the read, a link or a huge file is not one of ours
    with open(path, "rb") as handle:
        groups = json.loads(handle.read(_MAX_FILE_BYTES))
    host, _, port = groups[0]["targets"][0].rpartition(":")
    host = host.strip("[]")
    if host == socket.gethostname():
        host = "127.0.0.1"  # a wildcard bind: loopback reaches it without a name lookup
    if not _refused((host, int(port))):
        return
    after = os.lstat(path)
    # A process that bound the port since and wrote its own file under the same name keeps it.
    if (after.st_ino, after.st_mtime_ns) != (before.st_ino, before.st_mtime_ns):
        return
    path.unlink()
    _logger.info("openlora-otel: removed %s, left by a process that no longer serves it", path)


def _refused(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=_STALE_CONNECT_TIMEOUT_S):
            return False
    except ConnectionRefusedError:
        return True
    except OSError as exc:
        return exc.errno == errno.ECONNREFUSED
