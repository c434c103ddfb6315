"""``kvshelf dashboard``: the admin dashboard of a remote server, served from this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvshelf.cli.common import open_remote


def dashboard(
    target: Annotated[str, typer.Option(help="HOST:PORT of a `kvshelf serve` server")],
    port: Annotated[int, typer.Option(min=0, max=65535, help="port of the dashboard here (0: a free one)")] = 8765,
    addr: Annotated[str, typer.Option(help="address of the dashboard here; other than loopback needs "
                                           "--admin-token-file")] = "127.0.0.1",
    admin_token_file: Annotated[Path | None, typer.Option(help="file holding the token the dashboard "
                                                               "requires")] = None,
    token: Annotated[str | None, typer.Option(help="bearer token of the server (servers with a tokens file)",
                                              envvar="KVSHELF_TOKEN")] = None,
    namespace: Annotated[str, typer.Option(help="namespace: the one of --token on a server with tokens (dev-mode "
                                                "servers show every one)")] = "default",
    tls_ca: Annotated[Path | None, typer.Option(help="CA certificate of a TLS server")] = None,
    connect_timeout: Annotated[float, typer.Option(min=0.1, help="seconds to wait for the server")] = 10.0,
) -> None:
    """Serve the admin dashboard (live hit rates, tiers, evictions, event rate, most reused prefixes) of a remote
    server on this machine, reading its Stats over gRPC (a dev-mode server: every namespace; with a token: that
    token's namespace). Runs until Ctrl-C."""
    import threading

    from kvshelf.service.address import check_host
    from kvshelf.service.dashboard import check_dashboard_access, serve_dashboard
    from kvshelf.service.dashboard_data import CachedSource, TierHealth, history_points, remote_snapshot
    from kvshelf.service.metrics import read_token_file

    check_host(addr, "--addr")
    page_token = read_token_file(admin_token_file, "--admin-token-file") if admin_token_file else None
    check_dashboard_access(addr, page_token, "--addr")
    remote = open_remote(target, "--target", token=token, namespace=namespace, tls_ca=tls_ca,
                         connect_timeout=connect_timeout)
    remote.stats()  # reachable and authorized, or a clear error now
    health = TierHealth()
    endpoint = serve_dashboard(CachedSource(lambda: remote_snapshot(remote.stats(), health)), port, addr,
                               token=page_token, title=target,
                               history=lambda: history_points(remote.stats().get("history") or []))
    print(f"kvshelf dashboard of {target} on {endpoint.describe()}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        endpoint.close()
        remote.close()
