"""Stores by URL (``kvstore.store_url``): what each scheme opens, and one clear ``ConfigError`` for a bad URL."""

from __future__ import annotations

import socket

import pytest
from helpers import key_of, make_block
from redis_servers import redis_server  # noqa: F401 - the fixture

from kvshelf.kvstore.errors import ConfigError, TierUnavailableError
from kvshelf.kvstore.store import TieredStore
from kvshelf.kvstore.store_url import open_store


def test_embedded_url_opens_memory_over_lmdb_in_the_folder(tmp_path) -> None:
    block = make_block(list(range(16)))
    with open_store(f"embedded://{tmp_path}?memory=64MiB&disk_codec=int8", namespace="default") as store:
        assert isinstance(store, TieredStore)
        assert [t["name"] for t in store.stats()["tiers"]] == ["memory", "disk"]
        assert [t["codec"] for t in store.stats()["tiers"]] == ["raw", "int8"]
        store.put_many([(key_of(block), block)])
    assert (tmp_path / "lmdb").is_dir()
    with open_store(f"embedded://{tmp_path}?memory=0") as store:  # no memory tier: every read from LMDB
        assert [t["name"] for t in store.stats()["tiers"]] == ["disk"]
        assert store.held([key_of(block)]) == [True]


def test_embedded_url_takes_the_namespace(tmp_path) -> None:
    with open_store(f"embedded://{tmp_path}", namespace="tenant-a") as store:
        assert store.namespace == "tenant-a"


@pytest.mark.parametrize(("url", "words"), [
    ("nonsense", "not a URL"),
    ("ftp://host/x", "unknown scheme 'ftp://'"),
    ("embedded:///tmp/x?memory=lots", "memory"),
    ("embedded:///tmp/x?colour=red", "unknown parameter(s) 'colour'"),
    ("embedded:///tmp/x?disk_codec=nope", "nope"),
    ("grpc://localhost", "grpc://HOST:PORT"),
    ("grpc://localhost:99999", "grpc://HOST:PORT"),
    ("grpc://localhost:5000?codec=nope", "nope"),
    ("grpcs://localhost:5000", "tls_ca"),
    ("redis://localhost:6379/0?codec=nope", "nope"),
])
def test_a_bad_url_is_one_clear_config_error(url: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_store(url)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_an_empty_namespace_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="namespace"):
        open_store(f"embedded://{tmp_path}", namespace="")


def test_an_unreachable_server_is_tier_unavailable() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(TierUnavailableError, match="unreachable"):
        open_store(f"grpc://127.0.0.1:{port}?connect_timeout=0.5")


def test_grpc_url_opens_a_remote_store_to_kvshelf_serve(tmp_path) -> None:
    from service_helpers import ServeProcess

    from kvshelf.service.client import RemoteStore

    block = make_block(list(range(16)))
    server = ServeProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"))
    try:
        with open_store(f"grpc://{server.address}?connect_timeout=10") as store:
            assert isinstance(store, RemoteStore)
            assert store.put_many([(key_of(block), block)]) == 1
            got = store.get_many([key_of(block)], fingerprint=block.fingerprint)
            assert got[0] is not None and got[0].token_ids == block.token_ids
    finally:
        server.stop()


def test_redis_url_opens_one_redis_tier_in_its_codec(redis_server) -> None:  # noqa: F811
    block = make_block(list(range(16)), seed=7)
    with open_store(f"{redis_server.url}?codec=int8&prefix=store-url:") as store:
        assert [(t["name"], t["codec"]) for t in store.stats()["tiers"]] == [("redis", "int8")]
        assert store.put_many([(key_of(block), block)]) == 1
        assert store.get_many([key_of(block)], fingerprint=block.fingerprint)[0] is not None
