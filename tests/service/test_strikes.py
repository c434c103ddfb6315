"""Per-tenant strikes (service/strikes.py): a tenant whose calls keep failing through its own fault is refused at
admission for a while; other tenants, and a tenant that fails now and then, are not."""

from __future__ import annotations

import grpc
import pytest
from helpers import FINGERPRINT, assert_same_block, key_of, make_block
from service_helpers import TOKENS, write_tokens

from kvshelf.kvstore import open_embedded_store
from kvshelf.proto import kvshelf_pb2 as pb
from kvshelf.proto import kvshelf_pb2_grpc as pb_grpc
from kvshelf.service.auth import TokenTable
from kvshelf.service.client import RemoteStore
from kvshelf.service.errors import RemoteStoreError
from kvshelf.service.server import ServerLimits, start_server
from kvshelf.service.strikes import TenantStrikes

TOKEN_A, TOKEN_B = list(TOKENS)


def test_a_bucket_fills_with_strikes_and_drains_with_time():
    strikes = TenantStrikes(burst=3, leak_per_s=2.0)
    for _ in range(2):
        strikes.strike("a", now=0.0)
    assert strikes.blocked_for("a", now=0.0) == 0.0  # 2 strikes: below the burst
    strikes.strike("a", now=0.0)
    assert strikes.blocked_for("a", now=0.0) == pytest.approx(0.5)  # 3 strikes: blocked until one has drained
    assert strikes.blocked_for("a", now=0.5) == 0.0
    assert strikes.blocked_for("b", now=0.0) == 0.0  # per tenant
    strikes.strike("a", now=10.0)  # drained to 0 meanwhile: one strike only
    assert strikes.blocked_for("a", now=10.0) == 0.0


@pytest.fixture
def server(tmp_path):
    store = open_embedded_store(tmp_path / "data")
    tokens = TokenTable.from_file(write_tokens(tmp_path / "tokens.toml"))
    running = start_server(store, tokens=tokens, limits=ServerLimits(strike_burst=5, strike_leak_per_s=0.5))
    yield running
    running.stop(0)
    store.close()


def _garbage_put(stub: pb_grpc.KVShelfStub, token: str) -> grpc.RpcError:
    chunk = pb.Chunk(key=b"k" * 16, data=b"\x00" * 1024, last=True, total_size=1024)
    with pytest.raises(grpc.RpcError) as excinfo:
        stub.PutBlocks(iter([pb.PutBlocksRequest(chunk=chunk)]), timeout=10,
                       metadata=[("authorization", f"Bearer {token}")])
    return excinfo.value


def test_a_tenant_that_keeps_sending_damaged_puts_is_refused_at_admission(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.KVShelfStub(channel)
    codes = [_garbage_put(stub, TOKEN_A).code() for _ in range(5)]
    assert codes == [grpc.StatusCode.DATA_LOSS] * 5  # each one read and refused for what it is
    refused = _garbage_put(stub, TOKEN_A)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "too many of its calls failed" in refused.details()
    assert not any(k == "kvshelf-retry-after-ms" for k, _ in refused.trailing_metadata() or ())  # not retried
    assert server.servicer.streams.refused_strikes >= 1
    # the other tenant is served as before
    block = make_block([1, 2, 3], namespace="tenant-b")
    with RemoteStore(f"127.0.0.1:{server.port}", token=TOKEN_B, namespace="tenant-b", shared_memory=False) as b:
        assert b.put_many([(key_of(block), block)]) == 1
        assert_same_block(b.get_many([key_of(block)], fingerprint=FINGERPRINT)[0], block)
    # and the refused tenant's honest client fails fast with the reason, not after its whole timeout
    with RemoteStore(f"127.0.0.1:{server.port}", token=TOKEN_A, namespace="tenant-a", shared_memory=False,
                     timeout_s=30) as a, pytest.raises(RemoteStoreError, match="too many of its calls failed"):
        a.put_many([(key_of(block), make_block([1, 2, 3], namespace="tenant-a"))])
    channel.close()


def test_a_tenant_that_fails_now_and_then_is_never_refused(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.KVShelfStub(channel)
    with RemoteStore(f"127.0.0.1:{server.port}", token=TOKEN_A, namespace="tenant-a", shared_memory=False) as a:
        for i in range(12):
            if i % 4 == 0:
                assert _garbage_put(stub, TOKEN_A).code() == grpc.StatusCode.DATA_LOSS
            block = make_block([i, i + 1], namespace="tenant-a")
            assert a.put_many([(key_of(block), block)]) == 1  # successes are no strikes
    channel.close()


def test_strike_settings_are_checked():
    from kvshelf.kvstore.errors import ConfigError
    from kvshelf.service.serve import load_config

    assert load_config({"strike_burst": 0}, env={}).fairness.strike_burst == 0  # off
    with pytest.raises(ConfigError, match="strike_burst"):
        load_config({"strike_burst": -1}, env={})
    with pytest.raises(ConfigError, match="strike"):
        ServerLimits(strike_leak_per_s=0)
