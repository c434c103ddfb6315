"""Write-behind: storing new blocks off the caller's path.

A generator answers first and stores the new blocks after; with ``WriteBehind`` the storing runs in one writer
thread, so the next request does not wait for it either. The queue is bounded (``max_pending_blocks``): a caller
that outruns the store waits at ``submit`` (backpressure) rather than growing memory without end. Nothing is lost
silently: every failed write is counted (``stats()``), logged, and kept as ``last_error``; ``flush()`` waits until
everything submitted is written (or failed), ``close()`` flushes and stops the thread, and a writer still open at
interpreter exit is flushed by an ``atexit`` hook.

A block is visible to readers only once written: a caller that needs it at once (the next turn of a chat, a test)
calls ``flush()`` first, or writes synchronously (``wait=True`` on the generators).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvshelf.kvstore.block import KVBlock
from kvshelf.kvstore.errors import ConfigError, WriteBehindError
from kvshelf.kvstore.protocol import BlockStore
from kvshelf.kvstore.stats import WriterStats

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_BLOCKS = 256
EXIT_FLUSH_TIMEOUT_S = 60.0


class WriteBehind:
    """One writer thread storing ``(key, block)`` batches into ``store`` in submission order.

    Args:
        store: any ``BlockStore`` (its ``put_many`` is called from the writer thread: the embedded store and
            ``RemoteStore`` are thread-safe).
        max_pending_blocks: blocks queued or being written at most; ``submit`` waits beyond it (a single batch
            larger than this is accepted when the queue is empty).
        idle_priority: run the writer thread only on CPU time nothing else wants (``lower_thread_priority``): for
            a caller whose own threads keep the cores busy (an engine decoding), so that storing never slows it;
            a full queue still makes ``submit`` wait.
    """

    def __init__(self, store: BlockStore, *, max_pending_blocks: int = DEFAULT_MAX_PENDING_BLOCKS,
                 idle_priority: bool = False) -> None:
        if max_pending_blocks <= 0:
            raise ConfigError(f"max_pending_blocks must be > 0, got {max_pending_blocks}")
        self.store = store
        self.max_pending_blocks = max_pending_blocks
        self._cond = threading.Condition()
        self._queue: deque[tuple[list[tuple[bytes, KVBlock]], bool]] = deque()
        self._pending = 0  # blocks queued or being written
        self._closed = False
        self._counts = {"submitted_blocks": 0, "written_blocks": 0, "rejected_blocks": 0, "failed_blocks": 0,
                        "failed_batches": 0}  # the running counts of ``WriterStats``
        self._last_error: str | None = None
        self.idle_priority = idle_priority
        self.priority = "normal"  # what the writer thread runs at ("idle", "nice" or "normal": see lower_...)
        self._thread = threading.Thread(target=self._run, name="kvshelf-write-behind", daemon=True)
        self._thread.start()
        self._exit_hook = _exit_hook(weakref.ref(self))
        atexit.register(self._exit_hook)

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, entries: Sequence[tuple[bytes, KVBlock]], *, pin: bool = False) -> int:
        """Queue ``entries`` for ``store.put_many(entries, pin=pin)``; returns how many blocks were queued. Waits
        while the queue is full. Raises ``ConfigError`` once closed."""
        batch = list(entries)
        if not batch:
            return 0
        with self._cond:
            while (not self._closed and self._pending
                   and self._pending + len(batch) > self.max_pending_blocks):
                self._cond.wait()
            if self._closed:
                raise ConfigError("the write-behind writer is closed; blocks can no longer be submitted")
            self._queue.append((batch, pin))
            self._pending += len(batch)
            self._counts["submitted_blocks"] += len(batch)
            self._cond.notify_all()
        return len(batch)

    def flush(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Wait until every block submitted so far is written or has failed; returns ``stats()``. Raises
        ``WriteBehindError`` when ``timeout_s`` passes first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WriteBehindError(f"write-behind flush timed out after {timeout_s} s with "
                                           f"{self._pending} blocks still pending")
                self._cond.wait(left)
        return self.stats()

    def close(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Flush, then stop the writer thread (idempotent); returns the final ``stats()``."""
        if not self._closed:
            try:
                self.flush(timeout_s)
            finally:
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                self._thread.join(timeout_s)
                atexit.unregister(self._exit_hook)
        return self.stats()

    def typed_stats(self) -> WriterStats:
        """Counts: ``submitted_blocks``, ``written_blocks``, ``rejected_blocks`` (not accepted by the first tier:
        full), ``failed_blocks`` / ``failed_batches`` (the write raised), ``pending_blocks``, ``last_error``."""
        with self._cond:
            return WriterStats(**self._counts, pending_blocks=self._pending, last_error=self._last_error,
                               closed=self._closed)

    def stats(self) -> dict[str, Any]:
        """``typed_stats()`` as a JSON-ready dict (``WriterStats.as_dict``)."""
        return self.typed_stats().as_dict()

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        if self.idle_priority:
            self.priority = lower_thread_priority()
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                batch, pin = self._queue[0]
            written, error = 0, None
            try:
                written = int(self.store.put_many(batch, pin=pin))
            except Exception as exc:  # noqa: BLE001 - counted, logged and kept: the caller's request already ended
                error = f"{type(exc).__name__}: {exc}"
                log.error("write-behind: %d blocks not stored: %s", len(batch), error)
            with self._cond:
                self._queue.popleft()
                self._pending -= len(batch)
                if error is None:
                    self._counts["written_blocks"] += written
                    self._counts["rejected_blocks"] += len(batch) - written
                else:
                    self._counts["failed_blocks"] += len(batch)
                    self._counts["failed_batches"] += 1
                    self._last_error = error
                self._cond.notify_all()


def lower_thread_priority() -> str:
    """Let the calling thread run only when the CPUs are otherwise idle: Linux's ``SCHED_IDLE`` policy ("idle"),
    else the lowest nice value ("nice"), else nothing ("normal"). Lowering one's own priority needs no privilege."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread (Linux)
        return "idle"
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return "nice"
    except (AttributeError, OSError):
        return "normal"


def _exit_hook(ref: weakref.ref[WriteBehind]) -> Any:
    """An ``atexit`` callable flushing the writer if it is still alive and open (a weak reference: the hook does
    not keep the writer alive)."""

    def flush_at_exit() -> None:
        writer = ref()
        if writer is not None and not writer.closed:
            try:
                writer.close(EXIT_FLUSH_TIMEOUT_S)
            except WriteBehindError as exc:
                log.error("write-behind at exit: %s", exc)

    return flush_at_exit
