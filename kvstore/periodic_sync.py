"""``PeriodicSync``: flush a store's commits to the disk every few seconds instead of at every commit.

The ``interval`` durability of ``kvshelf serve`` (Redis's ``appendfsync everysec``): a put is committed to the
operating system before it is acknowledged, so a crash or SIGKILL of the server loses nothing, and one thread
calls ``flush`` (``fdatasync``) at most every ``interval_s`` seconds when something was committed since the last
flush, so an operating-system crash or power cut loses at most the last ``interval_s`` seconds of puts (a lost
block is a miss; the LMDB file is checked when it is opened: see ``kvstore.lmdb_tier.file``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class PeriodicSync:
    """Calls ``flush()`` in a daemon thread every ``interval_s`` seconds while ``dirty()`` was called since the last
    flush; ``close()`` stops the thread after a last flush. A failed flush is logged and retried next time."""

    def __init__(self, flush: Callable[[], None], interval_s: float) -> None:
        self._flush = flush
        self.interval_s = interval_s
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self.flushes = 0  # completed flushes (for tests and stats)
        self._thread = threading.Thread(target=self._run, name="kvshelf-periodic-sync", daemon=True)
        self._thread.start()

    def dirty(self) -> None:
        """Something was committed: flush it within ``interval_s``."""
        self._dirty.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._flush_if_dirty()

    def _flush_if_dirty(self) -> None:
        if not self._dirty.is_set():
            return
        self._dirty.clear()  # before the flush: a commit during it is flushed next time
        try:
            self._flush()
            self.flushes += 1
        except Exception:
            self._dirty.set()
            log.exception("periodic sync failed (retried in %.1f s)", self.interval_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._flush_if_dirty()
