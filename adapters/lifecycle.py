"""``Closable``: the lifecycle every front door shares (``CachedGenerator``, ``RAGGenerator``,
``PromptModuleGenerator``): ``close()`` ends it, later calls raise ``ConfigError``, and it is a context manager."""

from __future__ import annotations

from typing import Self

from kvshelf.kvstore.errors import ConfigError


class Closable:
    """Subclasses call ``_check_open()`` at the top of each public call and extend ``close()`` (calling
    ``super().close()``) with what they release; ``close()`` is idempotent."""

    _closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """End this object: later calls raise ``ConfigError``. A store it was given is left open (the caller's)."""
        self._closed = True

    def __enter__(self) -> Self:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"this {type(self).__name__} is closed; make a new one")
