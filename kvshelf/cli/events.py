"""``kvshelf events``: a namespace's KV events, live."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvshelf.cli.common import open_remote


def events(
    server: Annotated[str, typer.Option(help="HOST:PORT of a `kvshelf serve` server")],
    token: Annotated[str | None, typer.Option(help="bearer token (servers with a tokens file)",
                                              envvar="KVSHELF_TOKEN")] = None,
    namespace: Annotated[str, typer.Option(help="namespace (dev-mode servers)")] = "default",
    tls_ca: Annotated[Path | None, typer.Option(help="CA certificate of a TLS server")] = None,
    from_seq: Annotated[str, typer.Option(
        "--from-seq", help="replay the kept events from this sequence number first (0: live events only)")] = "0",
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per line")] = False,
    connect_timeout: Annotated[float, typer.Option(min=0.1, help="seconds to wait for the server")] = 10.0,
) -> None:
    """Print the namespace's KV events live (BlockStored / BlockRemoved / AllBlocksCleared), one line each, until
    Ctrl-C (exit 0). Resume after a disconnect with --from-seq = the last seq printed + 1."""
    import threading

    from kvshelf.cli.views.event_format import format_message
    from kvshelf.kvstore.errors import KVShelfError
    from kvshelf.service.client import RemoteStoreError

    try:
        start = int(from_seq)
    except ValueError:
        raise KVShelfError(f"--from-seq must be an integer >= 0, got {from_seq!r}") from None
    if start < 0:
        raise KVShelfError(f"--from-seq must be an integer >= 0, got {from_seq!r}")
    remote = open_remote(server, "--server", token=token, namespace=namespace, tls_ca=tls_ca,
                         connect_timeout=connect_timeout)
    current = [remote.subscribe_events(start)]
    stopping = threading.Event()
    failure: list[KVShelfError] = []

    def read() -> None:  # in a thread: the main one stays interruptible by Ctrl-C
        while True:
            subscription = current[0]
            try:
                for message in subscription:
                    for line in format_message(message, as_json=as_json):
                        print(line, flush=True)
                return
            except RemoteStoreError as exc:  # cut off as too slow (a slow terminal or pipe): resume where it stopped
                if exc.code.name != "RESOURCE_EXHAUSTED" or "too slow" not in str(exc) or stopping.is_set():
                    failure.append(exc)
                    return
                resume = subscription.next_seq
                print(json.dumps({"type": "resumed", "from_seq": resume}) if as_json else
                      f"# fell behind: resuming from seq {resume}", flush=True)
                current[0] = remote.subscribe_events(resume)
            except KVShelfError as exc:
                failure.append(exc)
                return

    reader = threading.Thread(target=read, name="kvshelf-events", daemon=True)
    reader.start()
    try:
        while reader.is_alive():
            reader.join(0.2)
    except KeyboardInterrupt:
        stopping.set()
        current[0].cancel()
        reader.join(5)
        return
    finally:
        remote.close()
    if failure:
        raise failure[0]
    raise KVShelfError("the server ended the subscription")

