"""Helpers of the admin dashboard tests: a real ``kvshelf serve`` with the dashboard on, a token file, HTTP
requests with a bearer header or a cookie, and real traffic (puts, gets, prefix lookups) through ``RemoteStore``."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from helpers import FINGERPRINT, key_of, make_block
from service_helpers import InProcessServe, free_port

from kvshelf.service.client import RemoteStore
from kvshelf.service.dashboard_data import MODEL_NAME_EXTRA
from kvshelf.service.serve import ServeConfig

TOKEN = "s3cret-admin-token_0123456789"


def token_file(directory: Path, token: str = TOKEN) -> Path:
    path = directory / "admin.token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def serve_with_dashboard(tmp_path: Path, capsys: Any, **settings: object) -> tuple[InProcessServe, int]:
    """``serve()`` in a thread with ``--admin-port`` on a free port: ``(serving, admin port)``."""
    port = free_port()
    config = ServeConfig.from_settings(listen="127.0.0.1:0", data_dir=str(tmp_path / "data"), memory="16MiB",
                                       max_disk="64MiB", admin_port=port, grace=0, **settings)
    return InProcessServe(config, capsys), port


def request(url: str, *, token: str | None = None, cookie: str | None = None, data: bytes | None = None
            ) -> tuple[int, dict[str, str], bytes]:
    """``(status, headers, body)`` of one request (redirects not followed)."""
    headers = {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if cookie is not None:
        headers["Cookie"] = cookie

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, data=data, headers=headers), timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def traffic(address: str, namespace: str, blocks: int, *, seed: int = 0, token: str | None = None,
            model_name: str | None = None) -> list[bytes]:
    """Put ``blocks`` blocks of 4 tokens into ``namespace``, get them all (hits) and one never stored (a miss), and
    look the run up as a prefix (a reuse of the prefix ending at the last key): the keys put. ``token``: the
    bearer token of a server with a tokens file (its namespace must be ``namespace``); ``model_name``: the name
    the blocks' headers give their model (``MODEL_NAME_EXTRA``)."""
    extra = {MODEL_NAME_EXTRA: model_name} if model_name is not None else None
    items = [make_block([seed * 1000 + 4 * i + j for j in range(4)], namespace=namespace, extra=extra)
             for i in range(blocks)]
    keys = [key_of(block) for block in items]
    absent = key_of(make_block([seed * 1000 + 999_000 + j for j in range(4)], namespace=namespace))
    with RemoteStore(address, namespace=namespace, token=token, shared_memory=False) as remote:
        assert remote.put_many(list(zip(keys, items, strict=True))) == blocks
        got = remote.get_many([*keys, absent], fingerprint=FINGERPRINT, tokens=[4] * (blocks + 1))
        assert all(b is not None for b in got[:-1]) and got[-1] is None
        assert remote.lookup_prefix(keys, model=FINGERPRINT, tokens=[4] * blocks) == blocks
    return keys
