"""``kvshelf stats``: the admin view of a server or of an embedded store directory."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from kvshelf.cli.common import console, open_remote


def stats(
    server: Annotated[str | None, typer.Option(help="HOST:PORT of a `kvshelf serve` server")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="or: an embedded store directory (what it holds)")] = None,
    token: Annotated[str | None, typer.Option(help="bearer token (servers with a tokens file)",
                                              envvar="KVSHELF_TOKEN")] = None,
    namespace: Annotated[str | None, typer.Option(
        help="namespace (dev-mode servers; default: default); with --json, its view leads, else the whole "
             "store's does", show_default=False)] = None,
    tls_ca: Annotated[Path | None, typer.Option(help="CA certificate of a TLS server")] = None,
    watch: Annotated[bool, typer.Option("--watch", help="refresh live until Ctrl-C")] = False,
    interval: Annotated[float, typer.Option(min=0.2, help="seconds between refreshes with --watch")] = 2.0,
    as_json: Annotated[bool, typer.Option("--json", help="print the raw stats as JSON")] = False,
    plot: Annotated[Path | None, typer.Option(help="draw hit rate and usage over time (server history) to PNG")] = None,
    connect_timeout: Annotated[float, typer.Option(min=0.1, help="seconds to wait for the server")] = 10.0,
) -> None:
    """The admin view: hit rates (blocks and tokens), usage per tier, top namespaces and models, evictions."""
    from kvshelf.cli.views.admin import plot as draw_plot
    from kvshelf.cli.views.admin import render
    from kvshelf.kvstore.errors import KVShelfError

    if (server is None) == (data_dir is None):
        raise KVShelfError("give exactly one of --server HOST:PORT or --data-dir DIR")
    fetch = (_remote_stats(server, token, namespace or "default", tls_ca, connect_timeout) if server
             else _local_stats(data_dir))
    if plot is not None:
        history = fetch().get("history")
        if history is None:
            raise KVShelfError("--plot needs a server's history: the server must run in dev mode (no tokens file)")
        console.print(f"wrote {draw_plot(history, plot)}")
        return
    if as_json:
        print(json.dumps(json_view(fetch(), namespace_given=namespace is not None), indent=2))
        return

    def view() -> Any:
        data = fetch()
        health = data.get("health", {})
        title = f"kvshelf {server or data_dir}" + (f" [{health['status']}]" if health else "")
        return render(data.get("store", data), title=title)

    if not watch:
        console.print(view())
        return
    from rich.live import Live

    with Live(view(), console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(view())
        except KeyboardInterrupt:
            pass


def json_view(data: dict[str, Any], *, namespace_given: bool) -> dict[str, Any]:
    """What ``--json`` prints, led by the data asked for. A dev-mode server's answer holds the namespace's view and
    the whole store's (``store``): without ``--namespace`` the whole store's leads (``scope: store``: its tiers,
    hit rates, counter rows and pins, then ``health`` and ``history``), with it the namespace's (``scope:
    namespace``, the store's under ``store``, last). A token server's answer (its caller's namespace) and an
    embedded store's are printed as they are, with their ``scope``."""
    if "store" not in data:
        return {"scope": "namespace" if "namespace" in data else "store", **data}
    rest = {k: v for k, v in data.items() if k != "store"}
    if namespace_given:
        return {"scope": "namespace", **rest, "store": data["store"]}
    return {"scope": "store", **data["store"], "health": data.get("health"), "history": data.get("history")}


def _remote_stats(server: str, token: str | None, namespace: str, tls_ca: Path | None,
                  connect_timeout: float) -> Callable[[], dict]:
    remote = open_remote(server, "--server", token=token, namespace=namespace, tls_ca=tls_ca,
                         connect_timeout=connect_timeout)
    return remote.stats


def _local_stats(data_dir: Path) -> Callable[[], dict]:
    from kvshelf.kvstore.errors import KVShelfError
    from kvshelf.kvstore.lmdb_tier import LMDBTier
    from kvshelf.kvstore.store import TieredStore

    lmdb_dir = data_dir / "lmdb"
    if not lmdb_dir.is_dir():
        raise KVShelfError(f"no kvshelf store at {data_dir} (expected {lmdb_dir})")
    store = TieredStore([LMDBTier(lmdb_dir)])
    return store.stats

